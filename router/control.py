"""Directives from the router's admin API to a worker's plugin control socket (ZMQ ROUTER).

One REQ round trip per directive: the plugin applies it through the engine's own API and replies
with a `DirectiveAck` (the same ack also goes out on its state stream). With a `control_token`
each directive goes out signed, timestamped and with a fresh nonce (`warply.protocol.control`).
"""

from __future__ import annotations

import zmq
import zmq.asyncio

from warply.protocol import Directive, DirectiveAck, encode_directive
from warply.protocol.control import ack_decoder, sign


async def send_directive(
    endpoint: str, directive: Directive, timeout_s: float = 10.0, token: str | None = None
) -> DirectiveAck:
    """Send `directive` to `endpoint` and wait for its ack; raises TimeoutError without one.
    With `token` (the router's `control_token`) the message is signed (`protocol.control`)."""
    payload = encode_directive(directive)
    return await send_payload(endpoint, sign(payload, token) if token else payload, timeout_s)


async def send_payload(endpoint: str, payload: bytes, timeout_s: float = 10.0) -> DirectiveAck:
    """One REQ round trip with raw bytes as the directive (also how malformed input is tested)."""
    sock = zmq.asyncio.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send(payload)
        if not await sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no ack from {endpoint} within {timeout_s:.0f}s")
        return ack_decoder.decode(await sock.recv())
    finally:
        sock.close(linger=0)
