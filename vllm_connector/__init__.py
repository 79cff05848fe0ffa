"""Warply's vLLM v1 KV connector: wraps a delegate connector, exports cache state, applies
directives. Engine imports live only in this package (see vllm_connector.connector)."""
