"""Side by side on two real vLLM CPU engines: warply-router vs sglang-router 0.3.2 cache_aware.

Same engines, same workload (the demo's: multi-turn chains from the Mooncake trace as text
prompts), caches reset before each run, measured at the client (TTFT, wall time) and from the
engines' own usage (cached tokens). sglang-router proxies any OpenAI server; it runs from a
scratch venv (`python3 -m venv /tmp/sgr && /tmp/sgr/bin/pip install sglang-router==0.3.2`).
Bounded: a fixed request list and a per-run timeout; every process is stopped by PID.

    .venvs/core/bin/python bench/router_vs_sglang.py --vllm .venvs/vllm/bin/vllm --model DIR \\
        --sglang-router /tmp/sgr/bin/python
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import demo  # noqa: E402  (the demo's engines, workload and client; not a package)

from warply.launch import HOST, EngineProcess, free_port, http_json  # noqa: E402


def _sglang(python: str, engines: list[tuple[EngineProcess, int, int]], workdir: Path,
            policy: str) -> EngineProcess:
    port = free_port()
    cmd = [python, "-m", "sglang_router.launch_router", "--host", HOST, "--port", str(port),
           "--policy", policy, "--worker-urls", *(e.url for e, _, _ in engines)]
    return EngineProcess(cmd, url=f"http://{HOST}:{port}", log_path=workdir / f"sgl-{policy}.log")


def _wait_registered(router: EngineProcess, engines: list[tuple[EngineProcess, int, int]]) -> None:
    """sglang-router adds its workers after /health answers: wait until /workers lists both."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status, body = http_json("GET", router.url + "/workers", timeout=5)
        if status == 200 and all(e.url in json.dumps(body) for e, _, _ in engines):
            return
        time.sleep(0.5)
    raise TimeoutError("sglang-router did not register both workers in 120 s")


def _served(engine: EngineProcess) -> float:
    """Requests an engine finished so far (its own counter): who really served the load."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def _summary(wall: float, done: list[dict[str, Any]]) -> dict[str, float]:
    ttft = sorted(d["ttft_s"] for d in done)
    return {
        "hit": sum(d["cached"] for d in done) / max(1, sum(d["prompt"] for d in done)),
        "p50": ttft[len(ttft) // 2] * 1e3,
        "p99": ttft[int(0.99 * (len(ttft) - 1))] * 1e3,
        "mean": statistics.fmean(ttft) * 1e3,
        "wall": wall,
    }


async def _main(args: argparse.Namespace, workdir: Path) -> None:
    items = demo.workload(args.trace, args.conversations, args.turns, args.words_per_id, 48)
    engines = demo.engine_pair(args.vllm, args.model, workdir)
    runs: dict[str, dict[str, Any]] = {}
    routers = {
        "warply prefix_affinity": lambda: demo.router_process(
            "prefix_affinity", engines, args.model, workdir
        ),
        "sglang cache_aware": lambda: _sglang(args.sglang_router, engines, workdir, "cache_aware"),
        "sglang round_robin": lambda: _sglang(args.sglang_router, engines, workdir, "round_robin"),
    }
    try:
        for e, _, _ in engines:
            e.start()
        for e, _, _ in engines:
            e.wait_healthy()
        for _ in range(args.repeats):
            for name, make in routers.items():
                demo.reset_caches(engines)
                with make() as router:
                    router.wait_healthy(120, path="/v1/models")
                    if name.startswith("sglang"):
                        _wait_registered(router, engines)
                    before = [_served(e) for e, _, _ in engines]
                    wall, done = await asyncio.wait_for(
                        demo.replay(router.url, items, args.in_flight), args.timeout_s
                    )
                split = [_served(e) - b for (e, _, _), b in zip(engines, before, strict=True)]
                runs.setdefault(name, {"split": "/".join(f"{n:.0f}" for n in split)})
                for k, v in _summary(wall, done).items():
                    runs[name][k] = float(runs[name].get(k, 0.0)) + v / args.repeats
    finally:
        for e, _, _ in engines:
            e.stop()
    print(f"{len(items)} requests, {sum(len(i['prompt']) for i in items)} prompt characters, "
          f"{args.in_flight} in flight, mean of {args.repeats} run(s)")
    print(f"{'router':26s} {'hit rate':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'mean':>8s} "
          f"{'wall s':>7s} {'served per engine':>18s}")
    for name, r in runs.items():
        print(f"{name:26s} {r['hit']:9.3f} {r['p50']:8.1f}m {r['p99']:8.1f}m {r['mean']:7.1f}m "
              f"{r['wall']:7.1f} {r['split']:>18s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--vllm", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--sglang-router", default="/tmp/sgr/bin/python", help="its venv's python")
    ap.add_argument("--trace", type=Path, default=demo.TRACE)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--words-per-id", type=int, default=24)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--timeout-s", type=float, default=600)
    args = ap.parse_args()
    asyncio.run(_main(args, Path(tempfile.mkdtemp(prefix="warply-vs-sglang-"))))


if __name__ == "__main__":
    main()
