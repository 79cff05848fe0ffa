"""Command line of the replayer: `python -m replay {replay,live} ...`.

`warply bench replay|live` runs this module in a subprocess, so the SDK never imports the router.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

from pydantic import BaseModel, ValidationError

from replay.baselines import BASELINES
from replay.costmodel import CostModel
from replay.engine import EngineConfig
from replay.live import LiveConfig, LiveError, run_live
from replay.pd import REFERENCE_KV_BYTES_PER_TOKEN, PdSettings
from replay.references import INFINITE, infinite_reuse, lru_reuse, pooled_lru_label
from replay.report import plot, summarize, table, write_json
from replay.sim import SimPool, simulate_pools
from replay.trace import ExpandedTrace, TraceError, read_trace
from router.config import ConfigError, PdConfig, TieringConfig, TierPolicyConfig, check_knobs
from router.strategies import Strategy, known_names, strategy_class
from router.tiering import make_policy
from warply.common.argtypes import number_list, output_file, positive
from warply.common.loading import LoadError, load_path
from warply.common.validation import describe

DEFAULT_STRATEGIES = (
    "adaptive",
    "round_robin",
    "least_loaded",
    "prefix_affinity",
    "kv-reuse",
    "sglang_cache_aware",
    "dynamo_kv",
    "llmd_precise",
)


class UsageError(ValueError):
    """Bad command-line input; the message says what and why."""


@dataclass(frozen=True)
class StrategySpec:
    """A strategy to replay: display label, class and validated knobs."""

    label: str
    cls: type[Strategy]
    knobs: BaseModel
    name: str = ""
    """The name as the router's config takes it (`strategy.name`)."""

    def build(self) -> Strategy:
        return self.cls(self.knobs)


def parse_strategy(spec: str) -> StrategySpec:
    """`[LABEL=]NAME[:JSON_KNOBS]`, e.g. `pa8=prefix_affinity:{"balance_abs": 8}`. NAME is
    resolved as the router resolves it (built-in, entry point, `module.path:Class` — write the
    knobs after the class then, `my.mod:Cls:{...}`) plus the replayer's baselines."""
    label, _, rest = spec.rpartition("=") if "=" in spec.split(":", 1)[0] else ("", "", spec)
    name, raw = _name_and_knobs(rest)
    try:
        cls = strategy_class(name, BASELINES)
        knobs = check_knobs(cls.Knobs, json.loads(raw or "{}"), "knobs", name)
    except json.JSONDecodeError as exc:
        raise UsageError(f"knobs for {name} are not JSON: {exc}") from None
    except ConfigError as exc:
        raise UsageError(str(exc).removeprefix("strategy.name: ")) from None
    return StrategySpec(label or (f"{name}:{raw}" if raw else name), cls, knobs, name)


def strategy_arg(spec: str) -> str:
    """argparse `type` for a strategy spec (`parse_strategy`'s form): a bad name or bad knobs
    stop the command at its flags, before any replay runs."""
    try:
        parse_strategy(spec)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return spec


def _name_and_knobs(text: str) -> tuple[str, str]:
    """Split `NAME[:JSON]`, where NAME may itself be a `module:Class` path."""
    name, _, raw = text.partition(":")
    if raw and not raw.lstrip().startswith("{"):  # a module:Class path
        attr, _, raw = raw.partition(":")
        name = f"{name}:{attr}"
    return name, raw


def _cost_model(path: str | None) -> Callable[[], CostModel] | None:
    if not path:
        return None
    try:
        factory = load_path(path)
    except LoadError as exc:
        raise UsageError(f"cannot load cost model {path!r}: {exc}") from None
    if not callable(factory) or not isinstance(factory(), CostModel):
        raise UsageError(f"{path} does not build a CostModel (prefill_ms, decode_ms)")
    model: Callable[[], CostModel] = factory
    return model


def _tiering(spec: str | None, interval_s: float) -> TieringConfig | None:
    """`NAME[:JSON_KNOBS]` → the tier policy the replay runs (built-in, entry point or
    `module:Class`, as the router loads it), every `interval_s` simulated seconds."""
    if spec is None:
        return None
    name, raw = _name_and_knobs(spec)
    try:
        knobs = json.loads(raw or "{}")
        policy = TierPolicyConfig(name=name, knobs=knobs)
        config = TieringConfig(policy=policy, interval_s=interval_s)
        make_policy(config.policy)  # load errors and bad knobs now, not in a worker process
    except json.JSONDecodeError as exc:
        raise UsageError(f"--tier-policy knobs are not JSON: {exc}") from None
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    except ValidationError as exc:
        raise UsageError(describe(exc, "bad --tier-policy / --tier-interval-s")) from None
    return config


def _engine_block(block_size: int | None, trace_block: int) -> int:
    """The engine block size: as given, else 64 tokens (the reference engine) when trace blocks
    are made of whole 64-token blocks, else the trace block itself (e.g. 16 for the GSP trace)."""
    if block_size is not None:
        return block_size
    return 64 if trace_block % 64 == 0 else trace_block


@dataclass(frozen=True)
class Deployment:
    """Simulated workers to replay: N aggregated, or P prefill + D decode at one threshold."""

    workers: int = 0
    prefill: int = 0
    decode: int = 0
    threshold: int | None = None
    """`pd.local_prefill_tokens` (None: the router's default)."""

    @property
    def total(self) -> int:
        return self.workers or self.prefill + self.decode

    def pools(self, spec: StrategySpec, prefill: StrategySpec | None) -> list[SimPool]:
        """The pools, each with its own strategy instance (strategies keep state)."""
        if self.workers:
            return [SimPool("w", "both", self.workers, spec.build())]
        return [
            SimPool("p", "prefill", self.prefill, (prefill or spec).build()),
            SimPool("d", "decode", self.decode, spec.build()),
        ]

    def label(self, spec: StrategySpec, prefill: StrategySpec | None, sweep: bool) -> str:
        """The strategy's label, with the prefill pool's strategy and the threshold when they
        tell rows apart."""
        label = spec.label if prefill is None else f"{spec.label}+{prefill.label} prefill"
        return f"{label} t={self.threshold}" if sweep else label


def _deployments(args: argparse.Namespace) -> list[Deployment]:
    """`--workers` (aggregated) or `--pd` with its threshold(s); P/D flags need `--pd`."""
    pd_flags = ("pd_threshold", "pd_bandwidth_gbps", "pd_latency_ms", "kv_bytes_per_token",
                "pd_prefill_strategy", "pd_local_by", "pd_transfer_weight",
                "pd_handoff_tokens", "pd_prefill_answers")  # fmt: skip
    if args.pd is None:
        used = [f"--{f.replace('_', '-')}" for f in pd_flags if getattr(args, f) is not None]
        if used:
            raise UsageError(f"{', '.join(used)} only apply to a P/D replay (--pd P,D)")
        return [Deployment(n) for n in args.workers or [8]]
    if args.workers is not None:
        raise UsageError("give --workers (aggregated) or --pd P,D (disaggregated), not both")
    if len(args.pd) != 2:
        got = ",".join(map(str, args.pd))
        raise UsageError(f"--pd wants two worker counts, prefill,decode (4,4); got {got!r}")
    thresholds = args.pd_threshold or [PdConfig().local_prefill_tokens]
    return [Deployment(0, args.pd[0], args.pd[1], t) for t in thresholds]


def _pd_settings(args: argparse.Namespace) -> PdSettings:
    given = {
        "bandwidth_gbps": args.pd_bandwidth_gbps,
        "latency_ms": args.pd_latency_ms,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "local_prefill_by": args.pd_local_by,
        "transfer_weight": args.pd_transfer_weight,
        "handoff_tokens": args.pd_handoff_tokens,
        "prefill_answers": args.pd_prefill_answers,
    }
    try:
        settings = PdSettings(**{k: v for k, v in given.items() if v is not None})
        settings.router()  # the router's own checks
        return settings
    except ValidationError as exc:
        raise UsageError(describe(exc, "bad P/D settings")) from None


# The forked workers read the expanded trace from here (inherited, never pickled).
_SHARED: dict[str, Any] = {}


def _run_one(job: tuple[StrategySpec, Deployment]) -> dict[str, Any]:
    spec, where = job
    trace: ExpandedTrace = _SHARED["trace"]
    prefill: StrategySpec | None = _SHARED["prefill"]
    result = simulate_pools(
        trace,
        where.pools(spec, prefill),
        where.label(spec, prefill, _SHARED["sweep"]),
        _SHARED["config"],
        _SHARED["model"],
        _SHARED.get("progress"),
        _SHARED["pd"].model_copy(update={"local_prefill_tokens": where.threshold}),
        tiering=_SHARED["tiering"],
    )
    return summarize(result, _SHARED["oracles"].get(pooled_lru_label(where.total)))


def _replay(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    specs = [parse_strategy(s) for s in (args.strategy or DEFAULT_STRATEGIES)]
    deployments = _deployments(args)
    pd = _pd_settings(args)
    prefill = parse_strategy(args.pd_prefill_strategy) if args.pd_prefill_strategy else None
    try:
        config = EngineConfig(
            num_blocks=args.num_blocks,
            block_size=_engine_block(args.block_size, args.trace_block),
            max_batched_tokens=args.max_batched_tokens,
            max_seqs=args.max_seqs,
            watermark=args.watermark,
            host_blocks=args.host_blocks,
            host_load_ms_per_token=args.host_load_ms_per_token,
        )
    except ValidationError as exc:
        raise UsageError(describe(exc, "bad engine settings")) from None
    model = _cost_model(args.cost_model)
    tiering = _tiering(args.tier_policy, args.tier_interval_s)
    requests = [
        dataclasses.replace(r, arrival_ms=r.arrival_ms / args.speedup)
        for r in read_trace(args.trace, args.limit)
    ]
    trace = ExpandedTrace(requests, args.trace_block, config.block_size)
    oracles = {INFINITE: infinite_reuse(trace)}
    for n in sorted({d.total for d in deployments}):
        oracles[pooled_lru_label(n)] = lru_reuse(trace, n * config.num_blocks)
    _SHARED.update(
        trace=trace, config=config, model=model, oracles=oracles, pd=pd, prefill=prefill,
        sweep=len(deployments) > 1 and args.pd is not None, tiering=tiering,
    )  # fmt: skip
    jobs = [(spec, d) for d in deployments for spec in specs]
    rows: list[dict[str, Any]] = []
    if args.jobs > 1:
        with (
            ProcessPoolExecutor(args.jobs, mp_context=get_context("fork")) as pool,
            tqdm(total=len(jobs), desc="replays (simulated)", disable=args.quiet) as bar,
        ):
            for row in pool.map(_run_one, jobs):
                rows.append(row)
                bar.update()
    else:
        for spec, d in jobs:
            with tqdm(
                total=len(trace), desc=f"{spec.label} N={d.total} (sim)", disable=args.quiet
            ) as bar:
                _SHARED["progress"] = bar.update
                rows.append(_run_one((spec, d)))
    print(table(rows, oracles))
    report = {
        "trace": str(args.trace),
        "requests": len(trace),
        "trace_block": args.trace_block,
        "speedup": args.speedup,
        "engine": {"simulator": "replay.engine", **config.model_dump()},
        **({"pd": pd.model_dump(exclude={"local_prefill_tokens"})} if args.pd else {}),
        "cost_model": args.cost_model or "reference (Dynamo mocker polynomial)",
        **({"tiering": tiering.model_dump(mode="json")} if tiering else {}),
        "reuse_references": oracles,
        "results": rows,
    }
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(args.plot, rows, oracles)
    return 0


def _live(args: argparse.Namespace) -> int:
    try:
        cfg = LiveConfig(
            url=args.url,
            model=args.model,
            speedup=args.speedup,
            concurrency=args.concurrency,
            timeout_s=args.timeout,
            max_output_tokens=args.max_output_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            vocab=args.vocab,
            allow_remote=args.allow_remote,
        )
    except ValidationError as exc:
        raise UsageError(describe(exc, "bad live settings")) from None
    requests = read_trace(args.trace, args.limit)
    row = run_live(requests, args.trace_block, cfg, quiet=args.quiet)
    print(table([row], {}))
    if args.json:
        write_json(
            args.json, {"trace": str(args.trace), "live": cfg.model_dump(), "results": [row]}
        )
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", help="Mooncake-format JSONL trace (timestamp ms, input_length, ...)")
    p.add_argument(
        "--trace-block",
        type=positive(int),
        default=512,
        help="tokens per trace hash id (Mooncake: 512; the SGLang GSP trace here: 16)",
    )
    p.add_argument("--limit", type=positive(int), help="replay only the first N requests")
    p.add_argument(
        "--speedup",
        type=positive(float),
        default=1.0,
        help="divide arrival times by this (2 = twice the arrival rate)",
    )
    p.add_argument("--json", metavar="PATH", type=output_file, help="write the report as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="warply bench",
        description="Replay a request trace: offline against simulated engines (replay), "
        "or against a running OpenAI-compatible endpoint (live).",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    # no abbreviations: `--trace FILE` (for the positional TRACE) was read as --trace-block
    r = sub.add_parser(
        "replay",
        allow_abbrev=False,
        help="simulated engines + the router's real index and strategies",
        description="Replay a trace through the router's index and strategies over N simulated "
        "engines (simulated time; default engine = the reference model of ENGINES.md). "
        "Prints a table with the reuse bound (one infinite cache) and the pooled-LRU reference; "
        "--json / --plot save it.",
    )
    _common(r)
    r.add_argument("--workers", type=number_list(int),
                   help="simulated aggregated workers, e.g. 8 or 4,8 (default 8)")
    r.add_argument(
        "--pd",
        metavar="P,D",
        type=number_list(int),
        help="a P/D deployment instead: P prefill + D decode workers, placed by the router's "
        "P/D placement (each strategy picks the decode worker; the prefill worker too, unless "
        "--pd-prefill-strategy)",
    )
    r.add_argument(
        "--pd-threshold",
        metavar="TOKENS[,...]",
        type=number_list(int, zero=True),
        help="pd.local_prefill_tokens: a decode worker prefills locally when fewer prompt "
        f"tokens than this are missing on it (default {PdConfig().local_prefill_tokens}, the "
        "router's); several values run one replay each",
    )
    r.add_argument(
        "--pd-local-by",
        choices=("threshold", "cost"),
        help="pd.local_prefill_by: `cost` also prefills locally when decode's predicted time to "
        f"first token beats the hand-off's (default {PdConfig().local_prefill_by}, the router's)",
    )
    r.add_argument(
        "--pd-transfer-weight",
        type=float,
        help=f"pd.transfer_weight (default {PdConfig().transfer_weight}): token-equivalents per "
        "prompt token moved P→D, for --pd-local-by cost",
    )
    r.add_argument(
        "--pd-handoff-tokens",
        type=int,
        help=f"pd.handoff_tokens (default {PdConfig().handoff_tokens}): the hand-off's fixed "
        "overhead in token-equivalents, for --pd-local-by cost",
    )
    r.add_argument(
        "--pd-prefill-answers",
        action="store_const",
        const=True,
        help="pd.prefill_answers: a prefill worker may answer a whole request itself (the "
        "prefill workers join the decode pool's candidates)",
    )
    r.add_argument(
        "--pd-prefill-strategy",
        metavar="[LABEL=]NAME[:JSON]",
        help="the prefill pool's own strategy, e.g. round_robin (default: each -s strategy)",
    )
    r.add_argument(
        "--pd-bandwidth-gbps",
        type=positive(float),
        help="P→D link per decode worker, Gbit/s (default 400)",
    )
    r.add_argument(
        "--pd-latency-ms",
        type=float,
        help="fixed time per P→D transfer (default 2 ms)",
    )
    r.add_argument(
        "--kv-bytes-per-token",
        type=positive(int),
        help=f"KV bytes per token moved P→D (default {REFERENCE_KV_BYTES_PER_TOKEN:,}: an "
        "8B-class GQA model in bf16)",
    )
    r.add_argument(
        "-s",
        "--strategy",
        action="append",
        metavar="[LABEL=]NAME[:JSON]",
        help=f"strategy to replay (repeatable; default: {', '.join(DEFAULT_STRATEGIES)}); "
        f"known: {', '.join(known_names(BASELINES))}; or a `module:Class` path",
    )
    r.add_argument(
        "--plot", metavar="PATH", type=output_file, help="write a PNG plot (matplotlib)"
    )
    r.add_argument("--jobs", type=positive(int), default=1, help="replays run in parallel")
    r.add_argument("--num-blocks", type=int, default=16384, help="KV blocks per worker")
    r.add_argument(
        "--block-size",
        type=positive(int),
        help="tokens per engine block (default: 64 when a trace block is a multiple of 64, "
        "else the trace block)",
    )
    r.add_argument("--max-batched-tokens", type=int, default=8192, help="per scheduler pass")
    r.add_argument("--max-seqs", type=int, default=256, help="running sequences per pass")
    r.add_argument("--watermark", type=float, default=0.01, help="free-block fraction kept")
    r.add_argument("--host-blocks", type=int, default=0, help="host (L2) tier blocks; 0 = none")
    r.add_argument("--host-load-ms-per-token", type=float, default=0.0, help="L2 load cost")
    r.add_argument("--cost-model", metavar="MODULE:CLASS", help="pluggable cost model")
    r.add_argument(
        "--tier-policy",
        metavar="NAME[:JSON]",
        help="tier policy the router runs over the simulated engines' tiers (built-in, entry "
        "point or module:Class, e.g. examples.tier_policies:KeepConversations)",
    )
    r.add_argument(
        "--tier-interval-s",
        type=positive(float),
        default=5.0,
        help="simulated seconds between tier-policy rounds (default 5)",
    )
    r.set_defaults(func=_replay)
    lv = sub.add_parser(
        "live",
        allow_abbrev=False,
        help="replay against a running OpenAI-compatible endpoint with real timing",
        description="Send the trace's requests to URL (/v1/completions, streaming, token-id "
        "prompts) at their trace times divided by --speedup; measures TTFT and ITL per request. "
        "Bounded by --limit, --timeout and --concurrency; stops by itself.",
    )
    _common(lv)
    lv.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
    lv.add_argument("--model", default="", help="model name to send (default: the first served)")
    lv.add_argument("--concurrency", type=positive(int), default=64, help="max open requests")
    lv.add_argument("--timeout", type=positive(float), default=600.0, help="whole run, seconds")
    lv.add_argument("--max-output-tokens", type=positive(int), help="cap each output_length")
    lv.add_argument("--max-prompt-tokens", type=positive(int), help="cap each prompt length")
    lv.add_argument("--vocab", type=positive(int), default=32000, help="token ids < vocab")
    lv.add_argument("--allow-remote", action="store_true", help="allow a URL that is not loopback")
    lv.set_defaults(func=_live)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except (UsageError, TraceError, LiveError) as exc:
        print(f"warply bench {args.command}: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, LiveError) else 2  # a dead endpoint is no usage error
    return code


if __name__ == "__main__":
    sys.exit(main())
