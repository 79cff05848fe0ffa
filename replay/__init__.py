"""Trace replay: what hit rate and TTFT would strategy X give on N workers?

`python -m replay replay TRACE ...` (or `warply bench replay ...`) runs the router's own
index (`router.index.PrefixIndex` over a `MemoryStore`), placement and strategy classes against
simulated engines in simulated time, aggregated or as prefill / decode pools (`--pd P,D`);
`... live --url URL TRACE` replays the trace against a running OpenAI-compatible endpoint.
Modules: `trace` (reading and token expansion), `costmodel`, `engine` (the simulator of one
worker), `sim` (the replay loop), `pd` (the prefill → decode hand-off and transfer),
`references` (reuse bounds), `baselines` (other routers' rules), `workloads`, `report`, `live`.
"""
