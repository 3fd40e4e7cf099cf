"""moe-overlap command line: demo | plan-stats | validate | sweep | report | project |
project-ffn (also `project --ffn`) | project-layer (also `project --layer`) | heap."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings


ROUTER_MODES = ("balanced", "moderate_skew", "stress_skew")  # moe_overlap.routing.ROUTER_MODES
TILE_MS = (64, 128, 256)  # moe_overlap.combine.plan.SUPPORTED_TILE_M
# the sweep's default shapes (tokens x experts x topk x N x K): --backend overlap keeps N and K
from .combine.shapes import MODELS, SYNTHETIC  # noqa: E402  (no torch: fast help pages)

MODEL_NAMES = tuple(MODELS)
from .ffn.shapes import FFN_SHAPES  # noqa: E402  (a plain dict: no torch)

FFN_SHAPE_NAMES = tuple(FFN_SHAPES)

from .paths import RESULTS, checkout_file, checkout_root, output_path_error  # noqa: E402

OVERLAP_SHAPES = tuple(tuple(int(v) for v in s.split("x")) for s in SYNTHETIC)  # T, E, k, N, K


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


def _float_type(low_open: bool):
    """argparse type: a finite float > 0 (low_open) or >= 0."""
    what = "a number > 0" if low_open else "a number >= 0"

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not math.isfinite(v) or v < 0 or (low_open and v == 0):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return v
    parse.__name__ = what
    return parse


_positive_float, _nonnegative_float = _float_type(True), _float_type(False)


def _check_out(parser, opt: str, path: str, folder: bool) -> None:
    """parser.error (exit 2) unless the output path can be written (before any work)."""
    why = output_path_error(path, folder)
    if why:
        parser.error(f"{opt} {path!r}: {why}")


def _int_list(choices=None):
    """argparse type: a comma-separated list of positive ints (optionally from choices)."""
    def parse(text: str) -> list[int]:
        out = [_positive_int(t.strip()) for t in text.split(",")]
        bad = [v for v in out if choices is not None and v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(
                f"{bad[0]} is not one of {', '.join(map(str, choices))}")
        return out
    parse.__name__ = "list of ints"
    return parse


def _name_list(choices):
    def parse(text: str) -> list[str]:
        out = [t.strip() for t in text.split(",")]
        bad = [v for v in out if v not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(choices)}")
        return out
    parse.__name__ = "list of names"
    return parse


def _check_experts(parser, experts, topk, world_sizes):
    """parser.error (exit 2) unless experts split evenly over every world size and topk fits."""
    for W in world_sizes:
        if experts % W:
            parser.error(f"--experts {experts} is not divisible by world size {W} (the experts "
                         "are split evenly over the ranks)")
    if topk > experts:
        parser.error(f"--topk {topk} exceeds --experts {experts}")


def _progress(it, total, desc):
    try:
        from tqdm import tqdm
        return tqdm(it, total=total, desc=desc, file=sys.stderr)
    except ImportError:
        return it


# ------------------------------------------------------------------------------- demo
def cmd_demo(args) -> int:
    from .routing import ROUTER_MODES
    from .combine.validation import LayerCase, check_layers, passed

    cases = [LayerCase(mode=m, tokens=args.tokens, num_experts=args.experts, topk=args.topk,
                       model_dim=64, hidden=128, out_features=96, tile_m=args.tile_m, mgb=args.mgb,
                       seed=args.seed, dtype=args.dtype) for m in ROUTER_MODES]
    print(f"moe-overlap demo: {args.world_size} CPU ranks (gloo), {args.tokens} tokens/rank, "
          f"{args.experts} experts, top-{args.topk}, tile_m={args.tile_m}, mgb={args.mgb}, "
          f"{args.dtype}, backend=reference")
    t0 = time.time()
    results = check_layers(args.world_size, cases)
    ok = True
    hdr = (f"{'router mode':<14}{'rows':>7}{'padded':>8}{'pad %':>7}{'remote %':>9}{'bands':>7}"
           f"{'segs':>6}{'err vs baseline':>17}{'err vs f64':>12}  result")
    print(hdr)
    print("-" * len(hdr))
    for case, res in zip(cases, results):
        good = passed(res)
        ok &= good
        s = [r["stats"] for r in res]
        rows = sum(x["rows_valid"] for x in s)
        padded = sum(x["rows_padded"] for x in s)
        remote = sum(x["remote_rows"] for x in s)
        print(f"{case.mode:<14}{rows:>7}{padded:>8}{100 * (padded - rows) / max(rows, 1):>7.1f}"
              f"{100 * remote / max(rows, 1):>9.1f}{sum(x['bands'] for x in s):>7}"
              f"{sum(x['segments'] for x in s):>6}{max(r['rel_err'] for r in res):>17.2e}"
              f"{max(r['rel_err_f64'] for r in res):>12.2e}  {'ok' if good else 'MISMATCH'}")
    print(f"(sums over {args.world_size} ranks; max relative errors over ranks; "
          f"{time.time() - t0:.1f} s)")
    print("demo passed" if ok else "demo FAILED: the overlapped plan does not match the baseline")
    return 0 if ok else 1


# ------------------------------------------------------------------------------- plan-stats
def plan_stats_rows(world_sizes, tile_ms, modes, tokens, experts, topk, seed=0, scaling="weak",
                    layouts=("aligned", "packed")):
    """Padding overhead and band/segment counts, aggregated over all ranks of each world size,
    per plan layout.

    scaling "weak": `tokens` per rank at every W; "strong": `tokens` in all, tokens / W per rank
    (W must divide it: the rows and the plot's label say the same number)."""
    from .combine.plan import plan_combine
    from .routing import routing_counts

    rows = []
    for W in world_sizes:
        if experts % W:
            raise ValueError(f"--experts {experts} is not divisible by world size {W}")
        if scaling == "strong" and tokens % W:
            raise ValueError(f"--global-tokens {tokens} is not divisible by world size {W}")
        per_rank = tokens if scaling == "weak" else tokens // W
        for mode in modes:
            counts = routing_counts(W, per_rank, experts, topk, mode, seed)
            for tm, layout in ((tm, lay) for tm in tile_ms for lay in layouts):
                tot = {"rows_valid": 0, "rows_padded": 0, "bands": 0, "remote_bands": 0,
                       "segments": 0, "remote_rows": 0}
                worst = 0.0
                for r in range(W):
                    s = plan_combine(counts, r, tile_m=tm, mgb=2, layout=layout).stats()
                    for k in tot:
                        tot[k] += s[k]
                    worst = max(worst, s["padding_overhead"])
                rows.append({"scaling": scaling, "world_size": W, "tokens_per_rank": per_rank,
                             "mode": mode, "tile_m": tm, "layout": layout, **tot,
                             "padding_overhead": (tot["rows_padded"] - tot["rows_valid"])
                             / max(tot["rows_valid"], 1),
                             "worst_rank_padding_overhead": worst,
                             "remote_fraction": tot["remote_rows"] / max(tot["rows_valid"], 1)})
    return rows


def cmd_plan_stats(args) -> int:
    world_sizes, tile_ms, modes = args.world_sizes, args.tile_m, args.modes
    tasks = [(scaling, tokens, W, mode)
             for scaling, tokens in (("weak", args.tokens), ("strong", args.global_tokens))
             for W in world_sizes for mode in modes]
    rows = []
    for scaling, tokens, W, mode in _progress(tasks, len(tasks), "plan-stats"):
        rows += plan_stats_rows([W], tile_ms, [mode], tokens, args.experts, args.topk, args.seed,
                                scaling, args.layouts)
    os.makedirs(args.out, exist_ok=True)
    print(f"plan statistics: {args.experts} experts, top-{args.topk}; weak scaling: {args.tokens} "
          f"tokens/rank; strong scaling: {args.global_tokens} tokens over all ranks.\n"
          "padding = padded rows / routed rows - 1, over all ranks")
    hdr = (f"{'scaling':<8}{'W':>4}{'tok/rank':>9} {'router mode':<14}{'tile_m':>7}"
           f" {'layout':<8}{'pad %':>8}"
           f"{'worst rank %':>13}{'remote %':>9}{'bands':>8}{'segments':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['scaling']:<8}{r['world_size']:>4}{r['tokens_per_rank']:>9} {r['mode']:<14}"
              f"{r['tile_m']:>7} {r['layout']:<8}"
              f"{100 * r['padding_overhead']:>8.1f}{100 * r['worst_rank_padding_overhead']:>13.1f}"
              f"{100 * r['remote_fraction']:>9.1f}{r['bands']:>8}{r['segments']:>9}")
    meta = {"tokens_per_rank": args.tokens, "global_tokens": args.global_tokens,
            "experts": args.experts, "topk": args.topk, "seed": args.seed,
            "layouts": list(args.layouts)}
    with open(os.path.join(args.out, "plan_stats.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    png = os.path.join(args.out, "plan_stats.png")
    try:
        _plot_plan_stats(rows, modes, tile_ms, png, meta)
        print(f"wrote {os.path.join(args.out, 'plan_stats.json')} and {png}")
    except ImportError:
        print(f"wrote {os.path.join(args.out, 'plan_stats.json')} (install matplotlib for the plot)")
    return 0


def _plot_plan_stats(rows, modes, tile_ms, path, meta):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scalings = (("weak", f"{meta['tokens_per_rank']} tokens/rank"),
                ("strong", f"{meta['global_tokens']} tokens in all"))
    fig, axes = plt.subplots(2, len(modes), figsize=(4.2 * len(modes), 6.6), sharey="row",
                             squeeze=False)
    for row, (scaling, what) in enumerate(scalings):
        for ax, mode in zip(axes[row], modes):
            for tm, layout in ((tm, lay) for tm in tile_ms for lay in meta["layouts"]):
                pts = sorted((r["world_size"], 100 * r["padding_overhead"]) for r in rows
                             if r["mode"] == mode and r["tile_m"] == tm and r["scaling"] == scaling
                             and r["layout"] == layout)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        ls="-" if layout == "packed" else "--", label=f"tile_m={tm} {layout}")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}, {what}", fontsize=9)
            ax.set_xlabel("world size W")
            ax.grid(alpha=0.3)
        axes[row][0].set_ylabel("padding (% of routed rows)")
    axes[0][0].legend()
    fig.suptitle(f"Padding vs rank count ({meta['experts']} experts, top-{meta['topk']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- project
def cmd_project(args) -> int:
    from .combine.projection import (PRODUCER_FILE, Fabric, ProducerRates, check_producer,
                                     check_sweep_files, format_sources, format_table,
                                     input_sources, plot, project, write)
    from .combine.tuning import CostModel
    from .provenance import source_text
    cost = CostModel()
    fabric = Fabric(gpus_per_node=args.gpus_per_node, ib_gbps=args.ib_gbps,
                    ib_latency_us=args.ib_latency_us)
    root = checkout_root()
    producer = producer_check = None
    if root:
        with open(os.path.join(root, RESULTS, PRODUCER_FILE)) as f:
            pdoc = json.load(f)
        producer, producer_check = ProducerRates.from_doc(pdoc), check_producer(pdoc)
    inputs = input_sources(root, cost, fabric, producer)
    check = check_sweep_files(args.sweep_docs, cost, fabric) if args.sweep_docs else None
    skipped = [f"{m} at W={W}" for m in args.models for W in args.world_sizes
               if MODELS[m][0] % W]
    if skipped:
        print("skipped (the experts do not split evenly over W ranks): " + ", ".join(skipped))
    rows = project(models=args.models, worlds=args.world_sizes, mode=args.mode,
                   tokens=args.tokens, cost=cost, fabric=fabric, producer=producer,
                   progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    print(f"Projection (not a measurement): {args.tokens} tokens per rank, {args.mode} routing; "
          "times in ms, best ccta per point. Inputs (value: source file (card, GPUs, date, "
          "commit; freshness)):")
    print(format_sources(inputs))
    if producer_check:
        print("Check of the GEMM rates on the token count they were not fitted on (" +
              PRODUCER_FILE + "): " + ", ".join(
                  f"{k} error mean {100 * v['mean']:+.1f} %, max |{100 * v['max_abs']:.1f}| %"
                  for k, v in producer_check["summary"].items()))
        for p in producer_check["points"]:
            print(f"  {p['label']:<32} from T={p['fitted_on_tokens']}: producer "
                  f"{100 * p['err_producer_ms']:+.1f} %, library {100 * p['err_library_ms']:+.1f} %,"
                  f" ratio {100 * p['err_ratio']:+.1f} %")
    else:
        print("No checkout here: CostModel's one GEMM rate for ours and the library's (no "
              f"{PRODUCER_FILE} to read).")
    if check:
        check_inputs = input_sources(root, cost, fabric, None)
        print("Check of the model on the measured 2-GPU sweep (" + ", ".join(check["files"])
              + "), with the rates of its era (CostModel: gemm_tflops "
              f"{cost.gemm_tflops:.0f} from {source_text(check_inputs['gemm_tflops']['source'])}"
              "; the others as above); every rank's rows rebuilt from the routing, the slowest rank against the "
              "sweep's maximum over ranks, the GEMM alone on every SM as the sweep times it:")
        for label, c in (("all points", check), ("held out", check["held_out"])):
            if not c:
                print(f"  {label}: none (no point of these files is in HELD_OUT_SWEEP, "
                      "moe_overlap/combine/projection.py)")
                continue
            print(f"  {label}: " + ", ".join(
                f"{k} error mean {100 * c[k]['mean']:+.0f} %, max |{100 * c[k]['max_abs']:.0f}| %"
                for k in ("t_gemm", "t_comm", "t_overlap") if k in c)
                + (f" (n = {c['t_overlap']['n']})" if "t_overlap" in c else ""))
        for e in check["points"]:
            if e["held_out"]:
                print(f"    K {e['K']:>5} N {e['N']:>5} {e['mode']:<14} ccta {e['ccta']:>2}: "
                      f"t_overlap {e['t_overlap_ms']:.3f} ms measured, {e['model_t_overlap_ms']:.3f}"
                      f" model ({100 * e['err_t_overlap']:+.1f} %)")
    else:
        check_inputs = None
        print("Not checked against a measured sweep (--sweep ''; a checkout's bench/results/ "
              "holds one).")
    print(format_table(rows))
    meta = _projection_meta(root, tokens=args.tokens, mode=args.mode,
                            sweep=list(args.sweep_docs))
    _write_and_plot(os.path.join(args.out, "projection.json"),
                    lambda out: write(rows, out, fabric, cost, check, meta, inputs,
                                      producer_check, check_inputs),
                    lambda png: plot(rows, png, fabric, check, inputs, producer_check))
    return 0


def _git_commit(root: str) -> str:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root,
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _projection_meta(root, **fields) -> dict:
    """The meta of a projection JSON: a model, not a device; when and from which commit."""
    import datetime
    return dict(device="model", kind="projection",
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                git_commit=_git_commit(root) if root else "?", **fields)


def _write_and_plot(out: str, write, plot) -> None:
    """write(out), then plot(<out>.png) where matplotlib is installed (the JSON either way)."""
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    write(out)
    png = os.path.splitext(out)[0] + ".png"
    try:
        plot(png)
        print(f"wrote {out} and {png}")
    except ImportError:
        print(f"wrote {out} (matplotlib is not installed: no plot)")


FFN_CHECK_FILE = "ffn_fused_v7_final_2xh200.json"  # the measured 2-GPU layer project-ffn checks


def cmd_project_ffn(args) -> int:
    from .ffn.projection import (Assumptions, FFNRates, check_reduce, format_check,
                                 format_sources, format_table, input_sources, plot, project,
                                 write)
    rates = FFNRates.from_results(args.root)
    a = Assumptions(busbw_gbps=args.busbw_gbps)
    inputs = input_sources(args.root, rates, a)
    with open(os.path.join(args.root, RESULTS, FFN_CHECK_FILE)) as f:
        check = check_reduce(json.load(f)["results"], rates)
    rows = project(shapes=args.shapes, worlds=args.world_sizes, tokens=args.tokens, rates=rates,
                   assumptions=a)
    print(a.describe(rates) + ".")
    print("Inputs (the values are in the JSON; source file (card, GPUs, date, commit; "
          "freshness)):")
    print(format_sources(inputs))
    print("Check of the compute='reduce' model on the measured 2-GPU layer "
          "(ffn_fused_v7_final_2xh200.json), torch rate from the same run (the kernels' rates "
          "come from that run too: a check of how the model composes them, the layer's time "
          "itself is no input):")
    print(format_check(check["same_run"]))
    print("... and with torch's rate from ffn_baseline_h200.json (as projected):")
    print(format_check(check["cross_run"]))
    print(f"Chained layer: {check['chained']}.")
    print("Projection (ms per call and GPU; x = reference / fused; goal x: the chained path with "
          "the all-reduce goal met, NCCL's bandwidth on 16 SMs):")
    print(format_table(rows))
    meta = _projection_meta(args.root, tokens=args.tokens, worlds=args.world_sizes,
                            command="moe-overlap project-ffn " + " ".join(args.argv))
    _write_and_plot(args.out, lambda out: write(rows, out, rates, a, check, meta, inputs),
                    lambda png: plot(rows, png, a, check, rates, inputs))
    return 0


def cmd_project_layer(args) -> int:
    from .combine.projection import PRODUCER_FILE, Fabric, ProducerRates, check_producer
    from .combine.projection_layer import (BYTES_FILE, UPPROJ_WINDOW_FILES, LayerRates, UpRates,
                                           check_bytes, format_table, input_sources, plot,
                                           project_layer, summary, write)
    from .combine.projection import format_sources
    from .combine.tuning import CostModel
    cost = CostModel()
    fabric = Fabric(gpus_per_node=args.gpus_per_node, ib_gbps=args.ib_gbps,
                    ib_latency_us=args.ib_latency_us)
    root = checkout_root()
    producer = producer_check = bytes_doc = up = None
    up_windows = ()
    if root:
        with open(os.path.join(root, RESULTS, PRODUCER_FILE)) as f:
            pdoc = json.load(f)
        producer, producer_check = ProducerRates.from_doc(pdoc), check_producer(pdoc)
        with open(os.path.join(root, RESULTS, BYTES_FILE)) as f:
            bytes_doc = json.load(f)
        up = UpRates.from_files(root)
        up_windows = tuple(UpRates.from_files(root, (n,)) for n in UPPROJ_WINDOW_FILES)
    rates = LayerRates.from_results(root)
    inputs = input_sources(root, cost, fabric, rates, producer, up=up, up_windows=up_windows)
    rows = project_layer(models=args.models, worlds=args.world_sizes, tokens=args.tokens,
                         mode=args.mode, cost=cost, fabric=fabric, rates=rates,
                         producer=producer, up=up, up_windows=up_windows,
                         progress=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
    bcheck = check_bytes(rows, bytes_doc) if bytes_doc else None
    print(f"Projection of the MoE layer (not a measurement): {args.mode} routing, rank 0; times "
          "in ms; layer = dispatch || up-projection, then down-projection || combine; (a) NCCL "
          "all-to-all per assignment + library GEMMs + NCCL all-to-all, sequential; (b) today's "
          "layer: (a)'s dispatch and up-projection, then the overlapped combine. Inputs:")
    print(format_sources(inputs))
    if bcheck:
        print(f"Dispatch bytes against {BYTES_FILE}: {bcheck['points']} points, equal: "
              f"{bcheck['equal']}")
    print(format_table(rows))
    meta = _projection_meta(root, tokens=args.tokens, worlds=args.world_sizes, mode=args.mode,
                            summary=summary(rows),
                            command="moe-overlap project-layer " + " ".join(args.argv))
    _write_and_plot(args.out,
                    lambda out: write(rows, out, fabric, cost, rates, meta, inputs, bcheck,
                                      producer_check),
                    lambda png: plot(rows, png, fabric, rates, inputs, bcheck))
    return 0


# ------------------------------------------------------------------------------- validate
VALIDATE_DEFAULTS = {"world_sizes": [2, 3, 4], "experts": 12, "tokens": 96, "topk": 2,
                     "dtype": "float32", "device": "cpu"}


def overlap_validate_argv(args, parser) -> list[str]:
    """`validate --backend overlap` as `sweep --validate-only` arguments: options the sweep can
    honour are passed on, the others refused (parser.error)."""
    argv = ["--validate-only", "--out", args.out or "validate_overlap.json"]
    if args.world_sizes is not None:
        if len(args.world_sizes) != 1:
            parser.error("--backend overlap runs on one set of GPUs: give one --world-sizes "
                         "value (default: every visible GPU)")
        argv += ["--world-size", str(args.world_sizes[0])]
    if args.dtype not in (None, "bfloat16"):
        parser.error(f"--backend overlap computes in bfloat16; --dtype {args.dtype} is for the "
                     "reference backend")
    if args.device not in (None, "cuda"):
        parser.error(f"--backend overlap runs on CUDA GPUs; --device {args.device} is for the "
                     "reference backend")
    for opt in ("race_calls", "soak"):
        if getattr(args, opt) is not None:
            argv += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    given = {k: getattr(args, k) for k in ("tokens", "experts", "topk")
             if getattr(args, k) is not None}
    if given and args.shapes is not None:
        parser.error("--backend overlap: give --shapes or --tokens/--experts/--topk, not both")
    if args.shapes is not None:
        argv += ["--shapes", args.shapes]
    if given:  # the grid's shapes with these tokens / experts / topk, N and K as the sweep's
        shapes = [(given.get("tokens", T), given.get("experts", E), given.get("topk", k), N, K)
                  for T, E, k, N, K in OVERLAP_SHAPES]
        _check_experts(parser, shapes[0][1], shapes[0][2], args.world_sizes or [])
        argv += ["--shapes", ",".join("x".join(map(str, s)) for s in shapes)]
    return argv


def resolve_validate_args(args, parser) -> None:
    """Fill the reference grid's defaults and refuse what cannot run, before any rank starts."""
    for k, v in VALIDATE_DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    _check_experts(parser, args.experts, args.topk, args.world_sizes)
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            parser.error("--device cuda: CUDA is not available here (use --device cpu)")
        if torch.cuda.device_count() < max(args.world_sizes):
            parser.error(f"--device cuda needs one GPU per rank: world size "
                         f"{max(args.world_sizes)} > {torch.cuda.device_count()} GPUs")


def cmd_validate(args) -> int:
    if args.backend == "overlap":  # the GPU grid: router modes x ccta x mgb x benchmark shapes
        from .combine.sweep import main as sweep_main
        return sweep_main(args.overlap_argv)
    from .routing import ROUTER_MODES
    from .combine.validation import LayerCase, check_layers, passed

    world_sizes = args.world_sizes
    grid = [(m, tm, mgb) for m in ROUTER_MODES for tm in (64, 128) for mgb in (1, 2, 4)]
    failures = 0
    total = 0
    records = []
    for W in _progress(world_sizes, len(world_sizes), "world sizes"):
        E = args.experts
        cases = [LayerCase(mode=m, tile_m=tm, mgb=mgb, num_experts=E, tokens=args.tokens,
                           topk=args.topk, seed=i, backend=args.backend, dtype=args.dtype)
                 for i, (m, tm, mgb) in enumerate(grid)]
        for case, res in zip(cases, check_layers(W, cases, args.device)):
            total += 1
            records.append({"world_size": W, "passed": passed(res), "ranks": res})
            if not passed(res):
                failures += 1
                print(f"MISMATCH W={W} {case}: "
                      f"{[(r['rel_err'], r['rel_err_f64']) for r in res]}")
    print(f"validate: {total - failures}/{total} cases passed (backend={args.backend}, "
          f"{args.dtype}, {args.device})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"passed": total - failures, "total": total, "cases": records}, f, indent=1)
    return 1 if failures else 0


# ------------------------------------------------------------------------------- heap
def _layer_spec(text: str) -> tuple:
    """argparse type: T_MAX,TOPK,N[,COUNT[,EXPERTS]] (a model name from
    moe_overlap.combine.shapes instead of TOPK,N: NAME@T_MAX[,COUNT], its experts known).
    Returns (T_MAX, TOPK, N, COUNT, EXPERTS), EXPERTS 0 where not given."""
    parts = [t.strip() for t in text.split(",")]
    name, _, tok = parts[0].lower().partition("@")
    try:
        if name in MODELS:
            if not tok or len(parts) > 2:
                raise ValueError
            e, k, _, n = MODELS[name]
            vals = [int(tok), k, n, int(parts[1]) if len(parts) > 1 else 1, e]
        else:
            if len(parts) not in (3, 4, 5):
                raise ValueError
            vals = [int(p) for p in parts] + [1, 0][len(parts) - 3:]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected T_MAX,TOPK,N[,COUNT[,EXPERTS]] or MODEL@T_MAX[,COUNT] (models: "
            f"{', '.join(MODEL_NAMES)})") from None
    if any(v < 1 for v in vals[:4]) or vals[4] < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: every value must be a positive integer")
    if vals[2] % 8:
        raise argparse.ArgumentTypeError(f"{text!r}: N={vals[2]} must be a multiple of 8 "
                                         "(16-byte rows)")
    return tuple(vals)


def cmd_heap(args) -> int:
    from .combine.comm_buffer import LayerShape, format_heap_report, heap_report
    specs = getattr(args, "layer", None) or [(4096, 8, 7168, 60, 256)]
    ordered = args.scale == "ordered"
    if ordered and any(not e for *_, e in specs):
        raise SystemExit("moe-overlap heap: --scale ordered needs each layer's experts "
                         "(T_MAX,TOPK,N,COUNT,EXPERTS or MODEL@T_MAX[,COUNT]): its per-segment "
                         "arrival words depend on them")
    layers = [LayerShape(t, k, n, c, e if ordered else 0, args.tile_m)
              for t, k, n, c, e in specs]
    r = heap_report(layers, args.world_size)
    r["layer_shapes"] = [list(x) for x in specs]
    r["scale"] = args.scale
    print(format_heap_report(r))
    if args.json:
        print(json.dumps(r, indent=1))
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    p = argparse.ArgumentParser(prog="moe-overlap", description=__doc__, formatter_class=fmt)
    sub = p.add_subparsers(
        dest="cmd", metavar="{demo,plan-stats,validate,sweep,report,project,project-ffn,project-layer,heap}")
    d = sub.add_parser("demo", help="CPU ranks: router -> dispatch -> combine, vs the baseline "
                       "(the default command)", formatter_class=fmt,
                       description="W CPU ranks (gloo) run router -> dispatch -> combine for each "
                       "router mode and compare with the sequential baseline and a float64 "
                       "truth; exits 1 on a mismatch.")
    d.add_argument("--world-size", type=_positive_int, default=4, help="CPU ranks (processes)")
    d.add_argument("--tokens", type=_positive_int, default=256, help="tokens per rank")
    d.add_argument("--experts", type=_positive_int, default=16,
                   help="global experts (a multiple of --world-size)")
    d.add_argument("--topk", type=_positive_int, default=4, help="experts per token")
    d.add_argument("--tile-m", type=int, default=64, choices=TILE_MS,
                   help="rows per band (the GEMM's M tile)")
    d.add_argument("--mgb", type=_positive_int, default=2, help="bands per transfer")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="data type of tokens and weights")
    d.add_argument("--seed", type=int, default=0, help="router and data seed")
    s = sub.add_parser("plan-stats", help="padding overhead and band/segment counts vs W",
                       formatter_class=fmt,
                       description="Plan statistics (padding, remote rows, bands, segments) "
                       "over world sizes, tile_m and router modes, under weak and strong "
                       "scaling; writes plan_stats.json and plan_stats.png under --out.")
    s.add_argument("--world-sizes", type=_int_list(), default="4,8,16,32,64",
                   help="comma-separated world sizes")
    s.add_argument("--tile-m", type=_int_list(TILE_MS), default="64,128,256",
                   help="comma-separated tile_m values")
    s.add_argument("--modes", type=_name_list(ROUTER_MODES), default=",".join(ROUTER_MODES),
                   help="comma-separated router modes")
    s.add_argument("--layouts", type=_name_list(("aligned", "packed")), default="aligned,packed",
                   help="comma-separated plan layouts")
    s.add_argument("--tokens", type=_positive_int, default=4096,
                   help="tokens per rank (weak scaling)")
    s.add_argument("--global-tokens", type=_positive_int, default=32768,
                   help="tokens over all ranks (strong scaling)")
    s.add_argument("--experts", type=_positive_int, default=256,
                   help="global experts (a multiple of every world size)")
    s.add_argument("--topk", type=_positive_int, default=8, help="experts per token")
    s.add_argument("--seed", type=int, default=0, help="router seed")
    s.add_argument("--out", default=os.path.join("out", "plan-stats"),
                   help="output folder (relative: under the current folder)")
    sub.add_parser("sweep", help="GPUs: overlap validation grid + ccta x mgb sweep (see "
                   "`moe-overlap sweep --help`)", add_help=False)
    v = sub.add_parser(
        "validate", help="the validation grid: CPU ranks (reference backend), or the GPU grid "
        "of the overlap backend (--backend overlap)",
        description="The validation grid (router modes x tile_m 64/128 x mgb 1/2/4) for each "
        "world size, against the sequential baseline and a float64 truth. --backend overlap "
        "runs `moe-overlap sweep --validate-only` instead (GPUs, bfloat16): --world-sizes (one "
        "value), --tokens, --experts, --topk and --out are passed on, options it cannot honour "
        "are refused.")
    v.add_argument("--world-sizes", type=_int_list(), default=None,
                   help="comma-separated world sizes (default: 2,3,4; overlap: one value, "
                   "default every visible GPU)")
    v.add_argument("--experts", type=_positive_int, default=None,
                   help="global experts, a multiple of every world size (default: 12; overlap: "
                   "the sweep's 16)")
    v.add_argument("--tokens", type=_positive_int, default=None,
                   help="tokens per rank (default: 96; overlap: the sweep's 4096)")
    v.add_argument("--topk", type=_positive_int, default=None,
                   help="experts per token (default: 2; overlap: the sweep's 4)")
    v.add_argument("--backend", default="reference", choices=["reference", "overlap", "auto"],
                   help="combine backend (default: reference)")
    v.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                   help="data type (default: float32; overlap: bfloat16 only)")
    v.add_argument("--out", default="", help="write every case's results as JSON (default: "
                   "none; overlap: validate_overlap.json)")
    v.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="cpu: gloo ranks; cuda: one GPU per rank, NCCL (default: cpu; overlap: "
                   "cuda only)")
    v.add_argument("--shapes", default=None,
                   help="--backend overlap: the shapes (moe_overlap.combine.shapes: TxExkxNxK, "
                        "model names, synthetic, models, all; default: synthetic)")
    v.add_argument("--race-calls", type=_nonnegative_int, default=None,
                   help="--backend overlap: extra calls per point with fresh data and poisoned "
                        "buffers (default: 3)")
    v.add_argument("--soak", type=_nonnegative_int, default=None,
                   help="--backend overlap: CUDA-graph replays of the soak (default: 0, none)")
    sub.add_parser("report", help="README status table and docs/RESULTS.md from bench/results/ "
                   "(see `moe-overlap report --help`)", add_help=False)
    j = sub.add_parser(
        "project", help="scale-out projection of the combine's same-scale speedup, W = 2..64",
        formatter_class=fmt,
        description="Projected same-scale speedup of the overlapped combine against W for the "
        "model shapes, aligned vs packed layout, from measured rates (moe_overlap/combine/"
        "projection.py), checked against the measured 2-GPU sweep; prints a table, writes "
        "projection.json and projection.png under --out. A projection, not a measurement.")
    j.add_argument("--models", type=_name_list(MODEL_NAMES), default=",".join(MODEL_NAMES),
                   help="comma-separated model shapes (moe_overlap.combine.shapes.MODELS)")
    j.add_argument("--world-sizes", type=_int_list(), default="2,4,8,16,32,64",
                   help="comma-separated world sizes (those the experts divide)")
    j.add_argument("--tokens", type=_positive_int, default=4096, help="tokens per rank")
    j.add_argument("--mode", default="balanced", choices=ROUTER_MODES, help="router mode")
    j.add_argument("--gpus-per-node", type=_positive_int, default=8,
                   help="GPUs per NVLink domain")
    j.add_argument("--ib-gbps", type=_positive_float, default=50.0,
                   help="InfiniBand bandwidth per GPU between nodes, GB/s (stated, > 0)")
    j.add_argument("--ib-latency-us", type=_nonnegative_float, default=10.0,
                   help="InfiniBand latency, us (>= 0)")
    j.add_argument("--sweep", default=",".join(
        f for f in (checkout_file(RESULTS, n) for n in ("combine_sweep_2xh200_v7.json",
                                                        "combine_sweep_2xh200_v7_k14336.json"))
        if f), help="measured 2-GPU sweep JSON files the model is checked against, "
        "comma-separated ('': none); the default is the two in the checkout this package runs "
        "from (their held-out points: moe_overlap/combine/projection.py, HELD_OUT_SWEEP)")
    j.add_argument("--out", default=os.path.join("out", "projection"),
                   help="output folder (relative: under the current folder)")
    f = sub.add_parser(
        "project-ffn", help="projection of the tensor-parallel FFN to G = 2, 4, 8 GPUs "
        "(also `project --ffn`)", formatter_class=fmt,
        description="Projected reference / fused time of the tensor-parallel FFN on G GPUs of "
        "one NVLink node for the seed shapes, from measured one- and two-GPU rates "
        "(moe_overlap/ffn/projection.py); the model of the compute='reduce' path is checked "
        "against the measured 2-GPU layer and its error printed. Prints a table, writes the "
        "JSON (every rate, its source and every assumption) and a PNG beside it. A projection, "
        "not a measurement.")
    f.add_argument("--shapes", type=_name_list(FFN_SHAPE_NAMES), default=",".join(FFN_SHAPE_NAMES),
                   help="comma-separated FFN shapes (moe_overlap.ffn.shapes.FFN_SHAPES)")
    f.add_argument("--world-sizes", type=_int_list(), default="2,4,8",
                   help="comma-separated GPU counts G (>= 2, dividing every hidden size)")
    f.add_argument("--tokens", type=_int_list(), default="8192,32768",
                   help="comma-separated token counts")
    f.add_argument("--busbw-gbps", type=_positive_float, default=None,
                   help="NCCL bf16 all-reduce bus bandwidth assumed at G > 2, GB/s (default: "
                   "each shape's measured 2-GPU value)")
    f.add_argument("--root", default=checkout_root() or "",
                   help="the moe-overlap checkout whose bench/results/ holds the measured "
                   "rates; the default is the one this package runs from")
    f.add_argument("--out", default=os.path.join("out", "project-ffn", "projection_ffn.json"),
                   help="JSON to write, the PNG beside it (relative: under the current folder; "
                   "the tracked result is bench/results/projection_ffn_g2_8.json)")
    ly = sub.add_parser(
        "project-layer", help="projection of the whole MoE layer (dispatch || up-projection, "
        "down-projection || combine), W = 2..64 (also `project --layer`)", formatter_class=fmt,
        description="Projected time of one MoE layer call against NCCL all-to-all + library "
        "GEMMs (all sequential) and against today's combine-only overlap, for the model shapes, "
        "from measured and stated rates (moe_overlap/combine/projection_layer.py: what is "
        "measured, stated and assumed). Writes the JSON (every input with its source, the "
        "assumptions) and a PNG beside it. A projection, not a measurement.")
    ly.add_argument("--models", type=_name_list(MODEL_NAMES),
                    default="deepseek-v3,qwen3-235b-a22b",
                    help="comma-separated model shapes (moe_overlap.combine.shapes.MODELS)")
    ly.add_argument("--world-sizes", type=_int_list(), default="2,4,8,16,32,64",
                    help="comma-separated world sizes (those the experts divide)")
    ly.add_argument("--tokens", type=_int_list(), default="4096,16384",
                    help="comma-separated tokens per rank")
    ly.add_argument("--mode", default="balanced", choices=ROUTER_MODES, help="router mode")
    ly.add_argument("--gpus-per-node", type=_positive_int, default=8,
                    help="GPUs per NVLink domain")
    ly.add_argument("--ib-gbps", type=_positive_float, default=50.0,
                    help="InfiniBand bandwidth per GPU between nodes, GB/s (stated, > 0)")
    ly.add_argument("--ib-latency-us", type=_nonnegative_float, default=10.0,
                    help="InfiniBand latency, us (>= 0)")
    ly.add_argument("--out", default=os.path.join("out", "project-layer", "projection_layer.json"),
                    help="JSON to write, the PNG beside it (relative: under the current folder; "
                    "the tracked result is bench/results/projection_layer.json)")
    hp = sub.add_parser(
        "heap", help="symmetric (NVSHMEM) heap the combine needs, with and without sharing",
        formatter_class=fmt,
        description="The symmetric heap per rank that the overlapped combine's communication "
        "buffers take for a model's layers: every layer its own buffer (2 x T_max x topk x N x "
        "2 bytes + a 24 W-byte block each) vs one CommBuffer shared by all of them (the "
        "MoECombine default: 2 slots of the largest layer + one block), and the "
        "NVSHMEM_SYMMETRIC_SIZE to set. Pure arithmetic: no GPU.")
    hp.add_argument("--layer", type=_layer_spec, action="append", default=argparse.SUPPRESS,
                    help="a layer shape T_MAX,TOPK,N[,COUNT[,EXPERTS]] (T_MAX: "
                    "max_tokens_per_rank; COUNT layers of it, default 1; EXPERTS: all ranks', "
                    "needed with --scale ordered) or MODEL@T_MAX[,COUNT]; repeat for several "
                    "shapes (default: 4096,8,7168,60, i.e. 60 DeepSeek-V3 layers at 4096 tokens)")
    hp.add_argument("--world-size", type=_positive_int, default=8,
                    help="ranks in the combine's process group (sizes the communication block)")
    hp.add_argument("--scale", choices=("plain", "ordered"), default="plain",
                    help="the layers' scale: 'ordered' adds W x segment capacity int64 "
                    "per-segment arrival words to the block (CombineOptions.scale)")
    hp.add_argument("--tile-m", type=int, default=128, choices=TILE_MS,
                    help="the layers' tile_m (sizes the segment capacity with --scale ordered)")
    hp.add_argument("--json", action="store_true",
                    help="also print the numbers as JSON")
    return p, {"demo": d, "plan-stats": s, "validate": v, "project": j, "project-ffn": f,
               "project-layer": ly, "heap": hp}


def _report_root_error(argv) -> str | None:
    """Why `report` cannot run on its --root (it rewrites README.md from bench/results/ of a
    checkout), or None. `--help` always runs."""
    if "-h" in argv or "--help" in argv:
        return None
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--root", default=".")
    root = ap.parse_known_args(argv)[0].root
    if os.path.isfile(os.path.join(root, "README.md")) and os.path.isdir(
            os.path.join(root, RESULTS)):
        return None
    return (f"{os.path.abspath(root)} is not a moe-overlap checkout (no README.md and "
            f"{RESULTS}/ there): run it from the checkout or pass --root PATH")


def _check_project_args(args, parser) -> None:
    """project: every model gets at least one world size that splits its experts (the pairs
    that do not are skipped, and said so); the measured sweep is read here (a missing or bad file
    is a usage error)."""
    for m in args.models:
        if all(MODELS[m][0] % W for W in args.world_sizes):
            parser.error(f"--world-sizes {','.join(map(str, args.world_sizes))}: none divides "
                         f"the {MODELS[m][0]} experts of {m} (each model needs one)")
    args.sweep_docs = {}
    for path in [p for p in args.sweep.split(",") if p]:
        try:
            with open(path) as f:
                doc = json.load(f)
            if not doc["points"]:
                raise ValueError("no points")
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--sweep {path!r}: not a readable sweep JSON with points "
                         f"({type(e).__name__}: {e}); pass --sweep '' for no check")
        args.sweep_docs[os.path.basename(path)] = doc
    _check_out(parser, "--out", args.out, folder=True)


def _check_project_ffn_args(args, parser) -> None:
    """project-ffn: G >= 2 dividing every hidden size; the measured rates it reads exist."""
    bad = [G for G in args.world_sizes if G < 2]
    if bad:
        parser.error(f"--world-sizes: G must be >= 2, got {bad}")
    for name in args.shapes:
        if any(FFN_SHAPES[name][1] % G for G in args.world_sizes):
            parser.error(f"--world-sizes {args.world_sizes}: not all divide the hidden size "
                         f"{FFN_SHAPES[name][1]} of {name}")
    from .ffn.projection import FILES
    if not args.root:
        parser.error(f"no moe-overlap checkout found beside this package: pass --root PATH, a "
                     f"checkout whose {RESULTS}/ holds {', '.join(FILES)}")
    missing = [n for n in dict.fromkeys(FILES + (FFN_CHECK_FILE,))
               if not os.path.isfile(os.path.join(args.root, RESULTS, n))]
    if missing:
        parser.error(f"--root {args.root!r}: {RESULTS}/ there lacks {', '.join(missing)} (pass "
                     "--root PATH, a moe-overlap checkout)")
    _check_out(parser, "--out", args.out, folder=False)


def main(argv=None) -> int:
    warnings.filterwarnings("ignore", category=FutureWarning)
    p, subs = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["report"]:  # its own options (moe_overlap/report.py)
        why = _report_root_error(argv[1:])
        if why:
            print(f"moe-overlap report: error: {why}", file=sys.stderr)
            return 2
        from .report import main as report_main
        return report_main(argv[1:])
    if argv[:1] == ["sweep"]:  # GPUs: its own options (moe_overlap/combine/sweep.py)
        from .combine.sweep import main as sweep_main
        return sweep_main(argv[1:])
    if argv[:1] == ["project"] and "--ffn" in argv:  # the FFN's projection, same command family
        argv = ["project-ffn"] + [x for x in argv[1:] if x != "--ffn"]
    if argv[:1] == ["project"] and "--layer" in argv:  # the whole layer's projection
        argv = ["project-layer"] + [x for x in argv[1:] if x != "--layer"]
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["demo"] + argv  # the main job: the CPU demo
    args = p.parse_args(argv)
    if args.cmd is None:
        p.error("choose a command")
    sp = subs[args.cmd]
    if args.cmd == "demo":
        _check_experts(sp, args.experts, args.topk, [args.world_size])
    elif args.cmd == "plan-stats":
        _check_experts(sp, args.experts, args.topk, args.world_sizes)
        for W in args.world_sizes:
            if args.global_tokens % W:
                sp.error(f"--global-tokens {args.global_tokens} is not divisible by world size "
                         f"{W} (strong scaling splits it evenly over the ranks)")
        _check_out(sp, "--out", args.out, folder=True)
    elif args.cmd == "validate" and args.backend == "overlap":
        args.overlap_argv = overlap_validate_argv(args, sp)
        _check_out(sp, "--out", args.overlap_argv[2], folder=False)
    elif args.cmd == "validate":
        resolve_validate_args(args, sp)
        if args.out:
            _check_out(sp, "--out", args.out, folder=False)
    elif args.cmd == "project":
        _check_project_args(args, sp)
    elif args.cmd == "project-ffn":
        _check_project_ffn_args(args, sp)
        args.argv = argv[1:]
    elif args.cmd == "project-layer":
        for m in args.models:
            if all(MODELS[m][0] % W for W in args.world_sizes):
                sp.error(f"--world-sizes {','.join(map(str, args.world_sizes))}: none divides "
                         f"the {MODELS[m][0]} experts of {m} (each model needs one)")
        _check_out(sp, "--out", args.out, folder=False)
        args.argv = argv[1:]
    return {"demo": cmd_demo, "plan-stats": cmd_plan_stats, "validate": cmd_validate,
            "project": cmd_project, "project-ffn": cmd_project_ffn,
            "project-layer": cmd_project_layer,
            "heap": cmd_heap}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
