"""One profiled launch of the fused FFN compute kernel (for Nsight Compute), one GPU.

    ncu --nvtx --nvtx-include "fused/" --set full -o $OUT/fused python bench/profile_fused_compute.py \
        [--shape llama3-8b] [--tile-o 256] [--cluster-m 1] [--h-pair 0]

Warms the kernel up (compile, module load), then runs it once inside the NVTX range ``fused``.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_ffn import SHAPES  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--tile-o", type=int, default=256)
    ap.add_argument("--h-pair", type=int, default=0, choices=(0, 1))
    ap.add_argument("--cluster-m", type=int, default=1, choices=(1, 2))
    a = ap.parse_args(argv)
    import torch
    from moe_overlap.ffn.compute_reduce import FusedFFNCompute
    dev = torch.device("cuda", 0)
    P, O = SHAPES[a.shape]
    T, N, Ol = a.tokens, P, O // 2
    bf = dict(dtype=torch.bfloat16, device=dev)
    x = torch.randn(T, P, **bf)
    w1 = torch.randn(P, Ol, **bf) * P ** -0.5
    b1 = torch.randn(Ol, **bf) * 0.1
    w2 = torch.randn(Ol, N, **bf) * Ol ** -0.5
    acc = torch.zeros(T, N, dtype=torch.float32, device=dev)
    ready = torch.zeros(T, dtype=torch.int32, device=dev)
    epoch = torch.ones(1, dtype=torch.int32, device=dev)
    comp = FusedFFNCompute(tile_o=a.tile_o, cluster_m=a.cluster_m, h_pair=bool(a.h_pair))
    b1f = b1.float()
    for _ in range(2):
        comp(x, w1, b1f, w2, acc, ready, epoch, act1="gelu")
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("fused")
    comp(x, w1, b1f, w2, acc, ready, epoch, act1="gelu")
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("profiled one launch:", a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
