"""Device time of the planner (`plan_combine`) and of the per-routing preparation
(`OverlapCombine.prepare`, and its scale="ordered" tables), replayed from CUDA graphs, on one GPU.

    PYTHONPATH=$PWD python bench/bench_plan.py [--out DIR] [--order remote_first expert]
        [--what plan ordered] [--device cpu]

Per implementation (`impl`: the torch reference or the CuTe DSL kernels), (W, E, tokens per rank,
top-k) and layout: the plan of one rank (--rank, default 0; -1: the last, whose planner CTA
reads the most counts) with `validate=False` and
`max_rows` the worst case (W * T * k) or tight (the rows the routing gives the rank), so the
cost of unused capacity shows; `prepare` (receive rows, source rows, expected counts) of that
rank's routing. Both captured in a CUDA graph of 5 calls; the median replay / 5. --order: the
plan's schedules to time (plan_combine(order=); prepare does not depend on it).
--what ordered: the ordered scale's per-routing tables (`ordered_routes.ordered_routes_device`,
validate=False: every other rank's plan rebuilt, the row signals, the tile order and dependency
lists, seg_inc) of the planned rank at W in ORDERED_WORLDS, layout auto, the layer's capacity
(max_rows = W * T * k), in the same CUDA graph timing: the torch path, the kernels given
prepare's rows, the kernels with prepare_routes, and the whole plan + prepare of
scale="ordered" against plan + prepare alone, and that whole again for a layer made for
CAPACITY_FACTOR x the tokens (a larger arrival table, the same routing); checked bitwise against
the host reference (`ordered_scale.ordered_routes`) before timing.
--device cpu: a smoke run (SMOKE_CASES, torch only, wall-clock medians of eager calls) of the
same code and checks. JSON to --out.
"""
import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_results import result_header, write_result  # noqa: E402
from moe_overlap.combine.plan import count_assignments, plan_combine  # noqa: E402
from moe_overlap.routing import route  # noqa: E402
from moe_overlap.timing import time_calls  # noqa: E402

CASES = [(2, 64, 8192, 8), (8, 256, 8192, 8), (32, 256, 8192, 8), (64, 512, 16384, 8)]
ORDERED_WORLDS = (2, 8, 64)  # --what ordered: the CASES of these world sizes
CAPACITY_FACTOR = 4  # --what ordered: also a layer made for 4x the tokens per rank
SMOKE_CASES = [(2, 16, 256, 4), (8, 32, 96, 2)]  # --device cpu


def time_us(fn, dev, reps=5, replays=15):
    """Median microseconds per call: CUDA-graph replays of `reps` calls on CUDA (time_calls),
    wall clock of eager calls elsewhere (the smoke run: the code path, not a GPU number)."""
    if dev.type == "cuda":
        return time_calls(fn, reps=reps, replays=replays)[0] * 1e3
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def prepare_fn(plan, ids, E, W, rank, impl):
    """OverlapCombine.prepare's device work (local_copy=False: source rows too), without the
    communication buffers an OverlapCombine would allocate."""
    from moe_overlap.combine.routes import prepare_routes
    return lambda: prepare_routes(ids, E, W, rank, False, plan, impl=impl)


def ordered_fn(ids, counts, plan, impl, rows=None):
    """OverlapCombine.prepare's scale="ordered" device work (ordered_routes_device,
    validate=False). impl "torch": the torch path, the senders' plans by the planner kernel on
    CUDA; "kernel": the kernels (combine/ordered_routes_kernel.py) given prepare's ``rows``;
    "kernel_rows": the kernels making the rows (prepare_routes, the senders' plans on a side
    stream under it), as OverlapCombine.prepare calls them."""
    from moe_overlap.combine.ordered_routes import ordered_routes_device
    plan_impl = "kernel" if ids.is_cuda else "torch"
    if impl == "torch":
        return lambda: ordered_routes_device(ids, counts, plan, plan_impl=plan_impl,
                                             validate=False, impl="torch")
    return lambda: ordered_routes_device(ids, counts, plan, validate=False, impl="kernel",
                                         rows=rows if impl == "kernel" else None)


def ordered_reference(ids, counts, plan):
    """The host reference (ordered_scale.ordered_routes) of the tables of ordered_fn."""
    from moe_overlap.combine import ordered_scale as osc
    return osc.ordered_routes(ids.cpu(), counts.cpu(), plan.rank, plan.tile_m, plan.mgb,
                              plan.layout, plan.segment_capacity, order=plan.order)


def ordered_matches_reference(got, ref) -> bool:
    """got (ordered_routes_device's) == ref (ordered_reference's) on every table's valid part,
    the padding -1, seg_count and each sender's prefix of seg_inc equal (the kernel path writes
    nothing past it)."""
    t = {n: v.cpu() for n, v in got.tables.items()}
    nd = int(t["dep_start"][-1])
    cnt, inc = got.seg_count.cpu(), got.seg_inc.cpu()
    same = torch.equal(cnt, ref.seg_count) and all(
        torch.equal(inc[s, :n], ref.seg_inc[s, :n]) for s, n in enumerate(cnt.tolist()))
    for n, want in ref.tables.items():
        if n in ("dep_kind", "dep_source", "dep_index"):
            same = same and bool((t[n][nd:] == -1).all())
            t[n] = t[n][:nd]
        same = same and torch.equal(t[n], want)
    return bool(same)


def routing(W, E, T, k, rank, dev):
    """(ids [T, k] of `rank`, counts [W, E]) on dev: ranks beyond 8 reuse the first routings'
    counts (the planner's cost does not depend on the values); the planned rank's row is its
    own routing's."""
    ids0 = route(T, E, k, "balanced", seed=3, rank=0)[0]
    others = [count_assignments(route(T, E, k, "balanced", seed=3, rank=r)[0], E)
              for r in range(1, min(W, 8))]
    cnt = [count_assignments(ids0, E)] + [others[(r - 1) % len(others)] if others else
                                          count_assignments(ids0, E) for r in range(1, W)]
    ids_r = ids0 if rank == 0 else route(T, E, k, "balanced", seed=3, rank=rank)[0]
    cnt[rank] = count_assignments(ids_r, E)
    return ids_r.to(dev), torch.stack(cnt).to(dev)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    ap.add_argument("--tag", default="h200", help="suffix of the JSON name")
    ap.add_argument("--impl", nargs="+", default=["torch", "kernel"], choices=["torch", "kernel"],
                    help="planner / prepare implementations to time (plan_combine impl=)")
    ap.add_argument("--rank", type=int, default=0, help="planned rank (-1: the last)")
    ap.add_argument("--order", nargs="+", default=["remote_first"],
                    choices=["remote_first", "expert"], help="plan_combine order= to time")
    ap.add_argument("--what", nargs="+", default=["plan", "ordered"], choices=["plan", "ordered"],
                    help="plan: the planner and prepare; ordered: the ordered scale's tables")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the smoke run (SMOKE_CASES, torch only, eager wall clock)")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    smoke = dev.type == "cpu"
    impls = ["torch"] if smoke else args.impl
    cases = SMOKE_CASES if smoke else CASES
    rows, ordered_rows = [], []
    for W, E, T, k in cases:
        rank = args.rank % W
        ids, counts = routing(W, E, T, k, rank, dev)
        El = E // W
        tight = int(counts[:, rank * El:(rank + 1) * El].sum())
        if "ordered" in args.what and (smoke or W in ORDERED_WORLDS):
            ordered_rows += time_ordered(ids, counts, W, E, T, k, rank, impls, args.order, dev)
        if "plan" not in args.what:
            continue
        for impl in impls:
            for order in args.order:
                for layout in ("aligned", "packed", "auto"):
                    for cap_name, max_rows in (("worst", W * T * k), ("tight", tight)):
                        fn = (lambda mr=max_rows, lay=layout, im=impl, o=order:
                              plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=mr,
                                           validate=False, layout=lay, impl=im, order=o))
                        plan_us = time_us(fn, dev)
                        plan = fn()
                        assert plan.order == order
                        prep_us = time_us(prepare_fn(plan, ids, E, W, rank, impl), dev)
                        r = dict(impl=impl, order=order, world_size=W, rank=rank, experts=E,
                                 tokens_per_rank=T, topk=k, layout=layout, capacity=cap_name,
                                 max_rows=max_rows, band_capacity=plan.band_capacity,
                                 plan_us=plan_us, prepare_us=prep_us)
                        rows.append(r)
                        print(f"{impl:<6} {order:<12} W={W:<3} r={rank:<3} E={E:<4} T={T:<6} "
                              f"{layout:<8} {cap_name:<6} plan {r['plan_us']:8.1f} us  "
                              f"prepare {r['prepare_us']:7.1f} us  "
                              f"sum {r['plan_us'] + r['prepare_us']:8.1f} us", flush=True)
    method = ("eager calls on the CPU, median wall clock (smoke run)" if smoke else
              "CUDA graph of 5 calls, median of 15 replays / 5")
    area = "ordered_tables" if ordered_rows else "plan"
    doc = dict(result_header("plan", cuda=not smoke, area=area), method=method, impls=impls,
               orders=args.order, what=args.what, rows=rows, ordered_rows=ordered_rows)
    tag = "cpu_smoke" if smoke and args.tag == "h200" else args.tag
    print(f"wrote {write_result(doc, args.out, f'plan_{tag}.json')}")
    if not all(r["equal_to_reference"] for r in ordered_rows):
        raise SystemExit("ordered_routes_device differs from the host reference (see "
                         "ordered_rows[].equal_to_reference)")


def time_ordered(ids, counts, W, E, T, k, rank, impls, orders, dev):
    """Rows of the ordered tables' timing (layout auto, the layer's capacity) per path and
    order, every path's result checked against the host reference first. On CUDA also the
    whole of scale="ordered"'s plan + prepare in one graph: the plan, prepare_routes and the
    tables' kernels (``plan_prepare_ordered_us``), beside plan + prepare_routes alone."""
    out = []
    paths = (["torch"] if "torch" in impls else []) + \
        (["kernel", "kernel_rows"] if "kernel" in impls and dev.type == "cuda" else [])
    for order in orders:
        plan_impl = "kernel" if dev.type == "cuda" else "torch"
        plan = plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=W * T * k,
                            validate=False, layout="auto", impl=plan_impl, order=order)
        ref = ordered_reference(ids, counts, plan)
        rows = prepare_fn(plan, ids, E, W, rank, plan_impl)()[0]
        for impl in paths:
            fn = ordered_fn(ids, counts, plan, impl, rows)
            equal = ordered_matches_reference(fn(), ref)
            us = time_us(fn, dev)
            r = dict(impl=impl, order=order, world_size=W, rank=rank, experts=E,
                     tokens_per_rank=T, topk=k, layout="auto", max_rows=W * T * k,
                     segment_capacity=plan.segment_capacity, ordered_us=us,
                     equal_to_reference=equal)
            if impl == "kernel":
                from moe_overlap.combine.ordered_routes import ordered_routes_device
                from moe_overlap.combine.routes import prepare_routes

                def plain():
                    p = plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=W * T * k,
                                     validate=False, layout="auto", impl="kernel", order=order)
                    return p, prepare_routes(ids, E, W, rank, False, p, impl="kernel")[0]

                def whole(cap=1):  # as OverlapCombine.prepare: rows made by the tables' path
                    p = plan_combine(counts, rank, tile_m=128, mgb=2,
                                     max_rows=cap * W * T * k, validate=False, layout="auto",
                                     impl="kernel", order=order)
                    return ordered_routes_device(ids, counts, p, validate=False, impl="kernel")
                r["plan_prepare_plain_us"] = time_us(plain, dev)
                r["plan_prepare_ordered_us"] = time_us(whole, dev)
                r["whole_equal_to_reference"] = ordered_matches_reference(whole(), ref)
                # a layer made for CAPACITY_FACTOR x these tokens per rank: its arrival table
                # is that much larger, the routing the same (no work may follow the capacity)
                big = functools.partial(whole, CAPACITY_FACTOR)
                plan_big = plan_combine(counts, rank, tile_m=128, mgb=2,
                                        max_rows=CAPACITY_FACTOR * W * T * k, validate=False,
                                        layout="auto", impl=plan_impl, order=order)
                r["capacity_factor"] = CAPACITY_FACTOR
                r["plan_prepare_ordered_big_capacity_us"] = time_us(big, dev)
                r["big_capacity_equal_to_reference"] = ordered_matches_reference(
                    big(), ordered_reference(ids, counts, plan_big))
                equal = equal and r["whole_equal_to_reference"] and \
                    r["big_capacity_equal_to_reference"]
                r["equal_to_reference"] = equal
            out.append(r)
            extra = (f"  plan+prepare plain {r['plan_prepare_plain_us']:6.1f} us, ordered "
                     f"{r['plan_prepare_ordered_us']:6.1f} us ({CAPACITY_FACTOR}x capacity "
                     f"{r['plan_prepare_ordered_big_capacity_us']:6.1f} us)"
                     if impl == "kernel" else "")
            print(f"ordered {impl:<11} {order:<12} W={W:<3} r={rank:<3} E={E:<4} T={T:<6} "
                  f"tables {us:8.1f} us  equal to the host reference: {equal}{extra}",
                  flush=True)
    return out


if __name__ == "__main__":
    main()
