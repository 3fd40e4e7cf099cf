"""Ranks that disagree on what they are about to do (issue 37, part 1), on 2 CPU ranks (gloo):
a plan of an earlier step reused on one rank while another rank's routing changed, one rank with
another dtype, size or option, a rank that skips a collective call (the combine, its backward).
With validate=True every rank must raise one error naming the rank(s) and what differs, before
any data moves (no silent wrong result, no death inside gloo, no wait until the process-group
timeout), and the group must stay usable afterwards."""
import time

import pytest
import torch

from moe_overlap import MoECombine
from moe_overlap.combine import dispatch_to_plan, exchange_counts, grouped_matmul
from moe_overlap.combine.checks import AGREE_TIMEOUT_ENV, agree_on_call, fingerprint
from conftest import spawn_ranks

W, EL, D, K, N, TOPK = 2, 2, 3, 4, 6, 2
E = W * EL
# every rank's routing (rank 0's experts are 0 and 1); step 2 moves rank 1's assignment of token
# 0 from expert 0 to expert 1: rank 0's own routing (and so its row of the counts) is unchanged
IDS = {0: [[0, 2], [1, 3], [0, 1], [2, 3], [1, 2]],
       1: [[0, 3], [2, 3], [1, 2], [0, 1], [3, 0]]}
IDS2 = {0: IDS[0], 1: [[1, 3]] + IDS[1][1:]}
SPAWN = dict(timeout_s=20, join_timeout_s=90)  # the process group's bound; a hang fails


def _data(rank, dtype=torch.float32, d=D, k=K, n=N):
    g = torch.Generator().manual_seed(10 + rank)
    T = len(IDS[rank])
    return dict(x=torch.randn(T, d, generator=g).to(dtype),
                w_up=torch.randn(EL, d, k, generator=g).to(dtype),
                w_down=torch.randn(EL, k, n, generator=g).to(dtype),
                gates=torch.rand(T, TOPK, generator=g))


def _layer(**kw):
    args = dict(num_experts=E, hidden_size=K, out_features=N, topk=TOPK, max_tokens_per_rank=8,
                tile_m=64, backend="reference")
    args.update(kw)
    return MoECombine(**args)


def _step(layer, ids, dat, num_experts=E):
    """One validated step: counts, plan, dispatch, up-projection, combine."""
    counts = exchange_counts(ids, num_experts)
    plan = layer.plan(counts)
    xp = dispatch_to_plan(dat["x"], ids, plan, counts)
    h = grouped_matmul(xp, dat["w_up"], plan.expert_rows.tolist())
    return layer(h, dat["w_down"], plan, ids, dat["gates"])


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _recovers(rank):
    """A good step on a fresh layer after the error: the group is usable and in step."""
    ids = torch.tensor(IDS[rank])
    return tuple(_step(_layer(), ids, _data(rank)).shape)


def _assert_every_rank(res, *needles, exc="RankMismatchError"):
    for rank, (name, msg, seconds) in enumerate(r["error"] for r in res):
        assert name == exc, (rank, name, msg)
        for needle in needles:
            assert needle in msg, (rank, needle, msg)
        assert seconds < 15, (rank, seconds)
    for rank, r in enumerate(res):
        assert r["after"] == (len(IDS[rank]), N), (rank, r)


# ---------------------------------------------------------------- (a) a plan of another step
def _stale(rank, W, hows):
    return {how: _stale_case(rank, how) for how in hows}


def _stale_case(rank, how):
    layer = _layer()
    dat = _data(rank)
    ids1, ids2 = torch.tensor(IDS[rank]), torch.tensor(IDS2[rank])
    counts1 = exchange_counts(ids1, E)
    plan1 = layer.plan(counts1)
    out = {}

    def step2():
        counts2 = exchange_counts(ids2, E)
        if how == "reuse_plan":  # plans made without the agreement; rank 0 reuses step 1's
            plan = plan1 if rank == 0 else layer.plan(counts2, validate=False)
            xp = dispatch_to_plan(dat["x"], ids2, plan, counts1 if rank == 0 else counts2,
                                  validate=False)
            h = grouped_matmul(xp, dat["w_up"], plan.expert_rows.tolist())
            layer(h, dat["w_down"], plan, ids2, dat["gates"])
        elif how == "skip_plan":  # rank 0 skips plan() and dispatches with its old plan
            plan = plan1 if rank == 0 else layer.plan(counts2)
            dispatch_to_plan(dat["x"], ids2, plan, counts2 if rank else counts1)
        elif how == "old_counts":  # rank 0 keeps the counts and the plan of step 1
            plan = plan1 if rank == 0 else layer.plan(counts2, validate=False)
            dispatch_to_plan(dat["x"], ids2, plan, counts1 if rank == 0 else counts2)

    out["error"] = _outcome(step2)
    out["after"] = _recovers(rank)
    return out


@pytest.fixture(scope="module")
def stale():
    """The cases of (a) in one run (the group stays usable after each error)."""
    res = spawn_ranks(_stale, W, ["reuse_plan", "old_counts", "skip_plan"], **SPAWN)
    return lambda how: [r[how] for r in res]


def test_a_plan_reused_on_one_rank_while_another_rank_rerouted_raises_on_every_rank(stale):
    """Rank 0's own routing did not change, so its row of the counts matches its plan; rank 1's
    row did. The ranks agree on a hash of the whole counts matrix each plan was made from."""
    res = stale("reuse_plan")
    _assert_every_rank(res, "the counts the plan was made from on rank 0 do not match",
                       "MoECombine.forward")
    assert "on rank 0 they differ in the row of rank 1" in res[0]["error"][1]


def test_old_counts_and_plan_on_one_rank_are_named_in_the_dispatch(stale):
    _assert_every_rank(stale("old_counts"), "expert_counts on rank 0 do not match",
                       "dispatch_to_plan")


def test_a_rank_that_skips_plan_is_named_with_the_call_each_rank_is_in(stale):
    _assert_every_rank(stale("skip_plan"), "different collective calls",
                       "rank 0 in dispatch_to_plan", "rank 1 in MoECombine.plan")


# ---------------------------------------------------------------- (b) another size or dtype
MISMATCHES = {  # what rank 1 does differently -> the field named, as "<field> differs (..."
    "dtype": "x dtype differs (float32 on rank 0 vs float64 on rank 1)",
    "combine_dtype": "h and w_down dtype differs (float32 on rank 0 vs float64 on rank 1)",
    "out_features": "out_features (N) differs (6 on rank 0 vs 5 on rank 1)",
    "num_experts": "num_experts differs (4 on rank 0 vs 6 on rank 1)",
    "hidden_size": "hidden_size (K) differs (4 on rank 0 vs 5 on rank 1)",
    "topk": "topk differs (2 on rank 0 vs 1 on rank 1)",
    "tile_m": "tile_m differs (64 on rank 0 vs 128 on rank 1)",
    "layout": "layout differs ('aligned' on rank 0 vs 'packed' on rank 1)",
    "dispatch_features": "x features (K) differs (3 on rank 0 vs 5 on rank 1)",
    "autograd": "autograd (backward is collective) differs (False on rank 0 vs True on rank 1)",
}


def _mismatch(rank, W, whats):
    return {what: _mismatch_case(rank, what) for what in whats}


def _mismatch_case(rank, what):
    odd = rank == 1
    ids = torch.tensor(IDS[rank])
    kw, dat, num_experts = {}, _data(rank), E
    if what == "dtype" and odd:
        dat = _data(rank, torch.float64)
    elif what == "out_features" and odd:
        kw, dat = dict(out_features=5), _data(rank, n=5)
    elif what == "num_experts" and odd:
        kw, num_experts = dict(num_experts=6), 6
    elif what == "hidden_size" and odd:
        kw, dat = dict(hidden_size=5), _data(rank, k=5)
    elif what == "topk" and odd:
        kw, ids = dict(topk=1), ids[:, :1]
        dat["gates"] = dat["gates"][:, :1]
    elif what == "tile_m" and odd:
        kw = dict(tile_m=128)
    elif what == "layout":
        kw = dict(layout="packed" if odd else "aligned")
    elif what == "dispatch_features" and odd:
        dat = _data(rank, d=5)
    out = {}
    if what in ("autograd", "combine_dtype"):
        def run():
            counts = exchange_counts(ids, E)
            layer = _layer()
            plan = layer.plan(counts)
            xp = dispatch_to_plan(dat["x"], ids, plan, counts)
            h = grouped_matmul(xp, dat["w_up"], plan.expert_rows.tolist())
            w_down = dat["w_down"]
            if what == "autograd":  # rank 1's h requires grad: only its backward is collective
                h.requires_grad_(odd)
            elif odd:  # rank 1's expert outputs in float64
                h, w_down = h.double(), w_down.double()
            layer(h, w_down, plan, ids, dat["gates"])
        out["error"] = _outcome(run)
    else:
        out["error"] = _outcome(lambda: _step(_layer(**kw), ids, dat, num_experts))
    out["after"] = _recovers(rank)
    return out


@pytest.fixture(scope="module")
def mismatch():
    res = spawn_ranks(_mismatch, W, list(MISMATCHES), **SPAWN)
    return lambda what: [r[what] for r in res]


@pytest.mark.parametrize("what", list(MISMATCHES))
def test_one_rank_with_another_size_dtype_or_option_raises_on_every_rank(mismatch, what):
    _assert_every_rank(mismatch(what), MISMATCHES[what])


# ---------------------------------------------------------------- (c) a skipped collective call
def _skip(rank, W, whats):
    import os
    os.environ[AGREE_TIMEOUT_ENV] = "4"
    return {what: _skip_case(rank, what) for what in whats}


def _skip_case(rank, what):
    layer = _layer()
    ids = torch.tensor(IDS[rank])
    dat = _data(rank)
    out = {}

    def run():
        counts = exchange_counts(ids, E)
        plan = layer.plan(counts)
        xp = dispatch_to_plan(dat["x"], ids, plan, counts)
        h = grouped_matmul(xp, dat["w_up"], plan.expert_rows.tolist())
        if what == "combine" and rank == 0:  # rank 0 skips the combine: on to the next step
            exchange_counts(ids, E)
            return
        w = dat["w_down"].clone().requires_grad_()
        y = layer(h, w, plan, ids, dat["gates"])
        if what in ("backward", "backward_and_wait") and rank == 0:  # rank 0 skips backward
            if what == "backward_and_wait":
                time.sleep(10)  # somewhere else, in no collective, past rank 1's bound
                return
            exchange_counts(ids, E)
            return
        y.sum().backward()

    out["error"] = _outcome(run)
    out["after"] = None if what == "backward_and_wait" else _recovers(rank)
    return out


@pytest.fixture(scope="module")
def skip():
    res = spawn_ranks(_skip, W, ["combine", "backward"], **SPAWN)
    return lambda what: [r[what] for r in res]


def test_a_rank_that_skips_the_combine_is_named_on_every_rank(skip):
    _assert_every_rank(skip("combine"), "rank 0 in exchange_counts",
                       "rank 1 in MoECombine.forward", "skipped a collective call")


def test_a_rank_that_skips_backward_is_named_on_every_rank(skip):
    _assert_every_rank(skip("backward"), "rank 0 in exchange_counts",
                       "rank 1 in backward of MoECombine.forward (layer call #2, validated call #")


def test_a_rank_left_waiting_in_backward_gets_a_timeout_naming_its_call():
    """Rank 0 skips backward and stays in no collective: rank 1 cannot learn where rank 0 is,
    so its bounded wait ($MOE_OVERLAP_AGREE_TIMEOUT_S=4) raises, naming the call it is in,
    well before the process group's 20 s timeout."""
    res = spawn_ranks(_skip, W, ["backward_and_wait"], hard_exit=True, **SPAWN)
    assert res[0]["backward_and_wait"]["error"][0] is None
    name, msg, seconds = res[1]["backward_and_wait"]["error"]
    assert name == "AgreementTimeoutError", (name, msg)
    assert "rank 1: backward of MoECombine.forward (layer call #2, validated call #" in msg, msg
    assert "no answer from every rank within 4 s" in msg, msg
    assert 3.5 < seconds < 15, seconds


# ---------------------------------------------------------------- three ranks
IDS3 = {0: [[0, 2], [1, 4], [5, 3], [0, 1]], 1: [[0, 3], [2, 5], [4, 1]], 2: [[2, 3], [4, 0]]}


def _three(rank, W):
    """Rank 1 has another out_features; then ranks 0 and 2 reuse step 1's plan while rank 1
    moved an assignment between rank 0's experts 0 and 1."""
    E3, n = W * EL, 5 if rank == 1 else N
    ids1 = torch.tensor(IDS3[rank])
    ids2 = ids1.clone()
    if rank == 1:
        ids2[0, 0] = 1  # [0, 3] -> [1, 3]
    g = torch.Generator().manual_seed(rank)
    T = len(ids1)
    dat = dict(x=torch.randn(T, D, generator=g), w_up=torch.randn(EL, D, K, generator=g),
               w_down=torch.randn(EL, K, n, generator=g), gates=torch.rand(T, TOPK, generator=g))
    out = {"N": _outcome(lambda: _step(_layer(num_experts=E3, out_features=n), ids1, dat, E3))}
    layer = _layer(num_experts=E3)
    plan1 = layer.plan(exchange_counts(ids1, E3))

    def step2():
        counts2 = exchange_counts(ids2, E3)
        plan = layer.plan(counts2, validate=False) if rank == 1 else plan1
        h = torch.randn(int(plan.total_rows), K, generator=g)
        layer(h, torch.randn(EL, K, N, generator=g), plan, ids2, dat["gates"])

    out["stale"] = _outcome(step2)
    return out


def test_three_ranks_group_the_values_and_name_every_stale_rank():
    res = spawn_ranks(_three, 3, **SPAWN)
    for rank, r in enumerate(res):
        name, msg, _ = r["N"]
        assert name == "RankMismatchError", (rank, name, msg)
        assert "out_features (N) differs (6 on ranks 0, 2 vs 5 on rank 1)" in msg, (rank, msg)
        name, msg, _ = r["stale"]
        assert name == "RankMismatchError", (rank, name, msg)
        assert "the counts the plan was made from on ranks 0, 2 do not match" in msg, msg
        assert ("on rank %d they differ in the row of rank 1" % rank in msg) == (rank != 1), msg


# ---------------------------------------------------------------- the record's shape
def test_fingerprints_are_the_same_in_every_process_and_tell_values_apart():
    """Hashes travel between processes: no per-process salt (Python's str hash has one)."""
    import subprocess
    import sys
    code = ("import torch; from moe_overlap.combine.checks import fingerprint as f; "
            "print([f(v)[0] for v in ('packed', torch.bfloat16, 7, torch.tensor([[1, 2]]))])")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**__import__("os").environ,
                                            "PYTHONHASHSEED": str(s)}).stdout for s in (1, 2)}
    assert len(runs) == 1
    assert fingerprint(torch.tensor([1, 2], dtype=torch.int32)) == \
        fingerprint(torch.tensor([1, 2]))  # counts: the values, not the integer width
    values = [6, 5, "6", torch.float32, torch.float64, torch.tensor([1, 2]),
              torch.tensor([2, 1]), torch.tensor([[1, 2]]), None, True]
    assert len({fingerprint(v)[0] for v in values}) == len(values)


def test_agree_on_call_at_world_size_one_raises_the_error_itself():
    agree_on_call("x", {"a": 1})
    with pytest.raises(KeyError):
        agree_on_call("x", {"a": 1}, KeyError("boom"))


# ---------------------------------------------------------------- the runtime's barrier
def _barrier(rank, W, skip_rank):
    """Every rank passes one bounded barrier; then every rank but skip_rank waits in a second
    (skip_rank stays out of every collective for 12 s, as a rank that skipped the call holding
    it). Returns per barrier (error type, message, seconds)."""
    import os
    from moe_overlap.combine.checks import bounded_barrier
    os.environ[AGREE_TIMEOUT_ENV] = "3"
    first = _outcome(lambda: bounded_barrier(None, f"rank {rank}: the first barrier"))
    if rank == skip_rank:
        time.sleep(12)
        return dict(first=first, second=None)
    return dict(first=first, second=_outcome(
        lambda: bounded_barrier(None, f"rank {rank}: MoEDispatch's first call")))


def test_a_rank_missing_from_a_runtime_barrier_is_a_named_timeout_not_a_hang():
    """The runtime's barriers (a layer's first call, CommBuffer.reset) are bounded like the
    agreement: the ranks left waiting raise AgreementTimeoutError naming their call after
    $MOE_OVERLAP_AGREE_TIMEOUT_S (3 s), well before the process group's 20 s."""
    res = spawn_ranks(_barrier, 3, 2, hard_exit=True, **SPAWN)
    for rank in range(3):
        assert res[rank]["first"][0] is None, res[rank]["first"]
    for rank in (0, 1):
        name, msg, seconds = res[rank]["second"]
        assert name == "AgreementTimeoutError", (name, msg)
        assert f"rank {rank}: MoEDispatch's first call: no answer from every rank within 3 s" \
            in msg, msg
        assert 2.5 < seconds < 10, seconds
