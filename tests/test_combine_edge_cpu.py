"""Edge cases of the combine pipeline on CPU ranks (gloo): ranks with zero tokens, experts with zero
rows, routings that no longer match the plan, bad expert ids, bad input on one rank only (every
rank must raise quickly, naming it), numpy integers and dtype messages."""
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from moe_overlap import MoECombine, plan_combine
from moe_overlap.combine import dispatch_to_plan, exchange_counts, grouped_matmul
from moe_overlap.combine.baseline import SequentialBaseline
from moe_overlap.combine.checks import PeerInputError, agree_on_error
from moe_overlap.combine.plan import count_assignments
from moe_overlap.combine.reference import (sequential_combine, sequential_dispatch,
                                           weighted_sum)
from conftest import spawn_ranks

E_PER_RANK, K, D, N, TOPK = 2, 8, 6, 5, 2


def _problem(W, tokens, experts, seed=0):
    """The same global problem on every rank: per rank ids / gates / x, and all experts' weights.
    experts: the global experts the router may pick (the others get zero rows)."""
    g = torch.Generator().manual_seed(seed)
    E = E_PER_RANK * W
    allowed = torch.tensor(experts)
    ranks = []
    for T in tokens:
        ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:TOPK]]
                           for _ in range(T)]) if T else torch.zeros(0, TOPK, dtype=torch.long)
        ranks.append(dict(ids=ids, gates=torch.rand(T, TOPK, generator=g, dtype=torch.float64),
                          x=torch.randn(T, D, generator=g, dtype=torch.float64)))
    w_up = torch.randn(E, D, K, generator=g, dtype=torch.float64)
    w_down = torch.randn(E, K, N, generator=g, dtype=torch.float64)
    return E, ranks, w_up, w_down


def _zero_case(rank, W, tokens, experts):
    E, ranks, w_up, w_down = _problem(W, tokens, experts)
    me = ranks[rank]
    mine = slice(rank * E_PER_RANK, (rank + 1) * E_PER_RANK)
    truth = torch.zeros(len(me["ids"]), N, dtype=torch.float64)
    for t in range(len(me["ids"])):
        for j in range(TOPK):
            e = int(me["ids"][t, j])
            truth[t] += me["gates"][t, j] * (me["x"][t] @ w_up[e] @ w_down[e])
    layer = MoECombine(E, K, N, TOPK, max_tokens_per_rank=8, tile_m=64, backend="reference")
    counts = exchange_counts(me["ids"], E)
    plan = layer.plan(counts)
    routes = layer.prepare(plan, me["ids"])
    x_plan = dispatch_to_plan(me["x"], me["ids"], plan, counts)
    h = grouped_matmul(x_plan, w_up[mine], plan.expert_rows.tolist())
    out = layer(h, w_down[mine], plan, me["ids"], me["gates"], routes=routes)
    x_c, counts_c = sequential_dispatch(me["x"], me["ids"], E)
    rows_e = counts_c[:, mine].sum(0).tolist()
    seq = sequential_combine(grouped_matmul(x_c, w_up[mine], rows_e), w_down[mine], counts_c,
                             me["ids"], me["gates"])
    # the prepared benchmark baseline, every CPU variant
    hc = grouped_matmul(x_c, w_up[mine], rows_e)
    base_err = 0.0
    for gemm in ("loop", "blocks"):
        for scale in ("fp32", "bmm"):
            base = SequentialBaseline(counts_c, me["ids"], gemm=gemm, scale=scale)
            base_err = max(base_err, _maxabs(base(hc, w_down[mine], me["gates"]) - truth))
    return (tuple(out.shape), _maxabs(out - truth), _maxabs(seq - truth), int(plan.total_rows),
            tuple(h.shape), base_err)


def _maxabs(t):
    return float(t.abs().max()) if t.numel() else 0.0


@pytest.mark.parametrize("T", [0, 1, 7])
def test_weighted_sum_against_a_float64_loop(T):
    """out[t] = sum_k w[t, k] * recv[rows[t, k]] from bf16 rows, accumulated in fp32 (its
    error against the float64 sum: fp32's, far below bf16's), in the dtype asked for; zero tokens
    give [0, N]."""
    g = torch.Generator().manual_seed(T)
    N, k = 6, 8
    recv = torch.randn(3 * k, N, generator=g).to(torch.bfloat16)
    rows = torch.stack([torch.randperm(3 * k, generator=g)[:k] for _ in range(T)]) if T \
        else torch.zeros(0, k, dtype=torch.long)
    gates = torch.rand(T, k, generator=g)
    truth = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            truth[t] += float(gates[t, j]) * recv[int(rows[t, j])].double()
    for out_dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        out = weighted_sum(recv, rows, gates, out_dtype)
        assert out.shape == (T, N) and out.dtype == out_dtype
        torch.testing.assert_close(out.double(), truth, rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens,experts", [
    ([6, 0], [1, 2, 3]),  # rank 1 routes nothing; expert 0 gets no rows
    ([0, 5, 4], [2, 3, 4, 5]),  # rank 0 routes nothing and receives nothing (h has 0 rows)
    ([0, 0], [0, 1, 2, 3]),  # nobody routes anything
])
def test_zero_tokens_and_empty_experts_on_every_path(tokens, experts):
    W = len(tokens)
    res = spawn_ranks(_zero_case, W, tokens, experts)
    for r, (shape, err, seq_err, total_rows, h_shape, base_err) in enumerate(res):
        assert shape == (tokens[r], N)
        assert err < 1e-12 and seq_err < 1e-12, (r, err, seq_err)
        assert base_err < 1e-5, (r, base_err)  # the benchmark baseline's scale is fp32
    if tokens == [0, 5, 4]:
        assert res[0][3] == 0 and res[0][4] == (0, K)


def _layer1(**kw):
    args = dict(num_experts=4, intermediate_size=8, out_features=6, topk=2, max_tokens_per_rank=16,
                tile_m=64, backend="reference")
    args.update(kw)
    return MoECombine(**args)


def _one_rank(T=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])
    counts = torch.bincount(ids.reshape(-1), minlength=4).unsqueeze(0)
    plan = plan_combine(counts, 0, tile_m=64)
    h = torch.randn(int(plan.total_rows), 8, generator=g)
    return h, torch.randn(4, 8, 6, generator=g), plan, ids, torch.rand(T, 2, generator=g)


def test_stale_routing_is_detected():
    h, w, plan, ids, gates = _one_rank()
    moved = ids.clone()
    moved[0] = torch.tensor([e for e in range(4) if e not in ids[0].tolist()][:2])
    with pytest.raises(ValueError, match="do not match the plan"):
        _layer1()(h, w, plan, moved, gates)
    # the same counts in another token order is the same plan: accepted
    _layer1()(h, w, plan, ids.flip(0), gates.flip(0))
    # the plan keeps the counts it was made from through .to()
    assert torch.equal(plan.to("cpu").routed_counts, plan.routed_counts)
    assert "routed_counts" in plan.tensors()


@pytest.mark.parametrize("bad,pos", [(4, (2, 1)), (-1, (0, 0)), (7, (5, 0))])
def test_bad_expert_ids_are_named(bad, pos):
    _, _, plan, ids, _ = _one_rank()
    ids = ids.clone()
    ids[pos] = bad
    msg = rf"got {bad} at topk_ids\[{pos[0]}, {pos[1]}\]"
    with pytest.raises(ValueError, match=msg):
        count_assignments(ids, 4)
    with pytest.raises(ValueError, match=msg):
        exchange_counts(ids, 4)
    x = torch.randn(ids.shape[0], 3)
    counts = torch.bincount(ids.reshape(-1).clamp(0, 3), minlength=4).unsqueeze(0)
    with pytest.raises(ValueError, match=msg):
        dispatch_to_plan(x, ids, plan, counts)


def test_dispatch_rejects_counts_of_another_routing():
    _, _, plan, ids, _ = _one_rank()
    counts = torch.bincount(ids.reshape(-1), minlength=4).unsqueeze(0)
    counts[0, 0] += 1
    counts[0, 1] -= 1
    with pytest.raises(ValueError, match="do not match expert_counts"):
        dispatch_to_plan(torch.randn(ids.shape[0], 3), ids, plan, counts)


# ---------------------------------------------------------------- bad input on one rank
def _raises(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _one_rank_bad(rank, W):
    """Each step: rank 1's input is bad, the others' good; every rank reports what it raised."""
    E, T = 2 * W, 6
    g = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    x = torch.randn(T, 4, generator=g)
    bad_ids = ids.clone()
    if rank == 1:
        bad_ids[3, 1] = E
    out = {"exchange_counts": _raises(lambda: exchange_counts(bad_ids, E))}
    counts = exchange_counts(ids, E)
    layer = MoECombine(E, 4, 6, 2, max_tokens_per_rank=T, tile_m=64, backend="reference")
    plan = layer.plan(counts)
    out["dispatch_to_plan"] = _raises(lambda: dispatch_to_plan(x, bad_ids, plan, counts))
    h = dispatch_to_plan(x, ids, plan, counts)
    w = torch.randn(2, 4, 6, generator=g)
    gates = torch.rand(T, 2, generator=g)
    stale = ids.clone()
    if rank == 1:  # re-routed after plan(): token 0 moves to other experts
        stale[0] = torch.tensor([e for e in range(E) if e not in ids[0].tolist()][:2])
    out["forward"] = _raises(lambda: layer(h, w, plan, stale, gates))
    too_many = counts.clone()
    if rank == 1:  # this rank's copy of the counts exceeds its capacity
        too_many[:, 2] = 10 * T * W  # expert 2 is rank 1's
    out["plan"] = _raises(lambda: layer.plan(too_many))
    # the group is still usable afterwards: a good call completes on every rank
    good = layer(h, w, plan, ids, gates)
    return out, tuple(good.shape)


def test_bad_input_on_one_rank_raises_on_every_rank_quickly():
    W = 3
    res = spawn_ranks(_one_rank_bad, W, timeout_s=30)
    for rank, (out, good_shape) in enumerate(res):
        assert good_shape == (6, 6)
        for step, (exc, msg, seconds) in out.items():
            assert exc is not None, (rank, step, "did not raise")
            assert seconds < 15, (rank, step, seconds)
            if rank == 1:
                assert msg.startswith("rank 1: "), (step, msg)
                assert exc in ("ValueError", "TypeError"), (step, exc, msg)
            else:
                assert exc == "PeerInputError" and "rank 1 reported bad input" in msg, \
                    (rank, step, exc, msg)
    assert "expert ids must be in [0, 6): got 6 at topk_ids[3, 1]" in res[0][0]["exchange_counts"][1]
    assert "do not match the plan" in res[2][0]["forward"][1]


def _collectives(rank, W):
    """all_reduce calls (the agreement's collective) per step, validating and not."""
    import torch.distributed as dist
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: calls.append(1) or real(*a, **k)
    E, T = 2 * W, 5
    g = torch.Generator().manual_seed(rank)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    x, w, gates = torch.randn(T, 4), torch.randn(2, 4, 6), torch.rand(T, 2)
    out = {}
    for validate in (True, False):
        layer = MoECombine(E, 4, 6, 2, T, tile_m=64, backend="reference", validate=validate)
        n0 = len(calls)
        counts = exchange_counts(ids, E, validate=validate)
        plan = layer.plan(counts)
        h = dispatch_to_plan(x, ids, plan, counts, validate=validate)
        y = layer(h, w, plan, ids, gates)
        out[validate] = (len(calls) - n0, y)
    dist.all_reduce = real
    return out[True][0], out[False][0], torch.equal(out[True][1], out[False][1])


def test_the_agreement_costs_one_all_reduce_per_step_and_none_without_validate():
    for with_validate, without, same in spawn_ranks(_collectives, 2):
        assert with_validate == 4 and without == 0 and same


def test_agree_on_error_at_world_size_one_raises_the_error_itself():
    agree_on_error(None)
    err = ValueError("boom")
    with pytest.raises(ValueError, match="^boom$"):
        agree_on_error(err)
    assert issubclass(PeerInputError, ValueError)


# ---------------------------------------------------------------- messages and integer types
def test_dtype_messages_name_the_supported_dtypes():
    h, w, plan, ids, gates = _one_rank()
    # float64 is supported by the reference backend (it computes in float64)
    out = _layer1()(h.double(), w.double(), plan, ids, gates)
    assert out.dtype == torch.float64
    ref = _layer1()(h, w, plan, ids, gates)
    assert torch.allclose(out.float(), ref, atol=1e-5)
    supported = "float32, bfloat16, float16, float64 .bfloat16 on the overlap backend.; got"
    with pytest.raises(TypeError, match=supported + " torch.float64 and torch.float32"):
        _layer1()(h.double(), w, plan, ids, gates)
    with pytest.raises(TypeError, match=supported + " torch.int32 and torch.int32"):
        _layer1()(h.int(), w.int(), plan, ids, gates)


def test_numpy_integers_are_accepted_and_bools_rejected():
    layer = MoECombine(np.int64(4), np.int32(8), np.int64(6), np.int64(2), np.int64(16),
                       tile_m=np.int64(64), backend="reference", mgb=np.int64(2),
                       ccta=np.int16(3))
    assert (layer.num_experts, layer.topk, layer.tile_m, layer.mgb, layer.ccta) == (4, 2, 64, 2, 3)
    assert all(type(v) is int for v in (layer.num_experts, layer.hidden_size, layer.tile_m,
                                        layer.mgb, layer.max_rows))
    counts = torch.tensor([[3, 1, 2, 4], [1, 1, 1, 1]])
    plan = plan_combine(counts, np.int64(1), tile_m=np.int64(64), mgb=np.int32(2),
                        max_rows=np.int64(100))
    assert (plan.rank, plan.tile_m, plan.mgb) == (1, 64, 2) and type(plan.rank) is int
    with pytest.raises(ValueError, match="rank"):
        plan_combine(counts, True)
    with pytest.raises(ValueError, match="mgb"):
        plan_combine(counts, 0, mgb=True)
    with pytest.raises(ValueError, match="max_rows"):
        plan_combine(counts, 0, max_rows=100.0)
    with pytest.raises(ValueError, match="num_experts"):
        MoECombine(True, 8, 6, 1, 16)
    with pytest.raises(ValueError, match="mgb"):
        MoECombine(4, 8, 6, 2, 16, mgb=np.float64(2))


# ---------------------------------------------------------------- autograd refusal (overlap)
def test_overlap_backend_refuses_grad_and_names_the_reference_backend():
    h, w, plan, ids, gates = _one_rank()
    layer = MoECombine(4, 8, 6, 2, 16, tile_m=64, backend="overlap")
    for name in ("h", "w", "gates"):
        args = dict(h=h, w=w, gates=gates)
        args[name] = args[name].clone().requires_grad_()
        with pytest.raises(RuntimeError, match="inference-only.*backend='reference'"):
            layer(args["h"], args["w"], plan, ids, args["gates"])
    with torch.no_grad():  # no grad wanted: the ordinary "cannot run here" error
        with pytest.raises(RuntimeError, match="cannot run"):
            layer(h.requires_grad_(), w, plan, ids, gates)


def test_overlap_combine_itself_refuses_grad():
    from moe_overlap.combine.overlap import OverlapCombine, OverlapError
    me = SimpleNamespace(experts_per_rank=4, hidden_size=8, out_features=6, topk=2)
    h, w, plan, ids, gates = _one_rank()
    with pytest.raises(OverlapError, match="inference-only.*backend='reference'"):
        OverlapCombine.check_inputs(me, h.bfloat16().requires_grad_(), w.bfloat16(), plan, ids,
                                    gates)


def test_exchange_counts_unvalidated_counts_like_the_checked_path():
    """validate=False counts without torch.bincount (no host sync, capturable): the same counts
    as the checked path for valid ids; ids outside [0, E) are dropped, not an error."""
    from moe_overlap.combine.dispatch import exchange_counts
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 12, (50, 4), generator=g)
    assert torch.equal(exchange_counts(ids, 12, validate=False), exchange_counts(ids, 12))
    bad = ids.clone()
    bad[0, 0], bad[1, 1] = -3, 12
    got = exchange_counts(bad, 12, validate=False)
    want = exchange_counts(ids, 12)
    want[0, ids[0, 0]] -= 1
    want[0, ids[1, 1]] -= 1
    assert torch.equal(got, want)
    assert exchange_counts(torch.zeros(0, 4, dtype=torch.int64), 12, validate=False).sum() == 0


def test_dispatch_rows_pads_with_zero_rows_and_refuses_too_few():
    _, _, plan, ids, _ = _one_rank()
    counts = torch.bincount(ids.reshape(-1), minlength=4).unsqueeze(0)
    x = torch.randn(ids.shape[0], 3)
    exact = dispatch_to_plan(x, ids, plan, counts)
    assert exact.shape[0] == int(plan.total_rows)
    more = dispatch_to_plan(x, ids, plan, counts, rows=exact.shape[0] + 7)
    assert torch.equal(more[:exact.shape[0]], exact) and not more[exact.shape[0]:].any()
    with pytest.raises(ValueError, match="< the plan's"):
        dispatch_to_plan(x, ids, plan, counts, rows=exact.shape[0] - 1)
