"""`warply stats` against the real router app after real requests (through the small engine
simulators of tests/test_router_api.py) and real state events: tables, `--watch`, exit codes;
and `--help` on every verb."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_cli_where import warply
from test_router_api import FakeEngine, _refused_port, _run, running, tokenizer_dir
from test_router_where import PROMPT, hold

from router.tokenize import RouterTokenizer

__all__ = ["tokenizer_dir"]


def test_stats_tables_and_watch(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("a", cached_tokens=4), FakeEngine("b", cached_tokens=4)]
        async with running(tokenizer_dir, engines) as (router, call, _s, base):
            ids = RouterTokenizer(tokenizer_dir).encode(PROMPT, True)
            await hold(router, ids, 3, 2)
            for _ in range(2):
                assert (await call("POST", "/v1/completions", {"prompt": PROMPT}))[0] == 200
            code, out, err = await warply("stats", "--router", base)
            assert code == 0, err
            assert "warply router: strategy adaptive" in out
            stats = await router.cache_stats()  # what the table must show
            summary = next(line for line in out.splitlines() if line.startswith("│ 2 "))
            assert stats.hit_rate.engine == 8 / 28  # 4 cached of 14 prompt tokens, twice
            # predicted: a's three blocks both times (its engine's shortfall is counted, and the
            # index keeps the blocks a real engine stores again)
            assert f"│ {8 / 28:.1%}" in summary and f"│ {24 / 28:.1%}" in summary
            assert stats.index.overpredicted == {"a": 4}
            tiers = {line.split("│")[1].strip(): line for line in out.splitlines()
                     if line.startswith(("│ gpu", "│ cpu"))}  # fmt: skip
            assert set(tiers) == {"gpu", "cpu"} == set(stats.index.bytes_by_tier)
            for tier, line in tiers.items():
                n = stats.index.bytes_by_tier[tier]
                assert f"│ {n} B" in line if n < 1024 else f"│ {n / 1024:.1f} KiB" in line
            assert "│ a " in out and "│ b " in out and "affinity" in out

            code, out, err = await warply("stats", "--router", base, "--watch", "--count", "2",
                                          "--interval", "0.1")  # fmt: skip
            assert code == 0, err
            assert "warply router: strategy adaptive" in out
            code, _, err = await warply("stats", "--router", base, "--interval", "0")
            assert code == 2 and "argument --interval: '0' must be > 0" in err
            code, _, err = await warply("stats", "--router", base, "--count", "-1")
            assert code == 2 and "argument --count: '-1' must be >= 0" in err

    _run(scenario())


def test_stats_unreachable_router_is_one_line_exit_1() -> None:
    async def scenario() -> None:
        url = f"http://127.0.0.1:{_refused_port()}"
        code, out, err = await warply("stats", "--router", url, "--watch")
        assert (code, out) == (1, "")
        refused = "[Errno 111] Connection refused"
        assert err == f"warply stats: cannot reach the router at {url}: {refused}\n"

    _run(scenario())


@pytest.mark.parametrize(
    ("url", "error"),
    [
        ("ftp://127.0.0.1:1", "not an http or https URL with a host (write http://HOST:PORT)"),
        ("127.0.0.1:8000", "not an http or https URL with a host (write http://HOST:PORT)"),
        ("http://127.0.0.1:99999", "Port out of range 0-65535 (write http://HOST:PORT)"),
        ("http://[::1", "Invalid IPv6 URL (write http://HOST:PORT)"),
    ],
)
def test_a_router_url_that_is_not_one_is_a_usage_error(url: str, error: str) -> None:
    """Not sent at all: urllib tried FTP for ftp:// and called a port out of range refused."""

    async def scenario() -> None:
        code, out, err = await warply("stats", "--router", url)
        assert (code, out) == (2, "")
        assert err == f"warply stats: router URL {url!r}: {error}\n"

    _run(scenario())


@pytest.mark.parametrize("verb", ["watch", "bench", "stats", "where", "demo"])
def test_every_verb_has_help(verb: str) -> None:
    async def scenario() -> None:
        code, out, err = await warply(verb, "--help")
        assert code == 0 and out.startswith(f"usage: warply {verb}") and err == ""

    _run(scenario())


def test_usage_errors_exit_2() -> None:
    async def scenario() -> None:
        code, _, err = await warply("stats", "--bogus")
        assert code == 2 and "unrecognized arguments: --bogus" in err
        code, _, err = await warply("where")
        assert code == 2 and "the following arguments are required: prompt" in err

    _run(scenario())
