"""Directives from the router's admin API to a worker's plugin control socket (ZMQ ROUTER).

One REQ round trip per directive: the plugin applies it through the engine's own API and replies
with a `DirectiveAck` (the same ack also goes out on its state stream).
"""

from __future__ import annotations

import msgspec
import zmq
import zmq.asyncio

from warply.protocol import Directive, DirectiveAck, encode_directive

_ack_decoder = msgspec.msgpack.Decoder(DirectiveAck)


async def send_directive(
    endpoint: str, directive: Directive, timeout_s: float = 10.0
) -> DirectiveAck:
    """Send `directive` to `endpoint` and wait for its ack; raises TimeoutError without one."""
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send(encode_directive(directive))
        if not await sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no ack from {endpoint} within {timeout_s:.0f}s")
        return _ack_decoder.decode(await sock.recv())
    finally:
        sock.close(linger=0)
