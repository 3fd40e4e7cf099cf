"""The README status table and docs/RESULTS.md, built from the result files in bench/results/.

    moe-overlap report [--root DIR] [--check]      (also: python scripts/report.py)

Which file is "newest" is decided by one rule, written here: `HEADLINE` names the current result
file(s) of every area, and only those are read. A new measurement becomes the headline by editing
that table and rerunning the report; `CURRENT_OTHER` lists the other files kept next to them
(inputs of the cost model, experiments without a successor). Everything older lives in
bench/results/archive/. `check()` fails when a named file is missing, when bench/results/ holds a
result file that neither table names (a new result nobody classified), or when README.md /
docs/RESULTS.md differ from what the files give (numbers edited by hand, or not regenerated).

The report reads JSON only (no torch), so it runs anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# area -> (title, current headline files, in bench/results/)
HEADLINE = {
    "producer": ("Producer grouped GEMM (CuTe DSL, band flags)",
                 ("grouped_gemm_v11_boost.json", "grouped_gemm_v11_back_to_back.json",
                  "grouped_gemm_v10_boost.json", "grouped_gemm_v10_back_to_back.json")),
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

# result files kept in bench/results/ that are not headline numbers (each with why)
CURRENT_OTHER = {
    "plan_h100_ordered_kernel_d457261.json": "the ordered tables' kernels with seg_inc zeroed "
                                             "at the [W, Sc] capacity by a memset (H100)",
    "ordered_routes_kernel_tests_2db7e5d.log": "the ordered tables' kernels' GPU tests and the "
                                               "ordered scale's, seg_inc by prefix (65 passed)",
    "ordered_routes_kernels_h100_2db7e5d.log": "the ordered tables' launches, each one's device "
                                               "time (profile_ordered_routes --kernels, H100)",
    "grouped_gemm_h100_e256_5868c2e.json": "the producer at 256 balanced experts (512 rows "
                                           "each, K 2048) and at 16, against the library (H100)",
    "moe_layer_1xh100_profile_487df88.json": "deepseek-v3@16384 on ONE GPU (H100) with each "
                                             "layer's longest kernels (--profile)",
    "moe_layer_1xh200_profile_487df88.json": "deepseek-v3@16384 on ONE GPU (H200) with each "
                                             "layer's longest kernels (--profile)",
    "profile_combine_layer_bf50eb1.log": "ours' combine in the one-GPU layer part by part: the "
                                         "producer on the layer's plan vs balanced bands "
                                         "(bench/profile_combine_layer.py, H100 and H200)",
    "moe_layer_1xh100_models_5868c2e.json": "one MoE layer on ONE GPU (H100, W=1: no remote "
                                            "rows), the four model shapes at 4096 and 16384 "
                                            "tokens, scale=plain",
    "moe_layer_1xh100_plain_2db7e5d.json": "one MoE layer on ONE GPU (H100), scale=plain, beside "
                                           "the ordered run of the same commit",
    "moe_layer_1xh100_ordered_2db7e5d.json": "one MoE layer on ONE GPU (H100), scale=ordered: its "
                                             "plan + prepare on the side stream under the dispatch",
    "plan_h100_ordered_kernel_4a2e90b.json": "the ordered tables' kernels, first run (4-round "
                                             "sort chunks, tables after prepare, H100)",
    "plan_h100_ordered_kernel_003ba4c.json": "the ordered tables with seg_inc zeroed by the "
                                             "senders kernel (reverted: slower at W = 64, H100)",
    "ffn_chained_compute_h100_auto_phased_0792106.json": "chained kernel, group auto with the "
                                                         "phased orders, the 14 points on an H100",
    "profile_ordered_routes_h200_918b75d.log": "the ordered scale's device tables by stage "
                                               "(bench/profile_ordered_routes.py, H200)",
    "ffn_chained_compute_h200_auto_patch_7dea59e.json": "chained kernel on an H200, the previous "
                                                        "auto rule (auto_group only); the FFN "
                                                        "projection's sustained ratios",
    "ffn_chained_compute_h100_t32768_2631ea0.json": "chained kernel at 32768 tokens on an H100: "
                                                    "the phased orders and 16p4c2 against the "
                                                    "auto_group rule, sustained",
    "ffn_chained_compute_h100_c2phased_2631ea0.json": "chained kernel at 8192 tokens on an H100: "
                                                      "the phased orders on 2-CTA clusters",
    "ffn_chained_compute_h100_phased_73897e1.json": "chained kernel at 8192 tokens on an H100: the "
                                                    "phased orders (8p1r16l8s, 6p1r18l6s, 4p1s) "
                                                    "against auto, 8p4, 16p4, sustained",
    "ffn_chained_compute_h100_cap_73897e1.json": "chained kernel, deepseek-v3-dense at 8192 tokens "
                                                 "on an H100: orders under the activation cap",
    "ffn_chained_compute_h100_lookahead_73897e1.json": "chained kernel at 8192 tokens on an H100: "
                                                       "16p4r32l16 against 16p4 and auto",
    "ffn_chained_compute_h100_cluster_73897e1.json": "chained kernel's 2-CTA cluster variant, "
                                                     "first run (llama3-70b, H100)",
    "plan_h100_73897e1.json": "the ordered scale's per-routing device tables (bench_plan --what "
                              "ordered, H100)",
    "ffn_chained_compute_h200_groups70b_c294d29.json": "chained kernel on llama3-70b, groups auto "
                                                       "(2), 3, 4, 8 in shuffled order",
    "ffn_chained_compute_h200_groups_32768_c294d29.json": "chained kernel, groups 2, 4, 8 at "
                                                          "32768 tokens, shuffled order",
    "ffn_chained_compute_h200_groups_8192_c294d29.json": "chained kernel, groups 2-16 at 8192 "
                                                         "tokens, shuffled order",
    "ffn_chained_compute_h200_groups_rest_c294d29.json": "chained kernel, groups 2-16 at 32768 "
                                                         "tokens (deepseek-v3-expert, mixtral)",
    "ffn_chained_compute_h200_auto_606aafd.json": "chained kernel, the auto rule over groups "
                                                  "8, 4, 2 unpatched, interleaved only: the runs "
                                                  "below show that interleaving favoured it",
    "ffn_chained_compute_h200_70b_hold_aec2584.json": "llama3-70b, interleaved then each path "
                                                      "alone for ~4 s (the clock trace beside it)",
    "ffn_chained_compute_h200_70b_lead20_aec2584.json": "llama3-70b with a 20 ms GPU sleep "
                                                        "before each call (still power-capped)",
    "ffn_70b_clock_trace_aec2584.csv": "nvidia-smi SM clock / power / throttle reasons during "
                                       "the two llama3-70b runs above",
    "ncu_chained_70b_8192_aec2584.csv": "ncu: baseline kernels and ours (group 8), llama3-70b, "
                                        "8192 tokens",
    "ncu_chained_70b_groups_8192_ef6ac23.csv": "ncu: ours at groups auto, 1, 2, 4, 8, 16 "
                                               "(DRAM / L2 bytes by group)",
    "ncu_chained_70b_32768_ef6ac23.csv": "ncu: baseline and ours (group 8), 32768 tokens",
    "ncu_chained_70b_patch_8192_7df8f19.csv": "ncu: ours with patched orders (8p2 .. 16p4)",
    "ffn_chained_compute_h200_70b_patch_7df8f19.json": "llama3-70b, patched orders, "
                                                       "interleaved + sustained",
    "ffn_chained_compute_h200_holds_patch_606dff6.json": "every slice: groups 8/4/2 unpatched, "
                                                         "8p4, "
                                                         "8p8, 16p4, interleaved + sustained "
                                                         "(what the new rule was chosen from)",
    "gpu_chained_tests_7dea59e.log": "chained kernel GPU tests with the new rule (32 passed)",
    "gpu_bar1_7dea59e.log": "band all-reduce emulated on one GPU, GPU tests (19 passed)",
    "gpu_autotune_7dea59e.log": "MoECombine.autotune at W=1 incl. order='auto' (10 passed)",
    "band_allreduce_onegpu_h200_7dea59e.json": "bf16 band all-reduce, G=2 emulated on one GPU "
                                               "(local HBM: the kernel's per-SM issue limit, "
                                               "not NVLink)",
    "packed_gemm_h200_w8_16_all_aec2584.json": "producer on packed plans at W = 8, 16, all "
                                               "three routings, both modes, both orders",
    "ffn_chained_grouped_h200_c294d29.json": "chained kernel's grouped call (ShardedExperts) vs "
                                             "torch._grouped_mm + act + torch._grouped_mm",
    "grouped_chained_tests_c294d29.log": "chained kernel GPU tests incl. the grouped call and "
                                         "ShardedExperts(compute='chained') on one rank (33 "
                                         "passed, the 2-GPU case skipped)",
    "packed_gemm_h200_w8_16_c294d29.json": "producer on packed plans at W = 8, 16, both orders "
                                           "(deepseek-v3, qwen3-235b, balanced)",
    "plan_kernel_orders_h200_5d8f208.json": "kernel planner in both orders, rank 0 (expert order "
                                            "1-2.5 us faster; prepare the same)",
    "plan_kernel_orders_last_h200_5d8f208.json": "kernel planner in both orders, the last rank",
    "plan_kernel_orders_gpu_tests_5d8f208.log": "kernel planner GPU tests in both orders "
                                                "(209 passed)",
    "combine_split_2xh200_pieces.json": "consumer rates of moe_overlap.combine.tuning.CostModel",
    "combine_split_2xh200_v7.json": "time split of one combine (gemm, overlap, scale, prepare)",
    "combine_split_2xh200_k14336_cluster2.json": "time split at K=14336, GEMM cluster 2",
    "band_ar_threads_unroll_2xh200.json": "band all-reduce threads x unroll",
    "fused_compute_c2_h200.json": "fused compute kernel, cluster_m=2",
    "fused_compute_epilogue_shapes_h200.json": "fused compute kernel, epilogue shapes",
    "fused_compute_hpair_h200.json": "fused compute kernel, h_pair",
    "fused_compute_hregs_h200.json": "fused compute kernel, h_regs",
    "fused_compute_phase_split_h200.json": "fused compute kernel, phases left out",
    "fused_compute_pingpong_h200.json": "fused compute kernel, ping-pong",
    "fused_compute_v5_variants_2xh200.json": "fused compute kernel variants",
    "validate_cpu_w4_w8.json": "CPU validation grid at W=4, 8",
    "packed_gemm_h200_tm64_2e87a02.json": "producer on packed plans at tile_m 64 (slower)",
    "projection_combine_w2_64.json": "projected same-scale speedup, W = 2..64 (moe-overlap project; "
                                     "a projection, not a measurement)",
    "projection_ffn_g2_8.json": "projected reference / fused FFN time at G = 2, 4, 8 (moe-overlap "
                                "project-ffn; a projection, not a measurement)",
    "ordered_scale_prediction_w2.json": "predicted T_overlap / bound of the token-ordered scale "
                                        "(bench/predict_ordered_scale.py; a model, not a "
                                        "measurement)",
    "single_gpu_tests_50c7989.log": "planner, producer and fused FFN single-GPU tests after the "
                                    "session's merges",
    "plan_kernel_h200_21d9b48.json": "first planner kernels (two plan launches) next to the torch "
                                     "planner: the torch reference's device time",
    "plan_kernel_gpu_tests_1622057.log": "planner kernel GPU tests, second version (120 passed)",
    "single_gpu_regress_1622057.log": "faults, producer and fused FFN single-GPU tests after the "
                                      "GEMM-base and fault merges (49 passed)",
    "ffn_chained_compute_h200_13e73a1.json": "chained kernel, six tile-order variants in one "
                                             "round (position-biased at 32768 tokens: see NOTES)",
    "chained_ffn_gpu_tests_13e73a1.log": "chained kernel GPU tests after the merges (21 passed)",
    "single_gpu_regress_13e73a1.log": "faults and fused FFN single-GPU tests after the options "
                                      "merge (17 passed)",
    "chained_ffn_gpu_tests_2bc5fa0.log": "GPU tests of the chained FFN compute kernel (18 passed)",
    "ffn_baseline_h200.json": "per-rank compute of the reference FFN (addmm + act + mm, G = 2 "
                              "slices): what the chained compute kernel must reach",
    "planner_and_gemm_gpu_tests_d98035d.log": "GPU tests of the planner and the producer on "
                                              "packed plans",
    "single_gpu_tests_fb15101.log": "producer bounds, ordered scale, W=1 fault and fused FFN "
                                    "single-GPU tests (77 passed, 6 need 2 GPUs)",
    "grouped_gemm_v12_bounds_fb15101.json": "producer with device bounds checks, --quick shape "
                                            "(1.018x the library)",
    "ordered_scale_h200_fb15101.json": "ordered scale, first run: 32-token tiles, 256 threads "
                                       "(2.4x the plain scale; B's mismatch a bench bug)",
    "ordered_scale_h200_tt32_th256_ff10300.json": "ordered scale, token tiles x threads",
    "ordered_scale_h200_tt8_th256_ff10300.json": "ordered scale, token tiles x threads",
    "ordered_scale_h200_tt4_th256_ff10300.json": "ordered scale, token tiles x threads",
    "ordered_scale_h200_tt16_th512_ff10300.json": "ordered scale, token tiles x threads",
    "ordered_scale_h200_tt8_th512_ff10300.json": "ordered scale, token tiles x threads",
    "ordered_scale_h200_defaults_fb5242b.json": "ordered scale with its new defaults (512 "
                                                "threads, 16-token tiles)",
    "scale_ordered_gpu_tests_fb5242b.log": "ordered scale GPU tests with the new defaults "
                                           "(7 passed)",
    "moe_layer_1xh200_overlap_fb5242b.json": "one MoE layer on ONE GPU, row placement by "
                                             "index_copy_ (superseded by the gather run)",
    "moe_layer_1xh200_gather_8b659eb.json": "one MoE layer on ONE GPU (W=1: no remote rows, "
                                            "nothing to hide; the 2-GPU run is the issue's)",
    "ordered_scale_tests_08c29b4.log": "ordered scale GPU tests with the peer-error poll "
                                       "(10 passed)",
    "ordered_scale_h200_peerpoll_08c29b4.json": "ordered scale with the peer-error poll, ccta 8 "
                                                "(A at today's rate)",
    "dispatch_1xh200_08c29b4.json": "dispatch_to_plan's placement, gather vs scatter vs the "
                                    "compact permutation (one GPU, eager)",
    "packed_gemm_h200_half_384457b.json": "producer with bands of <= 64 rows on one warpgroup "
                                          "(no gain; reverted)",
    "gemm_half_tests_384457b.log": "grouped GEMM + producer bounds GPU tests with the "
                                   "half-band skip (90 passed; reverted)",
    "packed_gemm_h200_expert_order_70a95b6.json": "producer on packed plans, remote-first vs "
                                                  "expert order at W=2 (1.04-1.10x the library "
                                                  "in expert order)",
}

BEGIN, END = "<!-- report:status:begin -->", "<!-- report:status:end -->"
RESULTS_MD = os.path.join("docs", "RESULTS.md")
RESULT_EXT = (".json", ".log")


def _load(root, name):
    with open(os.path.join(root, "bench", "results", name)) as f:
        return json.load(f)


def _meta(doc):
    """(device, date, commit) of a result file, '?' where it does not say."""
    m = doc.get("meta", doc)
    return (m.get("device", "?"), str(m.get("date", "?"))[:10],
            str(m.get("git_commit") or m.get("commit") or "?")[:10])


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
    lines, status = [], []
    for name in HEADLINE["producer"][1]:
        d = _load(root, name)
        rows, vs, flag = [], [], []
        for s in d["shapes"]:
            runs = {(r["config"], r["ccta"]): r for r in s["runs"]}
            c0, nf = runs.get(("def", 0)), runs.get(("def-noflag", 0))
            if c0 is None:
                continue
            f = (c0["median_ms"] / nf["median_ms"] - 1) * 100 if nf else None
            vs.append(c0["vs_lib_paired"])
            if f is not None:
                flag.append(f)
            rows.append((f"T{s['T']} N{s['N']} K{s['K']} E{s['E']}", f"{s['lib_ms']:.3f}",
                         s["lib_best"], f"{c0['median_ms']:.3f}", f"{c0['tflops']:.0f}",
                         f"{c0['vs_lib_paired']:.3f}", "n/a" if f is None else f"{f:.1f}"))
        regime = ("boost clock (a GPU sleep before each call)" if d.get("lead_ms", 0) > 0
                  else "calls back to back (power-limited clock)")
        lines += [f"### `{name}`: {regime}", "", _src(name, d), ""]
        lines += _table(("shape", "library ms", "library best", "ours ms", "TFLOP/s",
                         "library / ours (paired)", "flag cost %"), rows) + [""]
        status.append(f"{_rng(vs, '{:.3f}')}x ({d.get('tag', name)})")
        if flag:
            status[-1] += f", flags {_rng(flag, '{:.1f}', ' %')}"
    cell = ("at ccta=0, default options, the best library GEMM's time / ours on every bench "
            "shape: " + "; ".join(status))
    return lines, cell


def consumer(root):
    (name,) = HEADLINE["consumer"][1]
    d = _load(root, name)
    res = d["results"]
    sizes = sorted({r["bytes"] for r in res})
    cctas = sorted({r["ccta"] for r in res if r["variant"] != "copy_engine"})
    ce = {r["bytes"]: r["gbps"] for r in res if r["variant"] == "copy_engine"}
    rows = []
    for b in sizes:
        best = []
        for c in cctas:
            pts = [r for r in res if r["bytes"] == b and r["ccta"] == c
                   and r["variant"] != "copy_engine"]
            top = max(pts, key=lambda r: r["gbps"])
            best.append(f"{top['gbps']:.0f} ({top['variant'].replace('nvlink_tma_', '')})")
        rows.append([f"{b / 2 ** 20:.0f} MiB", f"{ce.get(b, float('nan')):.0f}"] + best)
    lines = [_src(name, d), "", "GB/s per direction with both directions busy; best ring per "
             "SM count (stages x chunk, lookahead).", ""]
    lines += _table(["size", "copy engine"] + [f"{c} SMs" for c in cctas], rows) + [""]
    big = max(sizes)
    at16 = max((r for r in res if r["bytes"] == big and r["ccta"] == 16), key=lambda r: r["gbps"],
               default=None)
    checked = {True: "received rows equal the sent ones; ", False: "DATA CHECK FAILED; "}.get(
        d["meta"].get("correct"), "")
    cell = (f"{checked}{at16['gbps']:.0f} GB/s per direction at 16 SMs for "
            f"{big / 2 ** 20:.0f} MiB (copy engine {ce.get(big, float('nan')):.0f})"
            if at16 else "no 16-SM point")
    return lines, cell


def _shape_name(s):
    base = f"T{s['tokens']} E{s['experts']} k{s['topk']} N{s['N']} K{s['K']}"
    return f"{s['name']} ({base})" if s.get("name") else base


def combine(root):
    lines, sweep_speed, same_scale, bounds, auto, valid = [], [], [], [], [], [0, 0]
    for name in HEADLINE["combine"][1]:
        d = _load(root, name)
        pts = d["points"]
        valid[0] += sum(bool(p["passed"]) for p in pts)
        valid[1] += len(pts)
        if all(p.get("timing") == "none" for p in pts):  # a validation-only grid
            lines += [f"### `{name}`: validation grid", "", _src(name, d), "",
                      f"{sum(bool(p['passed']) for p in pts)}/{len(pts)} points bitwise equal "
                      "to the non-overlapped path and within 8e-3 of the sequential baseline "
                      f"({len({json.dumps(p['shape']) for p in pts})} shapes x "
                      f"{len({p['mode'] for p in pts})} router modes x "
                      f"{len({(p['ccta'], p['mgb']) for p in pts})} (ccta, mgb)).", ""]
            continue
        has_same = any("speedup_same_scale" in p for p in pts)
        rows = []
        for r in d["summary"]:
            best = min((p for p in pts if p["shape"] == r["shape"] and p["mode"] == r["mode"]),
                       key=lambda p: p.get("t_overlap", p.get("t_overlap_ms")))
            sp_t = best.get("speedup_torch", best.get("speedup"))
            sweep_speed.append(sp_t)
            bounds.append(best["overlap_over_bound"])
            if r.get("autotuned_over_best"):
                auto.append(r["autotuned_over_best"])
            row = [_shape_name(r["shape"]), r["mode"], f"{best['ccta']},{best['mgb']}"]
            if has_same:
                same_scale.append(best["speedup_same_scale"])
                row.append(f"{best['speedup_same_scale']:.2f}")
            row += [f"{sp_t:.2f}", f"{best['overlap_over_bound']:.2f}",
                    "n/a" if not r.get("autotuned_over_best") else
                    f"{r['autotuned_over_best']:.3f}",
                    "yes" if r["all_passed"] else "NO"]
            rows.append(row)
        hdr = ["shape", "mode", "best ccta,mgb"] + (["x same-scale"] if has_same else []) + [
            "x torch baseline", "T_overlap / bound", "autotune / best", "all valid"]
        lines += [f"### `{name}`", "", _src(name, d), ""]
        lines += _table(hdr, rows) + [""]
        if not has_same:
            p0 = pts[0]
            lines += [f"Baseline: plain torch ({p0.get('seq_timing')} timing, GEMM "
                      f"`{p0.get('seq_gemm')}`, scale `{p0.get('seq_scale')}`); this file has "
                      "no same-scale baseline (CUDA graph, our scale kernel).", ""]
    lead = (f"{_rng(same_scale)}x the same-scale baseline, " if same_scale else
            "same-scale baseline not measured yet; ")
    cell = (f"{valid[0]}/{valid[1]} sweep and validation points bitwise equal to the "
            f"non-overlapped path; {lead}{_rng(sweep_speed)}x the torch-only sequential baseline "
            f"(best ccta, mgb); T_overlap / max(T_gemm, T_comm) = {_rng(bounds)}; autotune / "
            f"sweep best {_rng(auto, '{:.3f}')}")
    return lines, cell


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
    lines = [_src(name, d), "", f"Medians of {rounds} interleaved rounds; speed = reference time "
             "/ fused time (above 1: the fused backend is faster); bound = the speed a perfect "
             "overlap would give.", ""]
    lines += _table(("shape", "dims", "reference ms", "fused ms", "speed", "bound",
                     "memory fused / reference", "error vs reference"), rows) + [""]
    cell = (f"correct on 2 GPUs; {_rng(v for _, v in sp)}x the speed of the reference backend "
            f"over {len(sp)} shapes (slowest: {min(sp, key=lambda x: x[1])[0]}); the reference "
            "stays the default")
    return lines, cell


def scale(root):
    (name,) = HEADLINE["scale"][1]
    d = _load(root, name)
    v = min(d["variants"], key=lambda v: v["ms"])
    rows = [(x["variant"], f"{x['ms']:.3f}", f"{x['TBs']:.2f}",
             "yes" if x["bitwise_equal_default"] else "NO") for x in d["variants"]]
    lines = [_src(name, d), "", f"T={d['T']}, top-{d['topk']}, N={d['N']}; floor "
             f"{d['floor_ms_at_4p8TBs']:.3f} ms at 4.8 TB/s; torch gather + bmm "
             f"{d['torch_gather_bmm_ms']:.3f} ms.", ""]
    lines += _table(("variant", "ms", "TB/s", "bitwise = default"), rows) + [""]
    cell = (f"{v['ms']:.3f} ms at T={d['T']}, top-{d['topk']}, N={d['N']} ({v['TBs']:.1f} TB/s; "
            f"torch gather + bmm {d['torch_gather_bmm_ms']:.3f} ms)")
    return lines, cell


def packed(root):
    (name,) = HEADLINE["packed"][1]
    d = _load(root, name)
    pts = d["points"]
    rows = [(p["model"], str(p["world_size"]), p["mode"], f"{p['aligned_padding']:.2f}",
             f"{p['packed_padding']:.3f}", f"{p['library_ms']:.3f}", f"{p['aligned_ms']:.3f}",
             f"{p['packed_ms']:.3f}", f"{p['aligned_vs_library']:.3f}",
             f"{p['packed_vs_library']:.3f}", "yes" if p["correct"] else "NO") for p in pts]
    lines = [_src(name, d), "", "One GPU; rank 0's plan of W ranks' routings, "
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
            f"{_rng([p['aligned_padding'] for p in pts])}; deepseek-v3, qwen3 routings, W = "
            f"{', '.join(str(w) for w in sorted({p['world_size'] for p in pts}))}")
    return lines, cell


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
        lines += [_src(name, d), "", f"{d['method']}.", ""]
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
    cell = (f"{'; '.join(parts)} of device time (W = {ws[0]}..{ws[-1]}, first and last rank; "
            f"goal <= 30 us together); bitwise equal to the torch planner")
    return lines, cell


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
    lines = [_src(name, d), "", f"{d['method']}. impl: torch = the torch ops (the senders' "
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
            f"{', '.join(map(str, ws))}; {_meta(d)[0]}); bitwise equal to the host reference: "
            f"{all(r['equal_to_reference'] for r in rs)}")
    return lines, cell


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
    lines = [_src(name, d), "", f"{d['method']}.", ""]
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
    card = d["device"].replace("NVIDIA ", "").split()[0]
    cell = (f"one {card}, against torch addmm + act + mm timed in the same rounds: "
            + ratios("speedup")
            + (f"; sustained (each path alone at the power cap) {ratios('hold_speedup')}"
               if held else "")
            + f"; {mem}; in FusedFFN and "
            f"ShardedExperts as compute='chained' (not the default before its 2-GPU run)")
    return lines, cell


AREAS = {"producer": producer, "consumer": consumer, "combine": combine, "ffn": ffn,
         "scale": scale, "packed": packed, "chained": chained, "plan": plan,
         "ordered_tables": ordered_tables}


def _src(name, doc):
    dev, date, commit = _meta(doc)
    return f"Source `bench/results/{name}`; device {dev}, date {date}, commit {commit}."


# ------------------------------------------------------------------------------ outputs
STATIC_ROWS = (
    ("planner, reference backend, CLI",
     "done; property-tested on CPU, sync-free plan checked on CUDA", "tests"),
)
ROW_OF = {"producer": "producer grouped GEMM (CuTe DSL, WGMMA + TMA, band flags)",
          "consumer": "consumer (CuTe DSL, nvlink / nvshmem transports)",
          "scale": "scale (CuTe DSL)",
          "combine": "overlapped combine (`backend=\"overlap\"`)",
          "ffn": "fused TP FFN (`backend=\"fused\"`)",
          "packed": "producer on fine-grained MoE plans (`layout=\"packed\"`)",
          "chained": "chained FFN compute kernel (`ffn/compute_chained.py`)",
          "plan": "planner + prepare (CuTe DSL kernels; torch reference)",
          "ordered_tables": "scale=\"ordered\" per-routing tables (CuTe DSL kernels; torch "
                            "and host references)"}


def build(root="."):
    """{relative path: generated text}: the README status block and docs/RESULTS.md."""
    cells, sections = {}, []
    for area, fn in AREAS.items():
        lines, cell = fn(root)
        cells[area] = cell
        sections += [f"## {HEADLINE[area][0]}", ""] + lines
    rows = list(STATIC_ROWS) + [
        (ROW_OF[a], cells[a], ", ".join(f"`{n}`" for n in HEADLINE[a][1])) for a in AREAS]
    block = [BEGIN, "<!-- generated by `moe-overlap report` from bench/results/; do not edit -->",
             ""] + _table(("piece", "state", "source (bench/results/)"), rows) + [
        "", "Per-shape numbers, devices, dates and commits: [docs/RESULTS.md](docs/RESULTS.md).",
        END]
    results = ["# Results", "", "Generated by `moe-overlap report` (moe_overlap/report.py) from "
               "the headline result files in bench/results/; do not edit by hand. History and "
               "older files: bench/NOTES.md, bench/results/archive/.", ""] + sections
    return {"README.md": "\n".join(block), RESULTS_MD: "\n".join(results).rstrip() + "\n"}


def _readme_with(readme: str, block: str) -> str:
    i, j = readme.find(BEGIN), readme.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README.md has no {BEGIN} ... {END} block")
    return readme[:i] + block + readme[j + len(END):]


def problems(root=".") -> list[str]:
    """What is out of date or missing (empty when everything matches)."""
    out = []
    res = os.path.join(root, "bench", "results")
    named = {n for _, files in HEADLINE.values() for n in files} | set(CURRENT_OTHER)
    for n in sorted(named):
        if not os.path.isfile(os.path.join(res, n)):
            out.append(f"named result file missing: bench/results/{n}")
    for n in sorted(os.listdir(res)):
        if n.endswith(".json") and ".tune." not in n and n not in named:
            out.append(f"bench/results/{n} is named by neither HEADLINE nor CURRENT_OTHER in "
                       "moe_overlap/report.py: make it a headline, list it, or archive it")
    if out:
        return out
    gen = build(root)
    with open(os.path.join(root, "README.md")) as f:
        readme = f.read()
    try:
        if _readme_with(readme, gen["README.md"]) != readme:
            out.append("README.md status block differs from `moe-overlap report`")
    except ValueError as e:
        out.append(str(e))
    path = os.path.join(root, RESULTS_MD)
    if not os.path.exists(path) or open(path).read() != gen[RESULTS_MD]:
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
