"""One call of the chained FFN compute and one of the baseline (addmm + act + mm), each inside an
NVTX range, for hardware counters under Nsight Compute (one GPU):

    ncu --clock-control none --nvtx --nvtx-include "ours/" --nvtx-include "baseline/" \
        --metrics <list> --csv python bench/ncu_chained_compute.py --shape llama3-70b --tokens 8192

Both paths are compiled and run once before the ranges (so nothing is compiled or loaded inside
them). The inputs are those of bench_chained_compute (the same seed for the same shape).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_chained_compute import make_comp  # noqa: E402
from bench_ffn import SHAPES  # noqa: E402
from bench_ffn_baseline import baseline_call, ffn_slice  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-70b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2, help="G: the hidden slice is O / G")
    ap.add_argument("--act", default="gelu")
    ap.add_argument("--group", default="auto")
    a = ap.parse_args()
    P, O = SHAPES[a.shape]
    dev = torch.device("cuda")
    x, w1, b1, w2 = ffn_slice(a.tokens, P, O // a.world, dev, seed=a.tokens + P)
    comp = make_comp(a.group if a.group == "auto" or "r" in a.group else int(a.group))
    paths = {"baseline": baseline_call(x, w1, b1, w2, a.act),
             "ours": lambda: comp(x, w1, b1, w2, act1=a.act)}
    for fn in paths.values():
        fn()
    torch.cuda.synchronize()
    comp.check()
    for name, fn in paths.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    comp.check()
    print("done", flush=True)


if __name__ == "__main__":
    main()
