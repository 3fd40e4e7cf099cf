"""The README status table and docs/RESULTS.md, built from the result files in bench/results/.

    moe-overlap report [--root DIR] [--check]      (also: python scripts/report.py)

Which file is "newest" is decided by one rule, written here: `HEADLINE` names the current result
file(s) of every area, and only those (and the few `INPUTS`) are read. A new measurement becomes
the headline by editing that table and rerunning the report. The top level of bench/results/
holds only those files and the ones other code or README.md reads (`READ_BY`); everything else
lives in bench/results/archive/ (INDEX.md there says what each file was for).

Every cell of the status table comes from a result field: the figures, the card and number of
GPUs, the date and commit, and whether the source the number was measured with is still the
tree's. That last column ("freshness") is computed by moe_overlap.provenance: each area depends
on the files `DEPENDENCIES` names (kernels, launchers, options, the bench); a result
records their content hashes (`provenance.stamp`), or, written before the stamp existed, its
commit, whose content git gives. A row is **stale** where a dependency's content differs from
the tree's, with the number of commits that touched the changed files since the result's commit
(plus one for a change not yet committed, so a report written just before the commit that
carries the change reads the same when checked after it).

What `--check` can verify, and why it does not fail spuriously: the stale / current state is a
function of file contents only (recorded hashes vs the tree), not of HEAD, so a later commit that
touches no dependency changes nothing. The count of commits changes only when a commit touches a
dependency, which is exactly when the row's text should change (regenerate the report in that
commit). Where git cannot answer (a tarball, a copy without .git, a shallow clone without the
result's commit), freshness is "unknown" and `--check` compares everything but those cells.

`check()` also fails when a named file is missing, when bench/results/ holds a file that no
table names (a new result nobody classified), when a `READ_BY` reader no longer names its file,
or when README.md / docs/RESULTS.md differ from what the files give (numbers edited by hand, or
not regenerated).

The report reads JSON only (no torch), so it runs anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .provenance import DEPENDENCIES, Git, freshness

# area -> (title, current headline files, in bench/results/)
HEADLINE = {
    "producer": ("Producer grouped GEMM as MoECombine launches it, on model-shaped plans",
                 ("producer_models_h100_fffb23c_grid.json",
                  "producer_models_h200_fc47bea_s23.json")),
    "upproj": ("Arrival-gated SwiGLU up-projection as MoELayer launches it, every band arrived",
               ("upproj_models_h100_486caa4.json",)),
    "layer": ("One MoE layer end to end on one GPU (W = 1), ours against the same-scale base",
              ("moe_layer_1x_h100_fffb23c.json",)),
    "ranks": ("Multi-rank checks with the ranks sharing one GPU (correctness only)",
              ("ranks_onegpu_h100_486caa4.json",)),
    "dispatch_bytes": ("Dispatch bytes on the wire: once per destination rank vs once per "
                       "assignment (counted from routings, no GPU)",
                       ("dispatch_bytes_1bbb111.json",)),
    "consumer": ("Consumer (band shipping, nvlink TMA)", ("consumer_run5_large_2xh200.json",)),
    "combine": ("Combine sweep (overlapped MoE combine)",
                ("combine_sweep_2xh200_v7.json", "combine_sweep_2xh200_v7_k14336.json",
                 "validate_overlap_2xh200_b2403b3.json")),
    "ffn": ("Fused tensor-parallel FFN", ("ffn_fused_v7_final_2xh200.json",)),
    "scale": ("Scale (owner's top-k weighted sum)", ("scale_bench_h200.json",)),
    "packed": ("Producer on fine-grained MoE plans (aligned vs packed layout)",
               ("packed_gemm_h200_d98035d.json",)),
    "chained": ("Chained FFN compute kernel alone (GEMM1 -> bf16 H ring -> full-depth GEMM2)",
                ("ffn_chained_compute_h200_auto_phased_918b75d.json",)),
    "plan": ("Planner and prepare (device time)", ("plan_kernel2_h200_1622057.json",
                                                    "plan_kernel2_last_h200_1622057.json")),
    "ordered_tables": ("The ordered scale's per-routing tables (device time)",
                       ("plan_h100_ordered_seginc_2db7e5d.json",)),
}

# result files the report reads besides the headlines (each with what for)
INPUTS = {
    "combine_split_2xh200_v7.json": "our scale kernel's time at the sweep's K 1024 / 2048 "
                                    "shapes, for the same-scale baseline",
    "combine_split_2xh200_k14336_cluster2.json": "our scale kernel's time at K 14336, for the "
                                                 "same-scale baseline",
}

# result files other code or README.md reads -> the files that read them (check() fails where
# a reader no longer names the file: then it belongs in archive/)
READ_BY = {
    "combine_split_2xh200_pieces.json": ("moe_overlap/combine/tuning.py",),
    "ffn_baseline_h200.json": ("moe_overlap/ffn/projection.py",),
    "ffn_chained_compute_h100_auto_phased_0792106.json": ("tests/test_chained_auto_phased_cpu.py",),
    "ffn_chained_compute_h100_c2phased_2631ea0.json": ("tests/test_chained_auto_phased_cpu.py",),
    "ffn_chained_compute_h100_lookahead_73897e1.json": ("tests/test_chained_auto_phased_cpu.py",),
    "ffn_chained_compute_h100_phased_73897e1.json": ("tests/test_chained_auto_phased_cpu.py",),
    "ffn_chained_compute_h100_t32768_2631ea0.json": ("tests/test_chained_auto_phased_cpu.py",),
    "ffn_chained_compute_h200_auto_patch_7dea59e.json": ("tests/test_chained_auto_group_cpu.py",),
    "ffn_chained_compute_h200_groups_8192_c294d29.json": ("tests/test_chained_auto_group_cpu.py",),
    "ffn_chained_compute_h200_holds_patch_606dff6.json": ("tests/test_chained_auto_group_cpu.py",
                                                          "moe_overlap/ffn/compute_chained.py"),
    "ncu_chained_70b_groups_8192_ef6ac23.csv": ("bench/predict_chained_dram.py",),
    "ncu_chained_70b_patch_8192_7df8f19.csv": ("bench/predict_chained_dram.py",),
    "projection_ffn_g2_8.json": ("tests/test_ffn_projection.py", "moe_overlap/cli.py"),
    "projection_ffn_g2_8.png": ("README.md",),
    "projection_combine_w2_64.json": ("README.md",),
    "projection_combine_w2_64.png": ("README.md",),
    "projection_layer.json": ("README.md", "tests/test_projection_layer.py"),
    "projection_layer.png": ("README.md",),
    "packed_gemm_h200_expert_order_70a95b6.json": ("README.md",),
    "producer_models_h100_fffb23c_grid.json": ("moe_overlap/combine/projection.py",),
}

BEGIN, END = "<!-- report:status:begin -->", "<!-- report:status:end -->"
RESULTS_MD = os.path.join("docs", "RESULTS.md")


def _load(root, name):
    with open(os.path.join(root, "bench", "results", name)) as f:
        return json.load(f)


def _meta(doc):
    """(device, date, commit) of a result file, '?' where it does not say."""
    m = doc.get("provenance") or doc.get("meta", doc)
    return (m.get("device", "?"), str(m.get("date", "?"))[:10],
            str(m.get("git_commit") or m.get("commit") or "?")[:10])


def _card(device: str) -> str:
    """"NVIDIA H100 80GB HBM3" -> "H100"."""
    return device.replace("NVIDIA ", "").split()[0] if device.strip() else "?"


def _gpus(area, doc) -> int:
    """GPUs the result was measured on: the stamp's count, else the field the bench wrote."""
    if "gpus" in (doc.get("provenance") or {}):
        return int(doc["provenance"]["gpus"])
    m = doc.get("meta", doc)
    if str(m.get("device", "")).lower() == "cpu":  # counted or computed on the host
        return 0
    if area == "combine":  # moe-overlap sweep / bench_combine_split: one rank per GPU
        return int(m["world_size"])
    if area == "ffn":  # bench_ffn under torchrun: one rank per GPU
        return int(m["world"])
    kind = re.search(r"-x(\d+)$", str(m.get("device_kind", "")))
    if kind:  # the device machine the run asked for
        return int(kind.group(1))
    # bench_grouped_gemm, _scale, _packed_gemm, _plan, _chained_compute: one process, one
    # device (their W / world fields are simulated ranks, not GPUs)
    return 1


# set by build(): the tree the report is made in and its git
_CTX = {"root": ".", "git": None, "unknown": None}


def _fresh(area, doc) -> dict:
    return freshness(_CTX["root"], area, doc, _CTX["git"])


def _short(paths, most=4):
    names = [p.split("/", 1)[1] if p.startswith("moe_overlap/") else p for p in paths]
    return ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")


def _fresh_text(f, doc, area) -> str:
    """The freshness sentence of one result (no "|": it sits in a table cell)."""
    if f["state"] == "unknown":
        text = f"freshness unknown ({f['why']})"
        return _CTX["unknown"] if _CTX["unknown"] is not None else text
    commit = _meta(doc)[2]
    if f["state"] == "current":
        basis = "recorded hashes" if f["basis"] == "fingerprint" else "as at " + commit
        return f"current: its {len(DEPENDENCIES[area])} source files are the tree's ({basis})"
    n = ("an unknown number of commits" if f["commits"] is None else
         f"{f['commits']} commit{'s' if f['commits'] != 1 else ''}")
    text = f"**stale**: {n} touched {_short(f['changed'])} since {commit}"
    gpus = _gpus(area, doc)
    if gpus > 1:
        text = f"last measured on {gpus} GPUs on {_meta(doc)[1]}, {text}"
    return text


def _rng(vals, fmt="{:.2f}", unit=""):
    vals = sorted(vals)
    if not vals:
        return "n/a"
    lo, hi = fmt.format(vals[0]), fmt.format(vals[-1])
    sep = " to " if vals[0] < 0 else "-"
    return (lo if lo == hi else f"{lo}{sep}{hi}") + unit


def _table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


# ------------------------------------------------------------------------------ areas
def producer(root):
    """One section and one cell part per file (each file is one card's run)."""
    lines, cells, docs = [], [], []
    for name in HEADLINE["producer"][1]:
        d = _load(root, name)
        sec, cell = _producer_file(name, d)
        lines += sec
        cells.append(cell)
        docs.append((name, d))
    return lines, " | ".join(cells), docs


def _producer_file(name, d):
    ours = d["ours_variant"]
    lines = [_src(name, d, "producer"), "", f"Method: {d['method']}.", ""]
    rows = []
    for p in d["points"]:
        base = min((p[k], k[5:-3]) for k in ("base_grouped_mm_ms", "base_mm_loop_ms") if k in p)
        for vname, v in p["variants"].items():
            rows.append((p["label"], str(p["valid_rows"]), f"{base[0]:.3f} ({base[1]})", vname,
                         str(v["ccta"]), f"{v['gemm']['cluster_n']}",
                         v["gemm"].get("tile_fetch", "static"), f"{v['padding']:.2f}",
                         f"{v['ms']:.3f}", f"{v['ratio']:.3f}", f"{v['scaled_ratio']:.3f}",
                         str(v["correct"])))
    lines += _table(("point", "valid rows", "library ms (best)", "variant", "ccta", "cluster",
                     "tile walk", "padding", "ours ms", "library / ours", "scaled by SMs", "correct"), rows)
    lines.append("")
    for vname, b in d.get("beside_consumer", {}).items():
        lines.append(f"Beside the real consumer ({d['time_fields']['beside_consumer_ms']}), "
                     f"{vname}: {b['geomean_over_alone']:.2f}x its time alone on geometric mean "
                     f"of {b['points']} points, at most {b['max_over_alone']:.2f}x "
                     f"({b['worst']}); not timed beside: {', '.join(b['not_timed']) or 'none'}.")
        lines.append("")
    parts = []
    for vname, g in d["goals"].items():
        scaled = [p["variants"][vname]["scaled_ratio"] for p in d["points"]]
        raw = [p["variants"][vname]["ratio"] for p in d["points"]]
        # the file's "default" is what MoECombine ran at the file's commit
        ran = f" (what MoECombine ran at {d.get('git_commit', '?')})" if vname == ours else ""
        parts.append(f"{vname}{ran}: "
                     f"{_rng(raw, '{:.2f}')}x unscaled, {_rng(scaled, '{:.2f}')}x scaled by "
                     f"SMs / (SMs - ccta), geometric mean {g['geomean_scaled']:.3f} "
                     f"({_losses(scaled)}; goal >= {g['goal_scaled']} everywhere and mean >= "
                     f"{g['goal_geomean']}: {'met' if g['met'] else 'not met'})")
    models = sorted({p["model"] for p in d["points"]})
    cell = (f"{_card(d.get('device', '?'))}: our speed / the faster of torch._grouped_mm and a "
            f"per-expert cuBLAS loop on the unpadded rows, options as MoECombine resolves them, "
            f"{len(d['points'])} points "
            f"({', '.join(models)}; W {sorted({p['world_size'] for p in d['points']})}; "
            f"routings {sorted({p['routing'] for p in d['points']})}): " + "; ".join(parts)
            + f"; every output correct: {d['all_correct']}")
    return lines, cell


def ranks(root):
    (name,) = HEADLINE["ranks"][1]
    d = _load(root, name)
    lines = [_src(name, d, "ranks"), "", d["what"] + ".", ""]
    rows = []
    for check, c in d["checks"].items():
        why = "; ".join(sorted({f["reason"].split(" | ")[-1][:160] for f in c["failures"]}))
        rows.append((check, c.get("commit", d["commit"]), c.get("mode", d["mode"]),
                     str(c["points"]), str(c["passed"]), str(len(c["failures"])), why or "-"))
    lines += _table(("check", "commit", "mode", "points", "passed", "failed", "why"), rows)
    lines.append("")
    ok = [k for k, c in d["checks"].items() if c["points"] and not c["failures"]]
    bad = [k for k, c in d["checks"].items() if c["failures"]]
    t = d["totals"]
    # the test modules run W = 2 and 4; the validation grid names its W in the check
    ws = sorted({2, 4} | {int(m.group(1)) for k in d["checks"]
                          if (m := re.match(r"validate_w(\d+)_", k))})
    modes = ", ".join(d.get("modes", [d["mode"]]))
    cell = (f"W = {', '.join(map(str, ws[:-1]))} and {ws[-1]} ranks as processes on one GPU "
            f"({modes}): "
            f"{t['passed']} of {t['points']} checks passed; passing: {', '.join(ok)}; "
            f"failing: {', '.join(bad) or 'none'} (reasons in docs/RESULTS.md); timings of this "
            "mode are not speedups")
    # a merged file's checks ran at several commits: each commit speaks for its own checks, so
    # the row is as fresh as its oldest check, not as the file's last run
    by_commit = {}
    for c in d["checks"].values():
        k = c.get("commit", d["commit"])
        by_commit[k] = max(by_commit.get(k, ""), c.get("date", d["date"]))
    docs = [(name, dict(d, commit=k, date=by_commit[k]))
            for k in sorted(by_commit, key=by_commit.get, reverse=True)]
    return lines, cell, docs


def _losses(ratios) -> str:
    """"a loss on n of m" for speed ratios (ours / theirs, below 1: ours slower)."""
    n = sum(r < 1 for r in ratios)
    return f"a loss on {n} of {len(ratios)}" if n else f"no loss on {len(ratios)}"


def layer(root):
    (name,) = HEADLINE["layer"][1]
    d = _load(root, name)
    lines = [_src(name, d, "layer"), "", f"Method: {d['method']}.", ""]
    rows = [(r["name"], f"{r['base_ms']:.3f}", f"{r['ours_ms']:.3f}", f"{r['speedup']:.3f}",
             f"{r['ours_err_vs_fp32']:.2e}", f"{r['base_err_vs_fp32']:.2e}",
             str(r["plan_hidden"]), str(r["agree"])) for r in d["rows"]]
    lines += _table(("shape", "base ms", "ours ms", "base / ours", "ours vs fp32",
                     "base vs fp32", "plan hidden", "agrees"), rows) + [""]
    speed = [r["speedup"] for r in d["rows"]]
    below = [r["name"] for r in d["rows"] if r["speedup"] < 1.0]
    cell = (f"{_card(d.get('device', '?'))}, W = {d['world_size']} (nothing leaves the rank), "
            f"up-projection {d.get('up', 'library')}, {len(speed)} shapes "
            f"({', '.join(r['name'] for r in d['rows'])}): {_rng(speed, '{:.2f}')}x the base "
            f"layer ({_losses(speed)}{': ' + ', '.join(below) if below else ''}; goal >= 1.00 "
            f"on every shape: {'met' if not below else 'not met'}); against an fp32 "
            f"reference on each rank's first tokens, ours at most "
            f"{max(r['ours_err_vs_fp32'] for r in d['rows']):.1e}, the base at most "
            f"{max(r['base_err_vs_fp32'] for r in d['rows']):.1e} (tolerance {d['tol']:g}); "
            f"every shape agrees: {all(r['agree'] for r in d['rows'])}")
    return lines, cell, [(name, d)]


def upproj(root):
    (name,) = HEADLINE["upproj"][1]
    d = _load(root, name)
    lines = [_src(name, d, "upproj"), "", f"Method: {d['method']}.", ""]
    rows = [(p["label"], str(p["valid_rows"]), f"{p['base_ms']:.3f} ({p['base']})",
             f"{p['base_gemm_alone_ms']:.3f}", str(p["up_ccta"]), str(p["gemm"]["cluster_n"]),
             # files before the up_tile_fetch option ran the static walk
             p["gemm"].get("tile_fetch", "static"),
             f"{p['padding']:.2f}", f"{p['ms']:.3f}", f"{p['ratio']:.3f}",
             f"{p['scaled_ratio']:.3f}", str(p["correct"])) for p in d["points"]]
    lines += _table(("point", "valid rows", "library ms (GEMM + SwiGLU)", "library GEMM alone ms",
                     "SMs left", "cluster", "tile walk", "padding", "ours ms", "library / ours",
                     "scaled by SMs", "correct"), rows) + [""]
    scaled = [p["scaled_ratio"] for p in d["points"]]
    g = d["goals"]
    cell = (f"{_card(d.get('device', '?'))}: our fused SwiGLU GEMM / the faster of "
            f"torch._grouped_mm and a per-expert loop plus SwiGLU on the unpadded rows, "
            f"{len(scaled)} points ({', '.join(sorted({p['model'] for p in d['points']}))}; "
            f"W {sorted({p['world_size'] for p in d['points']})}; "
            f"{', '.join(sorted({p['routing'] for p in d['points']}))}): "
            f"{_rng(scaled, '{:.2f}')}x scaled by SMs, geometric mean {g['geomean_scaled']:.3f} "
            f"({_losses(scaled)}; goal >= {g['goal_scaled']} everywhere: "
            f"{'met' if g['met'] else 'not met'}); every output correct: {d['all_correct']}")
    return lines, cell, [(name, d)]


def dispatch_bytes(root):
    (name,) = HEADLINE["dispatch_bytes"][1]
    d = _load(root, name)
    rows = d["rows"]
    lines = [_src(name, d, "dispatch_bytes"), "", "Share of the dispatch's off-rank bytes saved "
             "by sending each token once per destination rank (its int32 top-k ids included) "
             "instead of once per (token, expert) assignment, counted from the routings (seed "
             f"{rows[0]['seed']}, {rows[0]['tokens_per_rank']} tokens per rank).", ""]
    lines += _table(("model", "W", "router", "saved", "busiest rank saved"),
                    [(r["model"], r["world_size"], r["mode"], f"{100 * r['saving']:.1f} %",
                      f"{100 * r['busiest_rank_saving']:.1f} %") for r in rows]) + [""]
    bal = [r for r in rows if r["mode"] == "balanced"]
    parts = []
    for m in dict.fromkeys(r["model"] for r in bal):
        per = sorted((r["world_size"], r["saving"]) for r in bal if r["model"] == m)
        parts.append(f"{m} " + " / ".join(f"{100 * v:.0f}" for _, v in per) + " % at W = "
                     + " / ".join(str(w) for w, _ in per))
    skew = [r["saving"] for r in rows if r["mode"] != "balanced"]
    cell = ("`MoEDispatch` (reference backend) sends each token once per destination rank: "
            "off-rank bytes saved on balanced routings, " + "; ".join(parts)
            + (f"; skewed routers {_rng([100 * v for v in skew], '{:.0f}', ' %')}" if skew else "")
            + f" ({rows[0]['tokens_per_rank']} tokens per rank, ids included)")
    return lines, cell, [(name, d)]


def consumer(root):
    (name,) = HEADLINE["consumer"][1]
    d = _load(root, name)
    res = d["results"]
    sizes = sorted({r["bytes"] for r in res})
    cctas = sorted({r["ccta"] for r in res if r["variant"] != "copy_engine"})
    ce = {r["bytes"]: r["gbps"] for r in res if r["variant"] == "copy_engine"}
    transports = sorted({r["variant"].split("_")[0] for r in res if r["variant"] != "copy_engine"})
    rows = []
    for b in sizes:
        best = []
        for c in cctas:
            pts = [r for r in res if r["bytes"] == b and r["ccta"] == c
                   and r["variant"] != "copy_engine"]
            top = max(pts, key=lambda r: r["gbps"])
            best.append(f"{top['gbps']:.0f} ({top['variant'].replace('nvlink_tma_', '')})")
        rows.append([f"{b / 2 ** 20:.0f} MiB", f"{ce.get(b, float('nan')):.0f}"] + best)
    lines = [_src(name, d, "consumer"), "", "GB/s per direction with both directions busy; best "
             "ring per SM count (stages x chunk, lookahead).", ""]
    lines += _table(["size", "copy engine"] + [f"{c} SMs" for c in cctas], rows) + [""]
    big = max(sizes)
    at16 = max((r for r in res if r["bytes"] == big and r["ccta"] == 16), key=lambda r: r["gbps"],
               default=None)
    checked = {True: "received rows equal the sent ones; ", False: "DATA CHECK FAILED; "}.get(
        d["meta"].get("correct"), "")
    cell = (f"transports measured: {', '.join(transports)} only; {checked}"
            + (f"{at16['gbps']:.0f} GB/s per direction at 16 SMs for {big / 2 ** 20:.0f} MiB "
               f"alone (copy engine {ce.get(big, float('nan')):.0f})" if at16 else
               "no 16-SM point"))
    docs = [(name, d)]
    ship = []
    for n in INPUTS:
        if n.startswith("combine_split"):
            sd = _load(root, n)
            ship += [p["remote_GBs_ship"] for p in sd["points"] if "remote_GBs_ship" in p]
    if ship:
        cell += (f"; inside the combine (combine_split files) it shipped "
                 f"{_rng(ship, '{:.0f}', ' GB/s')}")
    return lines, cell, docs


def _shape_name(s):
    base = f"T{s['tokens']} E{s['experts']} k{s['topk']} N{s['N']} K{s['K']}"
    return f"{s['name']} ({base})" if s.get("name") else base


def _our_scale_ms(root):
    """{shape json: median ms of our scale kernel} from the INPUTS split files."""
    per = {}
    for n in INPUTS:
        if n.startswith("combine_split"):
            for p in _load(root, n)["points"]:
                per.setdefault(json.dumps(p["shape"], sort_keys=True), []).append(p["scale"])
    return {k: sorted(v)[len(v) // 2] for k, v in per.items()}


def _same_scale_estimate(p, scale_ms):
    """The sweep point's torch-only baseline with our scale kernel and the best library GEMM
    variant in place of the ones it ran: t_seq - gemm[seq_gemm] + min(gemm) - scale[seq_scale]
    + our scale's time (ms), or None where a part is missing."""
    v = p.get("seq_variants_ms") or {}
    ours = scale_ms.get(json.dumps(p["shape"], sort_keys=True))
    try:
        gemm, scl = v["gemm"], v["scale"]
        return (p["t_seq_ms"] - gemm[p["seq_gemm"]] + min(gemm.values())
                - scl[p["seq_scale"]] + ours)
    except (KeyError, TypeError):
        return None


def combine(root):
    lines, sweep_speed, bounds, auto, valid = [], [], [], [], [0, 0]
    same_by_k, docs, mgbs, tuned_mgb, timing, hows = {}, [], set(), [], set(), set()
    scale_ms = _our_scale_ms(root)
    for name in HEADLINE["combine"][1]:
        d = _load(root, name)
        docs.append((name, d))
        pts = d["points"]
        valid[0] += sum(bool(p["passed"]) for p in pts)
        valid[1] += len(pts)
        if all(p.get("timing") == "none" for p in pts):  # a validation-only grid
            lines += [f"### `{name}`: validation grid", "", _src(name, d, "combine"), "",
                      f"{sum(bool(p['passed']) for p in pts)}/{len(pts)} points bitwise equal "
                      "to the non-overlapped path and within 8e-3 of the sequential baseline "
                      f"({len({json.dumps(p['shape']) for p in pts})} shapes x "
                      f"{len({p['mode'] for p in pts})} router modes x "
                      f"{len({(p['ccta'], p['mgb']) for p in pts})} (ccta, mgb)).", ""]
            continue
        mgbs |= {p["mgb"] for p in pts}
        tuned_mgb += [t["choice"][1] for t in d.get("autotune") or [] if t.get("choice")]
        has_same = any("speedup_same_scale" in p for p in pts)
        rows = []
        for r in d["summary"]:
            best = min((p for p in pts if p["shape"] == r["shape"] and p["mode"] == r["mode"]),
                       key=lambda p: p.get("t_overlap", p.get("t_overlap_ms")))
            t_ov = best.get("t_overlap", best.get("t_overlap_ms"))
            timing.add((best.get("timing"), best.get("seq_timing")))
            sp_t = best.get("speedup_torch", best.get("speedup"))
            sweep_speed.append(sp_t)
            bounds.append(best["overlap_over_bound"])
            if r.get("autotuned_over_best"):
                auto.append(r["autotuned_over_best"])
            if has_same:
                same, how = best["speedup_same_scale"], "measured"
            else:
                est = _same_scale_estimate(best, scale_ms)
                same, how = (None if est is None else est / t_ov), "estimated"
            if same is not None:
                hows.add(how)
                same_by_k.setdefault(r["shape"]["K"], []).append(same)
            rows.append([_shape_name(r["shape"]), r["mode"], f"{best['ccta']},{best['mgb']}",
                         "n/a" if same is None else f"{same:.2f} ({how})", f"{sp_t:.2f}",
                         f"{best['overlap_over_bound']:.2f}",
                         "n/a" if not r.get("autotuned_over_best") else
                         f"{r['autotuned_over_best']:.3f}", "yes" if r["all_passed"] else "NO"])
        hdr = ["shape", "mode", "best ccta,mgb", "x same-scale baseline", "x torch baseline",
               "T_overlap / bound", "autotune / best", "all valid"]
        lines += [f"### `{name}`", "", _src(name, d, "combine"), ""]
        lines += _table(hdr, rows) + [""]
        if not has_same:
            p0 = pts[0]
            lines += [f"Torch baseline: plain torch ({p0.get('seq_timing')} timing, GEMM "
                      f"`{p0.get('seq_gemm')}`, scale `{p0.get('seq_scale')}`). This file has no "
                      "measured same-scale baseline; the estimate replaces the baseline's scale "
                      f"`{p0.get('seq_scale')}` by our scale kernel's time at the same shape "
                      f"({', '.join(f'`{n}`' for n in INPUTS if n.startswith('combine_split'))}"
                      ") and its GEMM by the fastest library variant it timed "
                      "(seq_variants_ms); the baseline stays eager, ours a CUDA graph.", ""]
    for n in INPUTS:
        if n.startswith("combine_split"):
            sd = _load(root, n)
            docs.append((n, sd))
            lines += [f"### `{n}` (our scale's time for the estimate)", "",
                      _src(n, sd, "combine"), ""]
    same_txt = "; ".join(
        f"K {k} {_rng(v)}x" + (" (a loss)" if max(v) < 1 else
                               f" (a loss on {sum(x < 1 for x in v)})" if min(v) < 1 else "")
        for k, v in sorted(same_by_k.items()))
    how = ", ".join(sorted(f"ours {a}, baseline {b}" for a, b in timing))
    cell = (f"against the same-scale sequential baseline ({' and '.join(sorted(hows))}: our scale "
            f"kernel, fastest library GEMM; {how}): {same_txt or 'not measured'}; best ccta at mgb "
            f"{', '.join(map(str, sorted(mgbs)))} only (autotune chose mgb "
            f"{', '.join(map(str, sorted(set(tuned_mgb))))}); torch-only baseline "
            f"{_rng(sweep_speed)}x; T_overlap / max(T_gemm, T_comm) = {_rng(bounds)}; autotune / "
            f"sweep best {_rng(auto, '{:.3f}')}; {valid[0]}/{valid[1]} sweep and validation "
            "points bitwise equal to the non-overlapped path")
    return lines, cell, docs


def ffn(root):
    (name,) = HEADLINE["ffn"][1]
    d = _load(root, name)
    rows, sp = [], []
    for r in d["results"]:
        sp.append((r["shape"], r["speedup_vs_baseline"]))
        rows.append((r["shape"], f"P{r['P']} O{r['O']} N{r['N']} T{r['T']}",
                     f"{r['baseline_ms']:.3f}", f"{r['fused_ms']:.3f}",
                     f"{r['speedup_vs_baseline']:.2f}", f"{r['bound_speedup']:.2f}",
                     f"{r['memory']['fused_over_baseline']:.2f}",
                     f"{r['fused_err_vs_baseline']:.1e}"))
    rounds = d["meta"].get("args", {}).get("rounds")
    lines = [_src(name, d, "ffn"), "", f"Medians of {rounds} interleaved rounds; speed = "
             "reference time "
             "/ fused time (above 1: the fused backend is faster); bound = the speed a perfect "
             "overlap would give.", ""]
    lines += _table(("shape", "dims", "reference ms", "fused ms", "speed", "bound",
                     "memory fused / reference", "error vs reference"), rows) + [""]
    err = max(r["fused_err_vs_baseline"] for r in d["results"])
    speeds = [v for _, v in sp]
    cell = (f"the fused backend at {_rng(speeds)}x the reference backend's speed over "
            f"{len(sp)} shapes ({_losses(speeds)}; slowest: "
            f"{min(sp, key=lambda x: x[1])[0]}); max error vs the reference {err:.1e}")
    return lines, cell, [(name, d)]


def scale(root):
    (name,) = HEADLINE["scale"][1]
    d = _load(root, name)
    v = min(d["variants"], key=lambda v: v["ms"])
    rows = [(x["variant"], f"{x['ms']:.3f}", f"{x['TBs']:.2f}",
             "yes" if x["bitwise_equal_default"] else "NO") for x in d["variants"]]
    lines = [_src(name, d, "scale"), "", f"T={d['T']}, top-{d['topk']}, N={d['N']}; floor "
             f"{d['floor_ms_at_4p8TBs']:.3f} ms at 4.8 TB/s; torch gather + bmm "
             f"{d['torch_gather_bmm_ms']:.3f} ms.", ""]
    lines += _table(("variant", "ms", "TB/s", "bitwise = default"), rows) + [""]
    cell = (f"{v['ms']:.3f} ms at T={d['T']}, top-{d['topk']}, N={d['N']} ({v['TBs']:.1f} TB/s; "
            f"torch gather + bmm {d['torch_gather_bmm_ms']:.3f} ms)")
    return lines, cell, [(name, d)]


def packed(root):
    (name,) = HEADLINE["packed"][1]
    d = _load(root, name)
    pts = d["points"]
    rows = [(p["model"], str(p["world_size"]), p["mode"], f"{p['aligned_padding']:.2f}",
             f"{p['packed_padding']:.3f}", f"{p['library_ms']:.3f}", f"{p['aligned_ms']:.3f}",
             f"{p['packed_ms']:.3f}", f"{p['aligned_vs_library']:.3f}",
             f"{p['packed_vs_library']:.3f}", "yes" if p["correct"] else "NO") for p in pts]
    lines = [_src(name, d, "packed"), "", "One GPU; rank 0's plan of W ranks' routings, "
             f"{pts[0]['tokens_per_rank']} tokens per rank; our GEMM (ccta 0, flags on) on the plan "
             "layout vs `torch._grouped_mm` on the same rows unpadded, CUDA-graph replays. "
             "Padding = plan rows / valid rows.", ""]
    lines += _table(("model", "W", "router", "padding aligned", "padding packed", "library ms",
                     "aligned ms", "packed ms", "aligned / library", "packed / library",
                     "correct"), rows) + [""]
    good = sum(p["packed_vs_library"] >= 0.95 for p in pts)
    cell = (f"packed layout {_rng([p['packed_vs_library'] for p in pts], '{:.3f}')}x "
            f"`torch._grouped_mm` on the unpadded rows (>= 0.95x on {good} of {len(pts)} points), "
            f"aligned {_rng([p['aligned_vs_library'] for p in pts], '{:.3f}')}x; padding "
            f"{_rng([p['packed_padding'] for p in pts])} vs "
            f"{_rng([p['aligned_padding'] for p in pts])}; "
            f"{', '.join(sorted({p['model'] for p in pts}))} routings, W = "
            f"{', '.join(str(w) for w in sorted({p['world_size'] for p in pts}))} (simulated "
            f"ranks' plans); {_losses([p['packed_vs_library'] for p in pts])} for packed")
    return lines, cell, [(name, d)]


def plan(root):
    names = HEADLINE["plan"][1]
    docs = [(n, _load(root, n)) for n in names]
    all_rows = [r for _, d in docs for r in d["rows"]]
    lines = []
    for name, d in docs:
        rows = [(r.get("impl", "torch"), str(r.get("rank", 0)), str(r["world_size"]),
                 str(r["experts"]), str(r["tokens_per_rank"]), r["layout"], r["capacity"],
                 f"{r['plan_us']:.1f}", f"{r['prepare_us']:.1f}",
                 f"{r['plan_us'] + r['prepare_us']:.1f}") for r in d["rows"]]
        lines += [_src(name, d, "plan"), "", f"{d['method']}.", ""]
        lines += _table(("impl", "rank", "W", "experts", "tokens/rank", "layout", "max_rows",
                         "plan us", "prepare us", "sum us"), rows) + [""]
    parts = []
    for impl in ("kernel", "torch"):
        rs = [r for r in all_rows if r.get("impl", "torch") == impl]
        if not rs:
            continue
        tot = [r["plan_us"] + r["prepare_us"] for r in rs]
        parts.append(f"{impl}: plan {_rng([r['plan_us'] for r in rs], '{:.1f}', ' us')}, "
                     f"prepare {_rng([r['prepare_us'] for r in rs], '{:.1f}', ' us')}, together "
                     f"{_rng(tot, '{:.1f}', ' us')}")
    ws = sorted({r["world_size"] for r in all_rows})
    tot_all = [r["plan_us"] + r["prepare_us"] for r in all_rows]
    cell = (f"{'; '.join(parts)} of device time (W = {ws[0]}..{ws[-1]}, first and last rank; "
            f"goal <= 30 us together: {'met' if max(tot_all) <= 30 else 'not met'}); equality to "
            "the torch planner "
            + ("recorded: " + str(all(r["equal_to_torch"] for r in all_rows))
               if all("equal_to_torch" in r for r in all_rows) else
               "not recorded by these runs (tests/test_plan_kernel_gpu.py checks it)"))
    return lines, cell, docs


def ordered_tables(root):
    (name,) = HEADLINE["ordered_tables"][1]
    d = _load(root, name)
    rs = d["ordered_rows"]
    def us(r, key):
        return f"{r[key]:.1f}" if key in r else ""
    rows = [(r["impl"], str(r["world_size"]), str(r["experts"]), str(r["tokens_per_rank"]),
             us(r, "ordered_us"), us(r, "plan_prepare_plain_us"),
             us(r, "plan_prepare_ordered_us"), us(r, "plan_prepare_ordered_big_capacity_us"),
             str(r["equal_to_reference"])) for r in rs]
    lines = [_src(name, d, "ordered_tables"), "", f"{d['method']}. impl: torch = the torch ops "
             "(the senders' "
             "plans by the planner kernel), kernel = the six launches of "
             "combine/ordered_routes_kernel.py given prepare's rows, kernel_rows = the same "
             "making the rows (prepare_routes, the senders' plans on a side stream under it). "
             "plan + prepare: the whole per-routing work of scale=\"plain\" and of "
             "scale=\"ordered\" in one graph; big capacity: that of scale=\"ordered\" for a "
             "layer made for capacity_factor x the tokens per rank (same routing).", ""]
    lines += _table(("impl", "W", "experts", "tokens/rank", "tables us", "plan + prepare plain us",
                     "plan + prepare ordered us", "same, big capacity us",
                     "equal to host reference"), rows) + [""]
    k = [r for r in rs if r["impl"] == "kernel"]
    t = [r for r in rs if r["impl"] == "torch"]
    ws = sorted({r["world_size"] for r in rs})
    whole = [r['plan_prepare_ordered_us'] for r in k]
    big = [r["plan_prepare_ordered_big_capacity_us"] for r in k
           if "plan_prepare_ordered_big_capacity_us" in r]
    cell = (f"scale=\"ordered\": plan + prepare "
            f"{_rng(whole, '{:.1f}', ' us')} (plain "
            f"{_rng([r['plan_prepare_plain_us'] for r in k], '{:.1f}', ' us')}; goal <= 30 us: "
            f"{'met' if max(whole) <= 30 else 'not met'}"
            + (f"; {k[0]['capacity_factor']}x capacity {_rng(big, '{:.1f}', ' us')}" if big
               else "") + "), its tables "
            f"{_rng([r['ordered_us'] for r in k], '{:.1f}', ' us')} in six launches, torch ops "
            f"{_rng([r['ordered_us'] for r in t], '{:.0f}', ' us')} (W = "
            f"{', '.join(map(str, ws))}); bitwise equal to the host reference: "
            f"{all(r['equal_to_reference'] for r in rs)}")
    return lines, cell, [(name, d)]


def in_place_baseline_bytes(M: int, hidden: int, N: int) -> int:
    """The FFN baseline's peak bytes with its activation in place: H [M, hidden] beside out
    [M, N], bf16 (ffn.compute_chained.baseline_activation_bytes, which this package layer may
    not import; a test holds the two equal)."""
    return 2 * M * (hidden + N)


def chained(root):
    (name,) = HEADLINE["chained"][1]
    d = _load(root, name)
    groups = [str(g) for g in d["groups"]]
    held = all("hold_speedup" in r["variants"][g] for r in d["rows"] for g in groups)
    rows = []
    for r in d["rows"]:
        v = r["variants"]
        rows.append((r["shape"], str(r["tokens"]), f"{r['ms_baseline']:.3f}")
                    + tuple(f"{v[g]['ms']:.3f} ({v[g]['speedup']:.3f}x)" for g in groups)
                    + ((f"{r['hold_ms_baseline']:.3f}",) if held else ())
                    + (tuple(f"{v[g]['hold_ms']:.3f} ({v[g]['hold_speedup']:.3f}x)"
                             for g in groups) if held else ())
                    + (f"{r['activation_mem_baseline'] / 2**20:.0f}",
                       f"{v[groups[0]]['activation_mem'] / 2**20:.0f}",
                       f"{max(v[g]['err'] for g in groups):.1e}"))
    lines = [_src(name, d, "chained"), "", f"{d['method']}.", ""]
    lines += _table(("shape", "tokens", "torch ms") + tuple(f"group {g} ms" for g in groups)
                    + (("torch ms sustained",) + tuple(f"group {g} ms sustained"
                                                      for g in groups) if held else ())
                    + ("torch MiB", f"ours MiB (group {groups[0]})", "max rel err"), rows) + [""]

    def ratios(key):
        per = {g: [r["variants"][g][key] for r in d["rows"]] for g in groups}
        return (", ".join(f"group {g} {_rng(per[g], '{:.3f}', 'x')}" for g in groups)
                + f" (>= 0.95x on {sum(b >= 0.95 for b in per[groups[0]])} of "
                  f"{len(per[groups[0]])}; goal: all)")
    ratio = [r["variants"][groups[0]]["activation_ratio"] for r in d["rows"]]
    mem = f"activation memory {_rng(ratio, '{:.2f}', 'x')} the baseline's"
    if d.get("baseline_act_in_place"):
        wide = [q for q, r in zip(ratio, d["rows"]) if r["hidden_slice"] >= r["N"]]
        mem += (f" (gelu in place: H + out), <= 0.6x on {sum(q <= 0.6 for q in wide)} of the "
                f"{len(wide)} points with hidden >= N (goal: all), above it on "
                f"{sum(q > 1 for q in ratio)} (goal: none)")
    else:
        inplace = [r["variants"][groups[0]]["activation_mem"]
                   / in_place_baseline_bytes(r["tokens"], r["hidden_slice"], r["N"])
                   for r in d["rows"]]
        wide = [q for q, r in zip(inplace, d["rows"]) if r["hidden_slice"] >= r["N"]]
        mem += (f" (its gelu out of place); against the baseline with gelu in place (H + out) "
                f"{_rng(inplace, '{:.2f}', 'x')}, <= 0.6x on {sum(q <= 0.6 for q in wide)} of "
                f"the {len(wide)} points with hidden >= N (goal: all)")
    cell = ("against torch addmm + act + mm timed in the same rounds: " + ratios("speedup")
            + (f"; sustained (each path alone at the power cap) {ratios('hold_speedup')}"
               if held else "") + f"; {mem}")
    return lines, cell, [(name, d)]


AREAS = {"producer": producer, "layer": layer, "upproj": upproj, "ranks": ranks,
         "dispatch_bytes": dispatch_bytes, "consumer": consumer, "combine": combine, "ffn": ffn,
         "scale": scale, "packed": packed, "chained": chained, "plan": plan,
         "ordered_tables": ordered_tables}


def _src(name, doc, area):
    dev, date, commit = _meta(doc)
    return (f"Source `bench/results/{name}`; device {dev}, {_gpus(area, doc)} GPU(s), date "
            f"{date}, commit {commit}; {_fresh_text(_fresh(area, doc), doc, area)}.")


# ------------------------------------------------------------------------------ outputs
ROW_OF = {"producer": "producer grouped GEMM as `MoECombine` launches it (CuTe DSL)",
          "layer": "one MoE layer on one GPU (`bench_moe_layer`, overlap backend)",
          "upproj": "arrival-gated SwiGLU up-projection as `MoELayer` launches it (CuTe DSL)",
          "ranks": "multi-rank correctness, ranks sharing one GPU",
          "dispatch_bytes": "dispatch bytes (`MoEDispatch`, counted; no GPU)",
          "consumer": "consumer (CuTe DSL)",
          "scale": "scale (CuTe DSL)",
          "combine": "overlapped combine (`backend=\"overlap\"`)",
          "ffn": "fused TP FFN (`backend=\"fused\"`)",
          "packed": "producer on fine-grained MoE plans (`layout=\"packed\"`)",
          "chained": "chained FFN compute kernel (`ffn/compute_chained.py`)",
          "plan": "planner + prepare (CuTe DSL kernels; torch reference)",
          "ordered_tables": "scale=\"ordered\" per-routing tables (CuTe DSL kernels; torch "
                            "and host references)"}

_RANK = {"stale": 2, "unknown": 1, "current": 0}


def _row(area, cell, docs):
    """The status row of an area: its cell, then card, GPUs, date, commit and freshness of the
    files it was computed from (the least fresh one speaks for the row)."""
    def uniq(vals):
        return ", ".join(dict.fromkeys(vals))
    metas = [_meta(d) for _, d in docs]
    fresh = [(_fresh(area, d), d) for _, d in docs]
    worst = max(fresh, key=lambda fd: (_RANK[fd[0]["state"]], fd[0]["commits"] or 0))
    return (ROW_OF[area], cell, uniq(_card(m[0]) for m in metas),
            uniq(str(_gpus(area, d)) for _, d in docs), uniq(m[1] for m in metas),
            uniq(m[2] for m in metas), _fresh_text(worst[0], worst[1], area),
            ", ".join(dict.fromkeys(f"`{n}`" for n, _ in docs)))


def build(root=".", unknown_as=None):
    """{relative path: generated text}: the README status block and docs/RESULTS.md.
    unknown_as: the text put where freshness is unknown (check() passes a placeholder)."""
    _CTX.update(root=root, git=Git(root), unknown=unknown_as)
    rows, sections = [], []
    for area, fn in AREAS.items():
        lines, cell, docs = fn(root)
        rows.append(_row(area, cell, docs))
        sections += [f"## {HEADLINE[area][0]}", ""] + lines
    block = [BEGIN, "<!-- generated by `moe-overlap report` from bench/results/; do not edit -->",
             ""] + _table(("piece", "result", "card", "GPUs", "date", "commit",
                           "freshness (moe_overlap/provenance.py)", "source (bench/results/)"),
                          rows) + [
        "", "Per-shape numbers, devices, dates and commits: [docs/RESULTS.md](docs/RESULTS.md). "
        "Stale: a source file the number depends on changed since it was measured.",
        END]
    results = ["# Results", "", "Generated by `moe-overlap report` (moe_overlap/report.py) from "
               "the headline result files in bench/results/; do not edit by hand. History and "
               "older files: bench/NOTES.md, bench/results/archive/ (INDEX.md).", ""] + sections
    return {"README.md": "\n".join(block), RESULTS_MD: "\n".join(results).rstrip() + "\n"}


_UNKNOWN = "\x00freshness\x00"


def _matches(generated: str, text: str) -> bool:
    """text equals generated, where generated's unknown-freshness placeholders stand for any
    text within the line that has no table bar."""
    parts = generated.split(_UNKNOWN)
    if len(parts) == 1:
        return generated == text
    return re.fullmatch("[^|\n]*".join(re.escape(p) for p in parts), text) is not None


def _readme_with(readme: str, block: str) -> str:
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return readme[:i] + block + readme[j + len(END):]


def problems(root=".") -> list[str]:
    """What is out of date or missing (empty when everything matches)."""
    out = []
    res = os.path.join(root, "bench", "results")
    named = {n for _, files in HEADLINE.values() for n in files} | set(INPUTS) | set(READ_BY)
    for n in sorted(named):
        if not os.path.isfile(os.path.join(res, n)):
            out.append(f"named result file missing: bench/results/{n}")
    for n in sorted(os.listdir(res)):
        if n != "archive" and n not in named:
            out.append(f"bench/results/{n} is named by neither HEADLINE, INPUTS nor READ_BY in "
                       "moe_overlap/report.py: make it a headline, list it, or move it to "
                       "bench/results/archive/ (and say what it was for in its INDEX.md)")
    for n, readers in sorted(READ_BY.items()):
        stem = n.rsplit(".", 1)[0]
        for r in readers:
            path = os.path.join(root, r)
            if not os.path.isfile(path):
                continue  # a partial copy of the tree (tests)
            with open(path) as f:
                text = f.read()
            if n not in text and f"{stem}.*" not in text:
                out.append(f"{r} no longer names bench/results/{n} (READ_BY): archive it")
    if out:
        return out
    gen = build(root, unknown_as=_UNKNOWN)
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        out.append(f"README.md has no {BEGIN} ... {END} block")
    elif not _matches(gen["README.md"], readme[i:j + len(END)]):
        out.append("README.md status block differs from `moe-overlap report`")
    path = os.path.join(root, RESULTS_MD)
    if not os.path.exists(path) or not _matches(gen[RESULTS_MD], open(path).read()):
        out.append(f"{RESULTS_MD} differs from `moe-overlap report`")
    return out


def write(root="."):
    gen = build(root)
    path = os.path.join(root, "README.md")
    with open(path) as f:
        readme = f.read()
    with open(path, "w") as f:
        f.write(_readme_with(readme, gen["README.md"]))
    os.makedirs(os.path.join(root, "docs"), exist_ok=True)
    with open(os.path.join(root, RESULTS_MD), "w") as f:
        f.write(gen[RESULTS_MD])
    return ["README.md", RESULTS_MD]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="moe-overlap report", description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=".", help="the repository (default: the current folder)")
    ap.add_argument("--check", action="store_true",
                    help="write nothing; exit 1 if README.md / docs/RESULTS.md are out of date")
    args = ap.parse_args(argv)
    if args.check:
        bad = problems(args.root)
        for p in bad:
            print(p, file=sys.stderr)
        print("report: up to date" if not bad else f"report: {len(bad)} problem(s)")
        return 1 if bad else 0
    bad = [p for p in problems(args.root) if "differs" not in p]
    if bad:
        for p in bad:
            print(p, file=sys.stderr)
        return 1
    print("wrote " + ", ".join(write(args.root)))
    return 0
