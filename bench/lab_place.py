"""The layer's row placement on one GPU, three ways (a lab probe for bench_moe_layer's "place"):

    python bench/lab_place.py [--tokens 4096] [--models qwen3-235b-a22b,qwen3-30b-a3b,...]

For W = 1 and the model's balanced routing (``moe_overlap.routing``), the received rows (expert
by expert, [n, D] bf16) are placed in the plan layout (``plan_combine`` at tile_m 128):
- gather: ``recv_z.index_select(0, src)`` over every plan row, padding rows reading the zero row
  after the received ones (what bench_moe_layer's ours runs, ``plan_gather_index``);
- scatter: ``x_plan.index_copy_(0, dest, recv)``, the received rows only, padding rows left as
  they are (the GEMMs compute them, nothing reads them);
- permute: ``x.index_select(0, perm)`` of n rows (the base layer's permutation).
Each timed as a CUDA graph of 20 calls, median of 15 replays (``timing.time_calls``); results
printed, and checked: the scattered and gathered layouts equal on every valid row.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from moe_overlap.combine.dispatch import plan_gather_index  # noqa: E402
from moe_overlap.combine.plan import plan_combine  # noqa: E402
from moe_overlap.combine.shapes import MODELS  # noqa: E402
from moe_overlap.routing import routing_counts  # noqa: E402
from moe_overlap.timing import time_calls  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--models", default="qwen3-235b-a22b,qwen3-30b-a3b,deepseek-v3,mixtral-8x7b")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # off CUDA a dry run of the layout arithmetic: the calls run once, no times
    timed = ((lambda fn: time_calls(fn, reps=20, replays=15)[0]) if dev.type == "cuda"
             else (lambda fn: (fn(), float("nan"))[1]))
    for name in a.models.split(","):
        E, topk, _, D = MODELS[name]  # D: the hidden size the dispatched tokens have
        counts = routing_counts(1, a.tokens, E, topk, mode="balanced", seed=1).to(dev)
        plan = plan_combine(counts, 0, tile_m=128, max_rows=a.tokens * topk, validate=False)
        rows = int(plan.total_rows.item())
        n = int(counts.sum())
        src = plan_gather_index(plan, counts, 0, n, rows)  # the bench's gather index
        valid = src < n
        assert int(valid.sum()) == n  # each received row at one plan row
        dest = torch.empty(n, dtype=torch.long, device=dev)  # its inverse: received -> plan row
        dest[src[valid]] = valid.nonzero().squeeze(1)
        recv_z = torch.randn(n + 1, D, device=dev, dtype=torch.bfloat16)
        recv_z[n] = 0
        recv = recv_z[:n]
        perm = torch.randperm(n, device=dev)
        x_g = torch.empty(rows, D, device=dev, dtype=torch.bfloat16)
        x_s = torch.empty(rows, D, device=dev, dtype=torch.bfloat16)
        x_p = torch.empty(n, D, device=dev, dtype=torch.bfloat16)
        t = dict(gather=timed(lambda: torch.index_select(recv_z, 0, src, out=x_g)),
                 scatter=timed(lambda: x_s.index_copy_(0, dest, recv)),
                 permute=timed(lambda: torch.index_select(recv, 0, perm, out=x_p)))
        same = bool(torch.equal(x_g[dest], x_s[dest]))
        print(f"{name}@{a.tokens} W1: n {n} plan rows {rows} D {D}: "
              + " ".join(f"{k} {v:.4f} ms" for k, v in t.items()) + f"; valid rows equal {same}",
              flush=True)


if __name__ == "__main__":
    main()
