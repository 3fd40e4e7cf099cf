"""Where the time of the fused FFN compute kernel goes (issue 5), one GPU.

    python bench/bench_fused_compute.py [--shapes llama3-8b,deepseek-v3-expert] [--tokens 8192]
        [--rounds 20] [--out DIR]

Per shape (the rank-0 slice of bench_ffn.py's shapes at G = 2: x [T, P], w1 [P, O/2], w2 [O/2, P]),
interleaved CUDA-event timing, median:
- ``torch``: addmm(b1) + act1 + mm (cuBLAS, bf16 out): the GEMM rate the kernel competes with;
- ``tma256``: FusedFFNCompute's defaults (tile_o 256, H in registers as GEMM2's A operand, one
  operand ring of 4 stages, TMA reduce-add epilogue in 32-column sub-tiles x 2 buffers);
  ``tma256_c2``: clusters of two CTAs on adjacent m-tiles sharing W1 / W2 by TMA multicast;
  ``tma256_s3e32x4`` / ``tma256_e16``: other ring / epilogue shapes; ``tma256_pair*``: two
  hidden tiles per unit (h_pair: half the reduce-add bytes); ``tma128``: tile_o 128;
  ``tma256_half_grid``: on half the SMs (time nearly unchanged = a shared resource such as the
  L2's reduction rate is the limit; time doubled = per-SM work is); ``tma256_m64``: tile_m = 64;
- diagnostics (wrong results; ``diag_compute``: a FusedFFNCompute whose kernel is a
  FusedFFNKernel subclass with its timing-split attributes set, nothing of it in the product
  constructor): ``tma256_plain`` plain TMA stores instead of reduce-adds (the cost of the L2
  read-modify-write); ``tma256_gemm1_only`` / ``tma256_gemm2_only``: GEMM2 (its W2 stages, MMAs
  and reductions) or GEMM1's k loop left out; ``tma256_noepi`` / ``tma256_gemm2_noepi``:
  GEMM2's reductions left out (how the time splits between phases).
The variants that lost and were removed from the kernel (H through shared memory ``v4*``, the
register epilogue ``red256``) are in git history and bench/NOTES.md, session 10.
The reduce-add traffic is T * N * 4 * O_g / tile_o bytes; the table gives its rate per variant.
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_ffn import SHAPES  # noqa: E402

DIAG_SKIPS = (None, "gemm1", "gemm2", "epilogue", "gemm1+epilogue")
_DIAG_KERNELS = {}


def diag_compute(skip=None, plain_store=False, **options):
    """A FusedFFNCompute(**options) whose kernel leaves a phase out (benchmarks only, wrong
    results): skip "gemm1" / "gemm2" drops that GEMM's stages and work on both sides of the
    ring, "epilogue" GEMM2's reductions, "gemm1+epilogue" both; plain_store replaces the
    reduce-add by a plain TMA store."""
    from moe_overlap.ffn.compute_reduce import FusedFFNCompute
    if skip not in DIAG_SKIPS:
        raise ValueError(f"skip must be one of {DIAG_SKIPS}, got {skip!r}")
    key = (skip, bool(plain_store))
    if key not in _DIAG_KERNELS:
        from moe_overlap.ffn.compute_reduce_sm90 import FusedFFNKernel
        attrs = dict(skip_gemm1=skip in ("gemm1", "gemm1+epilogue"), skip_gemm2=skip == "gemm2",
                     skip_epi=skip in ("epilogue", "gemm1+epilogue"),
                     plain_store=bool(plain_store))
        name = "DiagFusedFFNKernel_" + "".join(c if c.isalnum() else "_" for c in
                                               f"{skip}_{int(bool(plain_store))}")
        _DIAG_KERNELS[key] = type(name, (FusedFFNKernel,), attrs)
    kernel_class = _DIAG_KERNELS[key]

    class DiagFusedFFNCompute(FusedFFNCompute):
        def _kernel_class(self):
            return kernel_class

    return DiagFusedFFNCompute(**options)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-8b,deepseek-v3-expert")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--act1", default="gelu")
    ap.add_argument("--lead-ms", type=float, default=2.0,
                    help="GPU sleep before each timed call (hides the host's launch path)")
    ap.add_argument("--variants", default="", help="comma-separated subset of the variants")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    from moe_overlap.ffn.activations import activation_
    from moe_overlap.ffn.compute_reduce import FusedFFNCompute, fused_ffn_compute_reference
    from moe_overlap.timing import time_interleaved
    dev = torch.device("cuda", 0)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    variants = {  # name: (FusedFFNCompute options, ccta)
        # default: H in registers (GEMM2 as WGMMA RS), 4 ring stages, 32-column epilogue x 2
        "tma256": (dict(), 0),
        "tma256_c2": (dict(cluster_m=2), 0),  # clusters of 2, W1 / W2 multicast
        "tma256_s3e32x4": (dict(stages=3, epi_n=32, epi_stages=4), 0),
        "tma256_e16": (dict(epi_n=16), 0),
        # two hidden tiles per unit (half the reduce-add bytes; 3 stages, 16 columns x 2)
        "tma256_pair": (dict(h_pair=True), 0),
        "tma256_pair_c2": (dict(h_pair=True, cluster_m=2), 0),
        "tma256_pair_s2e32x4": (dict(h_pair=True, stages=2, epi_n=32, epi_stages=4), 0),
        "tma256_pair_noepi": (dict(h_pair=True, _skip="epilogue"), 0),
        "tma128": (dict(tile_o=128), 0),
        "tma256_half_grid": (dict(), sms // 2),
        "tma256_m64": (dict(tile_m=64), 0),
        # diagnostics (wrong results): plain TMA stores instead of reduce-adds; the kernel
        # without GEMM2 / without GEMM1's k loop / without GEMM2's reductions
        "tma256_plain": (dict(_plain=True), 0),
        "tma256_gemm1_only": (dict(_skip="gemm2"), 0),
        "tma256_gemm2_only": (dict(_skip="gemm1"), 0),
        "tma256_noepi": (dict(_skip="epilogue"), 0),
        "tma256_gemm2_noepi": (dict(_skip="gemm1+epilogue"), 0),
    }
    if a.variants:
        variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
    rows = []
    for name in a.shapes.split(","):
        P, O = SHAPES[name]
        T, N, Ol = a.tokens, P, O // 2
        g = torch.Generator(device=dev).manual_seed(0)
        bf = dict(dtype=torch.bfloat16, device=dev)
        x = torch.randn(T, P, generator=g, **bf)
        w1 = torch.randn(P, Ol, generator=g, **bf) * P ** -0.5
        b1 = torch.randn(Ol, generator=g, **bf) * 0.1
        w2 = torch.randn(Ol, N, generator=g, **bf) * Ol ** -0.5
        acc = torch.zeros(T, N, dtype=torch.float32, device=dev)
        epoch = torch.ones(1, dtype=torch.int32, device=dev)
        fns = {}

        def torch_ffn():
            h = activation_(torch.addmm(b1, x, w1), a.act1)
            return torch.mm(h, w2)
        fns["torch"] = torch_ffn
        errs, tile_o = {}, {}
        for vname, (kw, ccta) in variants.items():
            diag = dict(skip=kw.get("_skip"), plain_store=kw.get("_plain", False))
            opts = {k: v for k, v in kw.items() if k not in ("_skip", "_plain")}
            comp = (diag_compute(**diag, **opts) if diag["skip"] or diag["plain_store"]
                    else FusedFFNCompute(**opts))
            tile_o[vname] = comp.tile_o
            ready = torch.zeros(-(-T // comp.band_rows), dtype=torch.int32, device=dev)
            if not (diag["skip"] or diag["plain_store"]):  # real variants, once
                acc.zero_()
                comp(x, w1, b1, w2, acc, ready, epoch, ccta=ccta, act1=a.act1)
                ref = fused_ffn_compute_reference(x[:512], w1, b1, w2, a.act1)
                errs[vname] = ((acc[:512] - ref).norm() / ref.norm()).item()
            fns[vname] = (lambda comp=comp, ready=ready, ccta=ccta:
                          comp(x, w1, b1, w2, acc, ready, epoch, ccta=ccta, act1=a.act1))
        res = time_interleaved(fns, 3, a.rounds, lead_ms=a.lead_ms)
        flops = 4 * T * P * Ol
        red_bytes = {v: T * N * 4 * Ol / tile_o[v] for v in variants}
        row = dict(shape=name, T=T, P=P, O_local=Ol, N=N, errors=errs, times=res)
        row["ms"] = {k: res[k]["median_ms"] for k in res}
        row["tflops"] = {k: flops / (v * 1e-3) / 1e12 for k, v in row["ms"].items()}
        row["reduce_TBs"] = {k: red_bytes[k] / (row["ms"][k] * 1e-3) / 1e12 for k in variants}
        rows.append(row)
        torch.cuda.empty_cache()
    out = a.out or os.environ.get("OUT") or os.path.join(os.path.dirname(
        os.path.abspath(__file__)), "results")
    os.makedirs(out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(dev), sms=sms, commit=os.environ.get(
        "GIT_COMMIT"), date=datetime.datetime.now(datetime.timezone.utc).isoformat())
    with open(os.path.join(out, "bench_fused_compute.json"), "w") as f:
        json.dump(dict(meta=meta, results=rows), f, indent=1)
    names = ["torch"] + list(variants)
    print(f"{'shape':20s} " + " ".join(f"{n:>16s}" for n in names))
    for r in rows:
        print(f"{r['shape']:20s} " + " ".join(
            f"{r['ms'][n]:7.3f}ms{r['tflops'][n]:5.0f}TF" for n in names))
        print(f"{'  reduce TB/s, err':20s} {'':16s} " + " ".join(
            f"{r['reduce_TBs'][n]:7.2f} {r['errors'].get(n, float('nan')):8.1e}"
            for n in variants))
    return 0


if __name__ == "__main__":
    sys.exit(main())
