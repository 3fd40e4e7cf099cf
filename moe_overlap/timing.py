"""Timing on the GPU: CUDA events around CUDA-graph replays (or eager back-to-back calls)."""
from __future__ import annotations

import statistics

import torch


def time_calls(fn, reps: int = 4, replays: int = 15, barrier=lambda: None, graph: bool = True):
    """Median milliseconds per call of `reps` back-to-back calls of `fn`.

    graph=True captures the `reps` calls in one CUDA graph and times its replays: the overlap
    backend's eager calls are bound by the host (each CuTe DSL launch costs ~0.1 ms of Python), so
    only replays show the GPU time. graph=False issues them eagerly (for code whose host work stays
    ahead of the GPU, e.g. NCCL collectives that are not captured). Before each replay `barrier()`
    lines the ranks up. Returns (median ms, "graph" | "eager", every replay's ms).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile, load and warm up outside any capture
            fn()
    torch.cuda.synchronize()
    captured = None
    if graph:
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            for _ in range(reps):
                fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        barrier()
        torch.cuda.synchronize()
        start.record()
        if captured is not None:
            captured.replay()
        else:
            for _ in range(reps):
                fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    del captured
    return statistics.median(times), ("graph" if graph else "eager"), times
