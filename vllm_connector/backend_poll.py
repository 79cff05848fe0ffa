"""A tier backend the plugin reads in the background: one daemon thread re-reads it every
`poll_interval_s`, so the scheduler thread only takes the last figure (`tier_bytes`) and never
waits on the backend's HTTP API."""

from __future__ import annotations

import abc
import logging
import threading

from warply.protocol import Tier

_log = logging.getLogger(__name__)


class BackendError(RuntimeError):
    """The backend answered with an error, or could not be reached."""


class PolledBackend(abc.ABC):
    """The polling thread and the last bytes per tier; subclasses read the backend in `_read`
    (which sets `_bytes`, raising `BackendError` when it cannot)."""

    def __init__(self, what: str, poll_interval_s: float, timeout_s: float) -> None:
        self._what = what
        self._interval = poll_interval_s
        self._timeout = timeout_s
        self._bytes: dict[Tier, int] | None = None
        self._stop = threading.Event()
        name = f"warply-{what.split()[0].lower()}"
        self._thread = threading.Thread(target=self._poll, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self._timeout)

    @property
    def tier_bytes(self) -> dict[Tier, int] | None:
        """The backend's bytes per tier at the last poll (None: not read yet)."""
        return self._bytes

    @abc.abstractmethod
    def _read(self) -> None:
        """Read the backend once and set `_bytes` (raises `BackendError`)."""

    def _poll(self) -> None:
        failures = 0
        while not self._stop.wait(self._interval):
            try:
                self._read()
                failures = 0
            except BackendError as exc:
                failures += 1
                if failures == 1:  # once per run of failures: a down backend does not flood
                    _log.warning("Warply: %s unreadable: %s", self._what, exc)
            except Exception:  # a reading bug must not end the thread (the figures would freeze)
                failures += 1
                if failures == 1:
                    _log.exception("Warply: reading %s failed", self._what)
