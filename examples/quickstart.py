"""Warply's SDK example, the README's main command (`bash scripts/demo.sh` runs it).

Two vLLM CPU engines (one per core) with an LMCache cpu tier each, behind the Warply router
(its default strategy, `adaptive`, no knobs); two tenants' conversations from the Mooncake trace
(scripts/data/, shipped) go through the OpenAI client with their own `cache_key`; then
`cache_stats()` and everything stops.

    .venvs/core/bin/python examples/quickstart.py --model DIR [--vllm .venvs/lmcache/bin/vllm]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import warply as wp
from warply.common.argtypes import positive

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from demo import TRACE, workload  # noqa: E402  (scripts/ is not a package)

TENANTS = ("tenant:acme:rag-v3", "tenant:globex:support")


def run(model: str, vllm: str | None, conversations: int, turns: int) -> None:
    engine = wp.Engine(
        model=model, backend="vllm",
        pool=wp.Pool("cpu", replicas=2, engine_args=["--max-model-len", "4096"]),
        routing=wp.CacheRouting(tiering=wp.KVTier(l1="gpu", l2="cpu", l2_size_gb=0.5)),
    )  # fmt: skip
    items = workload(TRACE, conversations, turns, words_per_id=24, max_ids=48)
    with engine.up(vllm=vllm):
        client = engine.client()
        prompt, cached = Counter[str](), Counter[str]()
        for item in items:  # a conversation's turns in order; even ones are acme's
            tenant = TENANTS[item["conversation"] % 2]
            stream = client.chat.completions.create(
                model="warply",
                messages=[{"role": "user", "content": item["prompt"]}],
                max_tokens=item["max_tokens"], temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"warply": {"cache_key": tenant}},
            )  # fmt: skip
            usage = [chunk.usage for chunk in stream if chunk.usage][-1]
            details = usage.prompt_tokens_details
            prompt[tenant] += usage.prompt_tokens
            cached[tenant] += (details.cached_tokens or 0) if details else 0
        time.sleep(1.5)  # the engines' last cache events and tier bytes reach the router
        for tenant in TENANTS:
            print(f"{tenant:24s} {cached[tenant]:6d} of {prompt[tenant]:6d} prompt tokens cached")
        print(engine.cache_stats().summary())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True, help="model folder (scripts/tiny_model.py)")
    ap.add_argument("--vllm", help="the vllm CLI of a venv with lmcache (default: found)")
    ap.add_argument("--conversations", type=positive(int), default=16,
                    help="conversations sent, half per tenant")
    ap.add_argument("--turns", type=positive(int), default=4, help="turns kept per conversation")
    args = ap.parse_args()
    try:
        run(args.model, args.vllm, args.conversations, args.turns)
    except (wp.UpError, wp.SpecError, ValueError) as exc:
        print(f"quickstart failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
