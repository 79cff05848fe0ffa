"""`warply where` against the real router app (its index fed through the real feed), run as a
user runs it: a subprocess printing tables; exit codes and one-line errors."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import msgspec
from test_router_api import FakeEngine, _refused_port, _run, running, tokenizer_dir
from test_router_where import PROMPT, hold

from router.tokenize import RouterTokenizer
from warply.protocol.api import Where

__all__ = ["tokenizer_dir"]

ROOT = Path(__file__).resolve().parents[1]


async def warply(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`python -m warply ARGS` (wide terminal, so rich does not wrap the tables)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "warply", *args, cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "250", **(env or {})},
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def test_where_prints_holdings_scores_and_the_choice(tokenizer_dir: Path) -> None:
    async def scenario() -> None:
        engines = [FakeEngine("a"), FakeEngine("b")]
        async with running(tokenizer_dir, engines, auth_token="s3cret") as (
            router, _c, session, base,
        ):  # fmt: skip
            ids = RouterTokenizer(tokenizer_dir).encode(PROMPT, True)
            await hold(router, ids, 3, 2)
            token = {"WARPLY_AUTH_TOKEN": "s3cret"}
            code, out, err = await warply("where", PROMPT, "--router", base, env=token)
            assert code == 0, err
            assert "choice: a (aggregated)" in out
            rows = {line.split("│")[1].strip(): line for line in out.splitlines()
                    if line.startswith("│") and "│ worker" not in line}  # fmt: skip
            assert set(rows) == {"a ←", "b"}
            assert "gpu:3" in rows["a ←"] and "cpu:2" in rows["b"]
            assert "lowest cost" in rows["a ←"] and "uncached_tokens=" in rows["b"]

            code, out, _ = await warply("where", PROMPT, "--router", base, "--json", env=token)
            printed = msgspec.json.decode(out, type=Where)
            headers = {"Authorization": "Bearer s3cret"}
            async with session.post(base + "/warply/where", json={"prompt": PROMPT},
                                    headers=headers) as r:  # fmt: skip
                assert printed == msgspec.json.decode(await r.read(), type=Where)

            code, out, err = await warply("where", PROMPT, "--router", base)  # no token
            assert code == 2 and out == "" and "Traceback" not in err
            assert err.strip().startswith("warply where: ") and "401" in err
            assert len(err.strip().splitlines()) == 1
            code, _, err = await warply("where", PROMPT, "--router", base, "--model", "x",
                                        env=token)  # fmt: skip
            assert code == 2 and "The model `x` does not exist." in err

    _run(scenario())


def test_where_unreachable_router_is_one_line_exit_1() -> None:
    async def scenario() -> None:
        url = f"http://127.0.0.1:{_refused_port()}"
        code, out, err = await warply("where", "hi", "--router", url)
        assert (code, out) == (1, "")
        assert err.startswith(f"warply where: cannot reach the router at {url}")
        assert len(err.strip().splitlines()) == 1

    _run(scenario())
