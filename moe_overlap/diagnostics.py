"""Benchmark diagnostics of the layers: one private debug object per layer, set for a scope.

A layer keeps ``self._debug`` (a ``CombineDebug`` / ``FFNDebug``, all off by default) and reads it
on the host in its eager call path only; nothing here reaches a kernel's compile key or the work
a CUDA graph captures. Benchmarks turn it on through the layer's public ``diagnostics(...)``
context manager, which restores the previous object on exit.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass


@dataclass
class CombineDebug:
    """OverlapCombine: timeline (a list or None): every forward appends a dict of CUDA timing
    events (start, begun, shipped, produced, scaled); skip_scale: leave the scale kernel out
    (the output is then not computed)."""
    timeline: list | None = None
    skip_scale: bool = False


@dataclass
class FFNDebug:
    """FusedFFN / ShardedExperts (fused backend): timeline (a list or None): every call appends
    [start, compute end, all-reduce end] CUDA timing events."""
    timeline: list | None = None


@contextlib.contextmanager
def debug_scope(layer, debug):
    """Sets ``layer._debug = debug`` for the ``with`` block (eager calls only: refused while the
    current stream is capturing a CUDA graph, where the events would be recorded once)."""
    import torch
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("diagnostics are for eager calls; the current stream is capturing")
    prev = layer._debug
    layer._debug = debug
    try:
        yield debug
    finally:
        layer._debug = prev
