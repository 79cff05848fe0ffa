"""Write the demo's workload file: the first multi-turn conversations of the Mooncake
conversation trace, as trace rows (the demo turns each hash id into a line of text).

    python3 scripts/demo_workload.py ../shared/traces/mooncake/conversation_trace.jsonl \\
        > scripts/data/mooncake_conversations.jsonl

Keeps every row of the first `--conversations` conversations (up to `--turns` rows each), in
trace order, so `scripts/demo.py` picks the same requests from this file as from the whole
trace for any `--conversations` / `--turns` up to these.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import conversation_groups  # noqa: E402  (scripts/ is not a package)

from warply.common.argtypes import positive  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trace", type=Path, help="Mooncake conversation trace (JSONL)")
    ap.add_argument("--conversations", type=positive(int), default=128, help="conversations kept")
    ap.add_argument("--turns", type=positive(int), default=8, help="turns kept per conversation")
    args = ap.parse_args()
    lines = [line for line in args.trace.read_text().splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines]
    groups = conversation_groups(rows)[: args.conversations]
    for i in sorted(i for g in groups for i in g[: args.turns]):
        sys.stdout.write(lines[i] + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
