"""The engines' P/D hand-off wire shapes, one module per protocol (`PoolConfig.kv_handoff`):
`vllm` (prefill, then decode with the returned `kv_transfer_params`) and `sglang` (one
bootstrap room sent to both workers at once). `router.dispatch` sends them."""
