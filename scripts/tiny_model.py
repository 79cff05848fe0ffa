#!/usr/bin/env python3
"""Build a deterministic random-weight Llama and a locally trained byte-level BPE tokenizer.

No hub access is needed: the tokenizer is trained on a corpus generated inside this script,
the weights are random (seeded). The result is a normal Hugging Face model folder that
`vllm serve DIR` (and transformers) load. Runs in the vllm venv (torch, transformers, tokenizers):

    .venvs/vllm/bin/python scripts/tiny_model.py --size tiny            # ~1M params
    .venvs/vllm/bin/python scripts/tiny_model.py --size small --out DIR # ~90M params

Default output: ${WARPLY_CACHE:-~/.cache/warply}/models/<size>-<hash of this script>, reused when
complete. The model path is printed as the last line on stdout; progress goes to stderr.
Same script + same seed -> byte-identical model.safetensors and tokenizer.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

from warply.common.argtypes import non_negative

SIZES = {
    # hidden 64, 2 layers: 2*8192*64 (untied embeddings) + 2*65k = ~1.2M params.
    # 2 heads -> head_dim 32: vLLM's CPU attention supports head sizes 32, 64, 80, ... only.
    "tiny": dict(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
    ),
    # hidden 1024, 8 layers, 16 heads: 16.8M embeddings + 8*8.9M = ~88M params
    "small": dict(
        hidden_size=1024,
        intermediate_size=1536,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=16,
    ),
}
VOCAB_SIZE = 8192
MAX_POSITIONS = 16384
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
SPECIAL = [BOS, EOS, "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
# Llama-3 style; bos comes from the template, so chat prompts are encoded without special tokens.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def log(msg: str) -> None:
    print(f"[tiny_model] {msg}", file=sys.stderr, flush=True)


def script_hash() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


def make_corpus(seed: int, n_lines: int = 60000) -> list[str]:
    """Deterministic pseudo-English: syllable words, common words, numbers, code-ish lines."""
    rng = random.Random(seed)
    onsets = [
        "",
        "b",
        "c",
        "d",
        "f",
        "g",
        "h",
        "j",
        "k",
        "l",
        "m",
        "n",
        "p",
        "r",
        "s",
        "t",
        "v",
        "w",
        "z",
        "st",
        "tr",
        "pl",
        "ch",
        "sh",
        "th",
        "gr",
        "br",
        "cl",
    ]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x"]
    lexicon = sorted(
        {
            "".join(
                rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                for _ in range(rng.randint(1, 3))
            )
            for _ in range(6000)
        }
    )
    common = (
        "the of and to in is that for it as with was on be by this are from at or an "
        "which you not have can all one cache block prefix token model request user "
        "system assistant please answer question data value time page memory"
    ).split()
    words = common * 20 + lexicon
    roles = ["system", "user", "assistant"]
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.70:
            n = rng.randint(4, 24)
            s = " ".join(rng.choice(words) for _ in range(n))
            s = s[0].upper() + s[1:] + rng.choice([".", ".", "?", "!", ",", ";", ":"])
        elif kind < 0.85:
            s = " ".join(
                str(rng.randint(0, 10 ** rng.randint(1, 6))) for _ in range(rng.randint(1, 8))
            )
        elif kind < 0.95:
            name = rng.choice(lexicon)
            s = (
                f"def {name}(x, y={rng.randint(0, 99)}):\n"
                f"    return x * {rng.randint(1, 9)} + y  # {rng.choice(words)}"
            )
        else:
            r = rng.choice(roles)
            s = (
                f"<|start_header_id|>{r}<|end_header_id|>\n\n"
                f"{rng.choice(words)} {rng.choice(words)}<|eot_id|>"
            )
        lines.append(s)
    return lines


def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token="<|pad|>",
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(size: str, seed: int, tokenizer):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **SIZES[size],
    )
    with torch.no_grad():
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    model.config.dtype = "bfloat16"
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, eot],
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def build(size: str, out: Path, seed: int) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        log(f"training byte-level BPE tokenizer (vocab {VOCAB_SIZE}, seed {seed})")
        tokenizer = build_tokenizer(seed)
        tokenizer.save_pretrained(tmp)
        # Loadable by transformers 4.x too (other engine venvs): generic class, template inline.
        tc_path = tmp / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
        log(f"building random Llama '{size}' {SIZES[size]}")
        model = build_model(size, seed, tokenizer)
        n = sum(p.numel() for p in model.parameters())
        log(f"{n / 1e6:.2f}M parameters; saving to {out}")
        model.save_pretrained(tmp, safe_serialization=True)
        # transformers 4.x reads rope_theta at the top level (5.x uses rope_parameters).
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.setdefault("rope_theta", cfg.get("rope_parameters", {}).get("rope_theta", 500000.0))
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        (tmp / "warply_tiny_model.json").write_text(
            json.dumps(
                {"size": size, "seed": seed, "params": n, "script_hash": script_hash()}, indent=1
            )
            + "\n"
        )
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)
        (tmp / ".complete").touch()
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def models_dir() -> Path:
    """Where built models go by default: $WARPLY_CACHE/models (~/.cache/warply/models)."""
    return Path(os.environ.get("WARPLY_CACHE", Path.home() / ".cache" / "warply")) / "models"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model size")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output folder (default: $WARPLY_CACHE/models/<size>-<script hash>)",
    )
    ap.add_argument(
        "--seed", type=non_negative(int), default=0, help="seed of the weights and tokenizer"
    )
    ap.add_argument("--force", action="store_true", help="rebuild even if complete")
    a = ap.parse_args()
    out = a.out
    if out is None:
        tag = script_hash() + ("" if a.seed == 0 else f"-s{a.seed}")
        out = models_dir() / f"{a.size}-{tag}"
    out = out.expanduser().resolve()
    if (out / ".complete").exists() and not a.force:
        log(f"reusing {out}")
    else:
        build(a.size, out, a.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
