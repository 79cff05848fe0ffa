"""Trace replay: what hit rate and TTFT would strategy X give on N workers?

`python -m replay replay TRACE ...` (or `warply bench replay ...`) runs the router's own
index (`router.index.PrefixIndex` over a `MemoryStore`) and strategy classes against simulated
engines in simulated time; `... live --url URL TRACE` replays the trace against a running
OpenAI-compatible endpoint.
Modules: `trace` (reading and token expansion), `costmodel`, `engine` (the simulator of one
worker), `sim` (the replay loop), `oracle` (reuse bounds), `baselines` (other routers' rules),
`report`, `live`.
"""
