"""Tensor-parallel FFN baseline and the band all-reduce kernel vs NCCL (issue 5).

    torchrun --nproc-per-node 2 bench/bench_ffn.py [--tokens 8192] [--shapes llama3-8b,...]
        [--act1 gelu] [--act2 none] [--rounds 30] [--skip-kernel] [--out DIR]
    python bench/bench_ffn.py --dry-run      # CPU: parse, list shapes / FLOPs / bytes, exit

Shapes (input = output N = P, hidden O), T = 8192 tokens, bf16, hidden split over the G ranks:
Llama 3 8B (4096, 14336), Llama 3 70B (8192, 28672), DeepSeek V3 dense (7168, 18432) and expert
(7168, 2048), Llama 4 Scout expert (5120, 8192) and shared (5120, 16384), Mixtral 8x7B expert
(4096, 14336).

Per shape, CUDA events, rounds interleaved, median (p10-p90), every rank starting together:
- ``baseline``: the plain-torch TP layer (``moe_overlap.ffn.reference.ffn_tp_reference``: addmm
  with b1, act1 in place, mm (+b2 on rank 0), NCCL all_reduce in bf16, act2 in place);
- ``compute``: the same without the all_reduce (the floor a perfect overlap reaches when compute
  dominates); ``allreduce_bf16``: NCCL all_reduce of the [T, N] bf16 partial alone;
  ``overlap_headroom`` = baseline - max(compute, allreduce_bf16);
- ``nccl_fp32``: NCCL all_reduce of a [T, N] fp32 buffer (the fused kernel's accumulator size);
- ``band_ar``: ``moe_overlap.ffn.band_allreduce.BandAllReduce`` (unicast backend, fp32 accumulator
  -> + b2, act2 -> bf16 out, accumulator zeroed), including its three tiny bookkeeping launches;
  ``band_ar_nozero``: the same without zeroing the accumulator.
Bus bandwidth (NCCL convention) = 2 (G-1)/G * bytes / time. JSON (device, date, git commit,
per-rank medians) to --out (default $OUT, else bench/results); the table is printed last.
NVLink multicast is never used: the script sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless already set.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_overlap.ffn.shapes import FFN_SHAPES  # noqa: E402

SHAPES = FFN_SHAPES  # name: (P = N, O)
ACTS = ("relu", "gelu", "gelu_tanh", "silu")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--shapes", default="all",
                    help=f"comma-separated subset of {', '.join(SHAPES)} (default all)")
    ap.add_argument("--act1", default="gelu", choices=ACTS)
    ap.add_argument("--act2", default="none", choices=("none",) + ACTS)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--band-rows", type=int, default=32,
                    help="rows per band of the band all-reduce (default 32: T=8192 gives 256 "
                         "bands, enough for one CTA per SM; one CTA works on one band at a time)")
    ap.add_argument("--ccta", type=int, default=None,
                    help="CTAs of the band all-reduce (default: one per SM)")
    ap.add_argument("--threads", type=int, default=512)
    ap.add_argument("--unroll", type=int, default=2)
    ap.add_argument("--skip-kernel", action="store_true",
                    help="time only the torch/NCCL baseline (no CuTe DSL needed)")
    ap.add_argument("--no-fused", action="store_true",
                    help="skip FusedFFN(backend='fused') and its ablations")
    ap.add_argument("--fused-ccta", type=int, default=None,
                    help="SMs of the fused layer's communication blocks (default: FusedFFN's)")
    ap.add_argument("--fused-tile-m", type=int, default=128, choices=(64, 128))
    ap.add_argument("--ar-variants", default="",
                    help="standalone band all-reduce variants THREADSxUNROLL[n] (e.g. "
                         "512x2,1024x4n; n: without arrive_ahead) on --ar-variant-ccta SMs, as "
                         "band_ar_c<ccta>_t<threads>u<unroll>[n]")
    ap.add_argument("--ar-variant-ccta", type=int, default=16)
    ap.add_argument("--compute-options", default="",
                    help="FusedFFN compute_options of the fused layer, e.g. h_pair=1,cluster_m=2")
    ap.add_argument("--fused-variants", default="",
                    help="more fused layers timed in the same rounds, 'name:k=v,k=v;name2:...' "
                         "(compute_options, ccta, allreduce_band_rows, compute; registered as "
                         "fused_<name>, fused_compute_<name>; e.g. 'chained:compute=chained')")
    ap.add_argument("--lead-ms", type=float, default=4.0,
                    help="GPU sleep before each timed call so that the events time GPU work, "
                         "not the host's launch path (0: time from the host's first "
                         "instruction after the barrier, as before 2026-11-30)")
    ap.add_argument("--hold-s", type=float, default=0.0,
                    help="after the interleaved rounds, each path called alone back to back for "
                         "about this many seconds (timing.time_held; the same call count on "
                         "every rank): the sustained, power-capped rate, row['holds'] and "
                         "hold_speedup_vs_baseline")
    ap.add_argument("--quick", action="store_true", help="3 shapes, 10 rounds")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the plan (shapes, FLOPs, bytes) and exit; no GPU needed")
    ap.add_argument("--world", type=int, default=None,
                    help="world size assumed by --dry-run (default: $WORLD_SIZE or 2)")
    ap.add_argument("--tune-cache", default=None,
                    help="also write each shape's measured fused and reference times into this "
                         "FFN tune cache (moe_overlap.ffn.tuning.FFNTuneCache), which "
                         "FusedFFN(backend='auto') reads; needs the layer's default options")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.tune_cache and (a.fused_ccta is not None or a.compute_options or a.skip_kernel
                         or a.no_fused or a.fused_tile_m != 128 or a.act2 != "none"):
        ap.error("--tune-cache records the default fused layer (backend='auto' decides on it): "
                 "drop --fused-ccta / --compute-options / --fused-tile-m / --act2 / "
                 "--skip-kernel / --no-fused")
    names = list(SHAPES) if a.shapes == "all" else [s.strip() for s in a.shapes.split(",") if s]
    bad = [n for n in names if n not in SHAPES]
    if bad:
        ap.error(f"unknown shapes {bad}; choose from {list(SHAPES)}")
    if a.quick:
        names = names[:3] if a.shapes == "all" else names
        a.rounds = min(a.rounds, 10)
    if a.tokens < 1 or a.rounds < 1 or a.warmup < 0 or a.band_rows < 1:
        ap.error("--tokens, --rounds, --band-rows must be >= 1 and --warmup >= 0")
    a.shape_names = names
    try:
        items = [t.strip() for t in a.ar_variants.split(",") if t.strip()]
        a.ar_variants = []
        for t in items:
            nt, x, un = t.rstrip("n").partition("x")
            if not (x and nt.isdigit() and un.isdigit()):
                raise ValueError(f"--ar-variants item {t!r}: THREADSxUNROLL[n]")
            a.ar_variants.append((int(nt), int(un), not t.endswith("n")))
        a.compute_opts = parse_options(a.compute_options)
        a.variants = {}
        for item in filter(None, a.fused_variants.split(";")):
            name, _, opts = item.partition(":")
            if not name.isidentifier() or name in a.variants:
                raise ValueError(f"bad or repeated variant name {name!r}")
            a.variants[name] = parse_options(opts)
    except ValueError as e:
        ap.error(str(e))
    return a


def parse_options(text):
    """'k=v,k=v' -> dict; values are ints (0 / 1 for the boolean options) or strings."""
    out = {}
    for kv in filter(None, text.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ValueError(f"option {kv!r} is not key=value")
        out[k.strip()] = int(v) if v.strip().lstrip("-").isdigit() else v.strip()
    for k in ("h_pair",):
        if k in out:
            out[k] = bool(out[k])
    return out


def plan(a, world):
    rows = []
    for name in a.shape_names:
        P, O = SHAPES[name]
        T, N, Ol = a.tokens, P, O // world
        flops = 2 * T * P * Ol + 2 * T * Ol * N  # per rank
        rows.append(dict(shape=name, P=P, O=O, N=N, T=T, O_local=Ol, gflop_per_rank=flops / 1e9,
                         partial_bytes_bf16=T * N * 2, acc_bytes_fp32=T * N * 4,
                         divisible=O % world == 0))
    return rows


def _git_commit():
    if os.environ.get("GIT_COMMIT"):  # set by the device scripts (the tree there has no .git)
        return os.environ["GIT_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001
        return None


def bench_shape(a, name, rank, world, dev):
    import torch
    import torch.distributed as dist
    from moe_overlap.ffn.reference import ffn_tp_reference
    P, O = SHAPES[name]
    T, N, Ol = a.tokens, P, O // world
    g = torch.Generator(device=dev).manual_seed(rank)
    bf = dict(dtype=torch.bfloat16, device=dev)
    x = torch.randn(T, P, generator=g, **bf)
    w1 = torch.randn(P, Ol, generator=g, **bf) * P ** -0.5
    b1 = torch.randn(Ol, generator=g, **bf) * 0.1
    w2 = torch.randn(Ol, N, generator=g, **bf) * O ** -0.5
    b2 = torch.randn(N, generator=g, **bf) * 0.1
    y = torch.empty(T, N, **bf)
    part = torch.randn(T, N, generator=g, **bf)
    acc32 = torch.randn(T, N, generator=g, device=dev)

    def baseline():
        ffn_tp_reference(x, w1, b1, w2, b2, a.act1, a.act2, None, world, rank, out=y)

    def compute():
        ffn_tp_reference(x, w1, b1, w2, b2, a.act1, a.act2, None, 1, rank, out=y)

    fns = dict(baseline=baseline, compute=compute,
               allreduce_bf16=lambda: dist.all_reduce(part),
               nccl_fp32=lambda: dist.all_reduce(acc32))
    ars = []
    if not a.skip_kernel:
        from moe_overlap.ffn.band_allreduce import BandAllReduce
        for zero in (True, False):
            ar = BandAllReduce(T, N, backend="unicast", act2=a.act2, band_rows=a.band_rows,
                               ccta=a.ccta, threads=a.threads, unroll=a.unroll, zero_acc=zero)
            ar.compile()
            out = torch.empty(T, N, **bf)
            fns["band_ar" if zero else "band_ar_nozero"] = (
                lambda ar=ar, out=out: ar(T, b2=b2, out=out))
            ars.append(ar)
        for cc in sorted({a.ccta, a.ar_variant_ccta}, key=lambda v: -1 if v is None else v):
            # the bf16-partial mode (compute="chained"'s all-reduce) at its default threads /
            # unroll: half the bytes of band_ar
            ar = BandAllReduce(T, N, backend="unicast", act2=a.act2, band_rows=a.band_rows,
                               ccta=cc, partial="bf16")
            ar.compile()
            ar.partial[:T].copy_(part)
            out = torch.empty(T, N, **bf)
            fns["band_ar_bf16" if cc == a.ccta else f"band_ar_bf16_c{cc}"] = (
                lambda ar=ar, out=out: ar(T, b2=b2, out=out))
            ars.append(ar)
        for nt, un, ahead in a.ar_variants:  # per-SM throughput of the all-reduce on few SMs
            ar = BandAllReduce(T, N, backend="unicast", act2=a.act2, band_rows=a.band_rows,
                               ccta=a.ar_variant_ccta, threads=nt, unroll=un,
                               arrive_ahead=ahead)
            ar.compile()
            out = torch.empty(T, N, **bf)
            fns[f"band_ar_c{a.ar_variant_ccta}_t{nt}u{un}{'' if ahead else 'n'}"] = (
                lambda ar=ar, out=out: ar(T, b2=b2, out=out))
            ars.append(ar)
    fused_info = {}
    if not a.skip_kernel and not a.no_fused:
        fused_info = add_fused(a, fns, x, w1, b1, w2, b2, y, baseline, rank, world, dev)
    from moe_overlap.timing import time_interleaved
    with torch.inference_mode():
        res = time_interleaved(fns, a.warmup, a.rounds, dist.barrier, lead_ms=a.lead_ms)
    slow = {k: round(v["host_ms"], 3) for k, v in res.items() if v["host_ms"] > 0.8 * a.lead_ms}
    if slow and a.lead_ms > 0:
        print(f"WARNING: host launch time near or above --lead-ms {a.lead_ms}: {slow}")
    timeline = {}
    if fused_info:
        mods = dict(fused=fused_info["mod"])
        mods.update({f"fused_{n}": v["mod"] for n, v in fused_info["variants"].items()})
        timeline = layer_timeline(mods, x, max(a.rounds, 5), dist.barrier, a.lead_ms)
        for m in mods.values():
            m.check_fused()
    for ar in ars:
        ar.check()  # raises on a device timeout
    # the slowest rank's median is the layer's time
    keys = sorted(res)
    med = torch.tensor([res[k]["median_ms"] for k in keys], dtype=torch.float64, device=dev)
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    for k, v in zip(keys, med.tolist()):
        res[k]["max_rank_median_ms"] = v
    bus = 2 * (world - 1) / world
    m = {k: res[k]["max_rank_median_ms"] for k in keys}
    held = {}
    if a.hold_s > 0:  # each path alone, back to back (the sustained rate; slowest rank)
        from moe_overlap.timing import time_held
        with torch.inference_mode():
            for k in keys:  # the same call count on every rank: from the agreed median
                held[k] = time_held(fns[k], a.hold_s, m[k], dist.barrier)
        for ar in ars:
            ar.check()
        hm = torch.tensor([held[k]["ms"] for k in keys], dtype=torch.float64, device=dev)
        dist.all_reduce(hm, op=dist.ReduceOp.MAX)
        held = {k: dict(held[k], max_rank_ms=v) for k, v in zip(keys, hm.tolist())}
    flops = 2 * T * P * Ol + 2 * T * Ol * N
    row = dict(shape=name, P=P, O=O, N=N, T=T, O_local=Ol, world=world, times=res,
               baseline_ms=m["baseline"], compute_ms=m["compute"],
               allreduce_bf16_ms=m["allreduce_bf16"],
               overlap_headroom_ms=m["baseline"] - max(m["compute"], m["allreduce_bf16"]),
               compute_tflops=flops / (m["compute"] * 1e-3) / 1e12,
               busbw_bf16_GBs=bus * T * N * 2 / (m["allreduce_bf16"] * 1e-3) / 1e9,
               busbw_nccl_fp32_GBs=bus * T * N * 4 / (m["nccl_fp32"] * 1e-3) / 1e9)
    if "fused" in m:
        row.update(fused_ms=m["fused"], speedup_vs_baseline=m["baseline"] / m["fused"],
                   bound_speedup=m["baseline"] / max(m["compute"], m["allreduce_bf16"]),
                   fused_err_vs_baseline=fused_info["err"],
                   fused_tflops=flops / (m["fused"] * 1e-3) / 1e12,
                   fused_compute_tflops=flops / (m["fused_compute"] * 1e-3) / 1e12,
                   memory=fused_info["memory"],
                   mean_std_ms={k: (res[k]["mean_ms"], res[k]["std_ms"]) for k in keys},
                   compute_options=a.compute_opts, timeline=timeline,
                   variants={n: dict(options=v["options"], err_vs_baseline=v["err"],
                                     ms=m[f"fused_{n}"], compute_ms=m[f"fused_compute_{n}"],
                                     x_fused=m["fused"] / m[f"fused_{n}"])
                             for n, v in fused_info["variants"].items()})
    if held:
        row["holds"] = held
        if "fused" in held:
            row["hold_speedup_vs_baseline"] = (held["baseline"]["max_rank_ms"]
                                               / held["fused"]["max_rank_ms"])
    row["band_ar_variants_ms"] = {k: v for k, v in m.items() if k.startswith("band_ar_c")}
    if "band_ar" in m:
        row["busbw_band_ar_GBs"] = bus * T * N * 4 / (m["band_ar"] * 1e-3) / 1e9
        row["band_ar_vs_nccl_fp32"] = m["nccl_fp32"] / m["band_ar"]
    return row


def add_fused(a, fns, x, w1, b1, w2, b2, y_base, baseline, rank, world, dev):
    """FusedFFN(backend="fused") and the issue's ablations, registered in ``fns``:

    - ``fused``: the layer (compute blocks || band all-reduce on ccta SMs);
    - ``fused_compute``: its compute kernel alone on all SMs (accumulating; flags unread);
    - ``fused_compute_layer_sms`` / ``fused_ar_layer_sms``: the compute kernel / the band
      all-reduce alone on the SMs each gets inside the layer (SMs - ccta / ccta);
    - ``abl_no_spec`` (no block specialization): compute kernel on all SMs, then the band
      all-reduce in stream order (the same two kernels, not concurrent);
    - ``abl_nccl``: compute kernel on all SMs, then NCCL all_reduce of the fp32 accumulator,
      + b2 (+ act2) -> bf16, accumulator zeroed (unicast vs NCCL all-reduce);
    - ``abl_no_fusion``: torch addmm + act1 + mm (separate kernels, H in HBM) into the fp32
      accumulator, then our band all-reduce.
    - ``fused_<name>`` / ``fused_compute_<name>``: the layer / its compute kernel with the
      options of each ``--fused-variants`` entry.
    Returns {"mod", "err" (fused vs the baseline's output), "memory", "variants"}."""
    import torch
    import torch.distributed as dist
    from moe_overlap.ffn import FusedFFN
    from moe_overlap.ffn.activations import activation_
    from moe_overlap.ffn.reference import rel_err
    T, P = x.shape
    N = w2.shape[1]
    Ol = w1.shape[1]
    kw = {} if a.fused_ccta is None else dict(ccta=a.fused_ccta)

    def layer(opts):
        opts = dict(opts)
        lkw = dict(kw, **{k: opts.pop(k) for k in ("ccta", "allreduce_band_rows", "compute")
                          if k in opts})
        m = FusedFFN(P, Ol * world, N, act1=a.act1, act2=a.act2, device=dev, backend="fused",
                     max_tokens=T, tile_m=a.fused_tile_m, compute_options=opts or None, **lkw)
        with torch.no_grad():
            m.w1.copy_(w1)
            m.b1.copy_(b1)
            m.w2.copy_(w2)
            m.b2.copy_(b2)
        # correctness in the same run: the fused layer against the plain-torch layer's output
        with torch.inference_mode():
            yf = m(x)
            baseline()
            torch.cuda.synchronize(dev)
            m.check_fused()
            e = rel_err(yf, y_base.double())
        ar_m = m.allreduce_for(T)

        data = ar_m.acc if ar_m.acc is not None else ar_m.partial  # fp32 acc / bf16 partial

        def alone(ccta=0):  # its compute kernel alone (the layer's weights = w1, b1, w2)
            m.run_compute(x, data[:T], ar_m.band_ready, ar_m.epoch, ccta=ccta)
        return m, e, ar_m, alone

    mod, err, ar, compute_alone = layer(a.compute_opts)
    if ar.acc is None:
        raise SystemExit("the main fused layer must be compute='reduce' (its ablations use the "
                         "fp32 accumulator); time compute='chained' as a --fused-variants entry")
    acc = ar.acc[:T]
    out = torch.empty(T, N, dtype=torch.bfloat16, device=dev)
    variants = {}
    for vname, opts in a.variants.items():  # the same layer with other kernel options
        m, e, _, alone = layer(opts)
        fns[f"fused_{vname}"] = lambda m=m: m(x)
        fns[f"fused_compute_{vname}"] = alone
        variants[vname] = dict(options=opts, err=e, mod=m)

    def no_spec():
        compute_alone()
        ar(T, b2=b2, out=out)  # standalone: no flag waits; zeroes acc

    def nccl():
        compute_alone()
        dist.all_reduce(acc)
        torch.add(acc, b2, out=out)
        activation_(out, a.act2)
        acc.zero_()

    def no_fusion():
        h = torch.addmm(b1, x, w1)
        h = activation_(h, a.act1)
        acc.copy_(torch.mm(h, w2))
        ar(T, b2=b2, out=out)

    fns.update(fused=lambda: mod(x), fused_compute=compute_alone,
               # each kernel alone on the SMs it gets in the layer (the all-reduce: no flag
               # waits, zeroes acc)
               fused_compute_layer_sms=lambda: compute_alone(mod.ccta),
               fused_ar_layer_sms=lambda: ar(T, b2=b2, out=out),
               abl_no_spec=no_spec, abl_nccl=nccl, abl_no_fusion=no_fusion)
    # activation memory: bytes the layer allocates beyond its inputs and weights. Baseline: the
    # peak of the torch caching allocator during one call (H, the partial/output). Fused: the
    # allocator's peak (the output) plus the symmetric fp32 accumulator (allocated once, outside
    # the caching allocator, sized for max_tokens rows).
    peaks = {}
    for name, fn in (("baseline", baseline), ("fused", lambda: mod(x))):
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        with torch.inference_mode():
            keep = fn()
        torch.cuda.synchronize(dev)
        peaks[name] = torch.cuda.max_memory_allocated(dev) - base
        del keep
    acc_bytes = ar.acc[:T].numel() * 4
    memory = dict(baseline_bytes=peaks["baseline"] + y_base.numel() * 2,  # y is preallocated
                  fused_bytes=peaks["fused"] + acc_bytes, fused_acc_bytes=acc_bytes,
                  h_bytes=T * Ol * 2, out_bytes=T * N * 2)
    memory["fused_over_baseline"] = memory["fused_bytes"] / memory["baseline_bytes"]
    return dict(mod=mod, err=err, memory=memory, variants=variants)


def layer_timeline(mods, x, calls, barrier, lead_ms):
    """Median over ``calls`` layer calls of when the compute kernel and the all-reduce end,
    in ms after the call's start (CUDA events of the layer's diagnostics()), per module name. As in
    time_interleaved, a GPU sleep of lead_ms before each call keeps the host's launch time out
    of the numbers (without it they include ~0.5 ms of CuTe DSL launch overhead)."""
    import statistics

    import torch
    from moe_overlap.timing import sleep_cycles_per_ms
    sleep = int(lead_ms * sleep_cycles_per_ms()) if lead_ms > 0 else 0
    out = {}
    for name, m in mods.items():
        ev = []
        with torch.inference_mode(), m.diagnostics(timeline=ev):
            for _ in range(calls):
                barrier()
                if sleep:
                    torch.cuda._sleep(sleep)
                m(x)
            torch.cuda.synchronize()
        comp = statistics.median(s.elapsed_time(c) for s, c, _ in ev)
        done = statistics.median(s.elapsed_time(e) for s, _, e in ev)
        out[name] = dict(compute_end_ms=comp, allreduce_end_ms=done, tail_ms=done - comp)
    return out


def table(rows, kernel):
    h = (f"{'shape':22s} {'P':>5s} {'O':>6s} {'base ms':>8s} {'comp ms':>8s} {'AR16 ms':>8s} "
         f"{'headroom':>8s} {'TFLOP/s':>7s} {'NCCL32':>7s}")
    if kernel:
        h += f" {'bandAR':>7s} {'noZero':>7s} {'x NCCL':>6s}"
    lines = [h]
    for r in rows:
        t = r["times"]
        s = (f"{r['shape']:22s} {r['P']:5d} {r['O']:6d} {r['baseline_ms']:8.3f} "
             f"{r['compute_ms']:8.3f} {r['allreduce_bf16_ms']:8.3f} "
             f"{r['overlap_headroom_ms']:8.3f} {r['compute_tflops']:7.0f} "
             f"{t['nccl_fp32']['max_rank_median_ms']:7.3f}")
        if kernel:
            s += (f" {t['band_ar']['max_rank_median_ms']:7.3f} "
                  f"{t['band_ar_nozero']['max_rank_median_ms']:7.3f} "
                  f"{r['band_ar_vs_nccl_fp32']:6.2f}")
        lines.append(s)
    fused = [r for r in rows if "fused_ms" in r]
    if fused:
        lines.append("")
        lines.append(f"{'shape':22s} {'base ms':>8s} {'fused ms':>8s} {'x base':>6s} "
                     f"{'bound x':>7s} {'fcomp ms':>8s} {'noSpec':>7s} {'NCCL':>7s} "
                     f"{'noFuse':>7s} {'err':>8s} {'mem x':>6s}")
        for r in fused:
            t = r["times"]

            def ms(k):
                return t[k]["max_rank_median_ms"]
            lines.append(f"{r['shape']:22s} {r['baseline_ms']:8.3f} {r['fused_ms']:8.3f} "
                         f"{r['speedup_vs_baseline']:6.2f} {r['bound_speedup']:7.2f} "
                         f"{ms('fused_compute'):8.3f} {ms('abl_no_spec'):7.3f} "
                         f"{ms('abl_nccl'):7.3f} {ms('abl_no_fusion'):7.3f} "
                         f"{r['fused_err_vs_baseline']:8.1e} "
                         f"{r['memory']['fused_over_baseline']:6.2f}")
    arv = [(r["shape"], k, v) for r in rows for k, v in r.get("band_ar_variants_ms", {}).items()]
    if arv:
        lines.append("")
        lines.append(f"{'shape':22s} {'all-reduce variant':24s} {'ms':>8s} {'GB/s bus':>8s}")
        for shape, k, v in arv:
            r = next(r for r in rows if r["shape"] == shape)
            bus = 2 * (r["world"] - 1) / r["world"] * r["T"] * r["N"] * 4 / (v * 1e-3) / 1e9
            lines.append(f"{shape:22s} {k:24s} {v:8.3f} {bus:8.0f}")
    tl = [(r, n, v) for r in fused for n, v in r.get("timeline", {}).items()]
    if tl:
        lines.append("")
        lines.append(f"{'shape':22s} {'layer':16s} {'comp end':>8s} {'AR end':>8s} "
                     f"{'tail':>6s} {'comp alone@layer SMs':>20s} {'AR alone':>8s}")
        for r, n, v in tl:
            t = r["times"]
            lines.append(f"{r['shape']:22s} {n:16s} {v['compute_end_ms']:8.3f} "
                         f"{v['allreduce_end_ms']:8.3f} {v['tail_ms']:6.3f} "
                         f"{t['fused_compute_layer_sms']['max_rank_median_ms']:20.3f} "
                         f"{t['fused_ar_layer_sms']['max_rank_median_ms']:8.3f}")
    var = [(r["shape"], n, v) for r in fused for n, v in r.get("variants", {}).items()]
    if var:
        lines.append("")
        lines.append(f"{'shape':22s} {'variant':14s} {'ms':>8s} {'x fused':>7s} "
                     f"{'comp ms':>8s} {'x base':>6s} {'err':>8s}")
        for shape, n, v in var:
            base = next(r["baseline_ms"] for r in fused if r["shape"] == shape)
            lines.append(f"{shape:22s} {n:14s} {v['ms']:8.3f} {v['x_fused']:7.3f} "
                         f"{v['compute_ms']:8.3f} {base / v['ms']:6.2f} "
                         f"{v['err_vs_baseline']:8.1e}")
    return "\n".join(lines)


def tune_entries(rows, device_name: str, world: int, **info) -> dict:
    """{FFN tune-cache key: entry} of the measured rows (dense FusedFFN at its default options
    against the reference layer, both timed in the same rounds)."""
    from moe_overlap.ffn.tuning import ffn_tune_key
    return {ffn_tune_key(device_name, world, r["P"], r["O"], r["N"], False, r["T"]):
            dict(fused_ms=r["fused_ms"], reference_ms=r["baseline_ms"], **info)
            for r in rows if "fused_ms" in r}


def main(argv=None):
    a = parse_args(argv)
    if a.dry_run:
        world = a.world or int(os.environ.get("WORLD_SIZE", "2"))
        for r in plan(a, world):
            print(json.dumps(r))
        return 0
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    import torch
    import torch.distributed as dist
    if not torch.cuda.is_available():
        print("bench_ffn: needs CUDA GPUs (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    if "RANK" not in os.environ:
        print("bench_ffn: launch with torchrun --nproc-per-node G", file=sys.stderr)
        return 2
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = [n for n in a.shape_names if SHAPES[n][1] % world]
    if bad:
        raise SystemExit(f"hidden size of {bad} is not divisible by world size {world}")
    rows = []
    try:
        for name in a.shape_names:
            rows.append(bench_shape(a, name, rank, world, dev))
            torch.cuda.empty_cache()  # this shape's tensors died with bench_shape's frame
            if rank == 0:
                print(f"done {name}: baseline {rows[-1]['baseline_ms']:.3f} ms", flush=True)
    finally:
        if rank == 0 and rows:
            out = a.out or os.environ.get("OUT") or os.path.join(os.path.dirname(
                os.path.abspath(__file__)), "results")
            os.makedirs(out, exist_ok=True)
            meta = dict(device=torch.cuda.get_device_name(dev), world=world,
                        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                        commit=_git_commit(), torch=torch.__version__, args=vars(a))
            from moe_overlap.provenance import stamp
            doc = stamp(dict(meta=meta, results=rows), "ffn", gpus=world, device=meta["device"],
                        commit=meta["commit"])
            with open(os.path.join(out, "bench_ffn.json"), "w") as f:
                json.dump(doc, f, indent=1)
            print(table(rows, not a.skip_kernel))
            if a.tune_cache:
                from moe_overlap.ffn.tuning import FFNTuneCache
                cache = FFNTuneCache(a.tune_cache)
                for key, e in tune_entries(rows, meta["device"], world, source="bench_ffn",
                                           date=meta["date"], commit=meta["commit"]).items():
                    cache.put(key, **e)
                    print(f"tune cache {a.tune_cache}: {key} reference / fused = "
                          f"{e['reference_ms'] / e['fused_ms']:.3f}")
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
