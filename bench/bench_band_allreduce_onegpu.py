"""The band all-reduce with its G ranks emulated on ONE GPU (band_allreduce.EmulatedRanks), timed:
a local-HBM emulation that measures the kernel's per-SM instruction / issue limit, not NVLink.

THIS IS A LOCAL-HBM EMULATION, NOT AN NVLINK MEASUREMENT: every "peer" load and store of the
emulated ranks goes to this GPU's own memory (all G buffers live on it), so the numbers measure
the kernel's per-SM instruction / issue limit (bytes in flight per SM, the reduce and the flag
handshakes) against local HBM / L2, an upper bound on what the same CTAs could move over
NVLink. The JSON says so in ``emulation``.

    PYTHONPATH=$PWD python bench/bench_band_allreduce_onegpu.py [--world 2] [--partial bf16] \\
        [--ccta 4,8,16] [--shapes 8192x8192,32768x8192] [--out DIR] [--tag h200] [--quick]

Per shape (M x N) and ccta (CTAs per rank; the G grids share the GPU, world * ccta SMs in all,
one CTA per SM): one EmulatedRanks (standalone calls, producer=False), random partials, a first
call checked (error words clear, outputs bitwise equal across ranks; bf16: bitwise equal to
bf16_allreduce_reference, the fp32 sum in rank order rounded once; fp32: relative error); then
timed in interleaved rounds (moe_overlap.timing.time_interleaved, a --lead-ms GPU sleep before
each timed call so the host's G launches are enqueued before the GPU reaches them):
  - ``events``: CUDA events around the whole call on the caller's stream (fork, the G kernels on
    their streams, join), median over --rounds;
  - ``graph``: --reps calls (fork / G launches / join each) captured in one CUDA graph on forked
    streams, its replays timed the same way, median / reps. If the capture fails, or a replay
    records a timeout (the graph's branches not run concurrently), the row records why and keeps
    the events timing;
  - ``copy``: torch ``copy_`` of the same local bytes (a src -> dst copy of half the reads +
    writes of all ranks' kernels) on the whole GPU: the local-memory floor.
Bytes per rank are counted from the kernel's own band / chunk arithmetic
(band_allreduce.band_allreduce_traffic): step 2 reads chunk r of every band from all G buffers
and stores it into all G (G chunks read + G written per band), step 3 reads the band from the own
buffer and writes ``out`` (fp32: and zeroes the accumulator); b2 loads and flags are not counted.
Reported: ms, GB/s per rank, GB/s per SM (all ranks' bytes / (world * ccta) SMs), the peer part of
step 2 per rank (what would cross NVLink), NCCL's bus-bandwidth convention (S / t x 2 (G - 1) / G,
S = M N x element size) for comparison with NCCL numbers, and the ratio to the copy floor.
JSON ``band_allreduce_onegpu_<tag>.json`` in --out (rewritten after every row) with device,
date and commit.
"""
import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_results import result_header, write_result  # noqa: E402
from moe_overlap.ffn import band_allreduce as B  # noqa: E402
from moe_overlap.timing import time_interleaved  # noqa: E402

EMULATION = ("local-HBM emulation of G ranks on ONE GPU: every peer access is local memory, so "
             "this measures the band all-reduce kernel's per-SM instruction / issue limit (and "
             "local HBM / L2), NOT NVLink bandwidth")


def graph_of(er, M, outs, reps):
    """A CUDA graph of `reps` emulated calls (each: fork, G launches, join), warmed up outside."""
    er(M, outs=outs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            er(M, outs=outs)
    torch.cuda.synchronize()
    return g


def first_call_check(er, M, partial):
    """Random partials, one call: (dict of checks, the partials' total bytes)."""
    gen = torch.Generator(device=er.device).manual_seed(M + er.ccta)
    parts = []
    for d in er.data:
        if partial == "bf16":
            p = (torch.randn(M, er.N, generator=gen, device=er.device) * 2).to(torch.bfloat16)
        else:
            p = torch.randn(M, er.N, generator=gen, device=er.device)
        d[:M].copy_(p)
        parts.append(p)
    outs = [torch.full((M, er.N), float("nan"), dtype=torch.bfloat16, device=er.device)
            for _ in range(er.world)]
    er(M, outs=outs)
    errors = [e for e in er.errors() if e]
    res = dict(errors=errors,
               rank_equal=all(torch.equal(outs[0], o) for o in outs[1:]),
               nan=bool(outs[0].isnan().any()))
    if partial == "bf16":
        ref = B.bf16_allreduce_reference(parts)
        res["bitwise_ref"] = bool(torch.equal(outs[0], ref))
    else:
        ref = parts[0].clone()
        for p in parts[1:]:
            ref += p
    res["max_rel_err"] = ((outs[0].float() - ref.float()).abs()
                          / (ref.float().abs() + 1e-2)).max().item()
    res["ok"] = (not errors and res["rank_equal"] and not res["nan"]
                 and res.get("bitwise_ref", res["max_rel_err"] < 1e-2))
    del parts, ref
    return res, outs


def bench_row(a, M, N, ccta):
    r = dict(M=M, N=N, world=a.world, partial=a.partial, band_rows=a.band_rows, ccta=ccta,
             sms_used=a.world * ccta)

    def fresh():
        return B.EmulatedRanks(a.world, M, N, partial=a.partial, band_rows=a.band_rows,
                               ccta=ccta, timeout_ns=int(a.timeout_ms * 1e6))

    er = fresh()
    r.update(threads=er[0].threads, unroll=er[0].unroll, ctas_per_sm=er[0].ctas_per_sm,
             device_sms=er.sms, timeout_ms=a.timeout_ms)
    traffic = B.band_allreduce_traffic(M, N, a.band_rows, a.world, a.partial, er[0].zero_acc)
    total = sum(t["total"] for t in traffic)
    per_rank = max(t["total"] for t in traffic)
    peer = max(t["step2_peer_read"] + t["step2_peer_write"] for t in traffic)
    r.update(bytes_per_rank=per_rank, bytes_all_ranks=total, peer_bytes_per_rank=peer,
             traffic_rank0=traffic[0])
    r["first_call"], outs = first_call_check(er, M, a.partial)
    if not r["first_call"]["ok"]:
        raise RuntimeError(f"first call wrong: {r['first_call']}")
    graph = None
    try:
        graph = graph_of(er, M, outs, a.reps)
        graph.replay()
        errs = [e for e in er.errors() if e]
        if errs:
            r["graph_error"] = f"a replay recorded a timeout: {errs}"
    except Exception as e:  # noqa: BLE001 - capture not possible: events only
        r["graph_error"] = f"{type(e).__name__}: {e}"
        torch.cuda.synchronize()
    if "graph_error" in r:
        # after a timeout the counters are out of step (and a failed capture may leave the
        # streams unusable): a fresh set of ranks for the events timing
        graph = None
        er = fresh()
    fns = {"events": lambda: er(M, outs=outs)}
    if graph is not None:
        fns["graph"] = graph.replay
    n = total // 2 // 2  # bf16 elements: a copy of total / 2 bytes reads and writes `total`
    src = torch.ones(n, dtype=torch.bfloat16, device=er.device)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    t = time_interleaved(fns, warmup=a.warmup, rounds=a.rounds, lead_ms=a.lead_ms)
    errs = [e for e in er.errors() if e]
    if errs:
        raise RuntimeError(f"a timed call recorded a timeout: {errs}")
    per_call = {"events": 1, "graph": a.reps, "copy": 1}
    for k, v in t.items():
        d = {q: v[q] / per_call[k] for q in ("median_ms", "p10_ms", "p90_ms")}
        d["host_ms"] = v["host_ms"]
        r[k] = d
    ms = r["graph"]["median_ms"] if "graph" in r else r["events"]["median_ms"]
    copy_ms = r["copy"]["median_ms"]
    elt = 2 if a.partial == "bf16" else 4
    r.update(timing="graph" if "graph" in r else "events", ms=ms,
             gbps_per_rank=per_rank / ms / 1e6,
             gbps_per_sm=total / ms / 1e6 / (a.world * ccta),
             peer_gbps_per_rank=peer / ms / 1e6,
             nccl_busbw_gbps=M * N * elt / ms / 1e6 * 2 * (a.world - 1) / a.world,
             copy_ms=copy_ms, copy_gbps=total / copy_ms / 1e6,
             copy_gbps_per_sm=total / copy_ms / 1e6 / er.sms,
             x_copy_floor=ms / copy_ms,
             lead_covered=r["events"]["host_ms"] < a.lead_ms)
    del src, dst, fns, outs, er, graph
    return r


def write(a, rows, final=False):
    doc = dict(result_header("band_allreduce_onegpu"), emulation=EMULATION, complete=final,
               world=a.world, partial=a.partial, band_rows=a.band_rows,
               method=f"EmulatedRanks (G={a.world} ranks' buffers on one GPU, rank r's kernel on "
                      f"stream r), standalone calls; time_interleaved over {a.rounds} rounds "
                      f"(warm-up {a.warmup}, a {a.lead_ms} ms GPU sleep before each timed call), "
                      f"median; events = one eager call (fork, G launches, join), graph = CUDA "
                      f"graph of {a.reps} calls / {a.reps}, copy = torch copy_ of the same "
                      f"bytes; bytes from band_allreduce_traffic",
               failed=[f"{r['M']}x{r['N']}@ccta{r['ccta']}" for r in rows if "error" in r],
               rows=rows)
    path = write_result(doc, a.out, f"band_allreduce_onegpu_{a.tag}.json")
    if final:
        print(f"wrote {path}; failed: {doc['failed']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2, help="G: emulated ranks")
    ap.add_argument("--partial", default="bf16", choices=B.PARTIALS)
    ap.add_argument("--ccta", default="4,8,16", help="CTAs per rank (world * ccta <= SMs)")
    ap.add_argument("--shapes", default="8192x8192,32768x8192", help="M x N, comma separated")
    ap.add_argument("--band-rows", type=int, default=32,
                    help="rows per band (32: the fused layer's default above O/G = 2048)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5, help="calls per CUDA graph")
    ap.add_argument("--lead-ms", type=float, default=5.0,
                    help="GPU sleep before each timed call (covers the host's G launches)")
    ap.add_argument("--timeout-ms", type=float, default=1000.0,
                    help="the kernels' bounded waits (from each CTA's start)")
    ap.add_argument("--quick", action="store_true", help="8192x8192 at ccta 8, 5 rounds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    a = ap.parse_args()
    if a.quick:
        a.shapes, a.ccta, a.rounds = "8192x8192", "8", 5
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    cctas = [int(c) for c in a.ccta.split(",")]
    print(EMULATION, flush=True)
    rows = []
    for M, N in shapes:
        for ccta in cctas:
            try:
                r = bench_row(a, M, N, ccta)
                g = r.get("graph_error")
                print(f"{M:6d}x{N:<6d} G={a.world} {a.partial} ccta {ccta:3d} "
                      f"({r['sms_used']} SMs): {r['ms']:8.3f} ms ({r['timing']}; events "
                      f"{r['events']['median_ms']:.3f}) {r['gbps_per_rank']:7.1f} GB/s per rank, "
                      f"{r['gbps_per_sm']:6.1f} GB/s per SM, copy floor {r['copy_ms']:.3f} ms "
                      f"({r['copy_gbps']:.0f} GB/s), x{r['x_copy_floor']:.2f}"
                      + (f" [graph: {g}]" if g else ""), flush=True)
            except Exception as e:  # noqa: BLE001 - record and go on
                r = dict(M=M, N=N, world=a.world, partial=a.partial, ccta=ccta,
                         error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                print(f"{M}x{N} ccta {ccta} FAILED: {r['error']}", flush=True)
            rows.append(r)
            write(a, rows)
            torch.cuda.empty_cache()
    write(a, rows, final=True)


if __name__ == "__main__":
    main()
