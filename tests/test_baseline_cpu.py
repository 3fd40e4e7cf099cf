"""The prepared benchmark baseline agrees with the plain sequential baseline in every GEMM and
scale variant; the plan-layout -> compact-layout row map gives the baseline the same data."""
import torch

from moe_overlap.combine.baseline import SequentialBaseline, plan_to_compact_rows
from moe_overlap.combine.dispatch import dispatch_to_plan, exchange_counts
from conftest import spawn_ranks
from moe_overlap.combine.plan import plan_combine
from moe_overlap.combine.reference import sequential_combine, sequential_dispatch
from moe_overlap.routing import route

# every variant the baseline can pick (on CUDA); the test fails if a new one is not listed here
GEMMS = ("loop", "blocks", "grouped_mm")
SCALES_CPU = ("fp32", "bmm")


def _check(rank, W, mode):
    E, k, T, K, N = 8, 2, 50, 16, 24  # K, N rows of 64 / 96 bytes: what _grouped_mm needs
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
    probe = SequentialBaseline(counts, ids)
    listed = (set(probe._gemm_variants()) <= set(GEMMS),
              probe._scale_variants(False) == list(SCALES_CPU),
              probe._scale_variants(True) == list(SCALES_CPU) + ["compiled"])
    for gemm in GEMMS:
        for scale in SCALES_CPU:
            base = SequentialBaseline(counts, ids, gemm=gemm, scale=scale)
            errs[gemm, scale] = float((base(x_c, w, gates) - ref).abs().max())
    auto = SequentialBaseline(counts, ids)
    auto(x_c, w, gates)
    return same_data, errs, auto.gemm, listed


def test_prepared_baseline_matches_sequential_combine_in_every_variant():
    for mode in ("balanced", "stress_skew"):
        for same, errs, gemm, listed in spawn_ranks(_check, 2, mode):
            assert same
            assert all(listed)
            assert set(errs) == {(g, s) for g in GEMMS for s in SCALES_CPU}
            for variant, err in errs.items():
                assert err < 1e-5, (mode, variant, err)
            assert gemm == "loop"  # CPU: auto takes the first variant, without timing


def test_compiled_scale_matches_fp32_scale():
    """The `compiled` scale (CUDA auto-selection only) on CPU: torch.compile of the same fp32
    gather + weighted sum, one process (world size 1)."""
    E, k, T, N = 4, 2, 40, 24
    ids, gates = route(T, E, k, "moderate_skew", seed=5, rank=0)
    counts = exchange_counts(ids, E)
    base = SequentialBaseline(counts, ids, scale="compiled")
    recv = torch.randn(T * k, N, generator=torch.Generator().manual_seed(1))
    got = base.scale(recv, gates)
    want = base._scale("fp32", recv, gates)
    assert base.scale_kind == "compiled" and base._compiled is not None
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_one_rank_baseline_neither_permutes_nor_copies():
    """W = 1 (issue 36, the one-GPU layer's same-scale base): one source, so the GEMM output is
    already in send order (no permutation: the map is not even read) and there is no exchange
    (the send rows are the received rows, no copy), as in the overlapped combine there; the
    result is still the sequential combine's, in every GEMM variant."""
    E, k, T, K, N = 4, 2, 40, 16, 24
    ids, gates = route(T, E, k, "moderate_skew", seed=7, rank=0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(E, K, N, generator=g)
    counts = exchange_counts(ids, E)
    x_c, _ = sequential_dispatch(x, ids, E)
    ref = sequential_combine(x_c, w, counts, ids, gates)
    for gemm in GEMMS:
        base = SequentialBaseline(counts, ids, gemm=gemm, scale="fp32")
        base.to_source_major = None  # a permutation would have to read it
        send = base.expert_gemm(x_c, w)
        assert base.exchange(send) is send, gemm
        assert float((base(x_c, w, gates) - ref).abs().max()) < 1e-5, gemm
