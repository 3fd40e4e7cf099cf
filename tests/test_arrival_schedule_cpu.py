"""``arrival_schedule`` (combine/dispatch_index.py): the up-projection's band order for the
per-source expand, checked against a row-by-row construction (every row of the plan layout
labelled with its source, from the counts and the plan's group starts), at W = 2, 3, 4, both
layouts, skewed and uniform routings and a rank with no tokens. The emulated check that the
kernel raises the flags in exactly this order is in tests/test_dispatch_overlap_emulated.py."""
import pytest
import torch

from moe_overlap.combine.dispatch_index import arrival_schedule
from moe_overlap.combine.plan import plan_combine


def _counts(W, El, seed, skew):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 150, (W, El * W), generator=g)
    if skew:  # a few hot experts, a source with nothing
        c = c * (torch.rand(W, El * W, generator=g) < 0.3)
        c[seed % W] = 0
    return c


def _far_by_rows(plan, counts):
    """{band: the farthest rank distance of a source with a row in it} for the valid bands."""
    W, r, El, tm = plan.world_size, plan.rank, plan.experts_per_rank, plan.tile_m
    src = {}
    for e in range(El):
        for s in range(W):
            a = int(plan.expert_row_start[e]) + int(plan.group_row_start[e, s])
            for row in range(a, a + int(counts[s, r * El + e])):
                src.setdefault(row // tm, set()).add(s)
    n = int(plan.num_bands)
    assert set(src) <= set(range(n))
    return {b: max((s - r) % W for s in src[b]) for b in range(n)}


@pytest.mark.parametrize("layout", ["aligned", "packed"])
@pytest.mark.parametrize("W", [2, 3, 4])
@pytest.mark.parametrize("skew", [False, True])
def test_bands_in_order_of_their_last_sources_distance(W, layout, skew):
    El, tm = 3, 64
    for seed in range(3):
        counts = _counts(W, El, seed, skew)
        for r in range(W):
            p = plan_combine(counts, r, tile_m=tm, layout=layout)
            sched = arrival_schedule(p, counts)
            n, B = int(p.num_bands), p.band_capacity
            assert sched.dtype == torch.int32 and sorted(sched.tolist()) == list(range(B))
            far = _far_by_rows(p, counts)
            got = sched[:n].tolist()
            assert got == sorted(range(n), key=lambda b: (far[b], b)), (W, layout, seed, r)
            assert sched[n:].tolist() == list(range(n, B))
            if far and any(f == 0 for f in far.values()):  # this rank's own rows first
                assert far[got[0]] == 0


@pytest.mark.parametrize("layout", ["aligned", "packed"])
@pytest.mark.parametrize("W", [2, 4])
def test_expert_order_keeps_each_experts_bands_together_then_arrival(W, layout):
    """order="expert": every valid band once, experts ascending, within an expert the arrival
    order (farthest source distance, then band id), the bands past num_bands last."""
    El, tm = 3, 64
    for seed in range(3):
        counts = _counts(W, El, seed, skew=seed == 2)
        for r in range(W):
            p = plan_combine(counts, r, tile_m=tm, layout=layout)
            sched = arrival_schedule(p, counts, order="expert")
            n, B = int(p.num_bands), p.band_capacity
            assert sorted(sched.tolist()) == list(range(B))
            far = _far_by_rows(p, counts)
            expert = [int(p.band_expert[b]) for b in range(n)]
            assert sched[:n].tolist() == sorted(range(n), key=lambda b: (expert[b], far[b], b))
            assert sched[n:].tolist() == list(range(n, B))


def test_unknown_order_is_refused():
    counts = _counts(2, 2, 0, False)
    with pytest.raises(ValueError, match="order"):
        arrival_schedule(plan_combine(counts, 0, tile_m=64), counts, order="band")
