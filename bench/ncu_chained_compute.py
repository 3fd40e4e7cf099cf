"""One call of the chained FFN compute and one of the baseline (addmm + act + mm), each inside an
NVTX range, for hardware counters under Nsight Compute (one GPU):

    ncu --clock-control none --nvtx --nvtx-include "regex:^(ours|baseline)" \
        --metrics <list> --csv --page raw python bench/ncu_chained_compute.py --groups auto,1,8

Both paths are compiled and run once before the ranges (so nothing is compiled or loaded inside
them); ours once per ``--groups`` entry, in a range named ``ours_g<entry>``. The inputs are those of bench_chained_compute (the same seed for the same shape).
"""
import argparse
import csv
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_chained_compute import make_comp  # noqa: E402
from bench_ffn import SHAPES  # noqa: E402
from bench_ffn_baseline import baseline_call, ffn_slice  # noqa: E402


SUMMARY = (("gpu__time_duration.sum", "ms", 1e6), ("sm__cycles_elapsed.avg.per_second", "MHz", 1e6),
           ("dram__bytes_read.sum", "GB dram rd", 1e9), ("dram__bytes_write.sum", "GB dram wr", 1e9),
           ("lts__t_bytes.sum", "GB L2", 1e9), ("sm__inst_executed.sum", "M inst", 1e6))


def summarize(path, min_ms=0.05):
    """One line per kernel of at least min_ms in an ncu `--csv --page raw` file."""
    rows = list(csv.reader(open(path)))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
    names = rows[head]
    for r in rows[head + 2:]:  # the line after the header holds the units
        val = {m: float(r[names.index(m)].replace(",", "")) / s for m, _, s in SUMMARY
               if m in names}
        if val.get("gpu__time_duration.sum", 0.0) < min_ms:
            continue
        print(f"{r[names.index('Kernel Name')][:44]:44s} " + " ".join(
            f"{val[m]:8.2f} {unit}" for m, unit, _ in SUMMARY if m in val))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-70b")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2, help="G: the hidden slice is O / G")
    ap.add_argument("--act", default="gelu")
    ap.add_argument("--groups", default="auto",
                    help="comma-separated ChainedFFNCompute groups (bench_chained_compute's "
                         "--groups syntax)")
    ap.add_argument("--summarize", metavar="CSV", help="print an ncu raw CSV's kernels and stop")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return
    P, O = SHAPES[a.shape]
    dev = torch.device("cuda")
    x, w1, b1, w2 = ffn_slice(a.tokens, P, O // a.world, dev, seed=a.tokens + P)
    comps = {g: make_comp(g if g == "auto" or not g.isdigit() else int(g))
             for g in a.groups.split(",")}
    paths = {"baseline": baseline_call(x, w1, b1, w2, a.act)}
    for g, comp in comps.items():
        paths[f"ours_g{g}"] = lambda comp=comp: comp(x, w1, b1, w2, act1=a.act)
    for fn in paths.values():
        fn()
    torch.cuda.synchronize()
    for name, fn in paths.items():
        torch.cuda.nvtx.range_push(name)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    for comp in comps.values():
        comp.check()
    print("done", flush=True)


if __name__ == "__main__":
    main()
