"""SGLang plugin entry point (`sglang.srt.plugins`): installs `--enable-warply` and the Warply
publisher (`sglang_hook`).

SGLang 0.5.23 calls `register()` once per process (launcher, schedulers, DP controller,
detokenizer) before `HookRegistry.apply_hooks()`.
"""

from __future__ import annotations

import argparse
from typing import Any

from sglang_hook.settings import SGLANG_VERSION

_registered = False


def _version_mismatch(found: str) -> None:
    """On another SGLang, `--enable-warply` exists only to fail with a clear message."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    def _after(result: None, parser: argparse.ArgumentParser) -> None:
        message = (
            f"Warply's SGLang hooks target sglang=={SGLANG_VERSION}; this is sglang {found}. "
            f"Install sglang=={SGLANG_VERSION} or run without --enable-warply."
        )

        class _Refuse(argparse.Action):
            def __call__(
                self,
                parser: argparse.ArgumentParser,
                namespace: argparse.Namespace,
                values: Any,
                option_string: str | None = None,
            ) -> None:
                parser.error(message)

        parser.add_argument("--enable-warply", nargs=0, action=_Refuse, help=message)

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _after, HookType.AFTER)


def register() -> None:
    """Install the hooks and the `warply` event publisher (idempotent per process)."""
    global _registered
    if _registered:
        return
    _registered = True
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if sglang.__version__ != SGLANG_VERSION:
        _version_mismatch(sglang.__version__)
        return
    from sglang_hook import scheduler, settings

    for target, fn in settings.HOOKS:
        HookRegistry.register(target, fn, HookType.AFTER)
    for target, fn, kind in scheduler.HOOKS:
        HookRegistry.register(target, fn, kind)
    scheduler.register_publisher()
