"""GPU tests of the chained FFN compute kernel (moe_overlap/ffn/compute_chained.py); skipped
without CUDA.

Every case draws fresh random inputs, poisons out and the H ring with NaN, and compares the result
with the float64 truth (H not rounded) and with ``chained_schedule.execute_reference`` on the same
schedule (<= 8e-3 relative to the largest |value|), and checks the band flags. Failures say which
case, the largest error and where, the first NaN, and which row blocks are wrong (a ring or
ordering bug shows as whole wrong blocks). The grouped call (``ChainedFFNCompute.grouped``) runs
the same checks on the padded expert layout (experts without rows, counts not multiples of 128,
b1 or None, groups 1 / 2 / auto) against the per-block float64 truth and
``chained_ffn_grouped_reference``, and refuses expert ids outside [0, E).

    python3 -m pytest -q -x tests/test_chained_ffn_gpu.py
"""
import pytest
import torch

pytestmark = pytest.mark.gpu  # skipped without a GPU by tests/conftest.py

TOL = 8e-3
SHAPE = (1024, 2048, 1024)  # P, hidden, N: at M = 8192 the derived ring (35 blocks) wraps
SHAPE2 = (512, 1536, 768)  # P != N, 6 hidden tiles, 3 output tiles


@pytest.fixture(scope="module")
def mod():
    import cutlass.cute  # noqa: F401  (a missing DSL on a GPU machine is an error, not a skip)
    from moe_overlap.ffn import compute_chained
    return compute_chained


def _inputs(M, P, hidden, N, seed, bias=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(M, P, **bf)
    w1 = torch.randn(P, hidden, **bf) / P ** 0.5
    b1 = torch.randn(hidden, **bf) * 0.5 if bias else None
    w2 = torch.randn(hidden, N, **bf) / hidden ** 0.5
    return x, w1, b1, w2


def _truth64(x, w1, b1, w2, act1):
    from moe_overlap.ffn.activations import activation
    h = x.double() @ w1.double()
    if b1 is not None:
        h = h + b1.double()
    return activation(h, act1) @ w2.double()


def _report(case, out, ref, what, tile_m=128):
    """None when out matches ref within TOL, else a message for the assertion."""
    out64, ref64 = out.double(), ref.double()
    scale = ref64.abs().max().item() or 1.0
    nan = torch.isnan(out64)
    err = (out64 - ref64).abs()
    err[nan] = float("inf")
    worst = err.max().item()
    if worst <= TOL * scale:
        return None
    idx = int(err.argmax())
    r, c = divmod(idx, out.shape[1])
    msg = [f"{case}: vs {what}: max |err| = {worst:.4g} (relative {worst / scale:.3g} > {TOL}) "
           f"at row {r} col {c} (block {r // tile_m}): out={out64[r, c].item():.5g} "
           f"ref={ref64[r, c].item():.5g}"]
    if nan.any():
        fi = int(nan.reshape(-1).nonzero()[0])
        fr, fc = divmod(fi, out.shape[1])
        msg.append(f"{int(nan.sum())} NaN, first at row {fr} col {fc} (block {fr // tile_m})")
    bad_rows = (err > TOL * scale).any(dim=1).nonzero().reshape(-1)
    blocks = sorted(set((bad_rows // tile_m).tolist()))
    msg.append(f"wrong row blocks ({len(blocks)} of {-(-out.shape[0] // tile_m)}): "
               f"{blocks[:20]}{' ...' if len(blocks) > 20 else ''}")
    return "; ".join(msg)


def _run_case(mod, M, shape, act1, bias, seed, comp=None, ccta=0, epoch_val=7):
    from moe_overlap.ffn.chained_schedule import execute_reference
    from moe_overlap.ffn.activations import activation
    P, hidden, N = shape
    comp = comp or mod.ChainedFFNCompute()
    x, w1, b1, w2 = _inputs(M, P, hidden, N, seed, bias)
    grid = comp.grid(M, hidden, N, x.device, ccta)
    s = comp.schedule(M, P, hidden, N, grid)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    ring = torch.full((comp.ring_rows(M, P, hidden, N, grid), hidden), float("nan"),
                      device="cuda", dtype=torch.bfloat16)
    ready = torch.zeros(s.blocks + 3, device="cuda", dtype=torch.int32)
    epoch = torch.tensor([epoch_val], device="cuda", dtype=torch.int32)
    y = comp(x, w1, b1, w2, out=out, band_ready=ready, epoch=epoch, act1=act1, ccta=ccta,
             h_ring=ring)
    assert y is out
    case = (f"M={M} P,hidden,N={shape} act1={act1} b1={'yes' if bias else 'None'} ccta={ccta} "
            f"cluster={comp.cluster} "
            f"group={comp.group} ({comp.group_for(M, P, hidden, N, grid)}) grid={grid} "
            f"lookahead={s.lookahead} ring={s.ring} blocks={s.blocks}")
    comp.check()  # raises with the device error text (a timed-out wait)
    msgs = [_report(case, out, _truth64(x, w1, b1, w2, act1), "float64 truth"),
            _report(case, out, execute_reference(s, x, w1, b1, w2,
                                                 lambda h: activation(h, act1)),
                    "execute_reference (same schedule)")]
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)
    flags = ready.tolist()
    assert flags[:s.blocks] == [epoch_val] * s.blocks and flags[s.blocks:] == [0, 0, 0], \
        f"{case}: band_ready {flags[:8]}... (want {epoch_val} on the {s.blocks} blocks, 0 after)"
    return comp


CASES = [  # M, shape, act1, b1 given
    (1, SHAPE, "gelu", True),
    (127, SHAPE, "relu", True),
    (1000, SHAPE, "silu", False),
    (1000, SHAPE, "none", True),
    (8192, SHAPE, "gelu", True),
    (8192, SHAPE, "gelu_tanh", False),
    (8192, SHAPE, "silu", True),
    (8192, SHAPE, "relu", False),
    (1000, SHAPE2, "gelu", True),
    (8192, SHAPE2, "gelu_tanh", True),
    # odd block counts (cluster 2: the last pair's second block lies past M)
    (1100, SHAPE2, "relu", True),
    (8059, SHAPE, "gelu", True),
]


@pytest.mark.parametrize("cluster", [1, 2], ids=["cluster1", "cluster2"])
@pytest.mark.parametrize("M,shape,act1,bias", CASES)
def test_matches_truth_and_reference(mod, M, shape, act1, bias, cluster):
    """cluster 2: pairs of adjacent row blocks share each weight tile by TMA multicast; the
    result, the ring's use and the band flags (none for the block past M) are the same."""
    _run_case(mod, M, shape, act1, bias, seed=1000 * M + len(act1) + bias,
              comp=mod.ChainedFFNCompute(cluster=cluster))


@pytest.mark.parametrize("group,patch,M,ring", [(2, 1, 8192, None), (8, 4, 8192, None),
                                                (16, 4, 8192, None), (4, 1, 1100, None),
                                                (2, 1, 8192, "min"), (8, 4, 8059, "min")])
def test_cluster_orders(mod, group, patch, M, ring):
    """cluster 2 with the super-block orders on pair blocks, and with the smallest valid ring
    (one pair super-block above the lookahead: GEMM1 tiles wait for their slot often)."""
    if ring == "min":
        base = mod.ChainedFFNCompute(cluster=2, group=group, patch=patch).schedule(
            M, *SHAPE, grid=torch.cuda.get_device_properties(0).multi_processor_count // 2 * 2)
        ring = base.lookahead + max(2, group)
    comp = mod.ChainedFFNCompute(cluster=2, group=group, patch=patch, _test_ring=ring)
    _run_case(mod, M, SHAPE, "gelu", True, seed=500 + group + M, comp=comp)


def test_cluster_small_grid_and_repeated_calls(mod):
    """cluster 2 on an odd number of free SMs (the grid rounds down to whole clusters), then
    repeated calls of one instance (counters and both mailboxes start fresh each launch)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    comp = mod.ChainedFFNCompute(cluster=2)
    _run_case(mod, 1100, SHAPE, "gelu", True, seed=6, comp=comp, ccta=sms - 33)
    for i in range(3):
        _run_case(mod, 8059, SHAPE, "silu", False, seed=88 + i, comp=comp, epoch_val=20 + i)


def test_cluster_refuses_grouped(mod):
    comp = mod.ChainedFFNCompute(cluster=2)
    x = torch.zeros(256, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(2, 256, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dense calls only"):
        comp.grouped(x, w, None, w, block_expert=torch.zeros(2, device="cuda",
                                                             dtype=torch.int32))


@pytest.mark.parametrize("group,M", [(1, 8192), (2, 8192), (4, 8192), (4, 1000)])
def test_grouped_order(mod, group, M):
    """The super-block tile order (group G) on the same kernel: a different table, same result."""
    _run_case(mod, M, SHAPE, "gelu", True, seed=300 + group + M,
              comp=mod.ChainedFFNCompute(group=group))


@pytest.mark.parametrize("group,ring", [(2, 20), (4, 24)])
def test_grouped_order_smallest_valid_ring(mod, group, ring):
    """A grouped ring one super-block above the lookahead (the bench's GrR variants): GEMM1 tiles
    wait for their slot far more often, the result is the same."""
    comp = mod.ChainedFFNCompute(group=group, _test_ring=ring)
    s = comp.schedule(8192, *SHAPE, grid=132)
    assert s.ring == ring and ring // group == s.base.lookahead + 1 and s.ring < s.blocks
    _run_case(mod, 8192, SHAPE, "gelu", True, seed=400 + group, comp=comp)


def test_small_grid(mod):
    """ccta leaves 32 CTAs: the schedule is derived for that grid and still correct."""
    _run_case(mod, 1000, SHAPE, "gelu", True, seed=5, ccta=torch.cuda.get_device_properties(
        0).multi_processor_count - 32)


def test_repeated_calls_reset_counters(mod):
    """One instance, new data each call: the counters are zeroed before every launch."""
    comp = mod.ChainedFFNCompute()
    for i in range(3):
        _run_case(mod, 8192, SHAPE, "gelu", True, seed=77 + i, comp=comp, epoch_val=10 + i)


@pytest.mark.parametrize("grouped", [False, True], ids=["dense", "grouped"])
def test_bf16_b1_bitwise_as_its_fp32_copy(mod, grouped):
    """A bf16 b1 is read as it is (no per-call fp32 copy): the output is bitwise the one from
    its fp32 copy (fp32 holds every bf16 value exactly), into outputs poisoned with NaN; an
    fp16 b1 goes through its fp32 copy; a b1 that differs in one element changes the output
    (the check can fail)."""
    comp = mod.ChainedFFNCompute()
    if grouped:
        P, hidden, N = SHAPE2
        x, w1, b1, w2, be = _grouped_inputs([300, 0, 128, 77], P, hidden, N, seed=31, bias=True)
        call = lambda b, o: comp.grouped(x, w1, b, w2, out=o, block_expert=be, act1="gelu")
    else:
        P, hidden, N = SHAPE2
        x, w1, b1, w2 = _inputs(1000, P, hidden, N, seed=31)
        call = lambda b, o: comp(x, w1, b, w2, out=o, act1="gelu")
    outs = {}
    for name, b in (("bf16", b1), ("fp32", b1.float()), ("fp16", b1.half())):
        o = torch.full((x.shape[0], N), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs[name] = call(b, o)
        comp.check()
    assert not torch.isnan(outs["bf16"]).any()
    assert torch.equal(outs["bf16"], outs["fp32"]), "bf16 b1 differs from its fp32 copy"
    ref = (_grouped_truth64(x, w1, b1, w2, be, "gelu") if grouped
           else _truth64(x, w1, b1, w2, "gelu"))
    msg = _report(f"bf16 b1 ({'grouped' if grouped else 'dense'})", outs["bf16"], ref,
                  "float64 truth")
    assert msg is None, msg
    # fp16 (not bf16's exponent range: tiny values lose bits) through the copy: within tolerance
    assert _report("fp16 b1", outs["fp16"], ref, "float64 truth") is None
    b2 = b1.clone()
    b2.view(-1)[5] += 1.0
    o = torch.full_like(outs["bf16"], float("nan"))
    assert not torch.equal(call(b2, o), outs["bf16"]), "a changed b1 left the output unchanged"
    comp.check()


def test_too_small_ring_without_slot_wait_is_wrong(mod):
    """Ordering matters: a 2-block ring whose GEMM1 tiles do not wait for their slot overwrites H
    that GEMM2 tiles still read, so the result must be wrong (or the check must fail)."""
    comp = mod.ChainedFFNCompute(group=1, _test_ring=2, _test_skip_slot_wait=True, timeout_ms=500)
    M, (P, hidden, N) = 8192, SHAPE
    x, w1, b1, w2 = _inputs(M, P, hidden, N, seed=11)
    out = comp(x, w1, b1, w2, act1="gelu")
    try:
        comp.check()
    except RuntimeError:
        return  # a timed-out wait also shows the order was broken
    msg = _report("ring=2, no slot wait", out, _truth64(x, w1, b1, w2, "gelu"), "float64")
    assert msg is not None, ("a 2-block ring without slot waits gave the right result: the test "
                             "does not exercise the ring (or the switch does nothing)")


def test_too_small_ring_with_waits_is_right_or_times_out(mod):
    """With the waits kept, a ring smaller than the tile order needs must never give a silently
    wrong result: it is right (the waits serialize) or check() names the slot wait that timed
    out."""
    comp = mod.ChainedFFNCompute(group=1, _test_ring=2, timeout_ms=500)
    M, (P, hidden, N) = 8192, SHAPE
    x, w1, b1, w2 = _inputs(M, P, hidden, N, seed=12)
    out = comp(x, w1, b1, w2, act1="gelu")
    try:
        comp.check()
    except RuntimeError as e:
        assert "ring slot" in str(e) or "H row block" in str(e), str(e)
        return
    msg = _report("ring=2 with waits", out, _truth64(x, w1, b1, w2, "gelu"), "float64")
    assert msg is None, msg
    comp.check()  # the error word was cleared, no second error


def test_cuda_graph_capture_and_replay(mod):
    """One call captured in a CUDA graph (the counter memset included), replayed with new data."""
    P, hidden, N = SHAPE
    M = 3000
    comp = mod.ChainedFFNCompute()
    x, w1, b1, w2 = _inputs(M, P, hidden, N, seed=21)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    grid = comp.grid(M, hidden, N, x.device, 0)
    ring = torch.empty(comp.ring_rows(M, P, hidden, N, grid), hidden, device="cuda",
                       dtype=torch.bfloat16)
    ready = torch.zeros(-(-M // 128), device="cuda", dtype=torch.int32)
    epoch = torch.ones(1, device="cuda", dtype=torch.int32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        comp(x, w1, b1, w2, out=out, band_ready=ready, epoch=epoch, h_ring=ring)
    torch.cuda.synchronize()
    comp.check()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        comp(x, w1, b1, w2, out=out, band_ready=ready, epoch=epoch, h_ring=ring)
    for i in range(3):
        nx, nw1, nb1, nw2 = _inputs(M, P, hidden, N, seed=100 + i)
        x.copy_(nx), w1.copy_(nw1), b1.copy_(nb1), w2.copy_(nw2)
        out.fill_(float("nan"))
        ring.fill_(float("nan"))
        epoch.fill_(5 + i)
        g.replay()
        torch.cuda.synchronize()
        comp.check()
        msg = _report(f"graph replay {i}", out, _truth64(x, w1, b1, w2, "gelu"), "float64")
        assert msg is None, msg
        assert (ready == 5 + i).all(), f"graph replay {i}: band flags {ready.tolist()[:8]}"


# ---------------------------------------------------------------- grouped over experts
def _grouped_inputs(rows, P, hidden, N, seed, bias=True):
    """x in the padded expert layout (each expert's rows padded to 128, padding rows zero, as
    ShardedExperts lays them out), the expert of each row block, and E experts' weights."""
    from moe_overlap.ffn.layers import padded_expert_layout
    E = len(rows)
    g = torch.Generator(device="cuda").manual_seed(seed)
    bf = dict(device="cuda", dtype=torch.bfloat16, generator=g)
    dst, block_expert, _, R_pad = padded_expert_layout(rows, 128, torch.device("cuda"))
    x = torch.zeros(R_pad, P, device="cuda", dtype=torch.bfloat16)
    x.index_copy_(0, dst, torch.randn(sum(rows), P, **bf))
    w1 = torch.randn(E, P, hidden, **bf) / P ** 0.5
    b1 = torch.randn(E, hidden, **bf) * 0.5 if bias else None
    w2 = torch.randn(E, hidden, N, **bf) / hidden ** 0.5
    return x, w1, b1, w2, block_expert


def _grouped_truth64(x, w1, b1, w2, block_expert, act1):
    out = torch.empty(x.shape[0], w2.shape[2], dtype=torch.float64, device=x.device)
    for blk, e in enumerate(block_expert.tolist()):
        r = slice(blk * 128, (blk + 1) * 128)
        out[r] = _truth64(x[r], w1[e], None if b1 is None else b1[e], w2[e], act1)
    return out


def _run_grouped_case(mod, rows, shape, act1, bias, seed, comp=None, ccta=0, epoch_val=9):
    from moe_overlap.ffn.compute_chained import chained_ffn_grouped_reference
    P, hidden, N = shape
    comp = comp or mod.ChainedFFNCompute()
    x, w1, b1, w2, be = _grouped_inputs(rows, P, hidden, N, seed, bias)
    M = x.shape[0]
    grid = comp.grid(M, hidden, N, x.device, ccta)
    s = comp.schedule(M, P, hidden, N, grid)
    assert be.numel() == s.blocks
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    ring = torch.full((comp.ring_rows(M, P, hidden, N, grid), hidden), float("nan"),
                      device="cuda", dtype=torch.bfloat16)
    ready = torch.zeros(s.blocks + 3, device="cuda", dtype=torch.int32)
    epoch = torch.tensor([epoch_val], device="cuda", dtype=torch.int32)
    y = comp.grouped(x, w1, b1, w2, out=out, band_ready=ready, epoch=epoch, block_expert=be,
                     ccta=ccta, act1=act1, h_ring=ring)
    assert y is out
    case = (f"grouped rows={rows} (blocks' experts {be.tolist()}) P,hidden,N={shape} "
            f"act1={act1} b1={'yes' if bias else 'None'} ccta={ccta} group={comp.group} "
            f"({comp.group_for(M, P, hidden, N, grid)}) grid={grid} ring={s.ring} "
            f"blocks={s.blocks}")
    comp.check()
    msgs = [_report(case, out, _grouped_truth64(x, w1, b1, w2, be, act1), "float64 truth"),
            _report(case, out, chained_ffn_grouped_reference(x, w1, b1, w2, be, act1),
                    "chained_ffn_grouped_reference")]
    msgs = [m for m in msgs if m]
    assert not msgs, "\n".join(msgs)
    flags = ready.tolist()
    assert flags[:s.blocks] == [epoch_val] * s.blocks and flags[s.blocks:] == [0, 0, 0], \
        f"{case}: band_ready {flags[:8]}..."
    return comp


GROUPED_CASES = [  # rows per expert (an expert without rows, counts not multiples of 128)
    ([300, 0, 128, 77], SHAPE2, "gelu", True),
    ([300, 0, 128, 77], SHAPE2, "silu", False),
    ([1, 0, 0], SHAPE, "relu", True),  # one block
    ([4000, 0, 1900, 2300], SHAPE, "gelu", True),  # 65 blocks: the ring wraps
    ([2500, 3000, 0, 2700, 1], SHAPE, "gelu_tanh", False),
]


@pytest.mark.parametrize("rows,shape,act1,bias", GROUPED_CASES)
def test_grouped_matches_truth_and_reference(mod, rows, shape, act1, bias):
    _run_grouped_case(mod, rows, shape, act1, bias, seed=sum(rows) + len(act1) + bias)


@pytest.mark.parametrize("group", [1, 2, "auto"])
def test_grouped_experts_with_super_blocks(mod, group):
    """Super-blocks of 2 / auto row blocks whose blocks belong to different experts."""
    _run_grouped_case(mod, [130, 0, 250, 3100, 4000], SHAPE, "gelu", True,
                      seed=60 + (0 if group == "auto" else group),
                      comp=mod.ChainedFFNCompute(group=group))


def test_grouped_repeated_calls_and_dense_on_one_instance(mod):
    """One instance: grouped calls with new experts per call, a dense call in between (its own
    table), counters and the experts' table tail rewritten before every launch."""
    comp = mod.ChainedFFNCompute(group=2)
    for i, rows in enumerate(([500, 0, 700], [0, 1200, 3], [500, 0, 700])):
        _run_grouped_case(mod, rows, SHAPE2, "gelu", True, seed=90 + i, comp=comp,
                          epoch_val=20 + i)
        _run_case(mod, 1000, SHAPE2, "gelu", True, seed=95 + i, comp=comp, epoch_val=30 + i)


def test_grouped_small_grid(mod):
    _run_grouped_case(mod, [300, 0, 128, 77], SHAPE2, "gelu", True, seed=7,
                      ccta=torch.cuda.get_device_properties(0).multi_processor_count - 32)


def test_grouped_expert_out_of_range_refused(mod):
    """An expert id outside [0, E): check_experts=True raises before the launch (out stays
    poisoned); without it the kernel records the error (check() raises, naming the block) and
    the launch ends; the next good call on the instance is right."""
    P, hidden, N = SHAPE2
    comp = mod.ChainedFFNCompute(timeout_ms=500)
    x, w1, b1, w2, be = _grouped_inputs([300, 0, 128, 77], P, hidden, N, seed=41)
    bad = be.clone()
    bad[2] = 4  # E = 4
    out = torch.full((x.shape[0], N), float("nan"), device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="row block 2 names expert 4"):
        comp.grouped(x, w1, b1, w2, out=out, block_expert=bad, check_experts=True)
    torch.cuda.synchronize()
    assert torch.isnan(out).all(), "check_experts=True must refuse before any launch"
    for e in (4, -1):
        bad[2] = e
        comp.grouped(x, w1, b1, w2, out=out, block_expert=bad)
        with pytest.raises(RuntimeError, match=f"row block 2 .* names expert {e}, outside "
                                               r"\[0, 4\)"):
            comp.check()
    comp.check()  # cleared
    _run_grouped_case(mod, [300, 0, 128, 77], SHAPE2, "gelu", True, seed=42, comp=comp)
