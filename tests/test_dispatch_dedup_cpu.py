"""MoEDispatch (each token once per destination rank) on CPU ranks (gloo): bitwise the layout of
dispatch_to_plan at W = 1, 2, 3 (ranks with 0 tokens, a rank that receives nothing, skewed and
duplicate routings, both plan layouts and orders, validate on and off), the same gradients,
bad input raising on every rank, and the bytes its all_to_all calls move off the rank equal to
dispatch_wire_bytes (which a brute-force count checks on its own)."""
import math
import random

import pytest
import torch

from moe_overlap import MoEDispatch
from moe_overlap.combine import dispatch_to_plan, dispatch_wire_bytes, exchange_counts
from moe_overlap.combine.checks import PeerInputError
from moe_overlap.combine.plan import plan_combine
from moe_overlap.routing import route
from moe_overlap.runtime import collectives
from conftest import spawn_ranks

EL, D, K = 3, 5, 3  # experts per rank, token width, top-k
SPAWN = dict(timeout_s=30, join_timeout_s=120)


def _routing(W, tokens, kind, seed=0):
    """Every rank's topk_ids [T_r, K], the same in every process. kind: "uniform" (distinct
    experts), "skew" (moe_overlap.routing stress_skew), "dup" (with repeats in a row),
    "not_rank0" (rank 0 owns none of the experts picked: it receives nothing)."""
    E = EL * W
    g = torch.Generator().manual_seed(seed)
    out = []
    for r, T in enumerate(tokens):
        if kind == "skew":
            out.append(route(T, E, K, "stress_skew", seed=seed, rank=r)[0])
        elif kind == "dup":
            out.append(torch.randint(0, E, (T, K), generator=g))
        else:
            allowed = torch.arange(EL if kind == "not_rank0" and W > 1 else 0, E)
            out.append(torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:K]]
                                    for _ in range(T)]) if T else
                       torch.zeros(0, K, dtype=torch.long))
    return out


def _recording(rank):
    """Patch collectives.all_to_all_single to log the bytes each call sends off this rank, by
    dtype class ("float" token rows, "int" index); returns (log, undo)."""
    orig = collectives.all_to_all_single
    log = {"float": 0, "int": 0}

    def rec(out, inp, out_splits, in_splits, group=None):
        row = math.prod(inp.shape[1:]) * inp.element_size()
        off = sum(int(n) for r, n in enumerate(in_splits) if r != rank)
        log["float" if inp.is_floating_point() else "int"] += off * row
        return orig(out, inp, out_splits, in_splits, group=group)

    collectives.all_to_all_single = rec
    return log, lambda: setattr(collectives, "all_to_all_single", orig)


def _case(rank, W, tokens, kind):
    all_ids = _routing(W, tokens, kind)
    ids = all_ids[rank]
    E = EL * W
    g = torch.Generator().manual_seed(100 + rank)
    x64 = torch.randn(len(ids), D, generator=g, dtype=torch.float64)
    counts = exchange_counts(ids, E)
    res = {"bitwise": [], "grad": [], "bytes": []}
    for layout in ("aligned", "packed"):
        for order in ("remote_first", "expert"):
            plan = plan_combine(counts, rank, tile_m=64, layout=layout, order=order)
            for dtype in (torch.float64, torch.bfloat16):
                x = x64.to(dtype)
                for validate in (True, False):
                    layer = MoEDispatch(E, D, K, max_tokens_per_rank=16, validate=validate)
                    log, undo = _recording(rank)
                    try:
                        got = layer(x, ids, plan, counts)
                        sent = dict(log)
                        log.update(float=0, int=0)
                        want = dispatch_to_plan(x, ids, plan, counts)
                        sent_today = log["float"]
                    finally:
                        undo()
                    res["bitwise"].append((layout, order, str(dtype), validate,
                                           got.dtype == want.dtype and got.shape == want.shape
                                           and torch.equal(got, want)))
                    wire = dispatch_wire_bytes(all_ids, EL, D, x.element_size())[rank]
                    res["bytes"].append((sent["float"], wire.once, sent["int"], wire.once_index,
                                         sent_today, wire.per_assignment))
            # gradients: float64, one cotangent for both paths
            cot = torch.randn(int(plan.total_rows), D, generator=torch.Generator().manual_seed(
                7 + rank), dtype=torch.float64)
            xa = x64.clone().requires_grad_()
            (MoEDispatch(E, D, K, 16)(xa, ids, plan, counts) * cot).sum().backward()
            xb = x64.clone().requires_grad_()
            (dispatch_to_plan(xb, ids, plan, counts) * cot).sum().backward()
            res["grad"].append(float((xa.grad - xb.grad).abs().max()) if len(ids) else 0.0)
    return res


CASES = [
    (1, [7], "uniform"),
    (2, [6, 0], "uniform"),  # rank 1 routes nothing
    (2, [5, 9], "not_rank0"),  # rank 0 receives nothing
    (2, [8, 6], "dup"),  # a token picks one expert twice
    (3, [0, 5, 8], "not_rank0"),  # rank 0 routes and receives nothing
    (3, [9, 4, 7], "skew"),
]


@pytest.mark.parametrize("W,tokens,kind", CASES)
def test_bitwise_the_layout_of_dispatch_to_plan_and_its_gradients(W, tokens, kind):
    res = spawn_ranks(_case, W, tokens, kind, **SPAWN)
    for rank, r in enumerate(res):
        bad = [c for c in r["bitwise"] if not c[-1]]
        assert not bad and len(r["bitwise"]) == 16, (rank, bad)
        assert max(r["grad"]) < 1e-12, (rank, r["grad"])
        for once, want_once, index, want_index, today, want_today in r["bytes"]:
            assert (once, index) == (want_once, want_index), (rank, r["bytes"])
            # the per-assignment count is dispatch_to_plan's own traffic
            assert today == want_today, (rank, r["bytes"])
    if W > 1:  # these routings have tokens with several experts on one remote rank
        assert sum(b[0] for r in res for b in r["bytes"]) < \
            sum(b[4] for r in res for b in r["bytes"])


# ------------------------------------------------------------------ bad input on one rank
def _outcome(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned to the test
        return type(e).__name__, str(e)
    return None, ""


def _bad_case(rank, W):
    E, T = EL * W, 6
    ids = _routing(W, [T] * W, "uniform", seed=3)[rank]
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(rank))
    counts = exchange_counts(ids, E)
    plan = plan_combine(counts, rank, tile_m=64)
    layer = MoEDispatch(E, D, K, max_tokens_per_rank=T)
    out = {}
    bad_ids = ids.clone()
    if rank == 1:
        bad_ids[2, 1] = E
    out["ids"] = _outcome(lambda: layer(x, bad_ids, plan, counts))
    wide = torch.randn(T, D + 1) if rank == 1 else x
    out["width"] = _outcome(lambda: layer(wide, ids, plan, counts))
    moved = ids.clone()
    if rank == 1:  # re-routed after the counts were exchanged
        moved[0] = torch.tensor([e for e in range(E) if e not in ids[0].tolist()][:K])
    out["stale"] = _outcome(lambda: layer(x, moved, plan, counts))
    small = MoEDispatch(E, D, K, max_tokens_per_rank=T - 1 if rank == 1 else T)
    out["capacity"] = _outcome(lambda: small(x, ids, plan, counts))
    # the group is still usable, and the result right
    out["after"] = torch.equal(layer(x, ids, plan, counts), dispatch_to_plan(x, ids, plan, counts))
    return out


def test_bad_input_on_one_rank_raises_on_every_rank():
    res = spawn_ranks(_bad_case, 2, **SPAWN)
    for what, match in (("ids", "expert ids must be in"), ("width", "hidden_size=5"),
                        ("stale", "do not match"), ("capacity", "max_tokens_per_rank=5")):
        name1, msg1 = res[1][what]
        assert name1 == "ValueError" and msg1.startswith("rank 1:") and match in msg1, \
            (what, res[1][what])
        name0, msg0 = res[0][what]
        assert name0 == PeerInputError.__name__ and "rank 1" in msg0 and match in msg0, \
            (what, res[0][what])
    assert res[0]["after"] and res[1]["after"]


# ------------------------------------------------------------------ one process
def test_constructor_checks():
    if not torch.cuda.is_available():  # the device transport needs a GPU, and says so
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            MoEDispatch(8, 4, 2, 16, backend="overlap")
    with pytest.raises(ValueError, match="backend"):
        MoEDispatch(8, 4, 2, 16, backend="nccl")
    with pytest.raises(ValueError, match="topk=9 exceeds"):
        MoEDispatch(8, 4, 9, 16)
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        MoEDispatch(8, 0, 2, 16)
    assert MoEDispatch(8, 4, 2, 16, backend="auto").backend == "reference"


class _UnmappedRuntime:
    """A two-rank symmetric allocator on the host (CommBuffer's runtime surface) whose peer,
    rank 1, has no load/store mapping: what a node without NVLink / P2P between the GPUs
    gives."""
    rank, world_size, device = 0, 2, torch.device("cpu")

    def alloc(self, shape, dtype, note=""):
        return torch.zeros(shape, dtype=dtype)

    def peer_table(self, t):
        return torch.tensor([t.data_ptr(), 0], dtype=torch.int64), (1,)

    def barrier(self, what=""):
        pass


def test_overlap_takes_an_nvshmem_buffer_and_refuses_nvlink_without_peer_mappings(monkeypatch):
    """The overlap backend's construction (host side, no kernel compiled): a CommBuffer of
    transport "nvshmem" gives a send of that transport (its puts need no load/store mapping of
    the peers; stage_source="auto" stages its source there), an "nvlink" one over the same
    unmapped peer is refused naming the rank, and a buffer of another process group is
    refused."""
    import moe_overlap.combine.dispatch_dedup as DD
    import moe_overlap.runtime.collectives as C
    import moe_overlap.runtime.device as DV
    from moe_overlap.combine.comm_buffer import CommBuffer
    from moe_overlap.runtime.nvshmem import NvshmemError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(DD, "world", lambda group: (0, 2))
    monkeypatch.setattr(DV, "num_sms", lambda device: 132)
    monkeypatch.setattr(C, "all_reduce", lambda t, *a, **k: t)  # the peer's flag: as this one
    comm = CommBuffer(None, "nvshmem", runtime=_UnmappedRuntime())
    ov = MoEDispatch(8, 64, 2, 16, backend="overlap", comm_buffer=comm, send_ctas=3)
    assert ov.comm is comm and comm.num_layers == 1 and ov.staged
    assert (ov.sender.transport, ov.sender.world_size, ov.sender.ctas) == ("nvshmem", 2, 3)
    with pytest.raises(NvshmemError, match=r"ranks \[1\] are not reachable"):
        MoEDispatch(8, 64, 2, 16, backend="overlap",
                    comm_buffer=CommBuffer(None, "nvlink", runtime=_UnmappedRuntime()))
    with pytest.raises(ValueError, match="this process group"):
        MoEDispatch(8, 64, 2, 16, backend="overlap",
                    comm_buffer=CommBuffer(object(), "nvshmem", runtime=_UnmappedRuntime()))


def _brute_force(all_ids, El, hidden, nbytes):
    """Python loops over every (token, k): what leaves each source rank."""
    W = len(all_ids)
    out = []
    for s, ids in enumerate(all_ids):
        assignments, tokens = 0, 0
        for row in ids.tolist():
            owners = [e // El for e in row]
            assignments += sum(o != s for o in owners)
            tokens += len(set(owners) - {s})
        k = ids.shape[1]
        out.append((assignments * hidden * nbytes, tokens * hidden * nbytes,
                    tokens * k * 4 + (W - 1) * 4, (W - 1) * El * W * 8, assignments, tokens))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_wire_bytes_match_a_brute_force_count(seed):
    rnd = random.Random(seed)
    W, El, k = rnd.choice([1, 2, 4, 5]), rnd.choice([1, 2, 3]), rnd.choice([1, 2, 3])
    k = min(k, W * El)
    g = torch.Generator().manual_seed(seed)
    all_ids = [torch.randint(0, W * El, (rnd.choice([0, 1, 9, 30]), k), generator=g)
               for _ in range(W)]
    got = dispatch_wire_bytes(all_ids, El, 7, 2)
    want = _brute_force(all_ids, El, 7, 2)
    assert [(w.per_assignment, w.once, w.once_index, w.counts_index, w.assignments, w.tokens)
            for w in got] == want
    assert [w.rank for w in got] == list(range(W))
    assert all(w.saved == w.per_assignment - w.once - w.once_index for w in got)


def test_wire_bytes_reject_bad_ids():
    with pytest.raises(ValueError, match=r"rank 1's expert ids must be in \[0, 4\)"):
        dispatch_wire_bytes([torch.zeros(2, 2, dtype=torch.long), torch.full((1, 2), 4)], 2, 8, 2)
