"""The producer grouped GEMM on the plan's layouts (aligned, packed) against the library on the
same rows unpadded, for fine-grained MoE routings (one GPU).

    PYTHONPATH=$PWD python bench/bench_packed_gemm.py [--out DIR] [--models a,b] [--worlds 2,8,16]

Per (model, W, router mode): routing counts are generated for all W ranks (4096 tokens each),
rank 0's plan is built in both layouts, and one GPU runs
  - ours: `GroupedGemm` (its defaults, ccta=0, band flags on) over the plan's bands and schedule,
    input rows scattered into the plan layout (padding rows zero);
  - library: `torch._grouped_mm` on the same valid rows, compact (expert-major, no padding).
Each is captured in a CUDA graph and its replays timed the same way (time_interleaved: rounds
interleaved, a GPU sleep before each call). Correct first: outputs poisoned with NaN before the
checked call, fresh random inputs per point; every valid row of both layouts must be bitwise
equal to each other, within 1e-2 of the library, and, for a few experts, of an fp32 reference.
JSON (device, date, commit) to --out.
"""
import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_overlap.combine.plan import plan_combine  # noqa: E402
from moe_overlap.combine.shapes import MODELS  # noqa: E402
from moe_overlap.provenance import stamp  # noqa: E402
from moe_overlap.routing import routing_counts  # noqa: E402

PEAK_TFLOPS = 790.0  # measured bf16 dense rate of this workplace's H200
LEAD_MS = 2.0


def layout_rows(plan, counts):
    """Row of each valid (expert, source, j) row in the plan layout, in compact order (local
    expert major, then source ascending, then arrival order): x_plan[layout_rows] = x_compact."""
    W, El, rank = plan.world_size, plan.experts_per_rank, plan.rank
    local = counts[:, rank * El:(rank + 1) * El].t().contiguous().long()  # [El, W]
    n = local.reshape(-1)
    blk = torch.repeat_interleave(torch.arange(n.numel()), n)
    j = torch.arange(blk.numel()) - (torch.cumsum(n, 0) - n)[blk]
    e, s = blk // W, blk % W
    start = plan.expert_row_start.cpu().long()[e] + plan.group_row_start.cpu().long()[e, s]
    return start + j


def run_point(model, W, mode, tokens, gemm, rounds, seed):
    from moe_overlap.timing import graphed, time_interleaved
    E, topk, K, N = MODELS[model]
    El = E // W
    dev = torch.device("cuda")
    counts = routing_counts(W, tokens, E, topk, mode, seed)
    rows_e = counts[:, :El].sum(0)
    n_valid = int(rows_e.sum())
    gen = torch.Generator(device=dev).manual_seed(seed)
    x_c = torch.randn(n_valid, K, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(El, K, N, device=dev, generator=gen) / K ** 0.5).to(torch.bfloat16)
    offs = torch.cumsum(rows_e, 0).to(torch.int32).to(dev)
    rec = dict(model=model, world_size=W, mode=mode, tokens_per_rank=tokens, E=E, topk=topk,
               K=K, N=N, experts_per_rank=El, valid_rows=n_valid,
               floor_ms=2.0 * n_valid * K * N / (PEAK_TFLOPS * 1e12) * 1e3,
               bytes_floor_ms=(n_valid * (K + N) + El * K * N) * 2 / 4.8e12 * 1e3)
    lib_out = {}

    def lib():
        lib_out["y"] = torch._grouped_mm(x_c, w, offs=offs)
    fns = {"library": lib}
    ys, idx = {}, {}
    epoch = torch.ones(1, dtype=torch.int32, device=dev)
    for layout in ("aligned", "packed"):
        plan = plan_combine(counts.to(dev), 0, tile_m=gemm.tile_m, layout=layout)
        rows = int(plan.total_rows.item())
        idx[layout] = layout_rows(plan, counts).to(dev)
        x = torch.zeros(rows, K, device=dev, dtype=torch.bfloat16)
        x[idx[layout]] = x_c
        y = torch.full((rows, N), float("nan"), device=dev, dtype=torch.bfloat16)
        ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
        ys[layout] = y
        fns[layout] = (lambda x=x, y=y, p=plan, ready=ready:
                       gemm(x, w, y, p.band_expert, p.band_src_row, p.schedule, p.num_bands,
                            ready, epoch, ccta=0))
        rec[f"{layout}_rows"] = rows
        rec[f"{layout}_padding"] = rows / max(n_valid, 1)
        rec[f"{layout}_bands"] = int(plan.num_bands.item())
        if layout == "packed":
            # the same bands in expert order (plan_combine(order="expert"): stacked row order),
            # not remote-first: each expert's bands run together, its weights read about once
            nb = rec["packed_bands"]
            by_expert = plan_combine(counts.to(dev), 0, tile_m=gemm.tile_m, layout=layout,
                                     order="expert").schedule
            ye = torch.full((rows, N), float("nan"), device=dev, dtype=torch.bfloat16)
            ready_e = torch.zeros_like(ready)
            ys["packed_expert_order"], idx["packed_expert_order"] = ye, idx[layout]
            fns["packed_expert_order"] = (
                lambda x=x, y=ye, p=plan, s=by_expert, ready=ready_e:
                gemm(x, w, y, p.band_expert, p.band_src_row, s, p.num_bands, ready, epoch,
                     ccta=0))
            rec["packed_local_only_bands"] = int(
                (plan.band_dest[plan.schedule[:nb].long()] == plan.rank).sum())
    # ---- correctness (poisoned outputs, one call each) ----------------------------------------
    for layout in ys:
        ys[layout].fill_(float("nan"))
        fns[layout]()
    lib()
    torch.cuda.synchronize()
    ref_lib = lib_out["y"].float()
    got = {lay: ys[lay][idx[lay]] for lay in ys}
    rec["bitwise_packed_vs_aligned"] = bool(torch.equal(got["aligned"].view(torch.int16),
                                                        got["packed"].view(torch.int16)))
    rec["bitwise_expert_order_vs_packed"] = bool(torch.equal(
        got["packed_expert_order"].view(torch.int16), got["packed"].view(torch.int16)))
    for lay, g in got.items():
        rec[f"{lay}_finite"] = bool(torch.isfinite(g.float()).all())
        rec[f"{lay}_err_vs_library"] = float((g.float() - ref_lib).norm()
                                             / ref_lib.norm().clamp_min(1e-30))
    start = torch.cumsum(rows_e, 0) - rows_e
    errs = []
    for e in sorted({0, El // 2, El - 1}):
        a, n = int(start[e]), int(rows_e[e])
        if n:
            ref = x_c[a:a + n].float() @ w[e].float()
            errs.append(float((got["packed"][a:a + n].float() - ref).norm()
                              / ref.norm().clamp_min(1e-30)))
    rec["packed_err_vs_fp32"] = max(errs) if errs else 0.0
    rec["correct"] = (rec["bitwise_packed_vs_aligned"] and rec["packed_finite"]
                      and rec["aligned_finite"] and rec["packed_err_vs_library"] < 1e-2
                      and rec["packed_err_vs_fp32"] < 1e-2
                      and rec["bitwise_expert_order_vs_packed"])
    # ---- timing: CUDA graph replays, interleaved -------------------------------------------
    graphs = {k: graphed(f) for k, f in fns.items()}
    t = time_interleaved({k: g.replay for k, g in graphs.items()}, rounds=rounds,
                         lead_ms=LEAD_MS)
    flops = 2.0 * n_valid * K * N
    for k, v in t.items():
        rec[f"{k}_ms"] = v["median_ms"]
        rec[f"{k}_p10_ms"], rec[f"{k}_p90_ms"] = v["p10_ms"], v["p90_ms"]
        rec[f"{k}_tflops"] = flops / v["median_ms"] / 1e9
    for lay in ys:
        rec[f"{lay}_vs_library"] = rec["library_ms"] / rec[f"{lay}_ms"]
        rec[f"{lay}_vs_library_paired"] = sorted(
            a / b for a, b in zip(t["library"]["times"], t[lay]["times"]))[rounds // 2]
    print(f"{model:<16} W={W:<2} {mode:<13} rows {n_valid:>6} pad aligned "
          f"{rec['aligned_padding']:.2f} packed {rec['packed_padding']:.3f} | lib "
          f"{rec['library_ms']:.3f} ms aligned {rec['aligned_ms']:.3f} ({rec['aligned_vs_library']:.3f}x)"
          f" packed {rec['packed_ms']:.3f} ({rec['packed_vs_library']:.3f}x) expert order "
          f"{rec['packed_expert_order_ms']:.3f} ({rec['packed_expert_order_vs_library']:.3f}x)"
          " | correct "
          f"{rec['correct']}", flush=True)
    del graphs, fns, ys, x_c, w, lib_out
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder of the JSON")
    ap.add_argument("--models", default="deepseek-v3,qwen3-235b-a22b,qwen3-30b-a3b",
                    help=f"comma-separated, from {sorted(MODELS)}")
    ap.add_argument("--worlds", default="2,8,16", help="world sizes W of the plans")
    ap.add_argument("--modes", default="balanced,moderate_skew", help="router modes")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--rounds", type=int, default=20, help="timed rounds per point")
    ap.add_argument("--tag", default="h200", help="suffix of the JSON name")
    ap.add_argument("--tile-m", type=int, default=128, choices=(64, 128),
                    help="the plan's and the producer's tile height")
    args = ap.parse_args()
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    gemm = GroupedGemm(tile_m=args.tile_m, tile_n=256)
    points = []
    for model in args.models.split(","):
        if model not in MODELS:
            ap.error(f"--models: unknown model {model!r}; choose from {sorted(MODELS)}")
        for W in (int(v) for v in args.worlds.split(",")):
            for i, mode in enumerate(args.modes.split(",")):
                points.append(run_point(model, W, mode, args.tokens, gemm, args.rounds,
                                        seed=1 + i))
    doc = dict(bench="packed_gemm", device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               git_commit=os.environ.get("GIT_COMMIT", "unknown"), torch=torch.__version__,
               gemm=dict(tile_m=args.tile_m, tile_n=256, ccta=0, signal=True), lead_ms=LEAD_MS,
               rounds=args.rounds, points=points)
    stamp(doc, "packed", gpus=1, device=doc["device"], commit=os.environ.get("GIT_COMMIT", ""))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"packed_gemm_{args.tag}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {path}; all correct: {all(p['correct'] for p in points)}")
    return 0 if all(p["correct"] for p in points) else 1


if __name__ == "__main__":
    sys.exit(main())
