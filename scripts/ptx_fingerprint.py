"""PTX of every product kernel in its default variants, for "this move changed no code" checks.

    CUTE_DSL_ARCH=sm_90a python scripts/ptx_fingerprint.py --out DIR        # write DIR/<name>.ptx
    python scripts/ptx_fingerprint.py --compare DIR_A DIR_B                 # exit 1 on a difference

Compiles for sm_90a without a GPU. The PTX is normalized before writing: `.file` / `.loc`
debug lines and the kernel entry names carry source paths (CuTe DSL mangles the module path into
the kernel's name), which move with the code without changing it; everything else is compared
byte for byte.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")


def _mod(*names):
    """The first importable of the module names (the same kernel before and after a move)."""
    for n in names:
        try:
            return importlib.import_module(n)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(f"none of {names}")


def _keep(launch, *args):
    import cutlass.cute as cute
    return cute.compile[cute.KeepPTX()](launch, *args).__ptx__


def _nvshmem_consumer(cons):
    try:
        import torch
        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    if not gpu:
        cons.use_sm90_nvshmem_bitcode()
    return _keep(cons.build_consumer("nvshmem"), *cons.consumer_example_args())


def variants():
    """name -> zero-argument function returning the PTX text."""
    gg = lambda: _mod("moe_overlap.combine.grouped_gemm", "moe_overlap.kernels.grouped_gemm")
    ffn = lambda: _mod("moe_overlap.ffn.compute_reduce", "moe_overlap.kernels.fused_ffn")
    ar = lambda: _mod("moe_overlap.ffn.band_allreduce", "moe_overlap.kernels.switch")
    cons = lambda: _mod("moe_overlap.combine.consumer", "moe_overlap.kernels.consumer")
    sc = lambda: _mod("moe_overlap.combine.scale", "moe_overlap.kernels.scale")
    pk = lambda: _mod("moe_overlap.combine.plan_kernel")
    rt = lambda: _mod("moe_overlap.combine.routes")
    ch = lambda: _mod("moe_overlap.ffn.compute_chained")
    G = lambda **kw: gg().GroupedGemm(**kw)
    C = lambda **kw: ch().ChainedFFNCompute(**kw)
    F = lambda **kw: ffn().FusedFFNCompute(**kw)
    return {
        # producer: OverlapCombine's choices (tile_n the largest of 256 / 128 / 64 dividing N,
        # clusters of 2 alone where N/tile_n is even, of 1 beside the consumer), flags on / off
        "grouped_gemm_default": lambda: G().compile(N=1024, K=512, keep_ptx=True).__ptx__,
        "grouped_gemm_tm64_c1": lambda: G(tile_m=64, cluster_n=1).compile(
            N=1024, K=512, keep_ptx=True).__ptx__,
        "grouped_gemm_tm128_c1": lambda: G(cluster_n=1).compile(N=1024, K=512,
                                                                keep_ptx=True).__ptx__,
        "grouped_gemm_tm64_c2": lambda: G(tile_m=64).compile(N=1024, K=512,
                                                             keep_ptx=True).__ptx__,
        "grouped_gemm_tn128_odd": lambda: G(tile_n=128).compile(N=384, K=256,
                                                                keep_ptx=True).__ptx__,
        "grouped_gemm_tn64_tm64": lambda: G(tile_m=64, tile_n=64).compile(
            N=128, K=256, keep_ptx=True).__ptx__,
        "grouped_gemm_noflag": lambda: G(signal=False).compile(N=1024, K=512,
                                                               keep_ptx=True).__ptx__,
        "grouped_gemm_noflag_c1": lambda: G(signal=False, cluster_n=1).compile(
            N=1024, K=512, keep_ptx=True).__ptx__,
        # non-default tuning knobs in one build (flag post by the consumer warp, at the last k
        # tile, 64-column epilogue sub-tiles, band-major order)
        "grouped_gemm_knobs": lambda: G(flag_warp=False, signal_k_tile=-1, epi_n=64,
                                        epi_stages=2, band_group=1).compile(
            N=1024, K=512, keep_ptx=True).__ptx__,
        # fused FFN compute: the kernel's default (H in registers), the layers' default h_pair
        # (O/G a multiple of 2 tile_o), tile_o 128 where 256 does not divide O/G, tile_m 64, each
        # activation, clusters of 2 (dense option); dense and grouped calls compile one kernel
        "fused_ffn_default": lambda: F().compile(
            P=256, O=1024, N=256, act1="gelu", keep_ptx=True).__ptx__,
        "fused_ffn_pair_gelu": lambda: F(h_pair=True).compile(
            P=256, O=1024, N=256, act1="gelu", keep_ptx=True).__ptx__,
        "fused_ffn_pair_silu_tm64": lambda: F(tile_m=64, h_pair=True).compile(
            P=256, O=1024, N=256, act1="silu", keep_ptx=True).__ptx__,
        "fused_ffn_to128_relu": lambda: F(tile_o=128).compile(
            P=256, O=384, N=256, act1="relu", keep_ptx=True).__ptx__,
        "fused_ffn_to128_pair_gelu_tanh": lambda: F(tile_o=128, h_pair=True).compile(
            P=256, O=512, N=256, act1="gelu_tanh", keep_ptx=True).__ptx__,
        "fused_ffn_pair_c2": lambda: F(h_pair=True, cluster_m=2).compile(
            P=256, O=1024, N=256, act1="gelu", keep_ptx=True).__ptx__,
        "fused_ffn_knobs": lambda: F(stages=3, epi_n=16, epi_stages=4, signal_k_tile=2).compile(
            P=512, O=512, N=256, act1="relu", keep_ptx=True).__ptx__,
        # chained FFN compute (one kernel for every group: the tile order is a runtime table):
        # the default (gelu, b1), no b1 with silu, non-default smem knobs, the slot-wait test
        # switch (a different kernel body)
        "chained_ffn_default": lambda: C().compile(
            P=512, hidden=1024, N=512, act1="gelu", keep_ptx=True).__ptx__,
        "chained_ffn_nob1_silu": lambda: C().compile(
            P=256, hidden=512, N=256, act1="silu", has_b1=False, keep_ptx=True).__ptx__,
        "chained_ffn_knobs_relu": lambda: C(stages=3, epi_n=64, epi_stages=2).compile(
            P=256, hidden=512, N=512, act1="relu", keep_ptx=True).__ptx__,
        "chained_ffn_noslotwait": lambda: C(_test_skip_slot_wait=True).compile(
            P=256, hidden=512, N=256, act1="none", keep_ptx=True).__ptx__,
        # the grouped call's kernel (3-D weights, experts after the tile table)
        "chained_ffn_grouped": lambda: C().compile(
            P=512, hidden=1024, N=512, act1="gelu", keep_ptx=True, grouped=True).__ptx__,
        # 2-CTA clusters along M: weight tiles multicast, the cluster mailbox
        "chained_ffn_cluster2": lambda: C(cluster=2).compile(
            P=512, hidden=1024, N=512, act1="gelu", keep_ptx=True).__ptx__,
        "band_allreduce_unicast_g2": lambda: ar().compile_band_allreduce(
            2, "unicast", "none", keep=True).__ptx__,
        # bf16 partials (the chained layers), b2 shared and one row per ready flag (experts)
        "band_allreduce_bf16_unicast_g2": lambda: ar().compile_band_allreduce(
            2, "unicast", "none", 512, 4, keep=True, partial="bf16").__ptx__,
        "band_allreduce_bf16_b2_per_band_g2": lambda: ar().compile_band_allreduce(
            2, "unicast", "none", 512, 4, keep=True, partial="bf16", b2_per_band=True).__ptx__,
        "band_allreduce_switch_g4_gelu": lambda: ar().compile_band_allreduce(
            4, "switch", "gelu", keep=True).__ptx__,
        "consumer_nvlink_tma": lambda: _keep(cons().build_consumer("nvlink", copy="tma",
                                                                   local_copy=False),
                                             *cons().consumer_example_args()),
        "consumer_nvlink_ldst": lambda: _keep(cons().build_consumer("nvlink", copy="ldst"),
                                              *cons().consumer_example_args()),
        "consumer_nvshmem_ldst": lambda: _nvshmem_consumer(cons()),
        "scale_top8_y": lambda: _keep(sc().build_scale(8, y_src=True), *sc().scale_example_args()),
        "plan_kernel_e512": lambda: _keep(pk().build_plan_kernels(True, 512, 8),
                                          *pk().plan_example_args()),
        # order="expert": the variant without the expert ranking
        "plan_kernel_e512_expert": lambda: _keep(pk().build_plan_kernels(
            True, 512, 2, by_expert=True), *pk().plan_example_args()),
        "routes_rank_y": lambda: _keep(rt().build_routes_kernels(True, 512, True)[1],
                                       *rt().rank_example_args()),
    }


def normalize(ptx: str) -> str:
    """Drops `.file` / `.loc` lines and renames each kernel entry symbol to ENTRY<i>: both carry
    the module path (CuTe DSL mangles it into the kernel name), which a move changes."""
    names = re.findall(r"\.entry\s+([A-Za-z0-9_$]+)\s*\(", ptx)
    for i, name in enumerate(sorted(set(names), key=len, reverse=True)):
        ptx = ptx.replace(name, f"ENTRY{i}")
    return "\n".join(line for line in ptx.splitlines()
                     if not re.match(r"\s*\.(file|loc)\b", line))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="folder to write <name>.ptx into")
    ap.add_argument("--only", default="", help="comma-separated subset of the variant names")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two folders")
    a = ap.parse_args(argv)
    if a.compare:
        A, B = a.compare
        names = sorted(set(os.listdir(A)) | set(os.listdir(B)))
        bad = 0
        for n in names:
            pa, pb = os.path.join(A, n), os.path.join(B, n)
            if not (os.path.exists(pa) and os.path.exists(pb)):
                print(f"{n}: only in {'A' if os.path.exists(pa) else 'B'}")
                bad += 1
                continue
            same = open(pa).read() == open(pb).read()
            bad += not same
            print(f"{n}: {'identical' if same else 'DIFFERS'}")
        return 1 if bad else 0
    if not a.out:
        ap.error("--out or --compare is required")
    os.makedirs(a.out, exist_ok=True)
    only = {s for s in a.only.split(",") if s}
    failed = []
    for name, fn in variants().items():
        if only and name not in only:
            continue
        try:
            text = normalize(fn())
        except Exception as e:  # noqa: BLE001 - e.g. a variant whose option was removed
            print(f"{name}: FAILED ({type(e).__name__}: {e})")
            failed.append(name)
            continue
        with open(os.path.join(a.out, name + ".ptx"), "w") as f:
            f.write(text)
        print(f"{name}: {len(text)} chars sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
