"""Compile-only checks of the planner and route-preparation kernels for sm_90a (no GPU needed),
and the closed forms the planner kernel implements against the torch planner, on the host.

The kernels compile for several host facts (counts / ids dtype, shared array length, sort length,
y_src); the PTX carries the CTA scans (shuffles), the warp match of the stable counting sort, and
no local-memory stack. `closed_form_plan` (the kernel's phases in plain Python) must equal
`plan_combine(impl="torch")` field by field on random and adversarial counts, in both orders.
"""
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)

from moe_overlap.combine.plan import plan_combine  # noqa: E402
from moe_overlap.combine.plan_closed_form import closed_form_plan  # noqa: E402
from moe_overlap.combine.plan_kernel import BAND_FIELDS, SEGMENT_FIELDS  # noqa: E402
from conftest import compile_ptx as _ptx  # noqa: E402


@pytest.mark.compile
@pytest.mark.parametrize("counts_64,NE,NPS", [(True, 512, 8), (False, 32, 2), (True, 1024, 1024),
                                              (False, 256, 64)])
def test_plan_kernels_compile(counts_64, NE, NPS):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from moe_overlap.combine.plan_kernel import build_plan_kernels, plan_example_args
    ptx = _ptx(build_plan_kernels(counts_64, NE, NPS), *plan_example_args())
    assert "shfl.sync.up.b32" in ptx and "shfl.sync.idx.b32" in ptx  # CTA scans
    # int64 counts: the low words, one 32-bit register each (no 64-bit loads)
    assert "ld.global.s32" in ptx and "ld.global.b64" not in ptx
    # eight scans in CTA 0 plus the sort, one more scan in the tail CTAs; two barriers a scan
    assert ptx.count("bar.sync") >= 18
    assert "%ctaid.x" in ptx and "%nctaid.x" in ptx  # CTA 0 plans, the others fill the tails
    # in one kernel: the plan's 29 output stores, the tail CTAs' -1 per field (17) and CTA 0's
    # -1 per segment field between num_segments and the remote cells (6)
    assert ptx.count("st.global.s32") >= 29 + 17 + 6
    assert ".local" not in ptx.split(".entry", 1)[1]
    assert ".reqntid 1024" in ptx  # ptxas then keeps it within 64 registers (1024 threads fit)


@pytest.mark.compile
@pytest.mark.parametrize("counts_64,NE,NPS", [(True, 512, 8), (False, 32, 2), (True, 1024, 1024)])
def test_plan_kernel_expert_order_compiles_without_the_sort(counts_64, NE, NPS):
    """order="expert": the same stores, scans and tails as remote_first, but no expert ranking
    (the bitonic sort's 64-bit shared keys and its barriers are gone)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from moe_overlap.combine.plan_kernel import PlanKernel, build_plan_kernels, plan_example_args
    ptx = _ptx(build_plan_kernels(counts_64, NE, NPS, by_expert=True), *plan_example_args())
    rf = _ptx(build_plan_kernels(counts_64, NE, NPS), *plan_example_args())
    assert "shfl.sync.up.b32" in ptx and "shfl.sync.idx.b32" in ptx
    assert "ld.global.s32" in ptx and "ld.global.b64" not in ptx
    assert "%ctaid.x" in ptx and "%nctaid.x" in ptx
    assert ptx.count("st.global.s32") >= 29 + 17 + 6
    assert ".local" not in ptx.split(".entry", 1)[1]
    assert ".reqntid 1024" in ptx
    # the sort is remote_first's only: its keys are the kernel's only 64-bit shared accesses
    assert "st.shared.s64" in rf and "ld.shared.s64" in rf
    assert "st.shared.s64" not in ptx and "ld.shared.s64" not in ptx
    assert 18 <= ptx.count("bar.sync") < rf.count("bar.sync")
    # a variant of its own in the compile cache, the sort length out of its key
    key = PlanKernel.variant(counts_64, E=NE, El=NPS, order="expert")
    assert key[-1] is True and key != PlanKernel.variant(counts_64, E=NE, El=NPS)
    assert key == PlanKernel.variant(counts_64, E=NE, El=2, order="expert")
    with pytest.raises(ValueError, match="order"):
        PlanKernel.variant(counts_64, E=NE, El=NPS, order="fastest")


@pytest.mark.compile
@pytest.mark.parametrize("ids_64,NE,y_src", [(True, 512, False), (True, 512, True),
                                             (False, 32, True), (True, 1024, False)])
def test_routes_kernels_compile(ids_64, NE, y_src):
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from moe_overlap.combine.routes import (build_routes_kernels, hist_example_args,
                                            rank_example_args)
    lh, lr = build_routes_kernels(ids_64, NE, y_src)
    assert "red.shared.add.s32" in _ptx(lh, *hist_example_args())
    ptx = _ptx(lr, *rank_example_args())
    assert "match.any.sync.b32" in ptx and "popc.b32" in ptx
    from moe_overlap.combine.routes import ROUNDS
    # one scan (two barriers) and one barrier before the rounds, two CTA barriers per round
    # (each warp zeroes its own row of counts: a warp barrier between rounds)
    assert ptx.count("bar.sync") == 3 + 2 * ROUNDS
    assert ptx.count("bar.warp.sync") == ROUNDS - 1
    assert ".reqntid 1024" in ptx
    assert ".local" not in ptx.split(".entry", 1)[1]


def _random_counts(rng, W, El, mode):
    c = torch.randint(0, rng.choice([1, 5, 70, 300, 1000]) + 1, (W, W * El),
                      generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))
    if mode == "one_hot":
        c.zero_()
        c[rng.randrange(W), rng.randrange(W * El)] = rng.randint(1, 3000)
    elif mode == "sparse":
        c *= (torch.rand(W, W * El) < 0.3).long()
    elif mode == "zero":
        c.zero_()
    elif mode == "to_one_rank":
        r = rng.randrange(W)
        c[:, :r * El] = 0
        c[:, (r + 1) * El:] = 0
    elif mode == "empty_experts":  # every other expert receives nothing
        c[:, rng.randrange(2)::2] = 0
    return c


def _check_closed_form(counts, rank, tile_m, mgb, layout, order, max_rows):
    ref = plan_combine(counts, rank, tile_m=tile_m, mgb=mgb, layout=layout, max_rows=max_rows,
                       impl="torch", order=order)
    assert ref.order == order
    cf = closed_form_plan(counts, rank, tile_m, mgb, ref.band_capacity, layout, order)
    assert set(cf) == set(ref.tensors())
    for name, t in ref.tensors().items():
        assert torch.equal(t, cf[name]), (name, tuple(counts.shape), tile_m, mgb, layout, order,
                                          rank, counts.tolist())


@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("seed", range(4))
def test_closed_forms_equal_the_torch_planner(seed, order):
    rng = random.Random(seed)
    for _ in range(60):
        W, El = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3, 7])
        tile_m, mgb = rng.choice([64, 128, 256]), rng.choice([1, 2, 3, 7])
        counts = _random_counts(rng, W, El, rng.choice(["random", "one_hot", "sparse", "zero",
                                                        "to_one_rank", "empty_experts"]))
        rank = rng.randrange(W)
        for layout in ("aligned", "packed", "auto"):
            tight = int(counts[:, rank * El:(rank + 1) * El].sum())
            _check_closed_form(counts, rank, tile_m, mgb, layout, order,
                               tight + rng.choice([0, 0, 999]))


@st.composite
def _plan_case(draw):
    W = draw(st.integers(1, 16))
    El = draw(st.integers(1, 12))
    mode = draw(st.sampled_from(["random", "one_hot", "sparse", "zero", "to_one_rank",
                                 "empty_experts"]))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    counts = _random_counts(random.Random(seed), W, El, mode)
    return (counts, draw(st.integers(0, W - 1)), draw(st.sampled_from([64, 128, 256])),
            draw(st.integers(1, 7)), draw(st.sampled_from([0, 0, 1, 999])))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_plan_case())
def test_closed_forms_equal_the_torch_planner_hypothesis(case):
    counts, rank, tile_m, mgb, slack = case
    El = counts.shape[1] // counts.shape[0]
    tight = int(counts[:, rank * El:(rank + 1) * El].sum())
    for layout in ("aligned", "packed", "auto"):
        for order in ("remote_first", "expert"):
            _check_closed_form(counts, rank, tile_m, mgb, layout, order, tight + slack)


LAYOUT_FIELDS = ("packed", "group_row_start", "expert_rows", "expert_row_start",
                 "recv_rows_per_rank", "routed_counts", "total_rows", "valid_rows")


def _garbage_counts(rng, W, El, mode, B, tile_m):
    """Counts a plan of band capacity B cannot hold (rank 0's experts): validate=False input."""
    c = torch.tensor([[rng.randrange(3) for _ in range(W * El)] for _ in range(W)])
    if mode == "huge":  # the GPU fault test's counts (tests/test_ranks_faults_gpu.py)
        c = torch.tensor([[rng.randrange(1 << 20) for _ in range(W * El)] for _ in range(W)])
    elif mode == "negative":
        c[rng.randrange(W), rng.randrange(El)] = -rng.randint(1, 300)
    elif mode == "one_count":  # a single count whose bands alone exceed B
        c[rng.randrange(W), rng.randrange(El)] = (B + 1) * tile_m + rng.randrange(tile_m)
    elif mode == "one_band_over":  # rank 0's rows in one group: exactly B + 1 bands
        c[:, :El] = 0
        c[0, 0] = B * tile_m + 1
    return c


@pytest.mark.parametrize("order", ["remote_first", "expert"])
@pytest.mark.parametrize("mode", ["huge", "negative", "one_count", "one_band_over"])
def test_overflow_counts_plan_nothing_and_flag_num_bands(mode, order):
    """validate=False counts the capacities cannot hold (issue 35): the torch planner (the
    reference) plans no band, cell or segment (every capacity field -1, the counts 0, where the
    old planner indexed past its tensors or planned negative rows), keeps the layout fields of
    the counts, and says it in num_bands: the bands needed (> B), or -1 for negative counts;
    outside [0, B] either way, which the producer refuses. The closed forms (the kernel's
    phases) give the same plan."""
    rng = random.Random(hash((mode, order)) & 0xFFFF)
    for _ in range(12):
        W, El = rng.choice([1, 2, 4]), rng.choice([1, 3, 4])
        tile_m, mgb = rng.choice([64, 128, 256]), rng.choice([1, 2, 3])
        max_rows = W * rng.choice([64, 256]) * 2
        B = max_rows // tile_m + W * El
        counts = _garbage_counts(rng, W, El, mode, B, tile_m)
        for layout in ("aligned", "packed", "auto"):
            kw = dict(tile_m=tile_m, mgb=mgb, layout=layout, impl="torch", order=order)
            p = plan_combine(counts, 0, max_rows=max_rows, validate=False, **kw)
            case = (mode, W, El, tile_m, mgb, layout, counts.tolist())
            assert p.band_capacity == B, case
            nb = int(p.num_bands)
            if mode == "negative":
                assert nb == -1, case
            else:
                assert nb > B, case
            if mode == "one_band_over":
                assert nb == B + 1, case
            assert p.counts()[1:] == (0, 0) and int(p.num_local_cells) == 0, case
            for name in BAND_FIELDS + SEGMENT_FIELDS:
                assert bool((getattr(p, name) == -1).all()), (name, case)
            if mode != "negative":  # the counts' own layout, as a plan that fits shows it
                fit = plan_combine(counts, 0, max_rows=None, validate=False, **kw)
                for name in LAYOUT_FIELDS:
                    assert torch.equal(getattr(p, name), getattr(fit, name)), (name, case)
            cf = closed_form_plan(counts, 0, tile_m, mgb, B, layout, order)
            for name, t in p.tensors().items():
                assert torch.equal(t, cf[name]), (name, case)


@pytest.mark.parametrize("order", ["remote_first", "expert"])
def test_overflow_boundary_b_bands_fit(order):
    """Exactly B bands fit (a plan, not flagged, even with counts above max_rows); B + 1 do
    not. The bound is the plan's band capacity, as the kernel's loops and the producer's."""
    for tile_m in (64, 128):
        max_rows = 300
        B = max_rows // tile_m + 2  # W = 1, El = 2
        for bands, flagged in ((B, False), (B + 1, True)):
            counts = torch.tensor([[tile_m * (bands - 1), 1]])
            p = plan_combine(counts, 0, tile_m=tile_m, max_rows=max_rows, validate=False,
                             layout="aligned", impl="torch", order=order)
            assert int(p.num_bands) == bands, (tile_m, bands)
            assert (int(p.schedule[0]) == -1) == flagged, (tile_m, bands)
            cf = closed_form_plan(counts, 0, tile_m, 1, B, "aligned", order)
            assert all(torch.equal(t, cf[n]) for n, t in p.tensors().items()), (tile_m, bands)
            with pytest.raises(ValueError, match="receive capacity exceeded"):
                plan_combine(counts, 0, tile_m=tile_m, max_rows=max_rows, validate=True,
                             layout="aligned", impl="torch", order=order)


@pytest.mark.compile
def test_plan_kernel_guards_its_count_derived_stores():
    """Every store index the kernel derives from the counts (schedule position, local cell,
    segment) is guarded by an unsigned compare against its capacity (the ``in_cap`` PTX), on
    top of the overflow check that skips the band and segment loops: a validate=False plan
    writes nothing outside its buffer whatever the counts (the GPU test
    test_plan_kernel_garbage_counts_stay_inside_the_buffer runs it)."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from moe_overlap.combine.plan_kernel import build_plan_kernels, plan_example_args
    guard = "setp.lt.u32 p,"
    for by_expert in (False, True):
        ptx = _ptx(build_plan_kernels(True, 32, 8, by_expert), *plan_example_args())
        assert ptx.count(guard) == 3, by_expert  # position, local cell, segment
    snd = _ptx(build_plan_kernels(True, 32, 8, False, True), *plan_example_args())
    assert snd.count(guard) == 1  # the senders' segment tables


def test_closed_form_expert_order_differs_where_the_torch_planner_does():
    """The two orders give different schedules, segments and local cells on a routing where
    some expert has fewer remote bands than a later one (so the comparison above tests the
    order, not two copies of one plan)."""
    counts = torch.zeros(2, 4, dtype=torch.int64)
    counts[0, 0:2] = torch.tensor([300, 50])  # rank 0's experts: 0 mostly local, 1 few rows
    counts[1, 0:2] = torch.tensor([10, 400])  # from rank 1: expert 1 mostly remote
    a = closed_form_plan(counts, 0, 64, 1, 40, "aligned", "remote_first")
    b = closed_form_plan(counts, 0, 64, 1, 40, "aligned", "expert")
    nb = int(a["num_bands"])
    assert b["schedule"][:nb].tolist() == list(range(nb)) != a["schedule"][:nb].tolist()
    assert not torch.equal(a["segment_start"], b["segment_start"])
    assert not torch.equal(a["local_cell_band"], b["local_cell_band"])
    with pytest.raises(ValueError, match="order"):
        closed_form_plan(counts, 0, 64, 1, 40, "aligned", "fastest")


def test_impl_switch_rejects_bad_values_and_cpu_kernel():
    counts = torch.ones(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="impl"):
        plan_combine(counts, 0, impl="fast")
    with pytest.raises(ValueError, match="CUDA"):
        plan_combine(counts, 0, impl="kernel")
    a = plan_combine(counts, 0, impl="auto")  # CPU counts: the torch planner
    b = plan_combine(counts, 0, impl="torch")
    assert all(torch.equal(t, getattr(b, n)) for n, t in a.tensors().items())
    # either order: the kernel is refused for the device only
    for order in ("remote_first", "expert"):
        with pytest.raises(ValueError, match="CUDA"):
            plan_combine(counts, 0, impl="kernel", order=order)


@pytest.mark.parametrize("impl", ["auto", "kernel"])
def test_kernel_path_plans_both_orders(impl, monkeypatch):
    """Where auto picks the kernel (CUDA counts, CuTe DSL importable; stood in for here by
    _resolve_impl), it picks it in both orders and hands the order to the kernel; the plan is
    the torch planner's in that order. The kernel is replaced by its closed forms (the same
    algorithm in Python), so this runs on the host."""
    import moe_overlap.combine.plan as plan_mod
    import moe_overlap.combine.plan_kernel as pk
    calls = []

    def fake_kernel(counts, rank, tile_m, mgb, band_capacity, layout, order="remote_first"):
        calls.append(order)
        return closed_form_plan(counts, rank, tile_m, mgb, band_capacity, layout, order)

    counts = _random_counts(random.Random(7), 4, 3, "random")
    cases = [(o, lay) for o in ("remote_first", "expert") for lay in ("aligned", "packed", "auto")]
    refs = {c: plan_combine(counts, 2, tile_m=64, mgb=2, layout=c[1], impl="torch", order=c[0])
            for c in cases}
    resolved = []

    def fake_resolve(impl_, counts):
        resolved.append(impl_)
        return "kernel"
    monkeypatch.setattr(plan_mod, "_resolve_impl", fake_resolve)
    monkeypatch.setattr(pk, "plan_tensors_kernel", fake_kernel)
    for order, layout in cases:
        got = plan_combine(counts, 2, tile_m=64, mgb=2, layout=layout, impl=impl, order=order)
        ref = refs[order, layout]
        assert calls[-1] == order and got.order == ref.order == order
        for n, t in ref.tensors().items():
            assert torch.equal(getattr(got, n), t), (n, order, layout)
    assert calls == [o for o in ("remote_first", "expert") for _ in range(3)]
    assert resolved == [impl] * 6


def test_planner_and_kernel_name_the_same_orders():
    from moe_overlap.combine.plan import ORDERS
    from moe_overlap.combine.plan_kernel import ORDERS as KERNEL_ORDERS
    assert ORDERS == KERNEL_ORDERS == ("remote_first", "expert")


def _emulate_routes_rows(ids, E):
    """The routes kernels' counting sort, step by step in Python (chunks of CHUNK ids per CTA,
    ROUNDS rounds of 1024, warps of 32): row = first[e] + chunks before + earlier rounds + warps
    before + lanes below with the same expert."""
    from moe_overlap.combine.routes import CHUNK, NT, ROUNDS
    flat = ids.reshape(-1).tolist()
    N = len(flat)
    G = max(1, -(-N // CHUNK))
    hist = [[0] * E for _ in range(G)]
    for i, e in enumerate(flat):
        hist[i // CHUNK][e] += 1
    tot = [sum(hist[b][e] for b in range(G)) for e in range(E)]
    first = [sum(tot[:e]) for e in range(E)]
    rows = [None] * N
    for b in range(G):
        base = [first[e] + sum(hist[c][e] for c in range(b)) for e in range(E)]
        run = [0] * E
        for u in range(ROUNDS):
            lanes = [b * CHUNK + u * NT + t for t in range(NT)]
            es = [flat[i] if i < N else -1 for i in lanes]
            wc = [[0] * E for _ in range(NT // 32)]
            for t, e in enumerate(es):
                if e >= 0:
                    wc[t // 32][e] += 1
            for t, e in enumerate(es):
                if e < 0:
                    continue
                w, lane = divmod(t, 32)
                below = sum(1 for x in es[w * 32:w * 32 + lane] if x == e)
                rows[lanes[t]] = base[e] + run[e] + below + sum(wc[v][e] for v in range(w))
            for t, e in enumerate(es):
                if e >= 0:
                    run[e] += 1
    return torch.tensor(rows, dtype=torch.int64).view(ids.shape)


@pytest.mark.parametrize("T,E,k,seed", [(700, 8, 2, 0), (3000, 64, 4, 1), (1025, 16, 8, 2)])
def test_routes_counting_sort_equals_stable_sort(T, E, k, seed):
    from moe_overlap.combine.plan import recv_rows
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (T, k), generator=g)
    ids[: T // 3] = ids[0]  # long runs of the same experts across warps, rounds and chunks
    assert torch.equal(_emulate_routes_rows(ids, E), recv_rows(ids, E))


def _run_ptx_term(text: str, i: int, v: int) -> int:
    """Runs the straight-line PTX of one fingerprint term ({$r0} = i, {$r1} = v, result in
    {$w0}) on 32-bit registers: the instructions it may use, with PTX's semantics (mul.lo: the
    low 32 bits of the product; shr.u32: a logical shift; shr.s32 would be arithmetic)."""
    import re
    body = text.strip()
    assert body.startswith("{") and body.endswith("}")
    regs = {"{$r0}": i & 0xFFFFFFFF, "{$r1}": v & 0xFFFFFFFF}

    def val(tok):
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        return int(tok, 0) & 0xFFFFFFFF  # an immediate

    for ins in (x.strip() for x in body[1:-1].split(";") if x.strip()):
        if ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        a = [val(x) for x in src]
        if op in ("mul.lo.s32", "mul.lo.u32"):
            r = a[0] * a[1]
        elif op in ("xor.b32",):
            r = a[0] ^ a[1]
        elif op == "shr.u32":
            r = a[0] >> a[1]
        elif op == "shr.s32":
            r = (a[0] - ((a[0] >> 31) << 32)) >> a[1]
        else:
            raise AssertionError(f"instruction {op} not emulated: {ins}")
        assert re.fullmatch(r"\{\$w0\}|[a-z]+", dst), dst
        regs[dst] = r & 0xFFFFFFFF
    return regs["{$w0}"]


def test_kernel_fingerprint_term_ptx_is_the_reference_term():
    """The kernel planner cannot run here: run the PTX text it inlines for one term of the
    counts fingerprint, against the plain-Python term (plan_closed_form), on random and edge
    (i, v); the kernel adds these terms over all W * E entries (mod 2^32), which is
    counts_fingerprint (tests/test_planner.py checks that against the torch planner)."""
    from moe_overlap.combine.plan_closed_form import FP_KEY, fmix32
    from moe_overlap.combine.plan_kernel import FINGERPRINT_TERM_PTX
    rng = random.Random(5)
    cases = [(0, 0), (1, 0), (0, 1), (1023, 0xFFFFFFFF), (2 ** 20, 0x80000000), (7, 3000)]
    cases += [(rng.randrange(1 << 21), rng.randrange(1 << 32)) for _ in range(500)]
    for i, v in cases:
        want = fmix32(v ^ (i * FP_KEY & 0xFFFFFFFF))
        assert _run_ptx_term(FINGERPRINT_TERM_PTX, i, v) == want, (i, v)
