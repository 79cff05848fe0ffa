"""Router configuration: file + flags validation, strategy lookup, clean exit 2 on bad config."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from test_router_api import tokenizer_dir

import warply.common.loading as loading
from router.__main__ import _parser, _summary, config_from_args
from router.config import ConfigError, RouterConfig, StrategyConfig, load_config
from router.strategies import LeastLoaded, PrefixAffinity, make_strategy, strategy_class
from router.workers import Workers
from warply.protocol.api import AUTH_TOKEN_ENV

ROOT = Path(__file__).resolve().parents[1]
__all__ = ["tokenizer_dir"]
GOOD = """
model: tiny
tokenizer: /models/tiny
strategy: {name: prefix_affinity, knobs: {balance_abs: 8}}
pools:
  - name: decode
    block_size: 32
    workers:
      - {name: a, url: "http://127.0.0.1:8001/", events: "tcp://127.0.0.1:5557"}
      - {name: b, url: "http://127.0.0.1:8002"}
"""


class MyStrategy(LeastLoaded):
    """A user strategy reachable as `tests.test_router_config:MyStrategy` or an entry point."""

    name = "mine"


def _write(tmp_path: Path, text: str, suffix: str = ".yaml") -> Path:
    path = tmp_path / f"router{suffix}"
    path.write_text(text)
    return path


def test_a_config_that_is_not_text_or_not_yaml_says_so(tmp_path: Path) -> None:
    binary = tmp_path / "router.yaml"
    binary.write_bytes(b"\xff\xfe\x00")  # a UnicodeDecodeError traceback before
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"router\.json is not valid YAML"):
        load_config(_write(tmp_path, "model: [\n", ".json"))  # read as YAML, named so


def test_yaml_and_toml_load(tmp_path: Path) -> None:
    cfg = load_config(_write(tmp_path, GOOD))
    assert cfg.pools[0].workers[0].url == "http://127.0.0.1:8001"
    assert cfg.strategy.knobs == {"balance_abs": 8}
    toml = """model = "tiny"\ntokenizer = "/m"\n[[pools]]\nname = "p"\nblock_size = 128
[[pools.workers]]\nname = "a"\nurl = "http://127.0.0.1:1"\n"""
    assert load_config(_write(tmp_path, toml, ".toml")).pools[0].block_size == 128


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (("block_size: 32", "block_size: 0"), "pools.0.block_size"),
        (("model: tiny", "model: tiny\nmodle: x"), "modle"),
        (("url: \"http://127.0.0.1:8002\"", "url: \"ftp://x\""), "pools.0.workers.1.url"),
        (("127.0.0.1:8002", "127.0.0.1:80020"), "pools.0.workers.1.url: Port out of range"),
        (("127.0.0.1:8002", ":8002"), "pools.0.workers.1.url: not an http or https URL with a"),
        (("name: b,", "name: a,"), "used twice"),
        (("name: b,", "name: 'b 1',"), "name 'b 1' must be printable, without spaces"),
        (("name: decode", "name: \"de\\tcode\""), "pools.0.name"),
        (("8002", "8001/"), "workers 'a' and 'b' have the same url http://127.0.0.1:8001"),
        (("tcp://127.0.0.1:5557", "127.0.0.1:5557"), "pools.0.workers.0.events"),
        (("tcp://127.0.0.1:5557", "tcp://127.0.0.1:99999"), "port 99999 out of range"),
        (("model: tiny", "model: tiny\nlora_adapters: [tiny]"), "the base model's name"),
        (("model: tiny", "model: tiny\nlora_adapters: ['']"), "adapter name '' must be non-empty"),
        (("model: tiny", "model: tiny\ntokenizer_cache_mib: 0"), "tokenizer_cache_mib"),
    ],
)
def test_bad_fields_are_named(tmp_path: Path, edit: tuple[str, str], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config(_write(tmp_path, GOOD.replace(*edit)))


def test_flags_override_and_build_a_pool(tmp_path: Path) -> None:
    args = _parser().parse_args(
        ["--config", str(_write(tmp_path, GOOD)), "--port", "9000", "--strategy", "round_robin",
         "--worker", "http://127.0.0.1:7001,events=tcp://127.0.0.1:7002,name=x",
         "--block-size", "128", "--min-hit-ratio", "0.3", "--lora-adapter", "a1",
         "--lora-adapter", "a2", "--cors-allowed-origin", "https://app.example"]
    )
    cfg = config_from_args(args)
    assert cfg.lora_adapters == ["a1", "a2"]
    assert cfg.cors_allowed_origins == ["https://app.example"]
    assert cfg.port == 9000 and cfg.strategy.name == "round_robin"
    assert cfg.pools[0].block_size == 128 and cfg.pools[0].workers[0].name == "x"
    assert cfg.alerts.min_hit_ratio == 0.3
    with pytest.raises(ConfigError, match="--worker"):
        config_from_args(_parser().parse_args(["--worker", "http://h:1,colour=red"]))
    with pytest.raises(ConfigError, match="URL .* first, then key=value parts, e.g. http://h:1,name=w0$"):
        config_from_args(_parser().parse_args(["--worker", "w0=http://h:1", "--block-size", "16"]))
    with pytest.raises(ConfigError, match="e.g. http://h:1,name=w0$"):
        config_from_args(_parser().parse_args(["--worker", "h:1", "--block-size", "16"]))
    with pytest.raises(ConfigError, match="e.g. http://h:1,name=w0$"):
        config_from_args(_parser().parse_args(["--worker", "ftp://h:1", "--block-size", "16"]))
    with pytest.raises(ConfigError, match="cors_allowed_origins: .app.example. is not an origin"):
        config_from_args(_parser().parse_args(
            ["--config", str(_write(tmp_path, GOOD)), "--cors-allowed-origin", "app.example"]
        ))  # fmt: skip
    with pytest.raises(ConfigError, match="--worker needs --block-size"):
        config_from_args(
            _parser().parse_args(["--config", str(_write(tmp_path, GOOD)), "--worker", "http://h:1"])
        )


def test_strategy_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    assert strategy_class("prefix_affinity") is PrefixAffinity
    assert strategy_class(f"{__name__}:MyStrategy") is MyStrategy
    ep = EntryPoint("mine", f"{__name__}:MyStrategy", "warply.strategies")

    def fake_entry_points(**kw: Any) -> list[EntryPoint]:
        return [ep] if kw.get("name", "mine") == "mine" else []

    monkeypatch.setattr(loading, "entry_points", fake_entry_points)
    assert strategy_class("mine") is MyStrategy
    assert loading.entry_point_names("warply.strategies") == ["mine"]
    with pytest.raises(ConfigError, match="unknown strategy 'nope'"):
        strategy_class("nope")
    with pytest.raises(ConfigError, match="not a router.strategies.Strategy"):
        strategy_class("pathlib:Path")
    with pytest.raises(ConfigError, match="strategy.knobs.balance_rel"):
        make_strategy(StrategyConfig(name="prefix_affinity", knobs={"balance_rel": 0.5}))
    with pytest.raises(ConfigError, match="strategy.knobs.colour"):
        make_strategy(StrategyConfig(name="round_robin", knobs={"colour": 1}))


def _router_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m router ARGS` as a user runs it, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "router", *args], cwd=ROOT, capture_output=True, text=True,
        timeout=60,
    )


def test_cli_bad_config_exits_2_without_traceback(tmp_path: Path) -> None:
    bad = _write(tmp_path, GOOD.replace("block_size: 32", "block_size: -1"))
    out = _router_cli("--config", str(bad))
    assert out.returncode == 2
    assert "pools.0.block_size" in out.stderr and "Traceback" not in out.stderr
    out = _router_cli("--config", str(_write(tmp_path, GOOD)), "--strategy", "nope")
    assert out.returncode == 2 and "strategy.name" in out.stderr and "Traceback" not in out.stderr


def test_a_port_in_use_is_one_line_and_exit_1(tmp_path: Path, tokenizer_dir: Path) -> None:
    """The listener cannot bind: the router says where, without a traceback (it printed
    aiohttp's), and says nothing of serving."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        good = _write(tmp_path, GOOD.replace("/models/tiny", str(tokenizer_dir)))
        out = _router_cli("--config", str(good), "--port", str(port))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert f"warply-router: cannot listen on 127.0.0.1:{port}: " in out.stderr
    assert "address already in use" in out.stderr and "serving" not in out.stderr


def test_check_builds_the_config_prints_it_and_exits(tmp_path: Path, tokenizer_dir: Path) -> None:
    """`--check` loads what the config names and exits without serving: 0 and a summary, or 2
    and the one-line error (a missing tokenizer here)."""
    good = _write(tmp_path, GOOD.replace("/models/tiny", str(tokenizer_dir)))
    out = _router_cli("--config", str(good), "--check")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok: tiny on http://127.0.0.1:8000")
    assert "pool decode (both, block 32): a http://127.0.0.1:8001, b http://127.0.0.1:8002" in (
        out.stdout
    )
    assert 'strategy prefix_affinity {"balance_abs": 8}' in out.stdout
    out = _router_cli("--config", str(_write(tmp_path, GOOD)), "--check")
    assert out.returncode == 2 and "tokenizer" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("tokenizer_config.json", b"not json", "tokenizer_config.json is not a readable JSON"),
        ("tokenizer_config.json", b"[1]", "tokenizer_config.json holds no JSON object"),
        ("tokenizer_config.json", b"\xff\xfe", "tokenizer_config.json is not a readable JSON"),
        ("tokenizer_config.json", b'{"chat_template": "{% for %}"}', "does not parse"),
        ("chat_template.jinja", b"{{ x", "does not parse"),
        ("tokenizer.json", b"{}", "no usable tokenizer.json"),
    ],
)
def test_a_broken_tokenizer_folder_is_named_in_one_line(
    tmp_path: Path, tokenizer_dir: Path, name: str, content: bytes, message: str
) -> None:
    """Each was a traceback at start-up (JSONDecodeError, AttributeError, Jinja's syntax
    error); now exit 2 and the file named."""
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / name).write_bytes(content)
    config = _write(tmp_path, GOOD.replace("/models/tiny", str(folder)))
    out = _router_cli("--config", str(config), "--check")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.startswith("warply-router: tokenizer: ") and message in out.stderr


def test_the_check_summary_hides_the_stores_password(tmp_path: Path) -> None:
    url = "redis://:hunter2@127.0.0.1:6379/0"
    config = load_config(_write(tmp_path, GOOD + f"index: {{store: redis, url: '{url}'}}\n"))
    summary = _summary(config)
    assert "hunter2" not in summary and "redis://***@127.0.0.1:6379/0" in summary


def test_an_unreachable_stores_error_hides_its_password(
    tmp_path: Path, tokenizer_dir: Path
) -> None:
    """The start-up error (and every `StoreUnavailable`, logged by the outage counter) shows the
    store's URL without its password."""
    good = GOOD.replace("/models/tiny", str(tokenizer_dir))
    url = "redis://:hunter2@127.0.0.1:1/0"  # port 1: nothing listens
    config = _write(tmp_path, good + f"index: {{store: redis, url: '{url}'}}\n")
    out = _router_cli("--config", str(config))
    assert out.returncode == 2, out.stderr
    assert "cannot reach the shared store: index store redis://***@127.0.0.1:1/0" in out.stderr
    assert "hunter2" not in out.stderr


def _config_text(roles: list[str]) -> str:
    pools = "".join(
        f"  - {{name: p{i}, role: {role}, block_size: 16, "
        f"workers: [{{name: w{i}, url: 'http://127.0.0.1:{8000 + i}'}}]}}\n"
        for i, role in enumerate(roles)
    )
    return f"model: m\ntokenizer: /t\npools:\n{pools}"


@pytest.mark.parametrize(
    ("roles", "error"),
    [
        (["prefill"], "no pool has role 'decode'"),
        (["prefill", "both"], "prefill pool\\(s\\) 'p0' hand prompts off"),
        (["decode", "both"], "no pool has role 'prefill'"),
        (["mixed"], "pools.0.role"),
    ],
)
def test_roles_are_validated(tmp_path: Path, roles: list[str], error: str) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(_config_text(roles))
    with pytest.raises(ConfigError, match=error):
        load_config(path)


def test_mixed_deployments_load(tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text(_config_text(["prefill", "prefill", "decode", "decode", "both"]))
    cfg = load_config(path)
    assert [p.role for p in cfg.pools] == ["prefill", "prefill", "decode", "decode", "both"]
    assert cfg.pd.local_prefill_tokens > 0
    workers = Workers(cfg.pools)
    assert [w.role for w in workers.values()] == ["prefill", "prefill", "decode", "decode", "both"]


def _handoff_config(prefill: str, decode: str, both: str | None = None) -> dict[str, Any]:
    """A prefill, a decode and (`both` not None) an aggregated pool; each argument lists the
    pool's extra fields as `key=value,...` (`bootstrap_*` go to its worker)."""

    def pool(i: int, role: str, spec: str) -> dict[str, Any]:
        fields = dict(kv.split("=") for kv in spec.split(",") if kv)
        worker: dict[str, Any] = {"name": f"w{i}", "url": f"http://127.0.0.1:{8000 + i}"}
        for key in ("bootstrap_port", "bootstrap_host"):
            if key in fields:
                worker[key] = fields.pop(key)
        return {"name": f"p{i}", "role": role, "block_size": 16, "workers": [worker], **fields}

    pools = [pool(0, "prefill", prefill), pool(1, "decode", decode)]
    if both is not None:
        pools.append(pool(2, "both", both))
    return {"model": "m", "tokenizer": "/t", "pools": pools}


@pytest.mark.parametrize(
    ("prefill", "decode", "both", "error"),
    [
        ("kv_handoff=sglang", "", None, r"share one kv_handoff \('p0': 'sglang', 'p1': 'vllm'\)"),
        ("kv_handoff=sglang", "kv_handoff=sglang", "kv_handoff=sglang",
         "pools.2: kv_handoff 'sglang' is for pools with role 'prefill' or 'decode'"),
        ("bootstrap_port=9000", "", None,
         "worker 'w0': bootstrap_port is for prefill workers of a pool with kv_handoff 'sglang'"),
        ("kv_handoff=sglang", "kv_handoff=sglang,bootstrap_host=h", None,
         "worker 'w1': bootstrap_host is for prefill workers .* role 'decode'"),
        ("kv_handoff=sglang,bootstrap_port=0", "kv_handoff=sglang", None,
         "pools.0.workers.0.bootstrap_port: Input should be greater than or equal to 1"),
        ("kv_handoff=mooncake", "", None, "pools.0.kv_handoff: Input should be 'vllm' or 'sglang'"),
    ],
)  # fmt: skip
def test_kv_handoff_is_validated(
    tmp_path: Path, prefill: str, decode: str, both: str | None, error: str
) -> None:
    path = _write(tmp_path, json.dumps(_handoff_config(prefill, decode, both)))  # JSON is YAML
    with pytest.raises(ConfigError, match=error):
        load_config(path)


@pytest.mark.parametrize(
    ("prefill", "decode", "pd", "error"),
    [
        ("kv_handoff=sglang,bootstrap_port=9000", "kv_handoff=sglang",
         {"local_prefill_by": "cost", "prefill_answers": True},
         r"pd.prefill_answers: prefill pool\(s\) 'p0' have kv_handoff 'sglang', whose prefill "
         "servers cannot decode"),
        ("block_size=32", "", {"prefill_answers": True},
         r"pd.prefill_answers: prefill pool\(s\) 'p0' share no block_size with a decode pool"),
    ],
)  # fmt: skip
def test_prefill_answers_is_validated(
    tmp_path: Path, prefill: str, decode: str, pd: dict[str, Any], error: str
) -> None:
    """A prefill worker may answer whole only where it can decode (never on SGLang pools) and
    be weighed beside the decode workers (one block size)."""
    path = _write(tmp_path, json.dumps({**_handoff_config(prefill, decode), "pd": pd}))
    with pytest.raises(ConfigError, match=error):
        load_config(path)
    ok = {**_handoff_config("", ""), "pd": {"prefill_answers": True}}
    assert RouterConfig.model_validate(ok).pd.prefill_answers


def test_sglang_pools_load() -> None:
    cfg = RouterConfig.model_validate(
        _handoff_config("kv_handoff=sglang,bootstrap_port=9000", "kv_handoff=sglang", "")
    )
    prefill, decode, both = cfg.pools
    assert (prefill.kv_handoff, decode.kv_handoff, both.kv_handoff) == ("sglang",) * 2 + ("vllm",)
    assert prefill.workers[0].bootstrap_port == 9000
    assert (prefill.local_prefill, decode.local_prefill, both.local_prefill) == (True, False, True)
    assert (prefill.decodes, decode.decodes, both.decodes) == (False, True, True)


def test_index_section_and_the_moved_cap(tmp_path: Path) -> None:
    shared = GOOD + "index: {store: redis, url: 'redis://127.0.0.1:6379/0', prefix: dep-a}\n"
    cfg = load_config(_write(tmp_path, shared), {"index_max_entries": 1000})
    assert (cfg.index.store, cfg.index.prefix, cfg.index.max_entries) == ("redis", "dep-a", 1000)
    assert load_config(_write(tmp_path, GOOD)).index.store == "memory"
    with pytest.raises(ConfigError, match="store 'redis' needs the server's url"):
        load_config(_write(tmp_path, GOOD + "index: {store: redis}\n"))
    with pytest.raises(ConfigError, match=r"index\.url"):
        load_config(_write(tmp_path, GOOD + "index: {store: redis, url: '127.0.0.1:6379'}\n"))
    with pytest.raises(ConfigError, match=r"write `index: \{max_entries: 5\}` instead"):
        load_config(_write(tmp_path, GOOD + "index_max_entries: 5\n"))


def test_the_admin_token_comes_from_the_environment_when_the_file_sets_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = {"model": "m", "tokenizer": "/t", "pools": [
        {"name": "p", "block_size": 16,
         "workers": [{"name": "w", "url": "http://127.0.0.1:1"}]}]}  # fmt: skip
    monkeypatch.delenv(AUTH_TOKEN_ENV, raising=False)
    assert RouterConfig.model_validate(config).auth_token is None
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-secret")
    assert RouterConfig.model_validate(config).auth_token == "from-secret"
    assert RouterConfig.model_validate({**config, "auth_token": "file"}).auth_token == "file"
