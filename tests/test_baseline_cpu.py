"""The prepared benchmark baseline agrees with the plain sequential baseline; the plan-layout ->
compact-layout row map gives the baseline the same data."""
import torch

from moe_overlap.combine.baseline import SequentialBaseline, plan_to_compact_rows
from moe_overlap.combine.dispatch import dispatch_to_plan, exchange_counts
from moe_overlap.launch import spawn
from moe_overlap.combine.plan import plan_combine
from moe_overlap.combine.reference import sequential_combine, sequential_dispatch
from moe_overlap.routing import route


def _check(rank, W, mode):
    E, k, T, K, N = 8, 2, 50, 16, 24
    ids, gates = route(T, E, k, mode, seed=3, rank=rank)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(E // W, K, N, generator=g)
    counts = exchange_counts(ids, E)
    plan = plan_combine(counts, rank, tile_m=64)
    x_plan = dispatch_to_plan(x, ids, plan, counts)
    x_c, _ = sequential_dispatch(x, ids, E)
    same_data = torch.equal(x_plan[plan_to_compact_rows(plan, counts)], x_c)
    ref = sequential_combine(x_c, w, counts, ids, gates)
    errs = {}
    for gemm in ("loop", "blocks"):
        for scale in ("fp32", "bmm"):
            base = SequentialBaseline(counts, ids, gemm=gemm, scale=scale)
            errs[gemm, scale] = float((base(x_c, w, gates) - ref).abs().max())
    auto = SequentialBaseline(counts, ids)
    auto(x_c, w, gates)
    return same_data, max(errs.values()), auto.gemm


def test_prepared_baseline_matches_sequential_combine():
    for mode in ("balanced", "stress_skew"):
        for same, err, gemm in spawn(_check, 2, mode):
            assert same
            assert err < 1e-5
            assert gemm in ("loop", "grouped_mm")
