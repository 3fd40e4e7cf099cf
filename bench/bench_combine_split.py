"""Where the overlapped combine's time goes: each part alone, and a timeline of the call.

    python bench/bench_combine_split.py [--shapes 4096x16x4x8192x1024,...] [--ccta 8,16,24]
                                        [--mgb 2] [--mode balanced] [--out split.json]

Per shape (tokens per rank x experts x topk x N x K) and ccta, on every GPU of the host (W ranks):
- CUDA-graph replays (as scripts/sweep.py: 4 calls per graph, median of replays, max over ranks):
  gemm_all (GEMM alone, every SM), gemm_prod (GEMM alone on the SMs the consumer leaves it),
  prepare (the routing's rows and counts, once per routing: outside the call unless --inline),
  begin (the call's bookkeeping: epoch, expected counts), ship (the consumer kernel alone, bands
  marked ready), comm (begin + flags + ship: the sweep's T_comm), scale (the owner's scale alone,
  arrivals complete), overlap (the whole call: the sweep's T_overlap), overlap_noscale (the call
  without its scale: producer || consumer);
- a timeline of eager calls with a GPU sleep before each (boost clock, host launch time hidden):
  when begin_call, the consumer, the producer and the scale end, ms after the call's start
  (--piece-rows: the consumer's work units to compare, see OverlapCombine);
- derived: the sweep's bound max(gemm_all, comm), the design's floor begin + max(gemm_prod, ship)
  + scale (perfect overlap of what overlaps, nothing else), and each over the bound.
JSON to --out; a short table last.
"""
from __future__ import annotations

import argparse
import functools
import datetime
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _k, _v in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
               ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("CUDA_MODULE_LOADING", "EAGER")):
    os.environ[_k] = _v  # never NVLink multicast on shared machines; eager module loading
os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "6G")

MARKS = ("begun", "shipped", "produced", "scaled")


def worker(rank, W, args):
    import torch
    import torch.distributed as dist

    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.overlap import OverlapCombine
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    from moe_overlap.timing import max_over_ranks as max_over_ranks_on
    from moe_overlap.timing import sleep_cycles_per_ms, time_calls

    dev = torch.device("cuda", rank)

    barrier = dist.barrier
    max_over_ranks = functools.partial(max_over_ranks_on, device=dev)

    def timed(fn):
        return max_over_ranks(time_calls(fn, args.reps, args.replays, barrier)[0])

    sleep = int(args.lead_ms * sleep_cycles_per_ms())
    points = []
    for si, (T, E, k, N, K) in enumerate(args.shapes):
        El = E // W
        ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N, topk=k,
                            max_tokens_per_rank=T, ccta=args.ccta[0],
                            local_copy=False, copy="tma")
        default_piece = ov.piece_rows
        ids, gates = route(T, E, k, args.mode, seed=si, rank=rank, device=dev)
        counts = exchange_counts(ids, E)
        g = torch.Generator(device=dev).manual_seed(si * 31 + rank)
        w_down = (torch.randn(El, K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
        plan = plan_combine(counts, rank, tile_m=128, mgb=args.mgb, max_rows=W * T * k)
        rows_total = int(plan.total_rows.item())
        h = torch.randn(rows_total, K, device=dev, generator=g).to(torch.bfloat16)
        st = plan.stats()
        ref = ov.forward(h, w_down, plan, ids, gates, check=True, overlap=False).clone()
        routes = None if args.inline else ov.prepare(plan, ids)
        y, band_ready = ov.buffers_for(h, plan)
        scratch = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
        cap = plan.band_capacity
        valid_b = torch.arange(cap, device=dev) < plan.num_bands

        def resync():
            """Quiescent ranks: every shipped row has landed, so the expected counts can restart
            from the counters (the 'ship' and 'begin' timings advance only one of the two)."""
            torch.cuda.synchronize()
            barrier()
            ov.expected.copy_(ov.counters)
            torch.cuda.synchronize()
            barrier()

        def mark_ready():
            band_ready.copy_(torch.where(valid_b, ov.epoch.expand(cap), band_ready))

        t_gemm_all = timed(lambda: ov.produce(h, w_down, plan, y, scratch, ccta=0))
        for ccta, piece in [(c, p) for c in args.ccta for p in args.piece_rows]:
            piece = default_piece if piece < 0 else piece
            call = dict(ccta=ccta, piece_rows=piece)  # passed to every call of the point
            out = ov.forward(h, w_down, plan, ids, gates, check=True, routes=routes, **call)
            bitwise = bool(torch.equal(out, ref))
            r = dict(shape=dict(tokens=T, experts=E, topk=k, N=N, K=K), mode=args.mode,
                     ccta=ccta, piece_rows=piece, mgb=args.mgb,
                     bitwise_equal=bitwise, stats=st,
                     gemm_all=t_gemm_all)
            r["overlap"] = timed(lambda: ov.forward(h, w_down, plan, ids, gates, routes=routes,
                                                    **call))
            with ov.diagnostics(skip_scale=True):
                r["overlap_noscale"] = timed(lambda: ov.forward(h, w_down, plan, ids, gates,
                                                                routes=routes, **call))
            ov.check_errors()
            # a complete non-overlapped call, then its scale again and again (arrivals are in)
            rows, weights = ov.begin_call(ids, gates, plan, routes)
            ov.produce(h, w_down, plan, y, band_ready, ccta=0)
            ov.ship(y, plan, band_ready, **call)
            resync()
            scale_out = torch.empty(T, N, dtype=torch.bfloat16, device=dev)
            r["scale"] = timed(lambda: ov.scale.launch(
                recv=ov.recv, rows=rows, weights=weights, out=scale_out, counters=ov.counters,
                expected=ov.expected, rank=rank, err=ov.err, epoch=ov.epoch,
                slot_bytes=ov.slot_bytes, num_sms=ov.num_sms, y=y))
            r["gemm_prod"] = timed(lambda: ov.produce(h, w_down, plan, y, scratch, ccta=ccta))
            r["prepare"] = timed(lambda: ov.prepare(plan, ids))
            r["begin"] = timed(lambda: ov.begin_call(ids, gates, plan, routes))
            mark_ready()  # the epoch stays put while the consumer alone ships again and again
            r["ship"] = timed(lambda: ov.ship(y, plan, band_ready, **call))

            def comm():
                ov.begin_call(ids, gates, plan, routes)
                mark_ready()
                ov.ship(y, plan, band_ready, **call)

            r["comm"] = timed(comm)
            resync()
            ov.check_errors()
            # timeline: eager calls, a GPU sleep before each start event
            marks = []
            with ov.diagnostics(timeline=marks):
                for _ in range(args.timeline_calls):
                    barrier()
                    torch.cuda._sleep(sleep)
                    ov.forward(h, w_down, plan, ids, gates, routes=routes, **call)
                torch.cuda.synchronize()
            ov.check_errors()
            tl = {m: statistics.median(c["start"].elapsed_time(c[m]) for c in marks)
                  for m in MARKS}
            r["timeline_rank"] = tl
            r["timeline"] = {m: max_over_ranks(v) for m, v in tl.items()}
            r["bound"] = max(r["gemm_all"], r["comm"])
            r["floor"] = r["begin"] + max(r["gemm_prod"], r["ship"]) + r["scale"]
            r["overlap_over_bound"] = r["overlap"] / r["bound"]
            r["floor_over_bound"] = r["floor"] / r["bound"]
            r["remote_GBs_ship"] = st["remote_rows"] * N * 2 / (r["ship"] * 1e-3) / 1e9
            points.append(r)
            if rank == 0:
                print(f"[{T}x{E}x{k}x{N}x{K} ccta={ccta} piece={piece}] " + " ".join(
                    f"{n} {r[n]:.3f}" for n in ("gemm_all", "gemm_prod", "prepare", "begin",
                                                "ship", "comm",
                                                "scale", "overlap", "overlap_noscale")) +
                      f" timeline {tl} bitwise {bitwise}", flush=True)
        ov = None  # (its symmetric buffers stay allocated: NVSHMEM heap)
        torch.cuda.synchronize()
    return points


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="4096x16x4x8192x1024,4096x16x4x8192x2048")
    ap.add_argument("--ccta", default="8,16,24")
    ap.add_argument("--mgb", type=int, default=2)
    ap.add_argument("--mode", default="balanced")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--replays", type=int, default=15)
    ap.add_argument("--timeline-calls", type=int, default=15)
    ap.add_argument("--lead-ms", type=float, default=2.0)
    ap.add_argument("--inline", action="store_true",
                    help="compute the routing's rows inside every call (the pre-prepare path)")
    ap.add_argument("--piece-rows", default="-1",
                    help="consumer piece rows to compare (-1: OverlapCombine's default, 0: "
                         "whole segments)")
    ap.add_argument("--out", default="combine_split.json")
    args = ap.parse_args(argv)
    args.shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    args.ccta = [int(c) for c in args.ccta.split(",")]
    args.piece_rows = [int(c) for c in args.piece_rows.split(",")]

    import torch

    from moe_overlap.launch import spawn
    W = torch.cuda.device_count()
    if W < 2:
        print("needs at least 2 GPUs", file=sys.stderr)
        return 2
    t0 = time.time()
    points = spawn(worker, W, args, backend="nccl")[0]
    meta = dict(device=torch.cuda.get_device_name(0), world_size=W, torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                git_commit=os.environ.get("GIT_COMMIT", ""), mode=args.mode, mgb=args.mgb,
                reps=args.reps, replays=args.replays, lead_ms=args.lead_ms, inline=args.inline,

                seconds=time.time() - t0)
    from moe_overlap.provenance import stamp
    doc = stamp(dict(meta=meta, points=points), "combine", gpus=W, device=meta["device"],
                commit=meta["git_commit"])
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"\ncombine split ({meta['device']} x{W}, {args.mode}, mgb {args.mgb}); ms, graph "
          "replays back to back, max over ranks; timeline: eager after a sleep, ms from start")
    cols = ("gemm_all", "gemm_prod", "prepare", "begin", "ship", "comm", "scale", "overlap",
            "overlap_noscale", "floor")
    hdr = f"{'shape':<22}{'ccta':>5}{'piece':>6}" + "".join(f"{c[:11]:>12}" for c in cols) + \
        f"{'ov/bound':>9}{'floor/bnd':>10}{'GB/s':>6}  timeline begun/shipped/produced/scaled"
    print(hdr)
    for r in points:
        s = r["shape"]
        name = f"{s['tokens']}x{s['experts']}x{s['topk']}x{s['N']}x{s['K']}"
        tl = "/".join(f"{r['timeline'][m]:.3f}" for m in MARKS)
        print(f"{name:<22}{r['ccta']:>5}{r['piece_rows']:>6}" +
              "".join(f"{r[c]:>12.3f}" for c in cols) +
              f"{r['overlap_over_bound']:>9.2f}{r['floor_over_bound']:>10.2f}"
              f"{r['remote_GBs_ship']:>6.0f}  {tl}{'' if r['bitwise_equal'] else '  NOT BITWISE'}")
    return 0 if all(r["bitwise_equal"] for r in points) else 1


if __name__ == "__main__":
    sys.exit(main())
