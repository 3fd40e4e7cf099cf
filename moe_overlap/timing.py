"""Timing on the GPU: CUDA events around CUDA-graph replays (or eager back-to-back calls)."""
from __future__ import annotations

import statistics

import torch


def graphed(fn, calls: int = 1) -> "torch.cuda.CUDAGraph":
    """``calls`` calls of fn captured in one CUDA graph, after two eager warm-up calls on a side
    stream (compile, load and warm up outside any capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return g


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


def max_over_ranks(x: float, device, group=None) -> float:
    """The largest x over the ranks of ``group`` (a collective: every rank calls it; the slowest
    rank's time is the call's time)."""
    import torch.distributed as dist

    from .runtime import collectives
    t = torch.tensor([x], dtype=torch.float64, device=device)
    collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def sleep_cycles_per_ms() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond (measured once per process)."""
    global _CYCLES_PER_MS
    if _CYCLES_PER_MS is None:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # first launch loads the kernel
        s.record()
        torch.cuda._sleep(10_000_000)
        e.record()
        e.synchronize()
        _CYCLES_PER_MS = 10_000_000 / max(s.elapsed_time(e), 1e-3)
    return _CYCLES_PER_MS


_CYCLES_PER_MS = None


def time_interleaved(fns: dict, warmup: int = 3, rounds: int = 40, barrier=lambda: None,
                     lead_ms: float = 0.0, shuffle_seed: int | None = None) -> dict:
    """Times every fn once per round, rounds interleaved (clock and power drift hit all alike);
    `barrier()` before each timed call lines ranks up. Returns, per name,
    dict(median_ms, p10_ms, p90_ms, mean_ms, std_ms, rounds, times, host_ms) with `times` in
    round order (for paired ratios) and `host_ms` the median host time of one call (enqueue only).

    lead_ms > 0: before the start event, a GPU sleep of that length keeps the stream busy while
    the host enqueues the call, so the events time the GPU work alone, as in a model whose host
    runs ahead of the GPU. Without it, a call right after a host-synchronizing barrier (NCCL's
    `dist.barrier` waits for the device) is timed from its first host instruction: a launch path
    that costs ~1 ms of Python (CuTe DSL argument conversion) then reads as ~1 ms of GPU time.
    The sleep also changes the power regime: calls no longer run back to back, so an H200
    (700 W) stays near its boost clock instead of its power-limited steady state (bf16 GEMMs at
    ~770 instead of ~640 TFLOP/s, bench/NOTES.md); report which regime a number comes from.
    `host_ms` is each call's enqueue time; without a barrier the host runs far ahead and it
    includes waiting for launch-queue space.

    shuffle_seed: each round calls the fns in a fresh random order (seeded, the same on every
    rank) instead of dict order. Calls of several ms heat the part over a round, so a fixed
    order makes the later ones slower (up to 16 % between identical configurations at the end
    and the start of a round of six, bench/NOTES.md); shuffling spreads that over all of them."""
    import random
    import time
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    torch.cuda.synchronize()
    sleep = int(lead_ms * sleep_cycles_per_ms()) if lead_ms > 0 else 0
    ev = {k: [] for k in fns}
    host = {k: [] for k in fns}
    rng = random.Random(shuffle_seed) if shuffle_seed is not None else None
    names = list(fns)
    for _ in range(rounds):
        if rng is not None:
            rng.shuffle(names)
        for k in names:
            fn = fns[k]
            barrier()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if sleep:
                torch.cuda._sleep(sleep)
            s.record()
            h0 = time.perf_counter()
            fn()
            host[k].append((time.perf_counter() - h0) * 1e3)
            e.record()
            ev[k].append((s, e))
    torch.cuda.synchronize()
    out = {}
    for k, pairs in ev.items():
        raw = [s.elapsed_time(e) for s, e in pairs]
        ts = sorted(raw)

        def q(f, ts=ts):
            return ts[min(len(ts) - 1, int(f * len(ts)))]

        out[k] = dict(median_ms=statistics.median(ts), p10_ms=q(0.1), p90_ms=q(0.9),
                      mean_ms=statistics.fmean(ts),
                      std_ms=statistics.stdev(ts) if len(ts) > 1 else 0.0,
                      rounds=rounds, times=raw, host_ms=statistics.median(host[k]),
                      lead_ms=lead_ms)
    return out


def time_held(fn, seconds: float, call_ms: float, barrier=lambda: None) -> dict:
    """Calls fn back to back for about `seconds` (the count from its measured time `call_ms`),
    the ranks lined up once before (`barrier()`), timed with two events around all the calls:
    the sustained rate, which on a power-capped part is the steady state a training step runs
    in. Returns dict(t0, t1, calls, ms): host wall-clock start and end (time.time, to match a
    clock trace taken beside the run) and ms per call.

    Why beside ``time_interleaved``: when paths of different power per FLOP alternate in calls of
    tens of ms, the power controller lags, so the one drawing more runs on part of the clock the
    other left (bench/NOTES.md, session 15: +10 % for the chained FFN at 8192 tokens, -4 % for
    its baseline); held alone, each path sets its own clock."""
    import math
    import time
    n = max(1, math.ceil(seconds * 1e3 / max(call_ms, 1e-6)))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    barrier()
    torch.cuda.synchronize()
    t0 = time.time()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return dict(t0=t0, t1=time.time(), calls=n, ms=start.elapsed_time(end) / n)
