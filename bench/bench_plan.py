"""Device time of the planner (`plan_combine`) and of the per-routing preparation
(`OverlapCombine.prepare`), replayed from CUDA graphs, on one GPU.

    PYTHONPATH=$PWD python bench/bench_plan.py [--out DIR] [--order remote_first expert]

Per implementation (`impl`: the torch reference or the CuTe DSL kernels), (W, E, tokens per rank,
top-k) and layout: the plan of one rank (--rank, default 0; -1: the last, whose planner CTA
reads the most counts) with `validate=False` and
`max_rows` the worst case (W * T * k) or tight (the rows the routing gives the rank), so the
cost of unused capacity shows; `prepare` (receive rows, source rows, expected counts) of that
rank's routing. Both captured in a CUDA graph of 5 calls; the median replay / 5. --order: the
plan's schedules to time (plan_combine(order=); prepare does not depend on it). JSON to --out.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_results import result_header, write_result  # noqa: E402
from moe_overlap.combine.plan import count_assignments, plan_combine  # noqa: E402
from moe_overlap.routing import route  # noqa: E402
from moe_overlap.timing import time_calls  # noqa: E402

CASES = [(2, 64, 8192, 8), (8, 256, 8192, 8), (32, 256, 8192, 8), (64, 512, 16384, 8)]


def prepare_fn(plan, ids, E, W, rank, impl):
    """OverlapCombine.prepare's device work (local_copy=False: source rows too), without the
    communication buffers an OverlapCombine would allocate."""
    from moe_overlap.combine.routes import prepare_routes
    return lambda: prepare_routes(ids, E, W, rank, False, plan, impl=impl)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    ap.add_argument("--tag", default="h200", help="suffix of the JSON name")
    ap.add_argument("--impl", nargs="+", default=["torch", "kernel"], choices=["torch", "kernel"],
                    help="planner / prepare implementations to time (plan_combine impl=)")
    ap.add_argument("--rank", type=int, default=0, help="planned rank (-1: the last)")
    ap.add_argument("--order", nargs="+", default=["remote_first"],
                    choices=["remote_first", "expert"], help="plan_combine order= to time")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows = []
    for W, E, T, k in CASES:
        rank = args.rank % W
        ids0 = route(T, E, k, "balanced", seed=3, rank=0)[0]
        others = [count_assignments(route(T, E, k, "balanced", seed=3, rank=r)[0], E)
                  for r in range(1, min(W, 8))]
        # ranks beyond 8 reuse the first routings' counts (the planner's cost does not depend
        # on the values); the planned rank's row is its own routing's
        cnt = [count_assignments(ids0, E)] + [others[(r - 1) % len(others)] if others else
                                              count_assignments(ids0, E) for r in range(1, W)]
        ids_r = ids0 if rank == 0 else route(T, E, k, "balanced", seed=3, rank=rank)[0]
        cnt[rank] = count_assignments(ids_r, E)
        counts = torch.stack(cnt).to(dev)
        El = E // W
        tight = int(counts[:, rank * El:(rank + 1) * El].sum())
        ids = ids_r.to(dev)
        for impl in args.impl:
            for order in args.order:
                for layout in ("aligned", "packed", "auto"):
                    for cap_name, max_rows in (("worst", W * T * k), ("tight", tight)):
                        fn = (lambda mr=max_rows, lay=layout, im=impl, o=order:
                              plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=mr,
                                           validate=False, layout=lay, impl=im, order=o))
                        ms = time_calls(fn, reps=5, replays=15)[0]
                        plan = fn()
                        assert plan.order == order
                        prep_ms = time_calls(prepare_fn(plan, ids, E, W, rank, impl), reps=5,
                                             replays=15)[0]
                        r = dict(impl=impl, order=order, world_size=W, rank=rank, experts=E,
                                 tokens_per_rank=T, topk=k, layout=layout, capacity=cap_name,
                                 max_rows=max_rows, band_capacity=plan.band_capacity,
                                 plan_us=ms * 1e3, prepare_us=prep_ms * 1e3)
                        rows.append(r)
                        print(f"{impl:<6} {order:<12} W={W:<3} r={rank:<3} E={E:<4} T={T:<6} "
                              f"{layout:<8} {cap_name:<6} plan {r['plan_us']:8.1f} us  "
                              f"prepare {r['prepare_us']:7.1f} us  "
                              f"sum {r['plan_us'] + r['prepare_us']:8.1f} us", flush=True)
    doc = dict(result_header("plan"),
               method="CUDA graph of 5 calls, median of 15 replays / 5", impls=args.impl,
               orders=args.order, rows=rows)
    print(f"wrote {write_result(doc, args.out, f'plan_{args.tag}.json')}")


if __name__ == "__main__":
    main()
