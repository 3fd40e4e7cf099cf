"""The planner kernel and the route-preparation kernels on CUDA against their torch references:
every plan tensor bitwise equal on random and adversarial counts in both orders (remote_first,
expert), prepare equal, and both captured in a CUDA graph and replayed with new counts / ids.

A failure names the case (W, E, rank, tile_m, mgb, layout, order, capacity, counts mode), the
field, the first differing index and the values around it on both sides, so it can be replayed on
the host with moe_overlap.combine.plan_closed_form.closed_form_plan (the kernel's phases in
Python).
"""
import random

import pytest
import torch

from moe_overlap.combine.plan import plan_combine

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py


def _first_diff(name, got, ref, case):
    g, r = got.reshape(-1).cpu(), ref.reshape(-1).cpu()
    if g.shape != r.shape or got.dtype != ref.dtype:
        return (f"{case}: {name} shape/dtype {tuple(got.shape)} {got.dtype} vs "
                f"{tuple(ref.shape)} {ref.dtype}")
    bad = (g != r).nonzero()
    i = int(bad[0])
    lo = max(0, i - 4)
    return (f"{case}: {name} differs at {len(bad)} of {g.numel()} entries, first at {i}: kernel "
            f"{g[lo:i + 5].tolist()} torch {r[lo:i + 5].tolist()} (from index {lo})")


def _check_plan(counts, rank, tile_m, mgb, layout, max_rows, case, order="remote_first"):
    ref = plan_combine(counts, rank, tile_m=tile_m, mgb=mgb, max_rows=max_rows, validate=False,
                       layout=layout, impl="torch", order=order)
    got = plan_combine(counts, rank, tile_m=tile_m, mgb=mgb, max_rows=max_rows, validate=False,
                       layout=layout, impl="kernel", order=order)
    assert got.order == ref.order == order, case
    assert (got.band_capacity, got.segment_capacity) == (ref.band_capacity, ref.segment_capacity)
    bad = [_first_diff(n, getattr(got, n), t, case) for n, t in ref.tensors().items()
           if not (getattr(got, n).shape == t.shape and getattr(got, n).dtype == t.dtype
                   and torch.equal(getattr(got, n), t))]
    assert not bad, "\n".join(bad)


def _counts(W, El, mode, seed, dev):
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(0, 700, (W, W * El), generator=g)
    if mode == "empty_experts":
        c[:, ::2] = 0
    elif mode == "one_hot":
        c.zero_()
        c[seed % W, (seed * 7) % (W * El)] = 5000 + seed
    elif mode == "to_one_rank":  # every source sends everything to rank 0's experts
        c[:, El:] = 0
    elif mode == "zero":
        c.zero_()
    elif mode == "sparse":
        c *= (torch.rand(W, W * El, generator=g) < 0.2).long()
    elif mode == "tiny":
        c = torch.randint(0, 3, (W, W * El), generator=g)
    return c.to(dev)


MODES = ["random", "empty_experts", "one_hot", "to_one_rank", "zero", "sparse", "tiny"]
ORDERS = ["remote_first", "expert"]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("W,El", [(1, 1), (1, 5), (2, 4), (3, 3), (4, 16), (8, 32), (16, 8),
                                  (64, 8), (1, 512), (2, 512)])
@pytest.mark.parametrize("mode", MODES)
def test_plan_kernel_equals_torch_planner(W, El, mode, order):
    dev = torch.device("cuda")
    rng = random.Random(W * 1000 + El * 10 + MODES.index(mode))
    counts = _counts(W, El, mode, rng.randrange(1 << 20), dev)
    for tile_m in (64, 128, 256):
        for layout in ("aligned", "packed", "auto"):
            rank = rng.randrange(W)
            mgb = rng.choice([1, 2, 3, 7])
            tight = int(counts[:, rank * El:(rank + 1) * El].sum())
            for cap_name, max_rows in (("tight", tight), ("worst", int(counts.sum()) + 1000)):
                case = (f"W={W} E={W * El} rank={rank} tile_m={tile_m} mgb={mgb} layout={layout} "
                        f"order={order} cap={cap_name}({max_rows}) mode={mode}")
                _check_plan(counts, rank, tile_m, mgb, layout, max_rows, case, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mgb", [1, 2, 3, 7])
def test_plan_kernel_at_scale(mgb, order):
    """W=64, E=512, 16384 tokens x top-8 per rank (balanced routing), every rank, worst case."""
    from moe_overlap.combine.plan import count_assignments
    from moe_overlap.routing import route
    W, E, T, k = 64, 512, 16384, 8
    cnt = [count_assignments(route(T, E, k, "balanced", seed=3, rank=r)[0], E) for r in range(4)]
    counts = torch.stack([cnt[r % 4] for r in range(W)]).cuda()
    for rank in (0, 17, 63):
        for tile_m in (64, 128, 256):
            for layout in ("aligned", "packed", "auto"):
                case = (f"W={W} E={E} T={T} k={k} rank={rank} tile_m={tile_m} mgb={mgb} "
                        f"{layout} {order}")
                _check_plan(counts, rank, tile_m, mgb, layout, W * T * k, case, order)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("W,El", [(1, 1), (3, 3), (8, 32), (64, 8), (2, 512)])
@pytest.mark.parametrize("mode", ["random", "one_hot", "zero", "sparse"])
def test_plan_kernel_writes_every_word_of_a_poisoned_buffer(W, El, mode, order, monkeypatch):
    """The -1 tails (tail CTAs from the valid lengths, CTA 0 between num_segments and the
    remote cells) leave no word unwritten: the buffer starts as 0x5A5A5A5A, not as whatever
    the caching allocator hands back (often the previous plan, tails included). The worst
    capacity spreads the tails over several CTAs."""
    import moe_overlap.combine.plan_kernel as pk
    monkeypatch.setattr(pk, "_plan_buffer", lambda n, device: torch.full(
        (n,), 0x5A5A5A5A, dtype=torch.int32, device=device))
    dev = torch.device("cuda")
    rng = random.Random(W * 31 + El + MODES.index(mode))
    counts = _counts(W, El, mode, rng.randrange(1 << 20), dev)
    for tile_m in (64, 256):
        for layout in ("aligned", "packed", "auto"):
            rank, mgb = rng.randrange(W), rng.choice([1, 2, 3, 7])
            tight = int(counts[:, rank * El:(rank + 1) * El].sum())
            for cap_name, max_rows in (("tight", tight), ("worst", int(counts.sum()) + 600_000)):
                case = (f"poisoned W={W} E={W * El} rank={rank} tile_m={tile_m} mgb={mgb} "
                        f"layout={layout} order={order} cap={cap_name}({max_rows}) mode={mode}")
                _check_plan(counts, rank, tile_m, mgb, layout, max_rows, case, order)


GARBAGE = ["huge", "negative", "just_over"]  # counts a validate=False plan cannot hold
POISON, GUARD = 0x5A5A5A5A, 1 << 20


def _guarded_plan_buffers(monkeypatch):
    """Plan buffers with 1 Mi poisoned words on each side (an unclamped band loop runs 25k to
    1M bands past B on huge counts); returns the list of (whole, n) made."""
    import moe_overlap.combine.plan_kernel as pk
    made = []

    def guarded(n, device):
        big = torch.full((GUARD + n + GUARD,), POISON, dtype=torch.int32, device=device)
        made.append((big, n))
        return big[GUARD:GUARD + n]
    monkeypatch.setattr(pk, "_plan_buffer", guarded)
    return made


def _check_overflow_plan(counts, rank, layout, order, max_rows, made, case, overflow=True):
    """Kernel == torch planner on counts its capacity cannot hold, every word of the poisoned
    buffer written, no word outside it, num_bands outside [0, band capacity] (``overflow``;
    False: the garbage lies in columns this rank's plan does not read, and its plan is a
    plan)."""
    _check_plan(counts, rank, 128, 2, layout, max_rows, case, order)
    big, n = made[-1]
    torch.cuda.synchronize()
    assert bool((big[:GUARD] == POISON).all() and (big[GUARD + n:] == POISON).all()), case
    nb = plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=max_rows, validate=False,
                      layout=layout, impl="torch", order=order)
    assert (0 <= int(nb.num_bands) <= nb.band_capacity) != overflow, case


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("W,El", [(2, 4), (8, 32), (1, 5)])
@pytest.mark.parametrize("garbage", GARBAGE)
def test_plan_kernel_garbage_counts_stay_inside_the_buffer(W, El, garbage, order, monkeypatch):
    """validate=False counts the capacity cannot hold (issue 35): the kernel writes no word
    outside its buffer, fills every field (the buffer starts poisoned: the segment fields of an
    overflow plan were left unwritten once, bench/NOTES.md) and equals the torch planner's
    overflow plan: num_bands outside [0, band capacity] (the producer refuses it), nothing
    planned. Rank 0 and the last rank (the group order depends on the rank); "negative" and
    "just_over" put the garbage in rank 0's expert columns only, so the last rank's plan (which
    reads its own experts' columns) is an ordinary one there."""
    made = _guarded_plan_buffers(monkeypatch)
    g = torch.Generator().manual_seed(W * 100 + El)
    max_rows = W * 256 * 2
    if garbage == "huge":
        counts = torch.randint(0, 1 << 20, (W, W * El), generator=g)
    else:
        counts = torch.randint(0, 3, (W, W * El), generator=g)
        if garbage == "negative":
            counts[W - 1, El - 1] = -5
        else:  # expert 0 alone one band more than the capacity holds
            B = max_rows // 128 + W * El
            counts[0, :El] = 0
            counts[0, 0] = (B + 1) * 128 - int(counts[1:, :El].sum())
    for rank in sorted({0, W - 1}):
        for layout in ("aligned", "packed", "auto"):
            case = f"garbage={garbage} W={W} El={El} rank={rank} layout={layout} order={order}"
            _check_overflow_plan(counts.cuda(), rank, layout, order, max_rows, made, case,
                                 overflow=garbage == "huge" or rank == 0)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_plan_kernel_garbage_counts_of_the_faults_test_on_every_rank(dtype, order, monkeypatch):
    """The exact counts of tests/test_ranks_faults_gpu.py's garbage fault (W = 2, E = 8, seed 2,
    max_rows 1024; there rank 1 plans them, int64 as exchange_counts gives them), on both ranks,
    both counts dtypes: session 21 saw rank 1's kernel plan differ from torch's there."""
    made = _guarded_plan_buffers(monkeypatch)
    counts = torch.randint(0, 1 << 20, (2, 8), generator=torch.Generator().manual_seed(2))
    for rank in (0, 1):
        for layout in ("auto", "aligned", "packed"):
            case = f"faults-test counts {dtype} rank={rank} layout={layout} order={order}"
            _check_overflow_plan(counts.to("cuda", dtype), rank, layout, order, 1024, made,
                                 case)


@pytest.mark.parametrize("order", ORDERS)
def test_plan_kernel_int32_counts_and_no_host_sync(order):
    counts = _counts(4, 8, "random", 5, "cuda")
    kw = dict(tile_m=128, mgb=2, max_rows=50_000, validate=False, order=order)
    ref = plan_combine(counts, 1, impl="torch", **kw)
    c32 = counts.to(torch.int32)
    plan_combine(c32, 1, impl="kernel", **kw)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = plan_combine(c32, 1, impl="kernel", **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for n, t in ref.tensors().items():
        assert torch.equal(getattr(got, n), t), _first_diff(n, getattr(got, n), t,
                                                            f"int32 {order}")


@pytest.mark.parametrize("order", ORDERS)
def test_auto_plans_either_order_with_the_kernel(order):
    """impl="auto" on CUDA counts: the kernel in both orders (its tensors are views of one
    buffer; the torch planner's are separate tensors), equal to the torch planner's."""
    counts = _counts(4, 8, "random", 9, "cuda")
    kw = dict(tile_m=128, mgb=2, max_rows=50_000, validate=False, order=order)
    got = plan_combine(counts, 2, impl="auto", **kw)
    ref = plan_combine(counts, 2, impl="torch", **kw)
    base = {t.untyped_storage().data_ptr() for t in got.tensors().values()}
    assert len(base) == 1, "impl='auto' did not plan with the kernel"
    assert len({t.untyped_storage().data_ptr() for t in ref.tensors().values()}) > 1
    assert got.order == order
    for n, t in ref.tensors().items():
        assert torch.equal(getattr(got, n), t), _first_diff(n, getattr(got, n), t,
                                                            f"auto {order}")


@pytest.mark.parametrize("order", ORDERS)
def test_plan_kernel_in_a_cuda_graph_replays_with_new_counts(order):
    W, El, rank = 8, 16, 3
    static = _counts(W, El, "random", 1, "cuda")
    kw = dict(tile_m=128, mgb=2, max_rows=W * 700 * El, validate=False, layout="auto",
              impl="kernel", order=order)
    plan_combine(static, rank, **kw)  # compile and load outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan = plan_combine(static, rank, **kw)
    for i, mode in enumerate(["random", "one_hot", "zero", "sparse", "to_one_rank"]):
        new = _counts(W, El, mode, 100 + i, "cuda")
        static.copy_(new)
        g.replay()
        ref = plan_combine(new, rank, **{**kw, "impl": "torch"})
        bad = [_first_diff(n, getattr(plan, n), t, f"graph replay {i} ({mode}, {order})")
               for n, t in ref.tensors().items() if not torch.equal(getattr(plan, n), t)]
        assert not bad, "\n".join(bad)


# ---- prepare -----------------------------------------------------------------------------------
@pytest.mark.parametrize("W,E,T,k,mode", [(1, 8, 300, 2, "balanced"), (2, 64, 8192, 8, "balanced"),
                                          (8, 256, 4097, 8, "moderate_skew"), (64, 512, 16384, 8,
                                                                         "balanced"),
                                          (4, 16, 0, 2, "balanced"), (4, 1024, 5000, 4,
                                                                      "balanced"),
                                          (2, 8, 20000, 1, "stress_skew")])
@pytest.mark.parametrize("local_copy", [True, False])
def test_prepare_kernel_equals_torch(W, E, T, k, mode, local_copy):
    from moe_overlap.combine.plan import count_assignments
    from moe_overlap.combine.routes import prepare_routes
    from moe_overlap.routing import route
    dev = torch.device("cuda")
    ids = [route(T, E, k, mode, seed=2, rank=r)[0] for r in range(min(W, 4))]
    if T and mode == "balanced" and E == 8:
        ids[0][: T // 2] = torch.arange(k)  # many repeats of a few experts
    rank = W - 1
    counts = torch.stack([count_assignments(ids[r % len(ids)], E) for r in range(W)]).to(dev)
    plan = plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=W * max(T, 1) * k,
                        validate=False, impl="torch")
    topk = ids[rank % len(ids)].to(dev)
    for dtype in (torch.int64, torch.int32):
        t = topk.to(dtype)
        for p in ((plan, None) if not local_copy else (plan,)):
            r_ref, inc_ref = prepare_routes(t, E, W, rank, local_copy, p, impl="torch")
            r_got, inc_got = prepare_routes(t, E, W, rank, local_copy, p, impl="kernel")
            case = (f"W={W} E={E} T={T} k={k} {mode} local_copy={local_copy} "
                    f"plan={p is not None} {dtype}")
            assert r_got.dtype == torch.int32 and r_got.shape == r_ref.shape, case
            assert torch.equal(r_got, r_ref), _first_diff("rows", r_got, r_ref, case)
            assert torch.equal(inc_got, inc_ref), _first_diff("expected_inc", inc_got, inc_ref,
                                                              case)


def test_prepare_kernel_in_a_cuda_graph_replays_with_new_ids():
    from moe_overlap.combine.routes import prepare_routes
    from moe_overlap.routing import route
    W, E, T, k, rank = 8, 256, 8192, 8, 2
    static = route(T, E, k, "balanced", seed=0, rank=0)[0].cuda()
    counts = torch.randint(0, 1000, (W, E)).cuda()  # within max_rows
    plan = plan_combine(counts, rank, tile_m=128, mgb=2, max_rows=W * T * k, validate=False)
    prepare_routes(static, E, W, rank, False, plan, impl="kernel")
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        rows, inc = prepare_routes(static, E, W, rank, False, plan, impl="kernel")
    for seed in (1, 2, 3):
        mode = "moderate_skew" if seed == 2 else "balanced"
        new = route(T, E, k, mode, seed=seed, rank=0)[0].cuda()
        static.copy_(new)
        g.replay()
        r_ref, inc_ref = prepare_routes(new, E, W, rank, False, plan, impl="torch")
        assert torch.equal(rows, r_ref), _first_diff("rows", rows, r_ref, f"replay {seed}")
        assert torch.equal(inc, inc_ref), _first_diff("inc", inc, inc_ref, f"replay {seed}")
