"""The router's configuration: one validated file (YAML or TOML) plus matching CLI flags.

Every model forbids unknown fields, so a typo is an error naming the field, not a silent
default. CLI flags override the file's top-level scalars (`--port`, `--strategy`, ...).
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml  # type: ignore[import-untyped]
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from warply.common.urls import check_http_url
from warply.common.validation import describe
from warply.protocol.api import AUTH_TOKEN_ENV, Role
from warply.protocol.endpoints import check_endpoint
from warply.protocol.plugin import CONTROL_TOKEN_ENV, CONTROL_TOKEN_MIN_CHARS


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending field(s)."""


def _printable_name(name: str) -> str:
    # a name is a response header (X-Warply-Worker), a URL path segment and a metric label:
    # a control character there failed the request after the engine had served it
    if not name.isprintable() or any(c.isspace() for c in name):
        raise ValueError(f"name {name!r} must be printable, without spaces")
    return name


_Name = Annotated[str, Field(min_length=1), AfterValidator(_printable_name)]
"""A worker's or pool's name."""


class _Strict(BaseModel):
    # Attribute docstrings become field descriptions: the `--help` of warply-router's flags
    # and the OpenAPI document's WorkerConfig schema read them.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class WorkerConfig(_Strict):
    """One engine server: where requests go and where its cache state comes from."""

    name: _Name
    url: str
    """OpenAI-compatible HTTP base URL (no trailing /v1)."""
    events: str | None = None
    """State-stream endpoint (stock `--kv-events-config` or the WarplyConnector's)."""
    replay: str | None = None
    """Replay endpoint of that stream (gap recovery)."""
    topic: str = ""
    """Topic prefix to subscribe to ("" = all)."""
    bind: bool = False
    """Bind the SUB socket (the engine connects to us) instead of connecting to the engine."""
    control: str | None = None
    """Directive endpoint of the Warply plugin (ZMQ ROUTER), if any."""
    bootstrap_host: str | None = Field(None, min_length=1)
    """SGLang prefill worker: the host its bootstrap server is reached at by decode workers
    (None: the host of `url`)."""
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    """SGLang prefill worker: its `--disaggregation-bootstrap-port` (None: SGLang's default,
    8998)."""

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return check_http_url(url).rstrip("/")

    @field_validator("events", "replay", "control")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        return None if value is None else check_endpoint(value)


KvHandoff = Literal["vllm", "sglang"]
"""A prefill / decode pair's hand-off protocol."""


class StrategyConfig(_Strict):
    """A strategy by name (builtin, `warply.strategies` entry point, or `module:Class`)."""

    name: str = "adaptive"
    knobs: dict[str, Any] = Field(default_factory=dict)


class PoolConfig(_Strict):
    """Workers that share a block size, a KV layout and a role."""

    name: _Name
    block_size: int = Field(gt=0)
    """Must equal the engines' own block (page) size, or keys will never match."""
    kv_bytes_per_token: int = Field(0, ge=0)
    """KV bytes one token takes on these engines (2·layers·kv_heads·head_dim·dtype bytes)."""
    role: Role = "both"
    """`both`: the workers prefill and decode their own requests (aggregated serving).
    `prefill`: they compute prompts handed off to a `decode` pool (vLLM: a KV connector such as
    NixlConnector with `kv_role` kv_producer); `decode`: they pull a prompt's KV from the prefill
    worker and generate (kv_consumer), or (vLLM) prefill locally when little of the prompt is
    missing (`pd.local_prefill_tokens`)."""
    kv_handoff: KvHandoff = "vllm"
    """How a prefill or decode pool's engines hand a prompt's KV over (docs/router.md):
    `vllm`, prefill first, then decode with the `kv_transfer_params` prefill returned;
    `sglang`, one body with `bootstrap_host` / `bootstrap_port` / `bootstrap_room` to both
    workers at once (`--disaggregation-mode prefill|decode`). Not for role `both`."""
    strategy: StrategyConfig | None = None
    """This pool's strategy (None: the router's `strategy`)."""
    price_per_hour: float = Field(0.0, ge=0)
    """What one of these workers costs per hour (any currency, the same for every pool; spot
    or on-demand as you pay it): `cost_aware` trades it against cache affinity."""
    prefill_tokens_per_s: float | None = Field(None, gt=0)
    """These engines' prefill speed (prompt tokens per second, measured on your model), from
    which `cost_aware` estimates the wait for a first token; required by that strategy."""
    workers: list[WorkerConfig] = Field(min_length=1)

    @property
    def local_prefill(self) -> bool:
        """Its workers can prefill a prompt themselves: aggregated workers, and vLLM decode
        workers (an SGLang 0.5.23 server in disaggregation mode refuses a request without
        `bootstrap_room`: `Scheduler._handle_generate_request`, managers/scheduler.py)."""
        return self.role != "decode" or self.kv_handoff == "vllm"

    @property
    def decodes(self) -> bool:
        """Its workers can decode a request themselves: all but SGLang prefill servers (0.5.23's
        `--disaggregation-mode prefill` only prefills and sends the KV to its decode peer)."""
        return self.role != "prefill" or self.kv_handoff == "vllm"

    @model_validator(mode="after")
    def _handoff_fields(self) -> PoolConfig:
        if self.role == "both" and self.kv_handoff != "vllm":
            raise ValueError(
                f"kv_handoff {self.kv_handoff!r} is for pools with role 'prefill' or 'decode'; "
                f"pool {self.name!r} has role 'both' (its workers hand nothing off)"
            )
        for w in self.workers:
            self.check_worker(w)
        return self

    def check_worker(self, worker: WorkerConfig) -> None:
        """Raise ValueError when `worker` has fields this pool's role and hand-off do not take
        (at load, and for a worker joining at runtime)."""
        if self.role == "prefill" and self.kv_handoff == "sglang":
            return
        for field in ("bootstrap_host", "bootstrap_port"):
            if getattr(worker, field) is not None:
                raise ValueError(
                    f"worker {worker.name!r}: {field} is for prefill workers of a pool with "
                    f"kv_handoff 'sglang'; pool {self.name!r} has role {self.role!r} and "
                    f"kv_handoff {self.kv_handoff!r}"
                )


class AlertConfig(_Strict):
    """Hit-rate alert: fires when the windowed hit rate drops below `min_hit_ratio`."""

    min_hit_ratio: float = Field(0.0, ge=0, le=1)
    window: int = Field(200, gt=0)
    """Requests in the sliding window."""
    min_requests: int = Field(20, gt=0)
    """No alert before the window holds this many requests."""
    callback: str | None = Field(None, pattern=r"^[\w.]+:\w+$")
    """Optional `module:function` called with (hit_ratio, threshold) when the alert fires."""


class PdConfig(_Strict):
    """The prefill → decode hand-off (pools with roles `prefill` and `decode`)."""

    local_prefill_tokens: int = Field(512, ge=0)
    """Conditional disaggregation: when fewer prompt tokens than this are missing on the chosen
    decode worker (prompt minus the prefix it holds), it prefills them itself instead of pulling
    them from a prefill worker; 0 hands every prompt off. Default from the measurement in
    docs/router.md (local prefill vs the P/D round trip on vLLM CPU engines)."""
    local_prefill_by: Literal["threshold", "cost"] = "threshold"
    """`threshold` (default): hand off every prompt missing at least `local_prefill_tokens` on
    decode; `cost`: also prefill locally when decode's predicted time to first token (its
    queued prefill plus the tokens it misses) is no more than the hand-off's (the prefill
    worker's queued prefill plus its missing tokens, plus the transfer in token-equivalents);
    docs/router.md."""
    transfer_weight: float = Field(0.0, ge=0)
    """`cost`: token-equivalents per prompt token moved P→D (transfer time ÷ prefill time per
    token: 0.17 for 128 KiB per token over 400 Gb/s against ~66 k prefilled tokens/s)."""
    handoff_tokens: int = Field(0, ge=0)
    """`cost`: the hand-off's fixed overhead in token-equivalents (second hop, transfer set-up)."""
    prefill_answers: bool = False
    """vLLM pools only: a prefill worker may answer a whole request itself (prefill and decode;
    a vLLM kv_producer serves a request without `kv_transfer_params` as an aggregated engine
    does): the prefill workers join the decode pool's candidates, and its strategy chooses among
    them all where the request runs, as among aggregated workers (docs/router.md). Off by
    default: it gives up the decode pool's isolation from prefill passes."""
    prefill_timeout_s: float = Field(60.0, gt=0)
    """Longest wait for a prefill worker's answer; past it the decode worker prefills locally."""
    lost_after_s: float = Field(10.0, ge=0)
    """A prefill worker failing its health probe this long (or refusing connections at all) is
    lost: legs waiting on it (its prefill, or a decode pulling its KV) turn into local prefills
    on decode. Not 0: on a busy machine a live engine's probe can time out once."""


class TierPolicyConfig(_Strict):
    """A tier policy by name (builtin, `warply.tier_policies` entry point, or `module:Class`)."""

    name: str = "lru_by_tier"
    knobs: dict[str, Any] = Field(default_factory=dict)


class PinBudgetConfig(_Strict):
    """Bytes each namespace (`cache_key`) may hold pinned, on every tier and worker together;
    the tier runner refuses a pin of any policy that would exceed it (docs/tiering.md)."""

    default_bytes: int | None = Field(None, ge=0)
    """The budget of namespaces not in `namespaces` (None: no budget; 0: no pins)."""
    namespaces: dict[str, Annotated[int, Field(ge=0)] | None] = Field(default_factory=dict)
    """Namespace → its own budget in bytes (None: no budget for it, whatever the default)."""

    def limit(self, namespace: str) -> int | None:
        """`namespace`'s budget in bytes (None: unlimited)."""
        return self.namespaces.get(namespace, self.default_bytes)


class TieringConfig(_Strict):
    """The tier policy the router runs, and how often (docs/tiering.md)."""

    policy: TierPolicyConfig = TierPolicyConfig()
    pin_budget: PinBudgetConfig = PinBudgetConfig()
    """Pinned bytes per namespace, all tiers and workers together (default: unlimited)."""
    interval_s: float = Field(5.0, gt=0)
    """Seconds between policy rounds."""
    directive_timeout_s: float = Field(2.0, gt=0)
    """Longest wait for a plugin's ack; past it the directive counts as `timeout`."""
    max_directives: int = Field(64, gt=0)
    """Directives sent per round at most (the rest are counted as `dropped`)."""
    max_prefixes: int = Field(1024, gt=0)
    """Prefixes tracked for policies (least recently used dropped first)."""
    max_prefix_blocks: int = Field(64, gt=0)
    """Blocks kept per tracked prefix."""


class BreakerConfig(_Strict):
    """A worker's circuit breaker: requests failing in a row take it out of placement."""

    failures: int = Field(3, ge=1)
    """Failed requests in a row (refused, broken, timed out, or a 5xx) that open it."""
    open_s: float = Field(10.0, gt=0)
    """How long it stays open; then one request at a time may try the worker (half-open):
    success closes it, failure opens it again."""


class IndexConfig(_Strict):
    """Where the prefix index lives: in the router's memory (the default), or on a Redis /
    Valkey server that several router replicas of one deployment share."""

    store: Literal["memory", "redis"] = "memory"
    url: str | None = Field(None, pattern=r"^(redis|rediss|unix)://")
    """The shared store's server (`store: redis`), e.g. redis://127.0.0.1:6379/0."""
    prefix: str = Field("warply", min_length=1, pattern=r"^[^{}]+$")
    """The deployment's namespace on that server: replicas with the same prefix share one
    index; deployments with different prefixes never see each other's entries."""
    max_entries: int = Field(4_000_000, gt=0)
    """Cap on (block, worker) entries, least recently used blocks evicted first (give every
    replica of a shared store the same value)."""
    timeout_s: float = Field(0.5, gt=0)
    """Longest wait for the shared store's answer before a call counts as failed (placement
    then goes on without prefix matches)."""
    stale_after_s: float | None = Field(30.0, gt=0)
    """A worker that answered a request which must have stored new blocks, and whose state
    stream then stays silent this long (its HTTP still answering), has its index entries aged
    out: dropped, the worker placed by load until its stream speaks again. None: never."""
    degraded_s: float = Field(10.0, ge=0)
    """How long a worker's index counts as `degraded` after its engine reported fewer cached
    tokens than predicted (evictions whose events lag) or a stream gap was replayed."""
    lag_tolerance: float = Field(0.1, ge=0, le=1)
    """A shortfall degrades the worker only while the cached tokens its engine did not report
    exceed this fraction of those predicted over its recent requests (about its last 32)."""
    parity_check: bool = True
    """Compare each engine's own tokenization of probe prompts (its `/tokenize`) with the
    router's when it turns healthy; on a mismatch its prefix matches are not used."""
    share_load: bool = True
    """With store `redis`: replicas publish their bookings (in-flight requests, pending
    prefill) there and place on the sum of every replica's (`router.load`)."""
    load_ttl_s: float = Field(10.0, gt=0)
    """How long a replica's published bookings outlive its last write: a replica that died
    stops counting after this (live ones rewrite theirs every third of it)."""

    @model_validator(mode="after")
    def _url_for_redis(self) -> IndexConfig:
        if self.store == "redis" and self.url is None:
            raise ValueError("url: store 'redis' needs the server's url (redis://HOST:PORT/DB)")
        if self.store == "memory" and self.url is not None:
            raise ValueError("url: applies to store 'redis' only (this index is in memory)")
        return self


class LimitsConfig(_Strict):
    """Largest client request the router takes; past a limit it answers 413 (body) or 400
    (prompt, messages, batch) in the OpenAI error shape before tokenizing or placing anything."""

    max_body_bytes: int = Field(16 << 20, gt=0)
    """Request body bytes (a 128k-token prompt is ~0.5 MiB of text, ~0.9 MiB as token ids)."""
    max_prompt_tokens: int = Field(1 << 20, gt=0)
    """Tokens of one prompt, whatever `max_model_len` says (it is checked as well when known)."""
    max_messages: int = Field(10_000, gt=0)
    """Messages of one chat request."""
    max_prompts: int = Field(1024, gt=0)
    """Prompts in one batched completion request (`prompt` as a list of prompts)."""


def _is_origin(text: str) -> bool:
    """Whether `text` is a web origin as a browser sends it: http(s)://host[:port]."""
    parts = urlsplit(text)
    try:
        port_ok = parts.port is None or parts.port > 0
    except ValueError:  # not a number below 65536
        return False
    extra = (parts.path, parts.query, parts.fragment, parts.username)
    return port_ok and parts.scheme in ("http", "https") and bool(parts.hostname) and not any(extra)


class RouterConfig(_Strict):
    """Everything `warply-router` needs."""

    model: str = Field(min_length=1)
    """Served model name clients send (and the engines serve); also seeds the key chains."""
    lora_adapters: list[str] = Field(default_factory=list)
    """LoRA adapter names the engines serve (vLLM `--lora-modules NAME=PATH`); a request may
    name one in `model`, and its prefixes are keyed apart from the base model's."""
    tokenizer: Path
    """Folder with the engine's tokenizer.json + tokenizer_config.json (the model folder)."""
    tokenizer_cache_mib: int = Field(32, gt=0)
    """Budget of the tokenizer's chunk cache (`router.token_cache`), least recently used chunks
    dropped first; remembered whole prompts get half as much again. Several minutes of a busy
    router's new prompt text, or ~30 conversations of 128k tokens each."""
    host: str = "127.0.0.1"
    """Address the HTTP server binds (loopback unless told otherwise)."""
    port: int = Field(8000, ge=0, le=65535)
    """HTTP port for clients, admins and Prometheus."""
    pools: list[PoolConfig] = Field(min_length=1)
    strategy: StrategyConfig = StrategyConfig()
    auth_token: str | None = Field(
        default_factory=lambda: os.environ.get(AUTH_TOKEN_ENV) or None, min_length=1
    )
    """When set, /warply/* admin endpoints require `Authorization: Bearer <token>`. Unset in
    the file: the `WARPLY_AUTH_TOKEN` environment variable (a Kubernetes Secret, say)."""
    control_token: str | None = Field(
        default_factory=lambda: os.environ.get(CONTROL_TOKEN_ENV) or None,
        min_length=CONTROL_TOKEN_MIN_CHARS,
    )
    """When set, directives to the plugins' control sockets are signed with it (HMAC-SHA256,
    timestamp and nonce: `warply.protocol.control`); give the plugins the same
    `control_token`. Default: the `WARPLY_CONTROL_TOKEN` environment variable (as the plugins
    read it), else none."""
    limits: LimitsConfig = LimitsConfig()
    cors_allowed_origins: list[str] = []
    """Origins (`https://host[:port]`, or "*" for any) whose web pages may call the client API
    from a browser (CORS); none by default. The admin API (/warply/*) never answers a web page
    (`router.cors`)."""
    trust_request_chat_template: bool = False
    """Render a chat request's own `chat_template` (sandboxed Jinja, as the engine would).
    Off: such requests are refused with 400, as vLLM refuses them without its
    `--trust-request-chat-template`; turn both on together, for clients you trust."""
    chat_template: str | None = Field(None, min_length=1)
    """The chat template the engines were started with (`--chat-template` of vLLM and SGLang):
    a file's path, or the Jinja text itself, read as vLLM 0.32 reads the flag (an SGLang
    fleet's `.jinja` file as SGLang 0.5 reads it). Unset: the tokenizer folder's
    (chat_template.jinja, else tokenizer_config.json's)."""
    chat_template_content_format: Literal["auto", "string", "openai"] = "auto"
    """vLLM's `--chat-template-content-format`: message contents reach the template as one text
    ("string") or as text parts ("openai"); "auto" detects it from the template as vLLM does.
    SGLang has no such flag and always detects it."""
    exclude_tools_when_tool_choice_none: bool = False
    """vLLM's `--exclude-tools-when-tool-choice-none`: a chat or response whose `tool_choice`
    is "none" reaches the template without its tools (SGLang always leaves them out then)."""
    anthropic_disabled_thinking_effort: Literal[
        "auto", "none", "low", "medium", "high", "xhigh", "max"
    ] = "auto"
    """vLLM's `--anthropic-disabled-thinking-effort`: the reasoning effort a /v1/messages
    request with `thinking: {"type": "disabled"}` renders with; "auto" probes the template as
    vLLM 0.32 does ("none", or "low" where the template refuses it or renders it as a thinking
    effort)."""
    hf_chat_template_name: str | None = Field(None, min_length=1)
    """SGLang's `--hf-chat-template-name`: which of the tokenizer folder's named chat templates
    an SGLang fleet renders every request with (unset: the first, "default" where the folder
    has one; SGLang ignores a request's own template and tool templates). vLLM has no such flag:
    it picks one per request."""
    default_chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """The engines' `--default-chat-template-kwargs` (e.g. `{enable_thinking: false}`):
    template arguments a request's own `chat_template_kwargs` and reasoning effort override,
    merged as each engine merges them."""
    index: IndexConfig = IndexConfig()
    max_model_len: int | None = Field(None, gt=0)
    """Longest prompt accepted (unset: ask the workers' /v1/models at start-up)."""
    alerts: AlertConfig = AlertConfig()
    health_interval_s: float = Field(2.0, gt=0)
    health_timeout_s: float = Field(2.0, gt=0)
    """How long one `/health` probe may take."""
    loop_stall_dump_s: float | None = Field(10.0, gt=0)
    """When the event loop has not run for this long, every thread's stack is written to the
    router's stderr (None: never); its lag is always the `warply_router_event_loop_lag_seconds`
    histogram."""
    unhealthy_after: int = Field(2, ge=1)
    """Failed probes in a row (slow, hung, or an error status) before a worker that still
    accepts connections leaves placement; a refused connection takes it out at once. One slow
    probe on a busy machine does not take a live engine out."""
    request_timeout_s: float = Field(600.0, gt=0)
    drain_timeout_s: float = Field(15.0, ge=0)
    """On SIGTERM / SIGINT the router stops accepting connections and lets the requests in
    flight finish for up to this long, then ends each one still open with a 503 (an error event
    on a started stream) and exits. Keep it inside the time the process is given to stop
    (Kubernetes' `terminationGracePeriodSeconds`, 30 s by default; `warply down`, 20 s)."""
    upstream_idle_timeout_s: float = Field(300.0, gt=0)
    """Longest silence on an open upstream request (no header, no byte): a worker that
    accepts connections but never answers fails the request with 504 after it."""
    breaker: BreakerConfig = BreakerConfig()
    pd: PdConfig = PdConfig()
    tiering: TieringConfig | None = None
    """None: no tier policy runs."""

    @model_validator(mode="before")
    @classmethod
    def _moved_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "index_max_entries" in data:
            raise ValueError(
                "index_max_entries moved into the index section: write "
                f"`index: {{max_entries: {data['index_max_entries']}}}` instead"
            )
        return data

    @field_validator("cors_allowed_origins")
    @classmethod
    def _origins(cls, origins: list[str]) -> list[str]:
        for origin in origins:
            if origin != "*" and not _is_origin(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: write scheme://host[:port] as a browser sends "
                    "it in its Origin header (no path, no trailing slash), or '*'"
                )
        return origins

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _template_defaults(cls, value: dict[str, Any]) -> dict[str, Any]:
        taken = sorted({"messages", "tools"} & value.keys())
        if taken:
            raise ValueError(f"{', '.join(taken)}: each request sets these, not a default")
        return value

    @field_validator("lora_adapters")
    @classmethod
    def _adapter_names(cls, names: list[str]) -> list[str]:
        for name in names:
            if not name or "\0" in name:
                raise ValueError(f"adapter name {name!r} must be non-empty, without NUL")
        return names

    @model_validator(mode="after")
    def _unique_names(self) -> RouterConfig:
        if self.model in self.lora_adapters:
            raise ValueError(f"lora_adapters: {self.model!r} is the base model's name")
        seen: set[str] = set()
        urls: dict[str, str] = {}
        for pool in self.pools:
            for w in pool.workers:
                if w.name in seen:
                    raise ValueError(f"worker name {w.name!r} is used twice")
                seen.add(w.name)
                # two workers on one engine would split its requests and its index entries
                if (other := urls.setdefault(w.url, w.name)) != w.name:
                    raise ValueError(f"workers {other!r} and {w.name!r} have the same url {w.url}")
        roles = {pool.role for pool in self.pools}

        def named(role: str) -> str:
            return ", ".join(repr(p.name) for p in self.pools if p.role == role)

        if "prefill" in roles and "decode" not in roles:
            raise ValueError(
                f"pools: prefill pool(s) {named('prefill')} hand prompts off to a decode pool, "
                "but no pool has role 'decode' (add one, or give them role 'both')"
            )
        if "decode" in roles and "prefill" not in roles:
            raise ValueError(
                f"pools: decode pool(s) {named('decode')} take prompts from a prefill pool, "
                "but no pool has role 'prefill' (add one, or give them role 'both')"
            )
        handoffs = {p.kv_handoff for p in self.pools if p.role != "both"}
        if len(handoffs) > 1:
            pools = ", ".join(
                f"{p.name!r}: {p.kv_handoff!r}" for p in self.pools if p.role != "both"
            )
            raise ValueError(
                f"pools: prefill and decode pools must share one kv_handoff ({pools}); "
                "an engine's decode workers take KV only from its own kind of prefill worker"
            )
        mute = [repr(p.name) for p in self.pools if not p.decodes]
        if self.pd.prefill_answers and mute:
            raise ValueError(
                f"pd.prefill_answers: prefill pool(s) {', '.join(mute)} have kv_handoff 'sglang', "
                "whose prefill servers cannot decode a request; turn prefill_answers off"
            )
        sizes = {p.block_size for p in self.pools if p.role == "decode"}
        apart = [
            repr(p.name) for p in self.pools if p.role == "prefill" and p.block_size not in sizes
        ]
        if self.pd.prefill_answers and apart:
            raise ValueError(
                f"pd.prefill_answers: prefill pool(s) {', '.join(apart)} share no block_size "
                "with a decode pool, so their workers cannot be weighed beside the decode "
                "workers; give them one block_size or turn prefill_answers off"
            )
        return self

    @model_validator(mode="after")
    def _prefill_speeds(self) -> RouterConfig:
        """`cost_aware` estimates waits from each pool's prefill speed; it also compares the
        pools' picks when it is the router's strategy."""
        for i, pool in enumerate(self.pools):
            uses = (pool.strategy or self.strategy).name == "cost_aware"
            if (uses or self.strategy.name == "cost_aware") and pool.prefill_tokens_per_s is None:
                raise ValueError(
                    f"pools.{i}.prefill_tokens_per_s: pool {pool.name!r} needs it for the "
                    "cost_aware strategy (its engines' prompt tokens per second)"
                )
        return self


CLI_FIELDS: dict[str, type] = {
    "model": str,
    "tokenizer": str,
    "host": str,
    "port": int,
    "auth_token": str,
    "control_token": str,
    "index_max_entries": int,
    "max_model_len": int,
    "chat_template": str,
    "chat_template_content_format": str,
    "hf_chat_template_name": str,
    "anthropic_disabled_thinking_effort": str,
}
"""Fields settable by a `--flag` of the same name (dashes for underscores); top-level ones, and
`index_max_entries` for `index.max_entries`."""


def check_knobs(
    model: type[BaseModel], knobs: dict[str, Any], path: str, what: str
) -> BaseModel:
    """`knobs` validated by a strategy's or tier policy's `Knobs` model; a `ConfigError` names
    each bad field under `path` (e.g. `strategy.knobs.balance_abs`)."""
    try:
        return model.model_validate(knobs)
    except ValidationError as err:
        details = "; ".join(
            f"{path}.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in err.errors()
        )
        raise ConfigError(f"invalid knobs for {what}: {details}") from None


def _read(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config {path} is not UTF-8 text") from None
    kind = "TOML" if path.suffix == ".toml" else "YAML"
    try:
        data = tomllib.loads(text) if kind == "TOML" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config {path} is not valid {kind}: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: the top level must be a mapping")
    return data


def load_config(
    path: Path | None,
    overrides: dict[str, Any] | None = None,
    *,
    strategy: str | None = None,
    knobs: dict[str, Any] | None = None,
    min_hit_ratio: float | None = None,
) -> RouterConfig:
    """Read `path` (if any), apply CLI overrides, validate; raises `ConfigError`."""
    data = _read(path) if path is not None else {}
    flags = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "index_max_entries" in flags:
        index = data.get("index")
        data["index"] = dict(index if isinstance(index, dict) else {})
        data["index"]["max_entries"] = flags.pop("index_max_entries")
    data.update(flags)
    if strategy is not None or knobs is not None:
        current = dict(data.get("strategy") or {})
        if strategy is not None:
            current["name"] = strategy
        if knobs is not None:
            current["knobs"] = knobs
        data["strategy"] = current
    if min_hit_ratio is not None:
        data["alerts"] = dict(data.get("alerts") or {}, min_hit_ratio=min_hit_ratio)
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe(err, "invalid router config")) from None
