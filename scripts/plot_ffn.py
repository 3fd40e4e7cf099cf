"""Bar chart of bench/bench_ffn.py results: per shape, the plain-torch baseline, the fused layer
and the ablations (mean with a standard-deviation whisker over the timed rounds, slowest rank).

    python scripts/plot_ffn.py bench/results/ffn_fused_v7_final_2xh200.json [-o out.png]
"""
import argparse
import json
import os
import sys

BARS = [("baseline", "baseline (torch + NCCL)"), ("compute", "compute only (no all-reduce)"),
        ("fused", "FusedFFN fused"), ("abl_no_spec", "fused, no block specialization"),
        ("abl_nccl", "fused compute + NCCL"), ("abl_no_fusion", "torch GEMMs + band all-reduce")]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json")
    ap.add_argument("-o", "--out", default=None)
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    doc = json.load(open(a.json))
    rows = doc["results"]
    bars = [(k, lbl) for k, lbl in BARS if all(k in r["times"] for r in rows)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 4.5))
    width = 0.8 / len(bars)
    for i, (k, lbl) in enumerate(bars):
        means = [r["times"][k].get("mean_ms", r["times"][k]["median_ms"]) for r in rows]
        stds = [r["times"][k].get("std_ms", 0.0) for r in rows]
        xs = [j + (i - (len(bars) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, means, width, yerr=stds, label=lbl, capsize=2)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["shape"] for r in rows], rotation=20, ha="right")
    ax.set_ylabel("ms per layer call (rank 0)")
    m = doc["meta"]
    ax.set_title(f"TP FFN, {m['world']}x {m['device']}, T={rows[0]['T']}, commit "
                 f"{str(m.get('commit'))[:7]}")
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = a.out or os.path.splitext(a.json)[0] + ".png"
    fig.savefig(out, dpi=120)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
