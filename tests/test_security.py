"""Security properties: the admin token on every admin route, signed and replay-protected
directives (router → plugin control socket), tenant isolation in the router's index, no prompts
or token ids in logs at the default level, loopback-only listeners by default.

The engine side of tenant isolation (a second tenant's identical prompt reports 0 cached tokens
on a real vLLM engine) is tests/vllm/test_router_integration.py::test_tenants_never_share_kv."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import PoolConfig, RouterConfig, WorkerConfig
from router.control import send_directive, send_payload
from router.index import MemoryStore, PrefixIndex, completed
from router.metrics.registry import tenant_label
from sglang_hook.settings import add_cli_args, settings_from_args
from tests.test_router_api import (  # noqa: F401
    FakeEngine,
    _is_error,
    _run,
    running,
    tokenizer_dir,
)
from vllm_connector.config import parse_config
from warply.launch import HOST, RouterServer, free_port
from warply.protocol import (
    BlockStored,
    Directive,
    DirectiveAck,
    DirectiveKind,
    PluginSettings,
    SettingsError,
    cache_namespace,
    prefix_keys,
    request_namespace,
)
from warply.protocol.api import CacheKey
from warply.protocol.control import ControlServer, Verifier, sign
from warply.protocol.directives import encode_directive

ADMIN_TOKEN = "admin-token"
CONTROL_TOKEN = "control-token-0123456789"
PIN = Directive("d1", DirectiveKind.PIN, token_ids=[1, 2, 3, 4])

# -- the admin token ---------------------------------------------------------------------------


def test_every_admin_route_needs_the_token(tokenizer_dir: Path) -> None:  # noqa: F811
    async def scenario() -> None:
        async with running(tokenizer_dir, [FakeEngine("a")], auth_token=ADMIN_TOKEN) as (
            router, call, _s, _b,
        ):  # fmt: skip
            routes = {
                (r.method, r.resource.canonical)
                for r in router.app.router.routes()
                if r.resource is not None and r.method != "HEAD"
            }
            admin = {(m, p) for m, p in routes if p.startswith("/warply/")}
            assert {p for _, p in admin} >= {"/warply/cache_stats", "/warply/directives"}
            wrong = [
                {},
                {"Authorization": "Bearer nope"},
                {"Authorization": ADMIN_TOKEN},
                {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
                {"Authorization": "Bearer"},
            ]
            for method, path in sorted(admin):
                concrete = re.sub(r"\{[^}]+\}", "a", path)  # any path parameter
                for headers in wrong:
                    status, body = await call(method, concrete, b"{}", headers=headers)
                    assert status == 401 and _is_error(body, "invalid_api_key"), (path, headers)
                good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
                status, _ = await call(method, concrete + "?wait=false", b"{}", headers=good)
                assert status != 401, path
            assert "a" not in router.workers  # the DELETE went through with the token
            for method, path in sorted(routes - admin):  # the client API takes no token
                if method == "GET":
                    assert (await call(method, path))[0] != 401, path
            doc = (await call("GET", "/openapi.json"))[1]
            for path, ops in doc["paths"].items():
                for method, op in ops.items():
                    if method != "parameters":
                        assert ("security" in op) == path.startswith("/warply/"), (path, method)

    _run(scenario())


# -- signed directives ---------------------------------------------------------------------------


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def test_verifier_checks_signature_clock_and_nonce() -> None:
    clock = _Clock()
    verifier = Verifier(CONTROL_TOKEN, window_s=30, max_nonces=3, clock=clock)
    payload = encode_directive(PIN)
    message = sign(payload, CONTROL_TOKEN, now=clock.now)
    assert verifier.open(message) == payload

    def refused(message: bytes) -> str:
        try:
            verifier.open(message)
        except ValueError as exc:
            return str(getattr(exc, "reason", ""))
        return "accepted"

    assert refused(message) == "replayed"
    assert refused(payload) == "unsigned"
    assert refused(b"\xc1") == "unsigned"
    assert refused(sign(payload, "another-token-0123456", now=clock.now)) == "bad_mac"
    tampered = msgspec.msgpack.decode(message)
    tampered[3] = encode_directive(Directive("d1", DirectiveKind.EVICT, token_ids=[1, 2, 3, 4]))
    assert refused(msgspec.msgpack.encode(tampered)) == "bad_mac"
    assert refused(sign(payload, CONTROL_TOKEN, now=clock.now - 31)) == "stale"
    assert refused(sign(payload, CONTROL_TOKEN, now=clock.now + 31)) == "stale"
    for _ in range(2):
        assert refused(sign(payload, CONTROL_TOKEN, now=clock.now)) == "accepted"
    assert refused(sign(payload, CONTROL_TOKEN, now=clock.now)) == "replayed"  # nonces full
    clock.now += 31  # the window passed: old nonces forgotten, their messages stale
    assert refused(message) == "stale"
    assert refused(sign(payload, CONTROL_TOKEN, now=clock.now)) == "accepted"


@pytest.fixture
def plugin_socket() -> Iterator[tuple[str, ControlServer]]:
    """A plugin's directive socket holding CONTROL_TOKEN that applies (acks) what it queues."""
    endpoint = f"tcp://{HOST}:{free_port()}"
    holder: list[ControlServer] = []

    def apply_now() -> None:
        holder[0].apply_pending(lambda d: DirectiveAck(d.id, True, "applied"))

    server = ControlServer(endpoint, wake=lambda: apply_now(), token=CONTROL_TOKEN)
    holder.append(server)
    try:
        yield endpoint, server
    finally:
        server.close()


def test_plugin_applies_only_signed_fresh_directives(
    plugin_socket: tuple[str, ControlServer],
) -> None:
    endpoint, server = plugin_socket

    async def scenario() -> None:
        ack = await send_directive(endpoint, PIN, 5, token=CONTROL_TOKEN)
        assert ack.applied and ack.directive_id == "d1"
        unsigned = await send_directive(endpoint, PIN, 5)
        assert not unsigned.applied and unsigned.reason.startswith("unauthenticated")
        wrong = await send_directive(endpoint, PIN, 5, token="not-the-control-token")
        assert not wrong.applied
        captured = sign(encode_directive(PIN), CONTROL_TOKEN)
        assert (await send_payload(endpoint, captured, 5)).applied
        replayed = await send_payload(endpoint, captured, 5)
        assert not replayed.applied and "received before" in replayed.reason
        garbage = await send_payload(endpoint, b"\xc1", 5)
        assert not garbage.applied

    asyncio.run(scenario())
    assert server.rejected == {"unsigned": 2, "bad_mac": 1, "replayed": 1}
    assert server.refused == 4


def test_router_signs_directives_with_its_control_token(
    tokenizer_dir: Path, plugin_socket: tuple[str, ControlServer]  # noqa: F811
) -> None:
    endpoint, server = plugin_socket
    pool = {"name": "p", "block_size": 4, "workers": [
        {"name": "w", "url": f"http://{HOST}:{free_port()}", "control": endpoint}]}  # fmt: skip
    body = {"worker": "w", "directive": msgspec.to_builtins(PIN)}

    async def scenario(token: str | None) -> DirectiveAck:
        async with running(tokenizer_dir, [], pools=[pool], control_token=token) as (
            _r, call, _s, _b,
        ):  # fmt: skip
            status, ack = await call("POST", "/warply/directives", body)
            assert status == 200
            return DirectiveAck(**ack)

    assert asyncio.run(scenario(CONTROL_TOKEN)).applied
    assert not asyncio.run(scenario(None)).applied
    assert server.rejected == {"unsigned": 1}


def test_a_signed_directive_to_a_plugin_without_token_says_why() -> None:
    endpoint = f"tcp://{HOST}:{free_port()}"
    server = ControlServer(endpoint)
    try:
        ack = asyncio.run(send_directive(endpoint, PIN, 5, token=CONTROL_TOKEN))
    finally:
        server.close()
    assert not ack.applied and "give this plugin the router's control_token" in ack.reason
    assert server.rejected == {"bad_directive": 1}


def test_control_tokens_are_validated() -> None:
    with pytest.raises(SettingsError) as err:
        PluginSettings(control_endpoint="tcp://127.0.0.1:5560", control_token="short")
    assert err.value.field == "control_token"
    with pytest.raises(ValueError, match="control_token"):
        RouterConfig.model_validate(
            {"model": "m", "tokenizer": "/t", "control_token": "short",
             "pools": [{"name": "p", "block_size": 4, "workers": [{"name": "a",
                                                                   "url": "http://h"}]}]}
        )  # fmt: skip


def test_router_and_plugins_read_the_control_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARPLY_CONTROL_TOKEN", CONTROL_TOKEN)
    router = RouterConfig.model_validate(
        {"model": "m", "tokenizer": "/t",
         "pools": [{"name": "p", "block_size": 4, "workers": [{"name": "a", "url": "http://h"}]}]}
    )  # fmt: skip
    assert router.control_token == CONTROL_TOKEN
    assert PluginSettings().control_token == CONTROL_TOKEN
    assert CONTROL_TOKEN not in repr(PluginSettings())
    vllm = parse_config({"warply": {"control_endpoint": "tcp://127.0.0.1:5560"}})
    assert vllm.warply.control_token == CONTROL_TOKEN
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", default=30000)
    parser.add_argument("--served-model-name", default="m")
    parser.add_argument("--model-path", default="m")
    add_cli_args(parser)
    base = ["--enable-warply", "--warply-router", "tcp://127.0.0.1:5557"]
    flagged = settings_from_args(parser.parse_args([*base, "--warply-control-token", "t" * 16]))
    assert flagged is not None and flagged.control_token == "t" * 16
    from_env = settings_from_args(parser.parse_args(base))
    assert from_env is not None and from_env.control_token == CONTROL_TOKEN


# -- tenant isolation in the router's index ------------------------------------------------------

_KEYS = st.none() | st.text(min_size=1, max_size=6).filter(lambda k: "\0" not in k)
_TENANT = st.tuples(_KEYS, st.sampled_from(["m", "sql", "chat"]))
BS = 4


@settings(max_examples=200, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    owner=_TENANT,
    other=_TENANT,
    tokens=st.lists(st.integers(0, 50), min_size=BS, max_size=6 * BS),
    split=st.integers(0, 6),
)
def test_no_cache_key_hits_another_tenants_blocks(
    owner: tuple[str | None, str], other: tuple[str | None, str], tokens: list[int], split: int
) -> None:
    """The owner's prompt is stored (as an engine reports it: a chain of events with parents);
    any other (cache_key, model) matches none of it, the owner matches all of it."""
    index = PrefixIndex("m", MemoryStore())
    for key in (k for k, _ in (owner, other) if k is not None):
        msgspec.convert(key, CacheKey)  # only keys the router takes

    def namespace(tenant: tuple[str | None, str]) -> str:
        body = {"model": tenant[1], **({"cache_salt": tenant[0]} if tenant[0] else {})}
        return request_namespace(body, "m")

    n = len(tokens) // BS * BS
    cut = min(split, n // BS) * BS
    lora = owner[1] if owner[1] != "m" else None
    ns = cache_namespace(owner[0], lora)
    assert ns == namespace(owner)
    hashes = list(range(1, n // BS + 1))
    events = [BlockStored(hashes[: cut // BS], None, tokens[:cut], BS, namespace=ns, lora=lora)]
    if cut < n:
        parent = hashes[cut // BS - 1] if cut else None
        events.append(
            BlockStored(hashes[cut // BS :], parent, tokens[cut:n], BS, namespace=ns, lora=lora)
        )
    completed(index.apply("w", [e for e in events if e.block_hashes]))
    mine = completed(index.match(prefix_keys(tokens, BS, "m", namespace(owner))))
    assert mine["w"].blocks == n // BS
    theirs = completed(index.match(prefix_keys(tokens, BS, "m", namespace(other))))
    same = (owner[0] or None, owner[1]) == (other[0] or None, other[1])
    assert ("w" in theirs and theirs["w"].blocks > 0) == same


# -- logs ----------------------------------------------------------------------------------------

SECRET_TEXT = "zebra quartz violet"
SECRET_IDS = [311, 312, 313, 314, 315]


def test_request_chat_templates_are_refused_unless_trusted(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """A chat template in the request is the client's code: the router renders none (a
    sandboxed loop still takes its CPU and memory) unless `trust_request_chat_template`, as
    vLLM 0.32 without `--trust-request-chat-template`; nothing reaches the engine."""
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
    messages = [{"role": "user", "content": "the cache"}]
    bodies = [
        {"messages": messages, "chat_template": loop},
        {"messages": messages, "chat_template_kwargs": {"chat_template": loop}},
    ]

    async def scenario() -> None:
        engine = FakeEngine("a", max_model_len=4096)
        async with running(tokenizer_dir, [engine], auth_token=ADMIN_TOKEN) as (
            router,
            call,
            _s,
            _b,
        ):
            admin = {"headers": {"Authorization": f"Bearer {ADMIN_TOKEN}"}}
            for body in bodies:
                for path, kw in (("/v1/chat/completions", {}), ("/warply/where", admin)):
                    status, answer = await call("POST", path, body, **kw)
                    assert status == 400 and _is_error(answer, "untrusted_chat_template"), answer
                    assert answer["error"]["param"] == "chat_template"
            assert engine.bodies == []
            status, _ = await call("POST", "/v1/chat/completions", {"messages": messages})
            assert status == 200 and len(engine.bodies) == 1
        trusted = {"trust_request_chat_template": True}
        async with running(tokenizer_dir, [engine], **trusted) as (router, call, _s, _b):
            template = "{% for m in messages %}{{ m.content }}{% endfor %}"
            body = {"messages": messages, "chat_template": template}
            status, _ = await call("POST", "/v1/chat/completions", body)
            assert status == 200 and engine.bodies[-1]["chat_template"] == template

    _run(scenario())


def test_no_prompt_or_token_ids_in_logs(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture  # noqa: F811
) -> None:
    """Every request path at INFO (warply-router's default level): served, retried after a
    refused connection, rejected, drained, a directive to a dead socket, a template error."""
    caplog.set_level(logging.INFO)

    async def scenario() -> None:
        engines = [FakeEngine("a", max_model_len=4096), FakeEngine("down", down=True)]
        trusted = {"trust_request_chat_template": True}  # the template error below
        async with running(tokenizer_dir, engines, **trusted) as (router, call, _s, _b):
            requests: list[tuple[str, dict[str, Any]]] = [
                ("/v1/completions", {"prompt": SECRET_TEXT}),
                ("/v1/completions", {"prompt": SECRET_IDS, "stream": True}),
                ("/v1/completions", {"prompt": [*SECRET_IDS, -1]}),
                ("/v1/completions", {"prompt": [*SECRET_IDS, 10**9]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_TEXT}]}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": SECRET_TEXT}],
                                          "chat_template": "{{ messages[0].content / 2 }}"}),
                ("/warply/directives", {"worker": "a", "directive": {
                    "id": "x", "kind": "pin", "token_ids": SECRET_IDS}}),
            ]  # fmt: skip
            for _ in range(2):
                for path, body in requests:
                    await call("POST", path, body)
            router.workers["a"].enabled = False
            await call("POST", "/v1/completions", {"prompt": SECRET_TEXT})

    _run(scenario())
    assert caplog.records  # the paths above do log (retries, refusals)
    ids = re.compile(r"31[1-5]\D+31[1-5]")
    for record in caplog.records:
        text = record.getMessage() + (record.exc_text or "")
        assert SECRET_TEXT not in text and "zebra" not in text, text
        assert not ids.search(text), text


def test_no_cache_key_in_metrics(tokenizer_dir: Path) -> None:  # noqa: F811
    """/metrics (no token) names tenants by a digest of their cache key, never by the key: a
    tenant's key is what keeps its KV apart, so another client holding it gets its hits."""
    key = "tenant-secret-7Qm2x"

    async def scenario() -> None:
        engines = [FakeEngine("a", max_model_len=4096)]
        async with running(tokenizer_dir, engines, lora_adapters=["sql"]) as (
            router, call, _s, _b,
        ):  # fmt: skip
            for model in ("m", "sql"):
                body = {"model": model, "prompt": "the cache", "warply": {"cache_key": key}}
                assert (await call("POST", "/v1/completions", body))[0] == 200
            assert (await call("POST", "/v1/completions", {"prompt": "the cache"}))[0] == 200
            _, text = await call("GET", "/metrics")
            assert key not in text
            series = r'warply_router_tenant_tokens\{kind="prompt",tenant="([^"]*)"'
            tenants = set(re.findall(series, text))
            assert tenants == {tenant_label(key), f"{tenant_label(key)}:sql", ""}
            assert re.fullmatch(r"[0-9a-f]{12}", tenant_label(key))
            assert key in (await router.cache_stats()).tenants  # the admin API (token) keeps it

    _run(scenario())


# -- listeners bind to loopback by default -------------------------------------------------------


def test_listeners_default_to_loopback() -> None:
    config = RouterConfig.model_validate(
        {"model": "m", "tokenizer": "/t",
         "pools": [{"name": "p", "block_size": 4, "workers": [{"name": "a", "url": "http://h"}]}]}
    )  # fmt: skip
    assert config.host == "127.0.0.1"
    assert WorkerConfig(name="a", url="http://h").bind is False  # the router's SUB connects
    assert PoolConfig.model_fields["workers"].is_required()
    assert HOST == "127.0.0.1"  # engines started by `warply` (launch) listen on loopback
    plugin = PluginSettings()
    assert (plugin.events_endpoint, plugin.replay_endpoint, plugin.control_endpoint) == (
        None, None, None)  # fmt: skip
    vllm = parse_config({}).warply
    assert (vllm.events_endpoint, vllm.replay_endpoint, vllm.control_endpoint) == (
        None, None, None)  # fmt: skip
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([])
    assert (args.warply_router, args.warply_control, args.warply_replay) == (None, None, None)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of sockets listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


@contextmanager
def _router_process(tokenizer: Path, tmp_path: Path) -> Iterator[tuple[RouterServer, int]]:
    """`warply-router` (no host given) over one worker that is not there, and its port, once
    it listens or has exited."""
    port = free_port()
    config = {
        "model": "m", "tokenizer": str(tokenizer), "port": port, "max_model_len": 64,
        "pools": [{"name": "p", "block_size": 4,
                   "workers": [{"name": "a", "url": f"http://{HOST}:{free_port()}"}]}],
    }  # fmt: skip
    with RouterServer(config, tmp_path) as router:
        assert router.proc is not None
        for _ in range(600):
            if _listening(port) or router.proc.poll() is not None:
                break
            time.sleep(0.1)
        yield router, port


def test_router_process_listens_on_loopback_only(
    tokenizer_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    """`warply-router` started with no host listens on 127.0.0.1 alone (the kernel's table of
    listening sockets, not a connection attempt that a firewall could also refuse)."""
    with _router_process(tokenizer_dir, tmp_path) as (router, port):
        assert _listening(port) == {"0100007F"}, router.log_tail()  # 127.0.0.1, little-endian hex


def test_the_router_process_logs_no_query_strings_or_request_bytes(
    tokenizer_dir: Path, tmp_path: Path  # noqa: F811
) -> None:
    """aiohttp's access line held the query string (`/warply/where?prompt=...` at INFO), and
    its parser logged a refused request with its first 100 bytes and a traceback: each showed a
    prompt. The process's log holds the path, the status and the error's class only, and a
    stored response's route, not its id (which reads the response from the engine)."""
    with _router_process(tokenizer_dir, tmp_path) as (router, port):
        assert _listening(port), router.log_tail()
        base = f"http://{HOST}:{port}"
        for path, headers in (
            (f"/warply/where?prompt={SECRET_TEXT.replace(' ', '%20')}", {}),
            ("/v1/models?" + "zebra" * 2000, {}),  # a request line past aiohttp's limit
            ("/health", {"X-Note": "zebra" * 2000}),  # a header past it
            ("/v1/responses/resp_zebra", {}),
        ):
            try:
                urllib.request.urlopen(urllib.request.Request(base + path, headers=headers))
            except urllib.error.HTTPError as err:
                assert err.code in (200, 400, 404, 503), err
    log = router.log_path.read_text()
    assert '"GET /warply/where" 200' in log and "LineTooLong (400)" in log, log
    assert '"GET /v1/responses/{response_id}"' in log, log
    assert "zebra" not in log and "Traceback" not in log, log


def test_wildcard_control_socket_without_token_warns(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    PluginSettings(control_endpoint="tcp://*:5560", control_token="")
    assert any("every interface without a control_token" in r.getMessage() for r in caplog.records)
    caplog.clear()
    PluginSettings(control_endpoint="tcp://127.0.0.1:5560", control_token="")
    PluginSettings(control_endpoint="tcp://*:5560", control_token=CONTROL_TOKEN)
    assert not caplog.records


def test_signed_messages_are_msgpack_arrays() -> None:
    """The wire form: a tagged msgspec array (`warply-signed`, ts, nonce, directive, mac)."""
    raw = msgspec.msgpack.decode(sign(encode_directive(PIN), CONTROL_TOKEN))
    assert raw[0] == "warply-signed" and len(raw) == 5 and len(raw[2]) == 16
    assert raw[3] == encode_directive(PIN) and len(raw[4]) == 32


def test_a_body_not_declared_json_is_refused_before_it_is_read(
    tokenizer_dir: Path,  # noqa: F811
) -> None:
    """A browser sends a cross-site POST of `text/plain` or a form without a CORS preflight:
    on a router without `auth_token`, any web page could drain a worker or join one of its own
    (and receive prompts). Every JSON body must be declared `application/json` (415), as the
    engines' JSON endpoints require."""

    async def scenario() -> None:
        engine = FakeEngine("a")
        async with running(tokenizer_dir, [engine]) as (router, call, session, base):
            join = {"name": "evil", "url": "http://127.0.0.1:9"}
            paths = [
                ("/warply/pools/p/workers", join), ("/warply/workers/a", {"enabled": False}),
                ("/warply/directives", {}), ("/v1/completions", {"prompt": "hi"}),
                ("/v1/responses", {"input": "hi"}), ("/tokenize", {"prompt": "hi"}),
            ]  # fmt: skip
            for kind in ("text/plain", "application/x-www-form-urlencoded", None):
                skip = () if kind else ("Content-Type",)
                headers = {"Content-Type": kind} if kind else {}
                for path, body in paths:
                    data = json.dumps(body).encode()
                    async with session.post(
                        base + path, data=data, headers=headers, skip_auto_headers=skip
                    ) as r:
                        answer = await r.json()
                        assert r.status == 415, (path, kind, answer)
                        assert answer["error"]["code"] == "unsupported_media_type"
            assert list(router.workers) == ["a"] and router.workers["a"].enabled
            assert not engine.bodies
            declared = {"Content-Type": "application/json; charset=utf-8"}
            data = json.dumps({"prompt": "hi"}).encode()
            async with session.post(base + "/v1/completions", data=data, headers=declared) as r:
                assert r.status == 200
            _, text = await call("GET", "/metrics")
            counted = r'warply_router_errors_total\{[^}]*"unsupported_media_type"[^}]*\} 18\.0'
            assert re.search(counted, text), text

    _run(scenario())
