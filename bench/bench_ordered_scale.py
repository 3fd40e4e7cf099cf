"""One GPU: the ordered scale beside the producer GEMM (design B's unknowns, bench/NOTES.md
"Session 11"), against today's order (GEMM, then the scale on every SM).

    CUDA_MODULE_LOADING=EAGER PYTHONPATH=$PWD python bench/bench_ordered_scale.py \
        [--shape 4096x16x4x8192x2048] [--ccta 8,12,16] [--out DIR]

Rank 0 of an emulated W = 2 world (both routings generated, the plans of both ranks built on the
CPU as the owner would): the producer GEMM of rank 0's plan on 132 - ccta SMs; the remote rows are
random data already in the receive slot with their per-segment counters already at the expected
value (the arrivals are done: at K = 2048 the consumer ends ~0.4 ms before the GEMM), so what is
measured is the local completion front and the scale's rate on the consumer's SMs. Variants
(interleaved rounds, 2 ms GPU sleep before each call, median):
- ``today``: GEMM, then the default Scale on every SM (stream order);
- ``A``: GEMM, then the ordered scale on every SM (stream order; no band waits);
- ``B``: GEMM || ordered scale on ``ccta`` CTAs of WORKER_THREADS threads (one per consumer SM,
  as the consumer: the stand-in of its CTAs after shipping) on a second stream, waiting on the
  band flags, then the ordered scale on every SM after the GEMM takes the tiles left (one
  queue);
- ``gemm``: the GEMM alone on 132 - ccta SMs.
Checks before timing: A and B outputs bitwise equal to today's, error word clear. JSON to --out.
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _k, _v in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
               ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")):
    os.environ[_k] = _v  # never NVLink multicast on shared machines


WORKER_THREADS = 512


def main(argv=None):
    import torch

    from moe_overlap.combine import ordered_scale as osc
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    from moe_overlap.combine.routes import prepare_routes_torch
    from moe_overlap.combine.scale import Scale
    from moe_overlap.combine.scale_ordered import OrderedScale
    from moe_overlap.combine.shapes import parse_shapes
    from moe_overlap.kernels.errors import describe_error
    from moe_overlap.routing import route
    from moe_overlap.timing import time_interleaved

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096x16x4x8192x2048")
    ap.add_argument("--ccta", default="8,12,16")
    ap.add_argument("--mode", default="balanced")
    ap.add_argument("--tile-tokens", type=int, default=None, help="default: "
                    "ordered_scale.DEFAULT_TILE_TOKENS")
    ap.add_argument("--ctas-per-sm", type=int, default=None, help="default: "
                    "scale_ordered.DEFAULT_CTAS_PER_SM")
    ap.add_argument("--threads", type=int, default=None, help="threads per CTA of design A's "
                    "launch (default scale_ordered.DEFAULT_THREADS; B's workers keep "
                    "WORKER_THREADS)")
    ap.add_argument("--tag", default="", help="suffix of the JSON file name")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    from moe_overlap.combine import scale_ordered
    args.tile_tokens = args.tile_tokens or osc.DEFAULT_TILE_TOKENS
    args.threads = args.threads or scale_ordered.DEFAULT_THREADS
    args.ctas_per_sm = args.ctas_per_sm or scale_ordered.DEFAULT_CTAS_PER_SM
    if os.environ.get("CUDA_MODULE_LOADING") != "EAGER":
        raise SystemExit("set CUDA_MODULE_LOADING=EAGER (a spinning kernel next to a lazily "
                         "loaded module can stall)")
    (sh,) = parse_shapes(args.shape)
    T, E, k, N, K = (sh[x] for x in ("tokens", "experts", "topk", "N", "K"))
    W, rank, tile_m, mgb = 2, 0, 128, 2
    dev = torch.device("cuda", 0)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    routed = [route(T, E, k, args.mode, seed=0, rank=r) for r in range(W)]
    ids = [x[0] for x in routed]
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plans = osc.sender_plans(counts, tile_m, mgb, "auto")
    deps = osc.row_dependencies(ids[rank], counts, rank, plans)
    plan = plans[rank].to(dev)
    ids0 = ids[rank].to(dev)
    rows, _ = prepare_routes_torch(ids0, E, W, rank, False, plan)
    weights = routed[rank][1].to(dev)
    El = E // W
    nrows = int(plan.num_bands.item()) * tile_m
    g = torch.Generator(device=dev).manual_seed(1)
    h = (torch.randn(nrows, K, device=dev, generator=g) * 0.1).to(torch.bfloat16)
    w = (torch.randn(El, K, N, device=dev, generator=g) * 0.05).to(torch.bfloat16)
    y_ext = torch.zeros(nrows + 1, N, dtype=torch.bfloat16, device=dev)
    max_rows = T * k
    recv = torch.randn(2 * max_rows, N, device=dev, generator=g).to(torch.bfloat16)
    slot_bytes = max_rows * N * 2
    band_ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
    epoch = torch.zeros(1, dtype=torch.int32, device=dev)
    seg_expected = osc.seg_expected_inc(plans, rank).to(dev)
    seg_arrivals = seg_expected.clone()  # every remote row already in (see the module doc)
    queue = torch.zeros(1, dtype=torch.int32, device=dev)
    err = torch.zeros(8, dtype=torch.int64, device=dev)
    zeros_w = torch.zeros(W, dtype=torch.int64, device=dev)
    gemm = GroupedGemm(tile_m=tile_m, tile_n=256, cluster_n=1)
    scale = Scale(k, y_src=True)
    ordered = OrderedScale(k, threads=args.threads, ctas_per_sm=args.ctas_per_sm)
    # the consumer workers' stand-in: ONE CTA per consumer SM, as the consumer itself. More CTAs
    # than the SMs the GEMM leaves free could take SMs its persistent grid still needs (a CTA of
    # it not yet resident never finishes its bands, and the workers wait on them: the deadlock
    # overlap.py documents); with ccta CTAs, GEMM (132 - ccta) + workers (ccta) fit on the GPU.
    workers = OrderedScale(k, threads=WORKER_THREADS, ctas_per_sm=1)
    side = torch.cuda.Stream(device=dev, priority=-1)
    outs = {n: torch.empty(T, N, dtype=torch.bfloat16, device=dev) for n in ("today", "A", "B")}
    results = []
    for ccta in (int(c) for c in args.ccta.split(",")):
        model = osc.ScaleModel()
        flows = [osc.flow_times(p, N, K, ccta, model) for p in plans]
        times = osc.dependency_times(deps, rank, [f[0] for f in flows], [f[1] for f in flows])
        tables = osc.tile_tables(osc.token_tiles(deps, times, args.tile_tokens), dev)

        def produce():
            gemm(h, w, y_ext[:nrows], plan.band_expert, plan.band_src_row, plan.schedule,
                 plan.num_bands, band_ready, epoch, ccta=ccta)

        def run_ordered(out, stream, grid, wait_bands, kernel=ordered):
            kernel.launch(recv=recv, rows=rows, weights=weights, out=out, y=y_ext,
                           tables=tables, band_ready=band_ready, seg_arrivals=seg_arrivals,
                           seg_expected=seg_expected, queue=queue, counters=zeros_w,
                           expected=zeros_w, rank=rank, err=err, epoch=epoch,
                           slot_bytes=slot_bytes, grid=grid, wait_bands=wait_bands,
                           check_tags=False, stream=stream)

        def call_today():
            epoch.add_(1)
            produce()
            scale.launch(recv=recv, rows=rows, weights=weights, out=outs["today"],
                         counters=zeros_w, expected=zeros_w, rank=rank, err=err, epoch=epoch,
                         slot_bytes=slot_bytes, num_sms=num_sms, y=y_ext)

        def call_a():
            epoch.add_(1)
            queue.zero_()
            produce()
            run_ordered(outs["A"], torch.cuda.current_stream(), num_sms * ordered.ctas_per_sm,
                        False)

        def call_b():
            s0 = torch.cuda.current_stream()
            epoch.add_(1)
            queue.zero_()
            side.wait_stream(s0)  # the epoch and the queue, not the GEMM
            produce()  # launched first: the workers never wait on a kernel not launched yet
            run_ordered(outs["B"], side, ccta, True, kernel=workers)
            run_ordered(outs["B"], s0, num_sms * ordered.ctas_per_sm, False)
            s0.wait_stream(side)

        # every kernel compiled and loaded alone, in stream order, before any of them spins
        # beside another (a module loaded next to a spinning kernel can stall)
        epoch.add_(1)
        queue.zero_()
        produce()
        run_ordered(outs["B"], torch.cuda.current_stream(), ccta, False, kernel=workers)
        torch.cuda.synchronize(dev)
        # each variant against today's scale of the SAME receive slot (the slot is chosen by the
        # epoch's parity and the two halves of recv hold different rows)
        got = {}
        for name, fn in (("today", call_today), ("today", call_today), ("A", call_a),
                         ("B", call_b)):
            fn()
            got[(name, int(epoch.item()) & 1)] = outs[name].clone()
        torch.cuda.synchronize(dev)
        if int(err[0]):
            raise SystemExit(describe_error(err.tolist()))
        same = {n: bool(torch.equal(v, got[("today", par)]))
                for (n, par), v in got.items() if n != "today"}
        par = int(epoch.item()) & 1
        ref = osc_reference(recv[max_rows:] if par else recv[:max_rows], rows, weights, y_ext)
        close = float((got[("today", par)].float() - ref.float()).abs().max())
        t = time_interleaved({"today": call_today, "A": call_a, "B": call_b, "gemm": lambda: (
            epoch.add_(1), produce())}, rounds=args.rounds, lead_ms=2.0)
        if int(err[0]):
            raise SystemExit(describe_error(err.tolist()))
        r = {"shape": sh, "ccta": ccta, "bitwise_equal": same, "max_abs_vs_torch": close,
             "tiles": int(tables["tile_start"].numel() - 1),
             **{n: t[n]["median_ms"] for n in t}}
        results.append(r)
        print(json.dumps(r), flush=True)
    meta = {"device": torch.cuda.get_device_name(dev), "date":
            datetime.datetime.now(datetime.timezone.utc).isoformat(), "torch": torch.__version__,
            "git_commit": os.environ.get("GIT_COMMIT", "unknown"), "threads": args.threads,
            "mode": args.mode, "tile_tokens": args.tile_tokens, "ctas_per_sm": args.ctas_per_sm,
            "rounds": args.rounds}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"ordered_scale_h200{args.tag}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "points": results}, f, indent=1)
    print("| ccta | gemm | today | A | B | bitwise A / B |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['ccta']} | {r['gemm']:.3f} | {r['today']:.3f} | {r['A']:.3f} | "
              f"{r['B']:.3f} | {r['bitwise_equal']['A']} / {r['bitwise_equal']['B']} |")
    if not all(all(r["bitwise_equal"].values()) for r in results):
        raise SystemExit("ordered scale not bitwise equal to the default scale")


def osc_reference(slot, rows, weights, y):
    from moe_overlap.combine.scale import scale_torch
    return scale_torch(slot, rows, weights, y)


if __name__ == "__main__":
    main()
