"""order="expert" (the plan's schedule expert by expert) through MoECombine on CPU ranks (gloo):
the same output as remote_first, bit for bit, and the float64 truth; the options key the tune
cache on it."""
import pytest
import torch

from moe_overlap import MoECombine
from moe_overlap.combine import dispatch_to_plan, exchange_counts, grouped_matmul
from moe_overlap.combine.options import CombineFacts, CombineOptions
from conftest import spawn_ranks

E_PER_RANK, K, D, N, TOPK = 3, 8, 6, 5, 2


def _case(rank, W):
    g = torch.Generator().manual_seed(5)
    E = E_PER_RANK * W
    per = [dict(ids=torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(200)]),
                gates=torch.rand(200, TOPK, generator=g, dtype=torch.float64),
                x=torch.randn(200, D, generator=g, dtype=torch.float64)) for _ in range(W)]
    w_up = torch.randn(E, D, K, generator=g, dtype=torch.float64)
    w_down = torch.randn(E, K, N, generator=g, dtype=torch.float64)
    me = per[rank]
    mine = slice(rank * E_PER_RANK, (rank + 1) * E_PER_RANK)
    outs, scheds = {}, {}
    for order in ("remote_first", "expert"):
        layer = MoECombine(E, K, N, TOPK, max_tokens_per_rank=200, tile_m=64,
                           backend="reference", options=CombineOptions(order=order))
        counts = exchange_counts(me["ids"], E)
        plan = layer.plan(counts)
        assert plan.order == order
        nb = int(plan.num_bands)
        scheds[order] = plan.schedule[:nb].tolist()
        x_plan = dispatch_to_plan(me["x"], me["ids"], plan, counts)
        h = grouped_matmul(x_plan, w_up[mine], plan.expert_rows.tolist())
        outs[order] = layer(h, w_down[mine], plan, me["ids"], me["gates"],
                            routes=layer.prepare(plan, me["ids"]))
    truth = torch.zeros(200, N, dtype=torch.float64)
    for t in range(200):
        for j in range(TOPK):
            e = int(me["ids"][t, j])
            truth[t] += me["gates"][t, j] * (me["x"][t] @ w_up[e] @ w_down[e])
    return (bool(torch.equal(outs["remote_first"], outs["expert"])),
            float((outs["expert"] - truth).abs().max()),
            scheds["expert"] == sorted(scheds["expert"]),
            scheds["remote_first"] != scheds["expert"])


def test_expert_order_gives_the_same_output():
    res = spawn_ranks(_case, 2)
    for same, err, sorted_, differs in res:
        assert same and err < 1e-10 and sorted_
    assert any(d for *_, d in res)  # the orders differ on some rank (else nothing was tested)


def test_options_check_it_and_key_the_cache_on_it():
    assert CombineOptions(order="expert", scale="ordered").order == "expert"
    with pytest.raises(ValueError, match="order="):
        CombineOptions(order="fastest")
    facts = CombineFacts(world_size=2, hidden_size=64, out_features=64, experts_per_rank=2,
                         tile_m=128, rows=64)
    a, b = CombineOptions(producer="torch"), CombineOptions(producer="torch", order="expert")
    assert a.tune_key(facts) != b.tune_key(facts)
