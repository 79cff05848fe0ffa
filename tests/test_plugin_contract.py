"""The plugin contract in the protocol layer: one endpoint grammar and the shared settings."""

from __future__ import annotations

import pickle

import pytest

from warply.protocol import (
    Endpoint,
    EndpointError,
    PluginSettings,
    SettingsError,
    parse_endpoint,
)
from warply.protocol.endpoints import binds


@pytest.mark.parametrize(
    ("text", "parsed", "binds_it"),
    [
        ("tcp://127.0.0.1:5557", Endpoint("tcp://127.0.0.1:5557", "tcp", "127.0.0.1", 5557), False),
        ("tcp://router.local:1", Endpoint("tcp://router.local:1", "tcp", "router.local", 1), False),
        ("tcp://*:5557", Endpoint("tcp://*:5557", "tcp", "*", 5557), True),
        ("tcp://0.0.0.0:5557", Endpoint("tcp://0.0.0.0:5557", "tcp", "0.0.0.0", 5557), True),
        ("tcp://[::]:5557", Endpoint("tcp://[::]:5557", "tcp", "[::]", 5557), True),
        ("tcp://[::1]:5557", Endpoint("tcp://[::1]:5557", "tcp", "[::1]", 5557), False),
        ("ipc:///tmp/w.sock", Endpoint("ipc:///tmp/w.sock", "ipc"), True),
        ("inproc://state", Endpoint("inproc://state", "inproc"), True),
    ],
)
def test_endpoint_grammar(text: str, parsed: Endpoint, binds_it: bool) -> None:
    assert parse_endpoint(text) == parsed
    assert str(parsed) == text
    assert parsed.binds is binds_it is binds(text)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("127.0.0.1:5557", "'127.0.0.1:5557' is not a ZMQ endpoint (tcp://HOST:PORT, ipc://PATH)"),
        ("tcp://127.0.0.1", "is not a ZMQ endpoint"),
        ("tcp://h:0", "port 0 out of range in 'tcp://h:0'"),
        ("tcp://h:99999", "port 99999 out of range"),
        ("http://h:1", "is not a ZMQ endpoint"),
        ("ipc://", "is not a ZMQ endpoint"),
        ("tcp://a b:1", "is not a ZMQ endpoint"),
    ],
)
def test_bad_endpoints_are_one_line_errors(text: str, message: str) -> None:
    with pytest.raises(EndpointError) as err:
        parse_endpoint(text)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_settings_validate_on_construction_and_name_the_field() -> None:
    ok = PluginSettings(events_endpoint="tcp://127.0.0.1:5591", control_endpoint="tcp://*:5592")
    assert pickle.loads(pickle.dumps(ok)) == ok  # SGLang pickles it to its schedulers
    cases = [
        ({"events_endpoint": "localhost:5591"}, "events_endpoint"),
        ({"replay_endpoint": "tcp://h:70000"}, "replay_endpoint"),
        ({"control_endpoint": "udp://h:1"}, "control_endpoint"),
        ({"snapshot_interval_s": 0}, "snapshot_interval_s"),
        ({"max_pinned_fraction": 1.5}, "max_pinned_fraction"),
    ]
    for fields, name in cases:
        with pytest.raises(SettingsError) as err:
            PluginSettings(**fields)  # type: ignore[arg-type]
        assert err.value.field == name
