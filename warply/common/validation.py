"""pydantic's validation errors as people read them: each on its own line, `field.path:
message`, under a title that says what was being read (a spec, a config, a command's
settings). One format for the SDK, the router and the replayer."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pydantic import ValidationError


def describe(err: ValidationError, title: str) -> str:
    """`title:` then each error of `err` on its own indented line, `field.path: message`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {loc}: {str(e['msg']).removeprefix('Value error, ')}")
    return f"{title}:\n" + "\n".join(lines)
