"""Markdown table and PNG heatmaps of a combine sweep (the JSON written by scripts/sweep.py).

    python scripts/report_sweep.py bench/results/combine_sweep_2xh200_v7.json [--out DIR]

Writes DIR/<name>.md (best configuration per shape and router mode, then every point) and
DIR/<name>_heatmaps.png (T_overlap / bound and speedup over the sequential baseline on the
ccta x mgb grid, one column per shape and router mode).
"""
from __future__ import annotations

import argparse
import json
import os


def shape_name(s):
    return f"T{s['tokens']} E{s['experts']} k{s['topk']} N{s['N']} K{s['K']}"


def markdown(data) -> str:
    m = data["meta"]
    lines = [f"# Combine sweep: {m['device']} x{m['world_size']}, {m.get('transport', '')}, "
             f"{m['date'][:10]}, commit {m['git_commit'][:10]}", "",
             "Times in ms (median of CUDA-graph replays, max over ranks). bound = max(T_gemm, "
             "T_comm); hidden = share of T_comm not added to T_overlap.", "",
             "## Best configuration per shape and router mode", "",
             "| shape | mode | ccta | mgb | T_gemm | T_comm | T_overlap | /bound | T_seq | speedup "
             "| hidden | all valid |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["summary"]:
        lines.append(f"| {shape_name(r['shape'])} | {r['mode']} | {r['best_ccta']} | "
                     f"{r['best_mgb']} | {r['t_gemm_ms']:.3f} | {r['t_comm_ms']:.3f} | "
                     f"{r['t_overlap_ms']:.3f} | {r['overlap_over_bound']:.2f} | "
                     f"{r['t_seq_ms']:.3f} | {r['speedup']:.2f} | {r['hidden_fraction']:.2f} | "
                     f"{'yes' if r['all_passed'] else 'NO'} |")
    if data.get("autotune"):
        best = {(json.dumps(r["shape"], sort_keys=True), r["mode"]): r for r in data["summary"]}
        lines += ["", "## MoECombine's own choice (ccta/mgb 'auto' + autotune)", "",
                  "| shape | mode | analytic first guess | tuned | T_overlap | / sweep best |",
                  "|---|---|---|---|---|---|"]
        for t in data["autotune"]:
            b = best[(json.dumps(t["shape"], sort_keys=True), t["mode"])]
            lines.append(f"| {shape_name(t['shape'])} | {t['mode']} | {t['first']} | "
                         f"{t['choice']} | {t['t_auto_ms']:.3f} | "
                         f"{t['t_auto_ms'] / b['t_overlap_ms']:.3f} |")
    lines += ["", "## Every point", "",
              "| shape | mode | ccta | mgb | T_gemm | T_comm | T_overlap | T_seq | speedup | "
              "bitwise | rel err |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in data["points"]:
        lines.append(f"| {shape_name(p['shape'])} | {p['mode']} | {p['ccta']} | {p['mgb']} | "
                     f"{p['t_gemm_ms']:.3f} | {p['t_comm_ms']:.3f} | {p['t_overlap_ms']:.3f} | "
                     f"{p['t_seq_ms']:.3f} | {p['speedup']:.2f} | {p['bitwise_equal']} | "
                     f"{p['rel_err_vs_seq']:.1e} |")
    return "\n".join(lines) + "\n"


def heatmaps(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = []
    for p in data["points"]:
        key = (shape_name(p["shape"]), p["mode"])
        if key not in groups:
            groups.append(key)
    cctas = sorted({p["ccta"] for p in data["points"]})
    mgbs = sorted({p["mgb"] for p in data["points"]})
    metrics = (("overlap_over_bound", "T_overlap / bound", "YlOrRd"),
               ("speedup", "speedup over sequential", "YlGn"))
    fig, axes = plt.subplots(len(metrics), len(groups), squeeze=False,
                             figsize=(2.6 * len(groups) + 1, 2.4 * len(metrics) + 0.8))
    for col, (shape, mode) in enumerate(groups):
        pts = {(p["ccta"], p["mgb"]): p for p in data["points"]
               if shape_name(p["shape"]) == shape and p["mode"] == mode}
        for row, (key, title, cmap) in enumerate(metrics):
            grid = np.array([[pts[(c, m)][key] if (c, m) in pts else np.nan for c in cctas]
                             for m in mgbs])
            ax = axes[row][col]
            ax.imshow(grid, cmap=cmap, aspect="auto")
            for i in range(len(mgbs)):
                for j in range(len(cctas)):
                    if not np.isnan(grid[i, j]):
                        ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                                color="k")
            ax.set_xticks(range(len(cctas)), [str(c) for c in cctas], fontsize=7)
            ax.set_yticks(range(len(mgbs)), [str(m) for m in mgbs], fontsize=7)
            ax.set_xlabel("ccta", fontsize=7)
            if col == 0:
                ax.set_ylabel(f"{title}\nmgb", fontsize=7)
            if row == 0:
                ax.set_title(f"{shape}\n{mode}", fontsize=7)
    m = data["meta"]
    fig.suptitle(f"Overlapped combine sweep, {m['device']} x{m['world_size']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="default: the JSON's folder")
    args = ap.parse_args()
    data = json.load(open(args.json))
    out = args.out or os.path.dirname(os.path.abspath(args.json))
    os.makedirs(out, exist_ok=True)
    stem = os.path.splitext(os.path.basename(args.json))[0]
    md = os.path.join(out, stem + ".md")
    with open(md, "w") as f:
        f.write(markdown(data))
    png = os.path.join(out, stem + "_heatmaps.png")
    heatmaps(data, png)
    print(f"wrote {md} and {png}")


if __name__ == "__main__":
    main()
