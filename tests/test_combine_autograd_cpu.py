"""Autograd through the combine on CPU ranks (gloo, float64): each rank's gradients of h (its
plan-layout rows), w_down (its experts) and topk_weights equal those of the same global problem
differentiated by plain torch autograd in one process; likewise the sequential baseline and the
dispatch (gradient of the tokens), also where a rank's experts receive no row."""
import pytest
import torch

from moe_overlap import MoECombine
from moe_overlap.combine import dispatch_to_plan, exchange_counts
from moe_overlap.combine.reference import sequential_combine, sequential_dispatch
from conftest import spawn_ranks

K, N, TOPK, EL = 5, 4, 2, 2


def _global(W, tokens):
    """The global problem, the same on every rank: per rank ids, gates, expert-input rows of each
    assignment, tokens and the output's cotangent; the weights of all experts."""
    g = torch.Generator().manual_seed(1234)
    E = EL * W
    ranks = []
    for T in tokens:
        ids = (torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(T)]) if T
               else torch.zeros(0, TOPK, dtype=torch.long))
        ranks.append(dict(ids=ids, gates=torch.rand(T, TOPK, generator=g, dtype=torch.float64),
                          rows=torch.randn(T, TOPK, K, generator=g, dtype=torch.float64),
                          x=torch.randn(T, K, generator=g, dtype=torch.float64),
                          cot=torch.randn(T, N, generator=g, dtype=torch.float64)))
    w = torch.randn(E, K, N, generator=g, dtype=torch.float64)
    return E, ranks, w


def _truth(ranks, w, inputs):
    """Single-process autograd of sum_s <out_s, cot_s>, out_s[t] = sum_j gate * row @ w[id];
    inputs: "rows" (expert-input rows per assignment) or "x" (each assignment's row is its
    token). Returns the gradients of the per-rank inputs, the gates and w."""
    w = w.clone().requires_grad_()
    leaves, gates, loss = [], [], 0
    for r in ranks:
        a = r[inputs].clone().requires_grad_()
        gt = r["gates"].clone().requires_grad_()
        rows = a if inputs == "rows" else a.unsqueeze(1).expand(-1, TOPK, -1)
        y = torch.einsum("tjk,tjkn->tjn", rows, w[r["ids"]])
        out = (gt.unsqueeze(-1) * y).sum(1)
        loss = loss + (out * r["cot"]).sum()
        leaves.append(a)
        gates.append(gt)
    loss.backward()
    return [a.grad for a in leaves], [gt.grad for gt in gates], w.grad


def _arrivals(ranks, g):
    """(source, token, k) of every assignment to global expert g, in the order they arrive:
    source ascending, then the source's (token, k) order."""
    return [(s, t, j) for s, r in enumerate(ranks) for t in range(len(r["ids"]))
            for j in range(TOPK) if int(r["ids"][t, j]) == g]


def _plan_rows(plan, ranks, rank):
    """{(source, token, k): row of the plan layout} for this rank's experts (docs: expert e's
    rows are one group per source at group_row_start[e, s], in the source's order)."""
    out = {}
    for e in range(EL):
        start = {}
        for s, t, j in _arrivals(ranks, rank * EL + e):
            i = start.setdefault(s, 0)
            start[s] = i + 1
            out[s, t, j] = int(plan.expert_row_start[e]) + int(plan.group_row_start[e, s]) + i
    return out


def _case(rank, W, tokens):
    E, ranks, w_all = _global(W, tokens)
    me = ranks[rank]
    mine = slice(rank * EL, (rank + 1) * EL)
    d_rows, d_gates, d_w = _truth(ranks, w_all, "rows")
    errs = {}

    # ---- MoECombine, reference backend: h in the plan layout
    layer = MoECombine(E, K, N, TOPK, max_tokens_per_rank=8, tile_m=64, backend="reference")
    counts = exchange_counts(me["ids"], E)
    plan = layer.plan(counts)
    where = _plan_rows(plan, ranks, rank)
    h = torch.randn(int(plan.total_rows), K, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(rank))  # padding rows: junk
    for (s, t, j), row in where.items():
        h[row] = ranks[s]["rows"][t, j]
    h.requires_grad_()
    w = w_all[mine].clone().requires_grad_()
    gates = me["gates"].clone().requires_grad_()
    out = layer(h, w, plan, me["ids"], gates)
    (out * me["cot"]).sum().backward()
    if h.grad is None or w.grad is None or gates.grad is None:
        return {"missing": [n for n, t in (("h", h), ("w_down", w), ("gates", gates))
                            if t.grad is None]}
    want_h = torch.zeros_like(h)
    for (s, t, j), row in where.items():
        want_h[row] = d_rows[s][t, j]
    errs["h"] = (h.grad - want_h).abs().max().item() if h.numel() else 0.0
    errs["w_down"] = (w.grad - d_w[mine]).abs().max().item()
    errs["gates"] = (gates.grad - d_gates[rank]).abs().max().item() if gates.numel() else 0.0

    # ---- sequential baseline: h in the compact layout (expert, source, source order)
    order = [a for e in range(EL) for a in _arrivals(ranks, rank * EL + e)]
    hc = torch.stack([ranks[s]["rows"][t, j] for s, t, j in order]) if order else \
        torch.zeros(0, K, dtype=torch.float64)
    hc.requires_grad_()
    w2 = w_all[mine].clone().requires_grad_()
    gates2 = me["gates"].clone().requires_grad_()
    seq = sequential_combine(hc, w2, counts, me["ids"], gates2)
    (seq * me["cot"]).sum().backward()
    want_hc = torch.stack([d_rows[s][t, j] for s, t, j in order]) if order else hc
    errs["seq_h"] = (hc.grad - want_hc).abs().max().item() if order else 0.0
    errs["seq_w_down"] = (w2.grad - d_w[mine]).abs().max().item()

    # ---- dispatch -> combine: the tokens' gradient crosses both exchanges
    d_x, _, d_w3 = _truth(ranks, w_all, "x")
    x = me["x"].clone().requires_grad_()
    w3 = w_all[mine].clone().requires_grad_()
    h3 = dispatch_to_plan(x, me["ids"], plan, counts)
    (layer(h3, w3, plan, me["ids"], me["gates"]) * me["cot"]).sum().backward()
    errs["dispatch_x"] = (x.grad - d_x[rank]).abs().max().item() if x.numel() else 0.0
    errs["dispatch_w_down"] = (w3.grad - d_w3[mine]).abs().max().item()
    xs = me["x"].clone().requires_grad_()
    x_c, counts_c = sequential_dispatch(xs, me["ids"], E)
    rows_e = counts_c[:, mine].sum(0).tolist()
    hs = torch.cat([x_c[sum(rows_e[:e]):sum(rows_e[:e + 1])] for e in range(EL)])
    (sequential_combine(hs, w_all[mine], counts_c, me["ids"], me["gates"])
     * me["cot"]).sum().backward()
    errs["seq_dispatch_x"] = (xs.grad - d_x[rank]).abs().max().item() if xs.numel() else 0.0
    return errs


@pytest.mark.parametrize("tokens", [[6], [7, 5], [6, 0, 4]])
def test_gradients_match_single_process_autograd(tokens):
    for rank, errs in enumerate(spawn_ranks(_case, len(tokens), tokens)):
        assert "missing" not in errs, (rank, errs)
        assert max(errs.values()) < 1e-12, (rank, errs)


def _combine_rank_receives_nothing(rank, world, xs, ids, gates, w_down_all, cots):
    """dispatch_to_plan -> MoECombine (reference) where rank 1's experts get no row."""
    E = w_down_all.shape[0]
    El = E // world
    combine = MoECombine(E, w_down_all.shape[1], w_down_all.shape[2], ids[0].shape[1],
                         max_tokens_per_rank=8, tile_m=64, backend="reference")
    x = xs[rank].clone().requires_grad_()
    w = w_down_all[rank * El:(rank + 1) * El].clone().requires_grad_()
    counts = exchange_counts(ids[rank], E)
    plan = combine.plan(counts)
    h = dispatch_to_plan(x, ids[rank], plan, counts)
    out = combine(h, w, plan, ids[rank], gates[rank])
    (out * cots[rank]).sum().backward()  # collective: every rank must take part
    return dict(rows=int(plan.total_rows), x=x.grad,
                w=torch.zeros_like(w) if w.grad is None else w.grad)


def test_combine_backward_takes_part_on_a_rank_that_receives_nothing():
    """A rank whose experts get no row (all tokens routed to rank 0's experts) still runs the
    combine's and the dispatch's backward exchange (it once built no graph there: the others
    then waited for it), and every gradient is the single-process one."""
    g = torch.Generator().manual_seed(7)
    f64 = torch.float64
    sizes, Dx, N = [3, 2], 5, 4
    ids = [torch.stack([torch.randperm(2, generator=g) for _ in range(T)]) for T in sizes]
    xs = [torch.randn(T, Dx, generator=g, dtype=f64) for T in sizes]
    gates = [torch.rand(T, 2, generator=g, dtype=f64) for T in sizes]
    cots = [torch.randn(T, N, generator=g, dtype=f64) for T in sizes]
    w_all = torch.randn(4, Dx, N, generator=g, dtype=f64)
    res = spawn_ranks(_combine_rank_receives_nothing, 2, xs, ids, gates, w_all, cots,
                      timeout_s=60, join_timeout_s=120)
    assert res[1]["rows"] == 0  # the case does what it says
    w = w_all.clone().requires_grad_()
    leaves = [x.clone().requires_grad_() for x in xs]
    loss = sum(((gt.unsqueeze(-1) * torch.einsum("td,tjdn->tjn", x, w[i])).sum(1) * c).sum()
               for x, i, gt, c in zip(leaves, ids, gates, cots))
    loss.backward()
    for r in range(2):
        assert torch.allclose(res[r]["x"], leaves[r].grad, atol=1e-12), r
        assert torch.allclose(res[r]["w"], w.grad[2 * r:2 * r + 2], atol=1e-12), r
