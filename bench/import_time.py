"""`import warply` / `import warply.protocol` cost in a fresh interpreter (target < 150 ms).

Runs each import in new processes (best of N) and, as the same-run baseline, a bare
`python -c pass`; also lists heavy modules that must not be pulled in.

    python bench/import_time.py [--runs N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from warply.common.argtypes import positive

_HEAVY = ("torch", "vllm", "sglang", "transformers", "zmq")


def _best(code: str, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--runs", type=positive(int), default=7, help="starts per import; the fastest counts"
    )
    args = ap.parse_args()
    bare = _best("pass", args.runs)
    print(f"bare interpreter start:      {bare * 1e3:7.1f} ms")
    for mod in ("warply", "warply.protocol"):
        total = _best(f"import {mod}", args.runs)
        print(
            f"import {mod:<20s} {total * 1e3:7.1f} ms total, {(total - bare) * 1e3:6.1f} ms "
            f"over bare ({'meets' if total - bare < 0.150 else 'MISSES'} < 150 ms)"
        )
    probe = f"import sys, warply; print(','.join(m for m in {_HEAVY!r} if m in sys.modules))"
    heavy = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.strip()
    print(f"heavy modules loaded by `import warply`: {heavy or 'none'}")


if __name__ == "__main__":
    main()
