"""Sweep and validate the overlapped MoE combine on the GPUs of one host.

    moe-overlap sweep --out results.json [--shapes synthetic,models | 4096x16x4x8192x1024,
                      deepseek-v3@4096,...] [--ccta 4,8,16,24] [--mgb 1,2,4]
                      [--modes balanced,moderate_skew,stress_skew] [--race-calls 3] [--soak 1000]
    moe-overlap validate --backend overlap      (the same grid, validation only, no timing)
    (also: python scripts/sweep.py ...)

For each shape (tokens per rank x experts x topk x N x K), router mode, ccta and mgb it
- validates: the overlapped call is bitwise equal to our own non-overlapped path (the same GEMM on
  every SM, then the consumer), and within 8e-3 relative error of the independent sequential
  baseline (torch grouped matmul + NCCL all_to_all_single + weighted sum); then `--race-calls`
  more calls as moe_overlap.combine.race_check does (fresh h and routings, NaN-poisoned buffers);
- times (CUDA-graph replays, median over replays, max over ranks): T_gemm (our GEMM alone on every
  SM), T_comm (the consumer alone, bands marked ready), T_overlap, T_seq (the baseline; both it
  and the overlapped call prepare their routing-derived rows once, outside the timing), and derives
  the perfect-overlap bound max(T_gemm, T_comm), T_overlap / bound, the hidden fraction of the
  communication, and the speedup over the baseline;
- per shape and mode also times, as CUDA-graph replays like the overlapped call: the same-scale
  baseline (SameScaleBaseline: best library GEMM on the unpadded rows + NCCL all_to_all_single +
  our scale kernel), NCCL all-to-all alone, our scale alone, and a copy-engine exchange of the
  same bytes (the transfer floor); per point the fields of moe_overlap.combine.metrics
  (t_gemm ... t_scale, speedup_same_scale, speedup_torch, overlap_over_bound, padding);
- records the analytic (ccta, mgb) choice of moe_overlap.combine.tuning for comparison with the best.
Prints a table of the best configuration per shape and mode last; writes everything as JSON.
Run `python scripts/report_sweep.py results.json` for the markdown table and heatmaps.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import subprocess
import sys
import time



def set_run_environment() -> None:
    """The sweep's process environment, set by `main` before any rank starts (not at import:
    importing this module for its helpers changes nothing): never NVLink multicast on shared
    machines, eager module loading, and a symmetric heap for the receive buffers of every shape
    (2 slots x tokens x topk x N bf16 each; deepseek-v3 at 16384 tokens: 2 x 16384 x 8 x 7168 x
    2 B = 3.8 GB per layer) unless the caller sized it."""
    for k, v in (("NVSHMEM_DISABLE_NVLS", "1"), ("NCCL_NVLS_ENABLE", "0"),
                 ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("CUDA_MODULE_LOADING", "EAGER")):
        os.environ[k] = v
    os.environ.setdefault("NVSHMEM_SYMMETRIC_SIZE", "48G")


def parse_shapes(text):
    from .shapes import parse_shapes as parse
    return parse(text)


def _time_graph_or_eager(time_calls, fn, reps, replays, barrier):
    """CUDA-graph replays (as the overlapped call); eager where capture fails (recorded)."""
    import torch
    try:
        t, mode, _ = time_calls(fn, reps, replays, barrier, graph=True)
    except Exception as e:  # noqa: BLE001 - e.g. a collective this build cannot capture
        torch.cuda.synchronize()
        t, mode, _ = time_calls(fn, reps, replays, barrier, graph=False)
        mode = f"eager ({type(e).__name__})"
    return t, mode


def worker(rank, W, args):
    import torch
    import torch.distributed as dist

    from moe_overlap.combine.baseline import (SameScaleBaseline, SequentialBaseline,
                                              copy_engine_exchange, exchange_plan,
                                              plan_to_compact_rows)
    from moe_overlap.combine.metrics import point_fields
    from moe_overlap.combine.race_check import rank_tokens, soak, soak_passed, validate_calls
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.combine.options import CombineOptions
    from moe_overlap.combine.overlap import OverlapCombine
    from moe_overlap.combine.plan import plan_combine
    from moe_overlap.routing import route
    from moe_overlap.timing import max_over_ranks as max_over_ranks_on, time_calls
    from moe_overlap.combine.tuning import analytic_choice

    from moe_overlap.launch import rank_device
    dev = rank_device()

    barrier = dist.barrier
    max_over_ranks = functools.partial(max_over_ranks_on, device=dev)

    from moe_overlap.combine import MoECombine

    points, tuned, soaks = [], [], []
    for si, shape in enumerate(args.shapes):
        T, E, k, N, K = shape["tokens"], shape["experts"], shape["topk"], shape["N"], shape["K"]
        El = E // W
        ov = OverlapCombine(group=None, num_experts=E, hidden_size=K, out_features=N, topk=k,
                            max_tokens_per_rank=T, tile_m=args.tile_m, ccta=args.ccta[0],
                            transport=args.transport,
                            local_copy=bool(args.local_copy), copy=args.copy,
                            gemm_options=args.gemm_options,
                            producer=None if args.producer == "auto" else args.producer)
        for mode, empty in itertools.product(args.modes, args.empty_ranks):
            seed = 1000 * si + args.modes.index(mode)
            # a rank in `empty` routes no token (its out is [0, N]); T stays every rank's capacity
            ids, gates = route(rank_tokens(T, rank, empty), E, k, mode, seed=seed, rank=rank,
                               device=dev)
            counts = exchange_counts(ids, E)
            g = torch.Generator(device=dev).manual_seed(seed * 31 + rank)
            w_down = (torch.randn(El, K, N, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
            for layout, order in itertools.product(args.layout, args.order):
                plans = {m: plan_combine(counts, rank, tile_m=args.tile_m, mgb=m,
                                         max_rows=W * T * k, order=order, layout=layout)
                         for m in args.mgb}
                p0 = plans[args.mgb[0]]
                rows = int(p0.total_rows.item())
                h = torch.randn(rows, K, device=dev, generator=g).to(torch.bfloat16)
                h_c = h[plan_to_compact_rows(p0, counts)]
                base = SequentialBaseline(counts, ids,
                                          gemm="loop" if args.validate_only else "auto",
                                          scale="fp32" if args.validate_only else "auto")
                ref = base(h_c, w_down, gates).float()
                timed = not args.validate_only

                def timing(fn, graph=True):
                    if not timed:
                        return float("nan"), "none", []
                    return time_calls(fn, args.reps, args.replays, barrier, graph=graph)

                # eager: NCCL inside graph capture is not relied on; its host work (a dozen torch
                # calls) stays well ahead of a millisecond of GPU work, so no launch gaps are timed
                t_seq, seq_mode, _ = timing(lambda: base(h_c, w_down, gates), graph=False)
                t_seq = max_over_ranks(t_seq)
                extra = dict(t_seq_same_scale=float("nan"), t_a2a_nccl=float("nan"),
                             t_a2a_copy_engine=float("nan"), t_scale=float("nan"))
                extra_info = {}
                if timed:
                    same = SameScaleBaseline(counts, ids, gemm="auto")
                    out_same = same(h_c, w_down, gates)
                    same.check_errors()
                    extra_info["same_scale_rel_err"] = max_over_ranks(float(
                        (out_same.float() - ref).norm() / ref.norm().clamp_min(1e-30)))
                    t, extra_info["same_scale_timing"] = _time_graph_or_eager(
                        time_calls, lambda: same(h_c, w_down, gates), args.reps, args.replays,
                        barrier)
                    extra["t_seq_same_scale"] = max_over_ranks(t)
                    extra_info["same_scale_gemm"] = same.gemm
                    send = same.expert_gemm(h_c, w_down)
                    t, extra_info["a2a_nccl_timing"] = _time_graph_or_eager(
                        time_calls, lambda: same.exchange(send), args.reps, args.replays, barrier)
                    extra["t_a2a_nccl"] = max_over_ranks(t)
                    recv = same.exchange(send).clone()
                    t, _ = _time_graph_or_eager(time_calls, lambda: same.scale(recv, gates),
                                                args.reps, args.replays, barrier)
                    extra["t_scale"] = max_over_ranks(t)
                    same.check_errors()
                    pieces = exchange_plan(same.counts_h, rank, El)
                    # slot 0 of every peer's receive buffer as [rows, N] (the symmetric tensor
                    # itself is what NVSHMEM maps; ov.recv is a strided view of it)
                    peers = {d: ov.rt.peer_tensor(ov.buffers.recv, d)[:ov.max_recv_rows * N].view(
                        ov.max_recv_rows, N) for d, _, _, _ in pieces}
                    t, extra_info["a2a_copy_engine_timing"] = _time_graph_or_eager(
                        time_calls, lambda: copy_engine_exchange(send, peers, pieces), args.reps,
                        args.replays, barrier)
                    extra["t_a2a_copy_engine"] = max_over_ranks(t)
                    torch.cuda.synchronize()
                    barrier()
                    del same, send, recv, out_same
                st = p0.stats()
                valid = int(counts[:, rank * El:(rank + 1) * El].sum())
                remote = st["remote_rows"]
                choice = analytic_choice(int(valid), int(remote), N, K, args.tile_m)
                # GEMM alone, every SM
                ov.forward(h, w_down, p0, ids, gates, check=True)  # compiles, warms up all
                y, _ = ov.buffers_for(h, p0)
                scratch = torch.zeros(p0.band_capacity, dtype=torch.int32, device=dev)
                t_gemm, _, _ = timing(lambda: ov.produce(h, w_down, p0, y, scratch, ccta=0))
                t_gemm = max_over_ranks(t_gemm)
                flops = 2.0 * rows * N * K
                for ccta in args.ccta:  # every call of the point passes its ccta
                    for mgb in args.mgb:
                        plan = plans[mgb]
                        # the routing's rows and counts, prepared once outside the timed calls as
                        # the baseline prepares its permutations (the reference call computes
                        # its own)
                        routes = ov.prepare(plan, ids)
                        out_seq = ov.forward(h, w_down, plan, ids, gates, check=True,
                                             overlap=False).clone()
                        out_ov = ov.forward(h, w_down, plan, ids, gates, check=True,
                                            routes=routes, ccta=ccta).clone()
                        bitwise = bool(torch.equal(out_seq, out_ov))
                        err = float((out_ov.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                        t_ov, ov_mode, _ = timing(lambda: ov.forward(h, w_down, plan, ids, gates,
                                                                     routes=routes, ccta=ccta))
                        ov.check_errors()
                        _, band_ready = ov.buffers_for(h, plan)
                        cap = plan.band_capacity
                        valid_b = torch.arange(cap, device=dev) < plan.num_bands

                        def comm_only():
                            ov.begin_call(ids, gates, routes=routes)
                            band_ready.copy_(torch.where(valid_b, ov.epoch.expand(cap), band_ready))
                            ov.ship(y, plan, band_ready, ccta=ccta)

                        t_comm, _, _ = timing(comm_only)
                        ov.check_errors()
                        barrier()
                        # all ranks agree on pass/fail and on times
                        t_ov, t_comm = max_over_ranks(t_ov), max_over_ranks(t_comm)
                        race = None
                        if args.race_calls:
                            race = validate_calls(ov, T, mode, calls=args.race_calls,
                                                  routing_every=2,
                                                  seed=seed * 100 + ccta * 10 + mgb, mgb=mgb,
                                                  ccta=ccta, layout=layout, order=order,
                                                  empty_ranks=empty)
                            race = {k: v for k, v in race.items() if k != "records"}
                        ok = max_over_ranks(0.0 if (bitwise and err <= 8e-3 and (
                            race is None or race["failures"] == 0)) else 1.0) == 0.0
                        err_max = max_over_ranks(err)
                        bound = max(t_gemm, t_comm)
                        hidden = (t_gemm + t_comm - t_ov) / t_comm if t_comm > 0 else 1.0
                        points.append(dict(
                            shape=shape, mode=mode, ccta=ccta, mgb=mgb, layout=layout,
                            order=order, empty_ranks=list(empty), rows=rows,
                            valid_rows=int(valid), remote_rows=int(remote),
                            t_gemm_ms=t_gemm, t_comm_ms=t_comm, t_overlap_ms=t_ov, t_seq_ms=t_seq,
                            bound_ms=bound, overlap_over_bound=t_ov / bound,
                            hidden_fraction=max(0.0, min(1.0, hidden)), speedup=t_seq / t_ov,
                            gemm_tflops=flops / t_gemm / 1e9, bitwise_equal=bitwise,
                            rel_err_vs_seq=err_max, passed=ok, timing=ov_mode,
                            seq_timing=seq_mode, seq_gemm=base.gemm, seq_scale=base.scale_kind,
                            seq_variants_ms=base.variant_ms,
                            analytic=list(choice), race_check=race, **extra_info))
                        # the fields of moe_overlap.combine.metrics (t_* in ms, speedups, bound
                        # ratio, padding)
                        points[-1].update(point_fields(t_gemm=t_gemm, t_comm=t_comm, t_overlap=t_ov,
                                                       t_seq_torch=t_seq, plan_rows=rows,
                                                       valid_rows=int(valid), **extra))
                        if rank == 0:
                            print(f"[{point_name(points[-1])}] ov {t_ov:.3f} ms gemm "
                                  f"{t_gemm:.3f} comm {t_comm:.3f} seq {t_seq:.3f} "
                                  f"x{t_seq / t_ov:.2f} err {err_max:.1e} bitwise {bitwise} "
                                  f"race {None if race is None else race['failures']} "
                                  f"{'ok' if ok else 'FAIL'}", flush=True)
                            if args.progress:  # what a killed run still leaves (ranks_grid)
                                with open(args.progress, "a") as f:
                                    f.write(json.dumps(points[-1]) + "\n")
            if args.soak and not soaks:
                # the first shape and mode: CUDA-graph replays with new data, poisoned, checked
                soak_ccta = choice[0] if 1 <= choice[0] < ov.num_sms else args.ccta[0]
                res = soak(ov, T, mode, calls=args.soak, routing_every=args.soak_routing_every,
                           seed=seed, mgb=args.mgb[0], ccta=soak_ccta, layout=args.layout[0],
                           order=args.order[0])
                res["passed"], res["why"] = soak_passed(res)
                soaks.append(dict(res, shape=shape, ccta=soak_ccta, mgb=args.mgb[0]))
                if rank == 0:
                    print(f"[{shape} {mode}] soak: {res['calls']} checked replays, "
                          f"{res['failures']} failures, max rel err {res['max_rel_err']:.1e}, "
                          f"allocated {res['memory_allocated_before']} -> "
                          f"{res['memory_allocated_after']} B (slack "
                          f"{res['memory_slack_bytes']} B): "
                          f"{'ok' if res['passed'] else 'FAIL ' + res['why']}", flush=True)
            if args.autotune and timed:
                # the library's own choice: ccta/mgb "auto" -> analytic first guess, refined by
                # MoECombine.autotune (cached per shape bucket: the first mode tunes, the others
                # reuse the cached choice, as a user's later calls would)
                comb = MoECombine(E, K, N, k, T, tile_m=args.tile_m, backend="overlap",
                                  transport=args.transport, validate=False,
                                  local_copy=bool(args.local_copy), copy=args.copy,
                                  options=CombineOptions(order=args.order[0]))
                first = (comb.ccta, comb.mgb)
                choice = comb.autotune(h, w_down, counts, ids, gates)
                plan = comb.plan(counts)
                routes = comb.prepare(plan, ids)
                out_auto = comb(h, w_down, plan, ids, gates, routes=routes)
                comb.check_errors()
                err = float((out_auto.float() - ref).norm() / ref.norm().clamp_min(1e-30))
                t_auto, _, _ = time_calls(lambda: comb(h, w_down, plan, ids, gates,
                                                       routes=routes),
                                          args.reps, args.replays, barrier)
                comb.check_errors()
                t_auto = max_over_ranks(t_auto)
                tuned.append(dict(shape=shape, mode=mode, first=list(first), choice=list(choice),
                                  t_auto_ms=t_auto, rel_err_vs_seq=max_over_ranks(err)))
                if rank == 0:
                    print(f"[{shape} {mode}] autotune {first} -> {choice}: {t_auto:.3f} ms",
                          flush=True)
    return points, tuned, soaks


def verdict(doc: dict) -> dict:
    """The checks of one sweep JSON document (also a stub a killed run left: ``error`` and
    the points its progress file held): {points, passed, failures: [{test, reason}]}.
    A point passes when it passed; with ``meta.expect_fail`` (a deliberately broken ordering)
    when it failed. Points planned (``meta.planned_points``) but missing, and a requested soak
    (``meta.soak``) that is missing or fails ``race_check.soak_passed``, fail."""
    from .race_check import soak_passed
    meta = doc.get("meta", {})
    pts, soaks = doc.get("points", []), doc.get("soak", [])
    expect_fail = bool(meta.get("expect_fail"))
    failures = []
    for p in pts:
        if expect_fail and p.get("passed"):
            failures.append(dict(test=point_name(p), reason="the broken ordering was not "
                                 "caught: the point passed"))
        elif not expect_fail and not p.get("passed"):
            failures.append(dict(test=point_name(p), reason=(
                f"bitwise={p.get('bitwise_equal')} rel_err={p.get('rel_err_vs_seq')} "
                f"race={p.get('race_check')}")))
    planned = max(int(meta.get("planned_points") or 0), len(pts), 1 if expect_fail else 0)
    missing = planned - len(pts)
    if missing:
        failures.append(dict(test=f"{missing} of {planned} points", reason="did not run: "
                             + (doc.get("error") or "no reason recorded")))
    planned_soaks = max(len(soaks), 1 if meta.get("soak") else 0)
    for s in soaks:
        ok, why = soak_passed(s)
        if not ok:
            failures.append(dict(test="soak", reason=why))
    if planned_soaks > len(soaks):
        failures.append(dict(test="soak", reason="did not run: "
                             + (doc.get("error") or "no reason recorded")))
    if doc.get("error") and not missing and planned_soaks == len(soaks):
        failures.append(dict(test="run", reason=doc["error"]))  # e.g. died after its points
    bad_points = sum(1 for f in failures if f["test"] not in ("soak", "run")) \
        - (1 if missing else 0)
    bad_soaks = sum(1 for f in failures if f["test"] == "soak")
    total = planned + planned_soaks
    return dict(points=total, passed=total - bad_points - missing - bad_soaks,
                failures=failures)


def summarize(points, tuned=()):
    best = {}
    for p in points:
        key = (json.dumps(p["shape"], sort_keys=True), p["mode"])
        if key not in best or p["t_overlap_ms"] < best[key]["t_overlap_ms"]:
            best[key] = p
    rows = []
    for (shape_s, mode), b in best.items():
        same = [p for p in points if json.dumps(p["shape"], sort_keys=True) == shape_s
                and p["mode"] == mode]
        auto = next((p for p in same if [p["ccta"], p["mgb"]] == b["analytic"]), None)
        tune = next((t for t in tuned if json.dumps(t["shape"], sort_keys=True) == shape_s
                     and t["mode"] == mode), None)
        rows.append(dict(shape=b["shape"], mode=mode, best_ccta=b["ccta"], best_mgb=b["mgb"],
                         t_gemm_ms=b["t_gemm_ms"], t_comm_ms=b["t_comm_ms"],
                         t_overlap_ms=b["t_overlap_ms"], bound_ms=b["bound_ms"],
                         overlap_over_bound=b["overlap_over_bound"], t_seq_ms=b["t_seq_ms"],
                         speedup=b["speedup"], hidden_fraction=b["hidden_fraction"],
                         analytic=b["analytic"],
                         analytic_over_best=(auto["t_overlap_ms"] / b["t_overlap_ms"])
                         if auto else None,
                         autotuned=tune["choice"] if tune else None,
                         autotuned_over_best=(tune["t_auto_ms"] / b["t_overlap_ms"])
                         if tune else None,
                         all_passed=all(p["passed"] for p in same)))
    return rows


def parse_empty_ranks(text: str) -> list[tuple]:
    """``--empty-ranks``: comma-separated items, each ``none`` (every rank routes tokens) or
    ranks joined by ``+`` (those route none), e.g. ``none,1`` or ``none,0+2``."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item.lower() == "none":
            out.append(())
            continue
        parts = item.split("+")
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"--empty-ranks item {item!r}: 'none' or ranks joined by '+'")
        out.append(tuple(sorted({int(p) for p in parts})))
    if not out:
        raise ValueError("--empty-ranks: at least one item")
    return out


def planned_points(args) -> int:
    """Points the worker makes of parsed arguments: one per shape, router mode, empty-ranks
    item, layout, order, ccta and mgb (``main`` checks the run made exactly these)."""
    return (len(args.shapes) * len(args.modes) * len(args.empty_ranks) * len(args.layout)
            * len(args.order) * len(args.ccta) * len(args.mgb))


def point_name(p: dict) -> str:
    """One line naming a point (shape, mode, empty ranks, layout, order, ccta, mgb)."""
    sh = p["shape"]
    name = sh.get("name") or "x".join(str(sh[k]) for k in ("tokens", "experts", "topk", "N",
                                                             "K"))
    empty = "+".join(map(str, p.get("empty_ranks") or [])) or "none"
    return (f"{name} {p['mode']} empty={empty} {p.get('layout', '?')} {p.get('order', '?')} "
            f"ccta={p['ccta']} mgb={p['mgb']}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moe-overlap sweep", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--shapes", default="synthetic",
                    help="comma-separated TxExkxNxK items (tokens per rank x experts x topk x N x "
                         "K), model names (moe_overlap.combine.shapes.MODELS, optionally "
                         "@tokens), synthetic, models or all")
    ap.add_argument("--modes", default="balanced,moderate_skew,stress_skew",
                    help="comma-separated router modes")
    ap.add_argument("--ccta", default="4,8,16,24",
                    help="comma-separated consumer CTA counts (SMs reserved for the consumer)")
    ap.add_argument("--mgb", default="1,2,4", help="comma-separated bands per transfer")
    ap.add_argument("--tile-m", type=int, default=128,
                    help="rows per band (the producer GEMM's M tile)")
    ap.add_argument("--transport", default="nvlink", choices=["nvlink", "nvshmem"],
                    help="how the consumer ships bands to their owners")
    ap.add_argument("--local-copy", type=int, default=-1, choices=[-1, 0, 1],
                    help="1: the consumer copies local rows into the receive buffer; 0: the "
                         "owner's scale reads them from y; -1: the default for the transport "
                         "(CombineOptions local_copy='auto')")
    ap.add_argument("--copy", default="auto", choices=["auto", "ldst", "tma"],
                    help="consumer copy: thread ld/st, TMA bulk copies, or the default for the "
                         "transport (CombineOptions copy='auto')")
    ap.add_argument("--order", default="remote_first",
                    help="comma-separated plan schedules (plan_combine(order=)): remote_first "
                    "(remote bands first) and/or expert (expert by expert: each expert's weights "
                    "read about once)")
    ap.add_argument("--layout", default="auto",
                    help="comma-separated plan row layouts: auto, aligned, packed")
    ap.add_argument("--empty-ranks", default="none",
                    help="comma-separated items, each 'none' or ranks joined by '+' that route "
                    "no token (e.g. none,1): one point per item")
    ap.add_argument("--producer", default="auto", choices=["auto", "torch"],
                    help="the producer: the library's (auto) or the torch stand-in (tests; what "
                    "MOE_OVERLAP_TEST_BROKEN_ORDER=flags_before_stores needs)")
    ap.add_argument("--expect-fail", action="store_true",
                    help="a check of the check (with a deliberately broken ordering): the run "
                    "passes only if every point fails")
    ap.add_argument("--progress", default="",
                    help="JSON-lines file rank 0 appends each finished point to (what a killed "
                    "run still leaves)")
    ap.add_argument("--world-size", type=int, default=0, help="ranks, one GPU each (0: every visible GPU)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="allow more ranks than GPUs: the ranks run as processes sharing the GPUs "
                         "(gloo host collectives; start MPS first: scripts/mps.sh start). For "
                         "correctness only: its timings are not NVLink timings")
    ap.add_argument("--reps", type=int, default=4, help="calls per captured graph")
    ap.add_argument("--replays", type=int, default=15,
                    help="CUDA-graph replays per timing (the median counts)")
    ap.add_argument("--autotune", type=int, default=1, help="1: also time MoECombine's own choice (autotune); 0: skip it")
    ap.add_argument("--validate-only", action="store_true",
                    help="the validation grid without timing (what `moe-overlap validate "
                         "--backend overlap` runs)")
    ap.add_argument("--gemm-cluster-n", type=int, default=None, choices=(1, 2),
                    help="producer GEMM cluster size for the sweep points (None: the GEMM's; "
                         "MoECombine's autotune rows keep the defaults)")
    ap.add_argument("--band-group", type=int, default=None,
                    help="producer GEMM tile order (band_group) for the sweep points (None: the "
                         "GEMM's)")
    ap.add_argument("--race-calls", type=int, default=3,
                    help="per point: extra calls with fresh data and poisoned buffers (0: none)")
    ap.add_argument("--soak", type=int, default=0,
                    help="CUDA-graph replays of the soak on the first shape and mode (0: none)")
    ap.add_argument("--soak-routing-every", type=int, default=1,
                    help="the soak makes a new routing (counts exchanged, plan copied into the "
                         "captured one) every this many replays (1: every replay)")
    ap.add_argument("--out", default="sweep.json", help="JSON results file")
    return ap


def parse_args(argv=None):
    """The sweep's arguments, checked (argparse's error exit on a bad one); no CUDA touched."""
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.shapes = parse_shapes(args.shapes)
        args.ccta = [int(c) for c in args.ccta.split(",")]
        args.mgb = [int(m) for m in args.mgb.split(",")]
    except ValueError as e:
        ap.error(f"{e} (--ccta and --mgb: comma-separated integers)")
    for sh in args.shapes:
        # named shapes carry a "name" string beside their sizes
        if min(v for key, v in sh.items() if key != "name") < 1 or sh["topk"] > sh["experts"]:
            ap.error(f"bad shape {sh}: every size >= 1 and topk <= experts")
    if min(args.ccta + args.mgb) < 1:
        ap.error("--ccta and --mgb values must be >= 1")
    from moe_overlap.routing import ROUTER_MODES
    args.modes = args.modes.split(",")
    if any(m not in ROUTER_MODES for m in args.modes):
        ap.error(f"--modes: choose from {', '.join(ROUTER_MODES)}")
    from .plan import LAYOUTS, ORDERS
    for opt, allowed in (("layout", LAYOUTS), ("order", ORDERS)):
        vals = [v.strip() for v in getattr(args, opt).split(",") if v.strip()]
        if not vals or any(v not in allowed for v in vals):
            ap.error(f"--{opt} {getattr(args, opt)!r}: comma-separated, from {', '.join(allowed)}")
        setattr(args, opt, vals)
    try:
        args.empty_ranks = parse_empty_ranks(args.empty_ranks)
    except ValueError as e:
        ap.error(str(e))
    args.gemm_options = {k: v for k, v in (("cluster_n", args.gemm_cluster_n),
                                           ("band_group", args.band_group)) if v is not None}
    from .options import CombineOptions  # "auto" / -1: the layers' default for the transport
    try:
        lc, args.copy = CombineOptions(
            transport=args.transport, copy=args.copy,
            local_copy="auto" if args.local_copy < 0 else bool(args.local_copy)).consumer_variant()
        CombineOptions(gemm_options=args.gemm_options).check_gemm_options(args.tile_m)
    except ValueError as e:
        ap.error(str(e))
    args.local_copy = int(lc)
    for opt, low in (("world_size", 0), ("reps", 1), ("replays", 1), ("race_calls", 0),
                     ("soak", 0)):
        if getattr(args, opt) < low:
            ap.error(f"--{opt.replace('_', '-')} must be >= {low}, got {getattr(args, opt)}")
    from ..paths import output_path_error
    why = output_path_error(args.out, folder=False)
    if why:
        ap.error(f"--out {args.out!r}: {why}")
    return args


def main(argv=None):
    set_run_environment()
    args = parse_args(argv)

    import torch

    from moe_overlap.launch import spawn
    W = args.world_size or torch.cuda.device_count()
    if W < 2:
        print("sweep needs at least 2 GPUs", file=sys.stderr)
        return 2
    if W > torch.cuda.device_count() and not args.share_gpu:
        print(f"sweep needs {W} GPUs (one per rank), found {torch.cuda.device_count()} "
              "(--share-gpu runs the ranks as processes sharing them)", file=sys.stderr)
        return 2
    from .shapes import check_world
    try:
        check_world(args.shapes, W)
    except ValueError as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 2
    outside = sorted({r for e in args.empty_ranks for r in e if r >= W})
    if outside:
        print(f"sweep: --empty-ranks names ranks {outside} of a world of {W}", file=sys.stderr)
        return 2
    planned = planned_points(args)
    if args.progress and os.path.exists(args.progress):
        os.remove(args.progress)
    t0 = time.time()
    if args.autotune:  # a fresh tune cache for this run
        os.environ["MOE_OVERLAP_TUNE_CACHE"] = os.path.abspath(args.out) + ".tune.json"
        if os.path.exists(os.environ["MOE_OVERLAP_TUNE_CACHE"]):
            os.remove(os.environ["MOE_OVERLAP_TUNE_CACHE"])
    points, tuned, soaks = spawn(worker, W, args, backend="cuda")[0]
    summary = summarize(points, tuned)
    commit = os.environ.get("GIT_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        except OSError:
            commit = ""
    gpus = torch.cuda.device_count()
    meta = dict(device=torch.cuda.get_device_name(0), world_size=W, gpus=min(W, gpus),
                ranks_share_gpu=W > gpus,
                mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")) and W > gpus,
                torch=torch.__version__,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                git_commit=commit, tile_m=args.tile_m,
                transport=args.transport, local_copy=args.local_copy, copy=args.copy,
                order=",".join(args.order), layout=",".join(args.layout), reps=args.reps,
                replays=args.replays, gemm_options=args.gemm_options,
                empty_ranks=[list(e) for e in args.empty_ranks], producer=args.producer,
                test_broken_order=os.environ.get("MOE_OVERLAP_TEST_BROKEN_ORDER", ""),
                expect_fail=args.expect_fail, planned_points=planned,
                race_calls=args.race_calls, soak=args.soak,
                soak_routing_every=args.soak_routing_every, seconds=time.time() - t0)
    from moe_overlap.provenance import stamp
    doc = stamp(dict(meta=meta, summary=summary, points=points, autotune=tuned, soak=soaks),
                "combine", gpus=W, device=meta["device"], commit=commit)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    v = verdict(doc)
    failed = v["failures"] + [t for t in tuned if t["rel_err_vs_seq"] > 8e-3]
    if args.validate_only:
        for f in failed:
            print(f"MISMATCH {f}")
        what = ("checks of the broken ordering caught (every point must fail)"
                if args.expect_fail else "checks passed (bitwise vs non-overlapped, rel err "
                "vs sequential <= 8e-3, race calls, soak)")
        print(f"validate (overlap, {meta['device']} x{W}, {args.transport}): "
              f"{v['passed']}/{v['points']} {what}; wrote {args.out}")
        return 1 if failed else 0
    print(f"\nbest configuration per shape and router mode ({meta['device']} x{W}, "
          f"{args.transport}); times in ms, median of CUDA-graph replays, max over ranks")
    hdr = (f"{'shape TxExkxNxK':<22}{'mode':<14}{'ccta':>5}{'mgb':>4}{'gemm':>7}{'comm':>7}"
           f"{'overlap':>8}{'/bound':>7}{'seq':>7}{'speedup':>8}{'hidden':>7}{'model/best':>11}"
           f"{'tuned':>8}{'tuned/best':>11}{'valid':>6}")
    print(hdr)
    print("-" * len(hdr))
    for r in summary:
        s = r["shape"]
        name = f"{s['tokens']}x{s['experts']}x{s['topk']}x{s['N']}x{s['K']}"
        ab = f"{r['analytic_over_best']:.3f}" if r["analytic_over_best"] else "n/a"
        tc = "{},{}".format(*r["autotuned"]) if r["autotuned"] else "n/a"
        tb = f"{r['autotuned_over_best']:.3f}" if r["autotuned_over_best"] else "n/a"
        print(f"{name:<22}{r['mode']:<14}{r['best_ccta']:>5}{r['best_mgb']:>4}"
              f"{r['t_gemm_ms']:>7.3f}{r['t_comm_ms']:>7.3f}{r['t_overlap_ms']:>8.3f}"
              f"{r['overlap_over_bound']:>7.2f}{r['t_seq_ms']:>7.3f}{r['speedup']:>8.2f}"
              f"{r['hidden_fraction']:>7.2f}{ab:>11}{tc:>8}{tb:>11}"
              f"{'ok' if r['all_passed'] else 'FAIL':>6}")
    print(f"validation: {len(points) - len(failed)}/{len(points)} points passed "
          f"(bitwise vs non-overlapped, rel err vs sequential <= 8e-3); wrote {args.out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
