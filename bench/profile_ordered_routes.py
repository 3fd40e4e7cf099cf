"""Where the ordered scale's per-routing tables (`ordered_routes.ordered_routes_device`) spend
their device time: each stage of it captured and replayed alone in a CUDA graph (the same
timing as bench_plan), for the CASES of bench_plan at W = 2 and 8 (and 64 with --w64), plus the
number of kernels each stage launches (torch.profiler, one eager call).

    PYTHONPATH=$PWD python bench/profile_ordered_routes.py [--w64] [--kernels]

Stages of the torch path (impl="torch"): segments (every other rank's plan rebuilt,
`_sender_segments`), deps (the row signals, `_row_dependencies`), keys (`_completion_keys`),
tables (`_tile_tables`), and the whole call. --kernels: the kernel path's launches instead, each
one's device time. Printed only: a diagnosis for bench/NOTES.md, not a headline.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_plan import CASES, routing, time_us  # noqa: E402
from moe_overlap.combine import ordered_routes as orr  # noqa: E402
from moe_overlap.combine.ordered_scale import DEFAULT_TILE_TOKENS  # noqa: E402
from moe_overlap.combine.plan import plan_combine  # noqa: E402


def kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--w64", action="store_true")
    ap.add_argument("--kernels", action="store_true",
                    help="the kernel path (impl='kernel'): each launch's device time")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: a smoke run of the code path (wall clock, no kernel count)")
    a = ap.parse_args()
    dev = torch.device(a.device)
    worlds = (2, 8, 64) if a.w64 else (2, 8)
    if a.kernels:
        return kernel_launches(worlds, dev)
    for W, E, T, k, ids, counts, plan in cases(worlds, dev, "auto"):
        assert orr.ordered_routes_device(ids, counts, plan, validate=True,
                                         impl="torch") is not None
        max_rows = orr.sender_max_rows(plan)
        idl = ids.long()
        segs = orr._sender_segments(counts, plan, max_rows, "auto", False)
        deps = orr._row_dependencies(idl, counts, plan, segs, False)
        key = orr._completion_keys(deps, plan, segs)
        Sc = plan.segment_capacity
        stages = {
            "one plan_combine": lambda: plan_combine(counts, 1, tile_m=128, mgb=2,
                                                     max_rows=max_rows, validate=False,
                                                     layout=plan.layout, impl="auto",
                                                     order=plan.order),
            "segments": lambda: orr._sender_segments(counts, plan, max_rows, "auto", False),
            "deps": lambda: orr._row_dependencies(idl, counts, plan, segs, False),
            "keys": lambda: orr._completion_keys(deps, plan, segs),
            "tables": lambda: orr._tile_tables(deps, key, DEFAULT_TILE_TOKENS, W, Sc),
            "whole": lambda: orr.ordered_routes_device(ids, counts, plan, plan_impl="auto",
                                                       validate=False, impl="torch"),
        }
        for name, fn in stages.items():
            n = kernels(fn) if dev.type == "cuda" else 0
            print(f"W={W:<3} E={E:<4} T={T:<6} {name:<17} {time_us(fn, dev):8.1f} us  "
                  f"{n:4d} kernels", flush=True)


def cases(worlds, dev, plan_impl):
    """(W, E, T, k, ids, counts, rank 0's plan) of the CASES at these world sizes."""
    for W, E, T, k in CASES:
        if W in worlds:
            ids, counts = routing(W, E, T, k, 0, dev)
            yield W, E, T, k, ids, counts, plan_combine(
                counts, 0, tile_m=128, mgb=2, max_rows=W * T * k, validate=False,
                layout="auto", impl=plan_impl, order="remote_first")


def kernel_launches(worlds, dev):
    """Per launch of ordered_routes_device(impl="kernel", rows=prepare's): its device time
    (torch.profiler, median of 5 eager calls), by kernel name in launch order."""
    from torch.profiler import ProfilerActivity, profile
    from moe_overlap.combine.routes import prepare_routes
    for W, E, T, k, ids, counts, plan in cases(worlds, dev, "kernel"):
        rows, _ = prepare_routes(ids, E, W, 0, False, plan, impl="kernel")

        def fn():
            return orr.ordered_routes_device(ids, counts, plan, validate=False, impl="kernel",
                                             rows=rows)
        fn()
        torch.cuda.synchronize()
        per = {}
        for _ in range(5):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
            for i, e in enumerate(evs):
                t = getattr(e, "device_time", None)
                per.setdefault((i, e.name[:60]), []).append(t if t is not None else e.cuda_time)
        for (i, name), ts in sorted(per.items()):
            ts.sort()
            print(f"W={W:<3} T={T:<6} {i:2d} {name:<60} {ts[len(ts) // 2]:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
