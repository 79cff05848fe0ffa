"""Warply: the control plane for KV-cache-aware serving across vLLM and SGLang.

`import warply` stays light (no torch, no engine, no ZMQ): engine plugins and the router import
`warply.protocol` cheaply.
"""

__version__ = "0.1.0"
