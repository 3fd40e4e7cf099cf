"""Benchmark of `dispatch_to_plan`'s placement on one GPU (a one-rank group: the exchange is a copy).

    PYTHONPATH=$PWD python bench/bench_dispatch.py [--tokens 4096] [--rounds 20] [--out DIR]

Per model shape (`combine.shapes.MODELS`, balanced routing): the library call (`dispatch_to_plan`:
sort, exchange with one trailing zero row, gather of every plan row), the same call with the
placement as a scatter into a zeroed buffer (``out[dest] = recv``, the library's placement before
session 13), and the torch-only baseline: the compact permutation a sequential layer does
(`x.index_select(0, argsort(ids) // k)`, no plan). The gather and the scatter are compared
bitwise every round. Timing: CUDA events around each eager call (the library call reads split
sizes and the plan's row count on the host, so it is not captured), the three interleaved in each
round, median over rounds. Floor: the plan's rows written + the received rows read once at
4.8 TB/s. JSON with device, date and commit to --out; a short table last.
"""
import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_results import result_header, write_result  # noqa: E402

from moe_overlap.combine import dispatch_to_plan  # noqa: E402
from moe_overlap.combine.plan import count_assignments, plan_combine  # noqa: E402
from moe_overlap.combine.reference import exchange  # noqa: E402
from moe_overlap.combine.shapes import MODELS  # noqa: E402
from moe_overlap.routing import route  # noqa: E402

HBM_TBS = 4.8


def dispatch_scatter(x, topk_ids, plan, counts):
    """`dispatch_to_plan` at W = 1 with the placement as a scatter into a zeroed buffer."""
    k = topk_ids.shape[1]
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    send = x.index_select(0, order // k)
    El = plan.experts_per_rank
    n_recv = int(counts.sum())
    recv = exchange(send, [n_recv], [n_recv])
    n = counts[:, :El].reshape(-1).to(x.device)
    start = torch.cumsum(n, 0) - n
    blk = torch.repeat_interleave(torch.arange(n.numel(), device=x.device), n,
                                  output_size=n_recv)
    j = torch.arange(n_recv, device=x.device) - start[blk]
    s, e = blk // El, blk % El
    dest = plan.expert_row_start.long()[e] + plan.group_row_start.long()[e, s] + j
    out = torch.zeros(int(plan.total_rows.item()), x.shape[1], dtype=x.dtype, device=x.device)
    out[dest] = recv
    return out


def permute(x, topk_ids):
    """The torch-only baseline: the compact layout's permutation, no plan."""
    order = torch.argsort(topk_ids.reshape(-1), stable=True)
    return x.index_select(0, order // topk_ids.shape[1])


def timed(fn, cuda):
    if not cuda:  # the CPU smoke test: wall time
        t0 = time.perf_counter()
        out = fn()
        return out, (time.perf_counter() - t0) * 1e3
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    out = fn()
    b.record()
    torch.cuda.synchronize()
    return out, a.elapsed_time(b)


def check_layout(name, got, compact, plan, counts):
    """Independent of the plan's index math: expert e's rows of the plan layout are its rows of
    the compact permutation (one rank: token order in both), every padding row zero."""
    ers, n = plan.expert_row_start.tolist(), counts[0].tolist()
    used = torch.zeros(got.shape[0], dtype=torch.bool, device=got.device)
    c0 = 0
    for e, ne in enumerate(n):
        r0 = ers[e]
        if not torch.equal(got[r0:r0 + ne], compact[c0:c0 + ne]):
            raise RuntimeError(f"{name}: expert {e}'s rows are not at its plan rows")
        used[r0:r0 + ne] = True
        c0 += ne
    if bool((got[~used] != 0).any()):
        raise RuntimeError(f"{name}: a padding row is not zero")


def run_shape(name, T, rounds, seed, placement=None):
    """placement: replaces the library call (tests: a broken placement must be caught)."""
    E, topk, _, N = MODELS[name]
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ids, _ = route(T, E, topk, "balanced", seed=seed)
    ids = ids.to(dev)
    counts = count_assignments(ids, E)[None].cpu()
    plan = plan_combine(counts, 0, tile_m=128).to(dev)
    counts = counts.to(dev)
    lib = placement or (lambda x: dispatch_to_plan(x, ids, plan, counts, validate=False))
    calls = {"gather": lib,
             "scatter": lambda x: dispatch_scatter(x, ids, plan, counts),
             "permute": lambda x: permute(x, ids)}
    g = torch.Generator(device=dev).manual_seed(seed)
    times = {n: [] for n in calls}
    with torch.inference_mode():
        for r in range(rounds + 3):  # 3 warm-up rounds
            x = torch.randn(T, N, device=dev, generator=g).to(torch.bfloat16)
            outs = {}
            for n, fn in calls.items():
                outs[n], ms = timed(lambda: fn(x), cuda)
                if r >= 3:
                    times[n].append(ms)
            if not torch.equal(outs["gather"], outs["scatter"]):
                raise RuntimeError(f"{name}: the gather and the scatter placements differ")
            check_layout(name, outs["gather"], outs["permute"], plan, counts)
    plan_rows = int(plan.total_rows.item())
    floor_ms = (plan_rows + T * topk) * N * 2 / (HBM_TBS * 1e12) * 1e3
    med = {n: statistics.median(v) for n, v in times.items()}
    return dict(name=f"{name}@{T}", tokens=T, experts=E, topk=topk, N=N, plan_rows=plan_rows,
                received_rows=T * topk, gather_ms=med["gather"], scatter_ms=med["scatter"],
                permute_ms=med["permute"], floor_ms=floor_ms,
                gather_over_scatter=med["scatter"] / med["gather"],
                gather_over_permute=med["permute"] / med["gather"], rounds=rounds,
                bitwise_gather_eq_scatter=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    rows = [run_shape(m, a.tokens, a.rounds, a.seed) for m in a.models.split(",")]
    doc = dict(result_header("bench_dispatch", torch.cuda.is_available()), rows=rows,
               method="eager calls, CUDA events, the three variants interleaved per round, "
                      "median; one-rank group (the exchange is a copy)")
    tag = f"_{a.tag}" if a.tag else ""
    path = write_result(doc, a.out, f"dispatch_1xh200{tag}_{doc['git_commit']}.json")
    print(f"{'shape':24s} {'gather':>8s} {'scatter':>8s} {'permute':>8s} {'floor':>7s}")
    for r in rows:
        print(f"{r['name']:24s} {r['gather_ms']:8.3f} {r['scatter_ms']:8.3f} "
              f"{r['permute_ms']:8.3f} {r['floor_ms']:7.3f}")
    print(path)


if __name__ == "__main__":
    main()
