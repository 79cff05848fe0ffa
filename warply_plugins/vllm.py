"""vLLM plugin entry point (`vllm.general_plugins`): registers `WarplyConnector` with vLLM.

vLLM 0.32 runs general plugins in the API server, EngineCore and every worker process, and may
run them more than once in one process, so registration is idempotent.
"""

from __future__ import annotations

CONNECTOR_NAMES = ("WarplyConnector", "WarplyHMAConnector")
"""Names for `--kv-transfer-config '{"kv_connector": NAME, ...}'` (class names in
`vllm_connector.connector`); the HMA variant is for delegates that support vLLM's hybrid memory
allocator, on platforms where it is on."""


def register() -> None:
    """Register the connectors lazily (by module path); a second call in one process is a no-op."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for name in CONNECTOR_NAMES:
        # vLLM 0.32's register_connector raises ValueError on a duplicate name and has no
        # lookup that does not import the class, so the registry dict is checked directly.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, "vllm_connector.connector", name)
