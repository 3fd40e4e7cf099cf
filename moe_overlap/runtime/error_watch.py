"""Asynchronous read-back of a device error word, shared by the overlapped combine and the fused
FFN (host runtime: torch only)."""
from __future__ import annotations

import torch


class DeviceError(RuntimeError):
    """An overlapped kernel recorded an error on the device (a timeout, out-of-step ranks, a bad
    plan entry); the layer needs a collective reset()."""


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class ErrorWatch:
    """Asynchronous read-back of one device error word (``int64[8]``, code in word 0, sticky on
    the device until a reset), so that an overlapped call's device error raises on the host
    without a host sync inside any call.

    ``after_call(stream)`` (end of a call): starts a non-blocking copy of the word to pinned host
    memory on ``stream`` and records an event; skipped while the previous copy is still in flight
    (the word is sticky: the next copy sees what this one would have). ``poll()`` (start of the
    next call): if that event has completed, reads the host copy and raises ``exc(text)`` when the
    code is set (``exc``: DeviceError unless the layer names its own); if it has not, leaves it for a later call (never waits). ``check()``:
    synchronizes and reads the device word itself. ``clear()``: forgets the host copies (after a
    reset zeroed the word). Under CUDA graph capture ``after_call`` captures the copy into a
    second pinned buffer (each replay refreshes it) and records no event; ``poll`` does nothing
    while capturing; after replays only ``check()`` (a sync) reports. ``enabled=False``: only
    ``check()`` reads. A CPU word (tests) is read synchronously: the copy is complete at once."""

    def __init__(self, err: torch.Tensor, describe, what: str, exc=None,
                 enabled: bool = True):
        self.err, self.describe, self.what = err, describe, what
        self.exc = DeviceError if exc is None else exc
        self.enabled = bool(enabled)
        pin = err.is_cuda
        # allocated here, never inside a call (pinned allocation can sync)
        self._host = torch.zeros(err.shape, dtype=err.dtype, pin_memory=pin)
        self._graph_host = torch.zeros(err.shape, dtype=err.dtype, pin_memory=pin)
        self._event = None
        self._pending = False
        self.copies = 0  # copies started (tests)

    def _raise_if(self, words):
        msg = self.describe([int(v) for v in words])
        if msg:
            raise self.exc(f"{self.what}: {msg}. The layer is unusable until a collective "
                           "reset() on every rank (README: Failures and recovery)")

    def poll(self):
        """Start of a call: raise for the last completed read-back; never waits."""
        if not self.enabled or not self._pending or _capturing(self.err):
            return
        if self._event is not None and not self._event.query():
            return  # the previous call is still running: checked by a later call
        self._pending = False
        self._raise_if(self._host.tolist())

    def after_call(self, stream=None):
        """End of a call: start the asynchronous read-back on ``stream`` (current by default)."""
        if not self.enabled:
            return
        if _capturing(self.err):
            self._graph_host.copy_(self.err, non_blocking=True)  # part of the graph
            return
        if self._pending:
            return
        if self.err.is_cuda:
            stream = stream or torch.cuda.current_stream(self.err.device)
            with torch.cuda.stream(stream):
                self._host.copy_(self.err, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(stream)
        else:
            self._host.copy_(self.err)
        self._pending = True
        self.copies += 1

    def check(self):
        """Synchronize and raise for the device word as it is now."""
        if self.err.is_cuda:
            torch.cuda.synchronize(self.err.device)
        self._pending = False
        self._raise_if(self.err.tolist())

    def clear(self):
        self._pending, self._event = False, None
        self._host.zero_()
        self._graph_host.zero_()
