"""Benchmark of the producer grouped GEMM against the library grouped GEMM.

    PYTHONPATH=$PWD python bench/bench_grouped_gemm.py [--quick] [--out DIR]

Shapes: total rows T in {16384, 32768}, N=8192, K=2048, E_local in {4, 16, 64} (balanced rows),
plus K=1024 and K=4096 (T=16384, E=16).  For each: our kernel at ccta = 0, 8, 16, 24 (flags on),
the same kernel with the flag epilogue compiled out (ccta=0), and the library: torch._grouped_mm or
per-expert torch.matmul, whichever is faster.  CUDA events around each call, warm-up, median of
many runs and the p10-p90 spread.  Every input set is >= 128 MB (several times the 50 MB L2), so
inputs are not rotated.  Writes JSON (device, date, git commit) to --out (default $OUT) and prints a
short table last.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_overlap.kernels.grouped_gemm import GroupedGemm  # noqa: E402

PEAK_TFLOPS = 790.0  # measured bf16 dense rate on this workplace's H200 (KINDS.md)
DEV = "cuda"


def timeit(fn, warmup=5, reps=30):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for s, e in ev:
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    ts = sorted(s.elapsed_time(e) for s, e in ev)
    q = lambda f: ts[min(len(ts) - 1, int(f * len(ts)))]
    return dict(median_ms=statistics.median(ts), p10_ms=q(0.1), p90_ms=q(0.9), reps=reps)


def balanced_bands(T, E, tile_m):
    rows_e = T // E
    assert rows_e % tile_m == 0
    nb = T // tile_m
    b = torch.arange(nb, device=DEV, dtype=torch.int32)
    band_expert = (b // (rows_e // tile_m)).to(torch.int32)
    band_src_row = (b * tile_m).to(torch.int32)
    return band_expert, band_src_row, b.clone(), torch.tensor([nb], dtype=torch.int32, device=DEV)


def library(x, w, T, E):
    """Returns (name, fn) of the faster library grouped GEMM, and all candidates' timings."""
    rows_e = T // E
    offs = torch.arange(1, E + 1, device=DEV, dtype=torch.int32) * rows_e
    cands = {}
    if hasattr(torch, "_grouped_mm"):
        cands["torch._grouped_mm"] = lambda: torch._grouped_mm(x, w, offs=offs)
    xs = x.view(E, rows_e, -1)
    out = torch.empty(T, w.shape[2], device=DEV, dtype=torch.bfloat16).view(E, rows_e, -1)

    def loop():
        for e in range(E):
            torch.matmul(xs[e], w[e], out=out[e])
        return out
    cands["matmul loop"] = loop
    cands["bmm"] = lambda: torch.bmm(xs, w, out=out)
    res = {}
    for name, fn in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
            res[name] = timeit(fn)
        except Exception as ex:  # e.g. _grouped_mm unsupported for this layout
            res[name] = dict(error=repr(ex)[:200])
    ok = {k: v for k, v in res.items() if "median_ms" in v}
    best = min(ok, key=lambda k: ok[k]["median_ms"])
    return best, cands[best], res


def run_shape(T, N, K, E, configs, reps):
    flops = 2.0 * T * N * K
    x = torch.randn(T, K, device=DEV).to(torch.bfloat16)
    w = (torch.randn(E, K, N, device=DEV) / K ** 0.5).to(torch.bfloat16)
    y = torch.empty(T, N, device=DEV, dtype=torch.bfloat16)
    rec = dict(T=T, N=N, K=K, E=E, gflop=flops / 1e9,
               floor_ms=flops / (PEAK_TFLOPS * 1e12) * 1e3,
               bytes_floor_ms=(T * K + E * K * N + T * N) * 2 / 4.8e12 * 1e3, runs=[])
    lib_name, lib_fn, lib_all = library(x, w, T, E)
    ref = lib_fn().reshape(T, N).float()
    rec["library"] = dict(best=lib_name, all=lib_all)
    lib_ms = lib_all[lib_name]["median_ms"]
    rec["lib_ms"] = lib_ms
    rec["lib_tflops"] = flops / lib_ms / 1e9
    epoch = torch.ones(1, dtype=torch.int32, device=DEV)
    for (tile_m, tile_n, stages, signal, cfg_cctas) in configs:
        g = GroupedGemm(tile_m=tile_m, tile_n=tile_n, stages=stages, signal=signal)
        be, bs, sched, nb = balanced_bands(T, E, tile_m)
        ready = torch.zeros(be.numel(), dtype=torch.int32, device=DEV)
        for ccta in cfg_cctas:
            fn = lambda: g(x, w, y, be, bs, sched, nb, ready, epoch, ccta=ccta)
            y.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            t = timeit(fn, reps=reps)
            r = dict(tile_m=tile_m, tile_n=tile_n, stages=stages, signal=signal, ccta=ccta,
                     rel_err_vs_lib=err, flags_ok=bool((ready == 1).all().item()) if signal else None,
                     tflops=flops / t["median_ms"] / 1e9, vs_lib=lib_ms / t["median_ms"], **t)
            rec["runs"].append(r)
            print(f"  T={T} K={K} E={E} {tile_m}x{tile_n} st={stages} sig={int(signal)} "
                  f"ccta={ccta}: {t['median_ms']:.3f} ms [{t['p10_ms']:.3f},{t['p90_ms']:.3f}] "
                  f"{r['tflops']:.0f} TF/s  {r['vs_lib']:.3f}x lib  err={err:.1e}", flush=True)
    print(f"  library {lib_name}: {lib_ms:.3f} ms {rec['lib_tflops']:.0f} TF/s "
          f"(floor {rec['floor_ms']:.3f} ms)", flush=True)
    del x, w, y
    torch.cuda.empty_cache()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    N = 8192
    shapes = [(16384, 2048, 4), (16384, 2048, 16), (16384, 2048, 64),
              (32768, 2048, 4), (32768, 2048, 16), (32768, 2048, 64),
              (16384, 1024, 16), (16384, 4096, 16)]
    if args.quick:
        shapes = shapes[1:2]
    cctas = [0, 8, 16, 24]
    results = []
    for i, (T, K, E) in enumerate(shapes):
        configs = [(128, 256, None, True, cctas), (128, 256, None, False, [0])]
        if i == 1:  # tile-shape / depth exploration on one shape, ccta=0
            configs += [(128, 128, None, True, [0]), (64, 256, None, True, [0]),
                        (128, 256, 3, True, [0])]
        results.append(run_shape(T, N, K, E, configs, args.reps))
    doc = dict(bench="grouped_gemm", device=torch.cuda.get_device_name(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               git_commit=os.environ.get("GIT_COMMIT", "unknown"), torch=torch.__version__,
               peak_tflops_assumed=PEAK_TFLOPS, tag=args.tag, shapes=results)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"grouped_gemm_{args.tag or 'bench'}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    # ---- short table last
    print(f"\n{doc['device']}  commit {doc['git_commit'][:10]}  -> {path}")
    print(f"{'T':>6} {'K':>5} {'E':>3} {'floor':>6} {'lib':>6} {'lib TF':>6} | "
          f"{'c0':>5} {'c8':>5} {'c16':>5} {'c24':>5} {'noflag':>6} | {'x lib':>5} {'flag%':>5}")
    for r in results:
        d = {(x['tile_m'], x['tile_n'], x['stages'], x['signal'], x['ccta']): x for x in r["runs"]}
        tf = lambda c, s=True: d.get((128, 256, None, s, c), {}).get("tflops", float("nan"))
        c0 = d.get((128, 256, None, True, 0), {})
        nf = d.get((128, 256, None, False, 0), {})
        flag = (c0.get("median_ms", 0) / nf.get("median_ms", 1) - 1) * 100 if nf else float("nan")
        print(f"{r['T']:>6} {r['K']:>5} {r['E']:>3} {r['floor_ms']:>6.3f} {r['lib_ms']:>6.3f} "
              f"{r['lib_tflops']:>6.0f} | {tf(0):>5.0f} {tf(8):>5.0f} {tf(16):>5.0f} {tf(24):>5.0f} "
              f"{tf(0, False):>6.0f} | {c0.get('vs_lib', float('nan')):>5.3f} {flag:>5.1f}")


if __name__ == "__main__":
    main()
