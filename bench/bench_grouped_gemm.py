"""Benchmark of the producer grouped GEMM against the library grouped GEMM.

    PYTHONPATH=$PWD python bench/bench_grouped_gemm.py [--quick] [--out DIR]

Shapes: total rows T in {16384, 32768}, N=8192, K=2048, E_local in {4, 16, 64} (balanced rows),
plus K=1024 and K=4096 (T=16384, E=16).  For each: our kernel at ccta = 0, 8, 16, 24 (flags on),
the pre-2026-11-30 defaults ("old": band-major order, flags from a consumer warp), other tile
orders (band_group 1 / 2 / 4: "bm", "pb", "g4"; the default is 8; "ex": groups of up to 8 cut
at expert boundaries, group_by="expert", the tables built in each call), each next to its build
without flags (ccta=0; BENCH_CONFIGS=def,g4 picks configs),
and the library: torch._grouped_mm, bmm or per-expert torch.matmul, whichever is fastest.
Bands per expert that do not divide 8 (where fixed groups of 8 span 2-3 experts), e.g. 5:
``BENCH_CONFIGS=def,ex --shapes 20480x2048x32`` (640 rows per expert).  CUDA
events around each call (after a GPU sleep that hides the host's launch path; BENCH_LEAD_MS=0:
calls back to back), warm-up, median of many runs and the p10-p90 spread.  Every input set is
>= 128 MB (several times the 50 MB L2), so inputs are not rotated.  Writes JSON (device, date,
git commit) to --out (default $OUT) and prints a short table last.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_overlap.combine.grouped_gemm import GroupedGemm  # noqa: E402
from moe_overlap.provenance import stamp  # noqa: E402
from moe_overlap.timing import time_interleaved  # noqa: E402

# GPU sleep before each timed call (time_interleaved lead_ms): no host launch time in the events,
# and the GPU near its boost clock; BENCH_LEAD_MS=0 times calls back to back, i.e. in the
# power-limited steady state (the method of the v1-v6 results). Both regimes are reported.
LEAD_MS = float(os.environ.get("BENCH_LEAD_MS", "2.0"))
PEAK_TFLOPS = 790.0  # measured bf16 dense rate on this workplace's H200 (KINDS.md)
DEV = "cuda"


def balanced_bands(T, E, tile_m):
    rows_e = T // E
    assert rows_e % tile_m == 0
    nb = T // tile_m
    b = torch.arange(nb, device=DEV, dtype=torch.int32)
    band_expert = (b // (rows_e // tile_m)).to(torch.int32)
    band_src_row = (b * tile_m).to(torch.int32)
    return band_expert, band_src_row, b.clone(), torch.tensor([nb], dtype=torch.int32, device=DEV)


def library_candidates(x, w, T, E):
    rows_e = T // E
    offs = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * rows_e
    xs = x.view(E, rows_e, -1)
    out = torch.empty(T, w.shape[2], device=DEV, dtype=torch.bfloat16).view(E, rows_e, -1)

    def loop():
        for e in range(E):
            torch.matmul(xs[e], w[e], out=out[e])
        return out
    cands = {"matmul loop": loop, "bmm": lambda: torch.bmm(xs, w, out=out)}
    if hasattr(torch, "_grouped_mm"):
        cands["torch._grouped_mm"] = lambda: torch._grouped_mm(x, w, offs=offs)
    ok = {}
    for name, fn in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
            ok[name] = fn
        except Exception as ex:  # e.g. _grouped_mm unsupported for this layout
            print(f"  library {name} unavailable: {ex!r:.120}")
    return ok


def run_shape(T, N, K, E, configs, rounds):
    """configs: {name: (GroupedGemm kwargs, [ccta...])}."""
    flops = 2.0 * T * N * K
    x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(E, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
    y = torch.empty(T, N, device=DEV, dtype=torch.bfloat16)
    rec = dict(T=T, N=N, K=K, E=E, gflop=flops / 1e9,
               floor_ms=flops / (PEAK_TFLOPS * 1e12) * 1e3,
               bytes_floor_ms=(T * K + E * K * N + T * N) * 2 / 4.8e12 * 1e3, runs=[])
    libs = library_candidates(x, w, T, E)
    ref = (x.view(E, T // E, K).float() @ w.float()).reshape(T, N)
    epoch = torch.ones(1, dtype=torch.int32, device=DEV)
    fns, meta = {}, {}
    for name, (kw, cctas) in configs.items():
        g = GroupedGemm(**kw)
        be, bs, sched, nb = balanced_bands(T, E, g.tile_m)
        ready = torch.zeros(be.numel(), dtype=torch.int32, device=DEV)
        for ccta in cctas:
            fn = (lambda g=g, be=be, bs=bs, sched=sched, nb=nb, ready=ready, ccta=ccta:
                  g(x, w, y, be, bs, sched, nb, ready, epoch, ccta=ccta))
            y.fill_(float("nan"))
            ready.zero_()
            fn()
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            flags_ok = bool((ready == 1).all().item()) if kw.get("signal", True) else None
            key = f"{name}@{ccta}"
            fns[key] = fn
            meta[key] = dict(config=name, ccta=ccta, kwargs={k: v for k, v in kw.items()},
                             rel_err=err, flags_ok=flags_ok)
    for k, fn in libs.items():
        fns["lib:" + k] = fn
    t = time_interleaved(fns, rounds=rounds, lead_ms=LEAD_MS)
    lib_name = min(libs, key=lambda k: t["lib:" + k]["median_ms"])
    lib_t = t["lib:" + lib_name]
    rec["library"] = {k: {kk: vv for kk, vv in t["lib:" + k].items() if kk != "times"} for k in libs}
    rec["lib_best"], rec["lib_ms"] = lib_name, lib_t["median_ms"]
    rec["lib_tflops"] = flops / lib_t["median_ms"] / 1e9
    for key, m in meta.items():
        tt = t[key]
        paired = statistics.median(l / o for l, o in zip(lib_t["times"], tt["times"]))
        r = dict(m, tflops=flops / tt["median_ms"] / 1e9, vs_lib=lib_t["median_ms"] / tt["median_ms"],
                 vs_lib_paired=paired, **{kk: vv for kk, vv in tt.items() if kk != "times"})
        rec["runs"].append(r)
        print(f"  T={T} K={K} E={E} {key:<18} {tt['median_ms']:.3f} ms [{tt['p10_ms']:.3f},"
              f"{tt['p90_ms']:.3f}] {r['tflops']:.0f} TF/s {r['vs_lib']:.3f}x lib (paired "
              f"{paired:.3f}) err={m['rel_err']:.1e} flags={m['flags_ok']}", flush=True)
    print(f"  library {lib_name}: {rec['lib_ms']:.3f} ms {rec['lib_tflops']:.0f} TF/s "
          f"(floor {rec['floor_ms']:.3f} ms); all: " +
          ", ".join(f"{k} {t['lib:' + k]['median_ms']:.3f}" for k in libs), flush=True)
    del x, w, y, ref
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--tag", default="")
    ap.add_argument("--cluster1-all", type=int, default=0, help="time cluster_n=1 at every ccta")
    ap.add_argument("--shapes", default="", help="TxKxE,... (default: the issue's eight shapes)")
    args = ap.parse_args()
    N = 8192
    shapes = [(16384, 2048, 4), (16384, 2048, 16), (16384, 2048, 64),
              (32768, 2048, 4), (32768, 2048, 16), (32768, 2048, 64),
              (16384, 1024, 16), (16384, 4096, 16)]
    if args.quick:
        shapes = shapes[1:2]
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    cctas = [0, 8, 16, 24]
    base = dict(tile_m=128, tile_n=256)
    results = []
    for i, (T, K, E) in enumerate(shapes):
        configs = {
            # "def": the defaults (cluster_n=2 for even N/tile_n, band_group 8, flag_warp)
            "def": (dict(base), cctas),
            "def-noflag": (dict(base, signal=False), [0]),
            # before 2026-11-30: band-major tile order, flags posted by the consumer warp
            "old": (dict(base, band_group=1, flag_warp=False), [0]),
            "old-noflag": (dict(base, band_group=1, signal=False), [0]),
            # other tile orders: band-major, band pairs, groups of 4 (default: groups of 8)
            "bm": (dict(base, band_group=1), [0]),
            "bm-noflag": (dict(base, band_group=1, signal=False), [0]),
            "pb": (dict(base, band_group=2), [0]),
            "pb-noflag": (dict(base, band_group=2, signal=False), [0]),
            "g4": (dict(base, band_group=4), [0]),
            "g4-noflag": (dict(base, band_group=4, signal=False), [0]),
            # groups cut at expert boundaries (the tables' launch included in each call)
            "ex": (dict(base, group_by="expert"), cctas),
            "ex-noflag": (dict(base, group_by="expert", signal=False), [0]),
        }
        if os.environ.get("BENCH_CONFIGS"):  # e.g. "def,g8": those and their no-flag builds
            keep = set(os.environ["BENCH_CONFIGS"].split(","))
            configs = {k: v for k, v in configs.items() if k.removesuffix("-noflag") in keep}
        results.append(run_shape(T, N, K, E, configs, args.rounds))
    doc = dict(bench="grouped_gemm", device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               git_commit=os.environ.get("GIT_COMMIT", "unknown"), torch=torch.__version__,
               peak_tflops_assumed=PEAK_TFLOPS, tag=args.tag, lead_ms=LEAD_MS, shapes=results)
    stamp(doc, "producer", gpus=1, device=doc["device"], commit=os.environ.get("GIT_COMMIT", ""))
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"grouped_gemm_{args.tag or 'bench'}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    # ---- short table last: TFLOP/s per config@ccta, x lib (paired), flag cost
    print(f"\n{doc['device']}  commit {doc['git_commit'][:10]}  -> {path}")
    present = {x["config"] for r in results for x in r["runs"]}
    for cfg in [c for c in ("def", "old", "bm", "pb", "g4", "ex", "sw") if c in present]:
        print(f"[{cfg}] {'T':>6} {'K':>5} {'E':>3} {'lib':>6} {'libTF':>5} | {'c0':>4} {'c8':>4} "
              f"{'c16':>4} {'c24':>4} {'nofl':>4} | {'xlib':>5} {'xlibP':>5} {'flag%':>5}")
        for r in results:
            d = {(x["config"], x["ccta"]): x for x in r["runs"]}
            tf = lambda c, n=cfg: d.get((n, c), {}).get("tflops", float("nan"))
            # flag cost against the kernel without flags (fw has no own no-flag build: same kernel)
            nf_cfg = cfg + "-noflag"
            c0, nf = d.get((cfg, 0), {}), d.get((nf_cfg, 0), {})
            flag = (c0["median_ms"] / nf["median_ms"] - 1) * 100 if c0 and nf else float("nan")
            print(f"[{cfg}] {r['T']:>6} {r['K']:>5} {r['E']:>3} {r['lib_ms']:>6.3f} "
                  f"{r['lib_tflops']:>5.0f} | {tf(0):>4.0f} {tf(8):>4.0f} {tf(16):>4.0f} "
                  f"{tf(24):>4.0f} {tf(0, nf_cfg):>4.0f} | {c0.get('vs_lib', 0):>5.3f} "
                  f"{c0.get('vs_lib_paired', 0):>5.3f} {flag:>5.1f}")
    r = results[min(1, len(results) - 1)]
    print("explore T=%d K=%d E=%d: " % (r["T"], r["K"], r["E"]) + ", ".join(
        f"{x['config']} {x['tflops']:.0f}" for x in r["runs"] if x["ccta"] == 0))


if __name__ == "__main__":
    main()
