"""The chained FFN kernel's grouped call (ShardedExperts' compute, compute="chained") against
torch's grouped GEMMs on the same rows unpadded, one GPU.

    PYTHONPATH=$PWD python bench/bench_chained_grouped.py [--shapes a,b] [--rows 8192,32768]

Per expert shape (the G = 2 slice of each expert: x [R, P], w1 [E, P, O/G], w2 [E, O/G, P]) and
routed row count R: expert row counts drawn at random (a multinomial over E experts, one seeded
draw per point, so some experts get more rows than others), then
  - ours: ``ChainedFFNCompute.grouped`` on the rows laid out as ShardedExperts lays them out
    (each expert's rows padded to 128, ``padded_expert_layout``; padding rows zero);
  - library: ``torch._grouped_mm(x, w1, offs)``, act in place, ``torch._grouped_mm(h, w2, offs)``
    on the same rows compact (the reference backend's best library form; no bias, as
    ShardedExperts' default).
Both in CUDA graphs of --reps calls, replays timed in shuffled order per round
(moe_overlap.timing.time_interleaved), median ms per call. Correct first: ours' output poisoned
with NaN before the checked call; every valid row against the library's within 2e-2 (both bf16 H)
and a few rows of every expert against float64. JSON ``ffn_chained_grouped_<tag>.json``.
"""
import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_chained_compute import graph_of  # noqa: E402
from bench_results import result_header, write_result  # noqa: E402
from moe_overlap.ffn.activations import activation, activation_  # noqa: E402
from moe_overlap.ffn.compute_chained import ChainedFFNCompute  # noqa: E402
from moe_overlap.ffn.layers import padded_expert_layout  # noqa: E402
from moe_overlap.ffn.shapes import FFN_SHAPES  # noqa: E402
from moe_overlap.timing import time_interleaved  # noqa: E402

# experts of each expert shape's layer (the models' counts, or a local share of them)
EXPERTS = {"mixtral-8x7b-expert": 8, "llama4-scout-expert": 16, "deepseek-v3-expert": 32}


def point(name, E, R, world, act, reps, rounds, seed, comp, dev):
    P, O = FFN_SHAPES[name]
    Og = O // world
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = torch.multinomial(torch.ones(E), R, replacement=True, generator=g)
    counts = torch.bincount(rows, minlength=E).tolist()
    gd = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(R, P, device=dev, dtype=torch.bfloat16, generator=gd)
    w1 = (torch.randn(E, P, Og, device=dev, generator=gd) / P ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, Og, P, device=dev, generator=gd) / Og ** 0.5).to(torch.bfloat16)
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32).to(dev)
    dst, tile_expert, _, R_pad = padded_expert_layout(counts, comp.tile_m, dev)
    x_pad = torch.zeros(R_pad, P, device=dev, dtype=torch.bfloat16)
    x_pad.index_copy_(0, dst, x)
    y_pad = torch.empty(R_pad, P, device=dev, dtype=torch.bfloat16)

    def ours():
        return comp.grouped(x_pad, w1, None, w2, out=y_pad, block_expert=tile_expert, act1=act)

    def library():
        h = activation_(torch._grouped_mm(x, w1, offs=offs), act)
        return torch._grouped_mm(h, w2, offs=offs)

    rec = dict(shape=name, experts=E, rows=R, P=P, hidden_slice=Og, N=P, act=act,
               padded_rows=R_pad, padding=R_pad / R, min_expert_rows=min(counts),
               max_expert_rows=max(counts))
    y_pad.fill_(float("nan"))
    ours()
    comp.check()
    got = y_pad.index_select(0, dst).float()
    ref = library().float()
    rec["finite"] = bool(torch.isfinite(got).all())
    rec["err_vs_library"] = float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    errs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            sel = slice(start, start + min(n, 4))
            t = activation(x[sel].double() @ w1[e].double(), act) @ w2[e].double()
            errs.append(float((got[sel].double() - t).abs().max() / t.abs().max()))
        start += n
    rec["err_vs_float64"] = max(errs)
    rec["correct"] = rec["finite"] and rec["err_vs_library"] < 2e-2 and rec["err_vs_float64"] < 8e-3
    graphs = {"ours": graph_of(ours, reps), "library": graph_of(library, reps)}
    t = time_interleaved({k: gr.replay for k, gr in graphs.items()}, warmup=2, rounds=rounds,
                         shuffle_seed=seed)
    comp.check()
    flops = 2.0 * R * P * Og * 2
    for k in graphs:
        rec[f"{k}_ms"] = t[k]["median_ms"] / reps
        rec[f"{k}_tflops"] = flops / rec[f"{k}_ms"] / 1e9
    rec["speedup"] = rec["library_ms"] / rec["ours_ms"]
    rec["floor_ms"] = flops / 790e12 * 1e3
    print(f"{name:22s} E={E:3d} R={R:6d} pad {rec['padding']:.3f} | library {rec['library_ms']:.3f}"
          f" ms ({rec['library_tflops']:.0f} TF/s) ours {rec['ours_ms']:.3f} ms "
          f"({rec['ours_tflops']:.0f} TF/s) x{rec['speedup']:.3f} | err lib "
          f"{rec['err_vs_library']:.1e} f64 {rec['err_vs_float64']:.1e} correct {rec['correct']}",
          flush=True)
    return rec


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=",".join(EXPERTS), help=f"from {sorted(EXPERTS)}")
    ap.add_argument("--rows", default="8192,32768", help="routed rows per point")
    ap.add_argument("--world", type=int, default=2, help="G: each expert's hidden slice is O / G")
    ap.add_argument("--act", default="gelu")
    ap.add_argument("--reps", type=int, default=5, help="calls per CUDA graph")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args()
    dev = torch.device("cuda")
    comp = ChainedFFNCompute()
    recs = []
    for name in a.shapes.split(","):
        if name not in EXPERTS:
            ap.error(f"--shapes: unknown {name!r}; choose from {sorted(EXPERTS)}")
        for R in (int(r) for r in a.rows.split(",")):
            try:
                recs.append(point(name, EXPERTS[name], R, a.world, a.act, a.reps, a.rounds,
                                  seed=R + EXPERTS[name], comp=comp, dev=dev))
            except Exception as e:  # noqa: BLE001 - record and go on
                recs.append(dict(shape=name, rows=R, error=f"{type(e).__name__}: {e}",
                                 traceback=traceback.format_exc()))
                print(f"{name:22s} R={R:6d} FAILED: {recs[-1]['error']}", flush=True)
            torch.cuda.empty_cache()
    ok = [r for r in recs if "speedup" in r]
    doc = dict(result_header("ffn_chained_grouped"), world=a.world, act=a.act,
               method=f"CUDA graphs of {a.reps} calls per path, replays interleaved over "
                      f"{a.rounds} rounds in shuffled order, median / {a.reps}; ours on the "
                      "rows padded per expert to 128, the library (torch._grouped_mm, act, "
                      "torch._grouped_mm) on the same rows unpadded",
               all_correct=all(r.get("correct", False) for r in recs),
               min_speedup=min((r["speedup"] for r in ok), default=None), rows=recs)
    path = write_result(doc, a.out, f"ffn_chained_grouped_{a.tag}.json")
    print(f"all correct {doc['all_correct']}; min speedup {doc['min_speedup']}; wrote {path}")
    return 0 if doc["all_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
