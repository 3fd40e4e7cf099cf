"""FusedFFN / ShardedExperts, reference backend, on CPU ranks (gloo) against the float64 truth of
the unsplit layer; argument errors; the fused/switch refusals. One spawn per world size runs every
case (spawning dominates the time)."""
import pytest
import torch

from moe_overlap.ffn import (FusedFFN, ShardedExperts, check_compute_options,
                             fused_default_allreduce_band_rows, fused_default_ccta)
from moe_overlap.ffn.activations import ACTIVATIONS
from moe_overlap.ffn.reference import ffn_truth, rel_err, tolerance
from moe_overlap.ffn.validation import check_cases
from conftest import spawn_ranks


def _cases(world):
    cases = []
    for i, act1 in enumerate(ACTIVATIONS):
        act2 = [None, "silu", "relu", "gelu"][i]
        # odd token counts; hidden = 8 * world * k; out != in for some
        cases.append(dict(P=24, O=8 * world * (i + 1), N=16 if i % 2 else 24, T=7 + 2 * i,
                          act1=act1, act2=act2, dtype="bfloat16", seed=100 * world + i))
        cases.append(dict(P=16, O=4 * world, N=8, T=1 + 4 * i, act1=act1, act2="gelu_tanh",
                          dtype="float32", seed=7 * world + i))
    cases.append(dict(P=16, O=4 * world, N=12, T=5, act1="silu", dtype="float32", bias=False,
                      seed=3))
    cases.append(dict(P=16, O=4 * world, N=12, T=0, act1="relu", dtype="float32", seed=4))
    rows = [3, 0, 5, 1]
    for j, act in enumerate(("silu", "gelu")):
        cases.append(dict(experts=True, E=4, rows=rows, P=16, O=8 * world, N=24,
                          T=sum(rows) + 2 * j, act1=act, dtype=["float32", "bfloat16"][j],
                          bias=bool(j), seed=11 + j))
    return cases


def _check(results, cases):
    for case, r in zip(cases, results):
        assert r["rel_err"] <= r["tol"], (case, r)
        assert r["rank_diff"] == 0.0, (case, r)  # every rank returns the same output


@pytest.mark.parametrize("world", [2, 4, 8])
def test_reference_backend_matches_float64_truth(world):
    cases = _cases(world)
    per_rank = spawn_ranks(check_cases, world, cases)
    assert len(per_rank) == world
    for results in per_rank:
        _check(results, cases)


def test_single_process_every_activation():
    cases = _cases(1)
    _check(check_cases(0, 1, cases), cases)
    with torch.inference_mode():  # in-place activations path
        _check(check_cases(0, 1, cases), cases)


def test_leading_dims_and_autograd_path():
    g = torch.Generator().manual_seed(0)
    W1, b1 = torch.randn(8, 12, generator=g), torch.randn(12, generator=g)
    W2, b2 = torch.randn(12, 8, generator=g), torch.randn(8, generator=g)
    m = FusedFFN.from_full_weights(W1, b1, W2, b2, act1="silu", act2="relu")
    x = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    y = m(x)
    assert y.shape == (2, 3, 8)
    y.sum().backward()  # out-of-place activations while autograd records
    assert x.grad is not None
    t = ffn_truth(x.detach().reshape(6, 8), W1, b1, W2, b2, "silu", "relu").reshape(2, 3, 8)
    assert rel_err(y, t) < tolerance(torch.float32)


def test_wrong_result_is_detected():
    """The check can fail: the wrong activation, or dropping a slice, is far above tolerance."""
    g = torch.Generator().manual_seed(1)
    W1, b1 = torch.randn(16, 32, generator=g), torch.randn(32, generator=g)
    W2, b2 = torch.randn(32, 8, generator=g), torch.randn(8, generator=g)
    x = torch.randn(9, 16, generator=g)
    truth = ffn_truth(x, W1, b1, W2, b2, "gelu")
    y = FusedFFN.from_full_weights(W1, b1, W2, b2, act1="silu")(x)
    assert rel_err(y, truth) > 100 * tolerance(torch.float32)
    W2h = W2.clone()
    W2h[16:] = 0  # what rank 1 of 2 would contribute
    y = FusedFFN.from_full_weights(W1, b1, W2h, b2, act1="gelu")(x)
    assert rel_err(y, truth) > 100 * tolerance(torch.float32)


def _ffn(**kw):
    args = dict(in_features=8, hidden_features=16, out_features=4, act1="gelu")
    args.update(kw)
    return FusedFFN(**args)


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(in_features=0), ValueError, "in_features"),
    (dict(hidden_features=2.5), ValueError, "hidden_features"),
    (dict(out_features=-1), ValueError, "out_features"),
    (dict(act1="tanh"), ValueError, "act1"),
    (dict(act1=None), ValueError, "act1"),
    (dict(act2="softmax"), ValueError, "act2"),
    (dict(backend="triton"), ValueError, "backend"),
    (dict(comm="unicast"), ValueError, "backend='fused' only"),
    (dict(backend="fused", comm="carrier-pigeon"), ValueError, "comm"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(dtype=torch.float32, backend="fused"), TypeError, "bfloat16"),
    (dict(bias="yes"), TypeError, "bias"),
])
def test_constructor_errors(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        _ffn(**kw)


def test_forward_errors():
    m = _ffn(dtype=torch.float32)
    with pytest.raises(TypeError, match="torch.Tensor"):
        m([[1.0] * 8])
    with pytest.raises(ValueError, match="features"):
        m(torch.zeros(3, 7))
    with pytest.raises(ValueError, match="tokens"):
        m(torch.zeros(8))
    with pytest.raises(TypeError, match="dtype"):
        m(torch.zeros(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"on meta"):
        m(torch.zeros(3, 8, device="meta"))


def test_weight_loading_errors():
    W1, b1, W2, b2 = torch.zeros(8, 16), torch.zeros(16), torch.zeros(16, 4), torch.zeros(4)
    with pytest.raises(ValueError, match="both biases"):
        FusedFFN.from_full_weights(W1, b1, W2, None)
    with pytest.raises(ValueError, match="W2 has 15 rows"):
        FusedFFN.from_full_weights(W1, b1, torch.zeros(15, 4), b2)
    with pytest.raises(TypeError, match="W1 must be a 2-D"):
        FusedFFN.from_full_weights(torch.zeros(8), b1, W2, b2)
    m = _ffn(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"b1 has shape \(15,\)"):
        m.load_full_weights(W1, torch.zeros(15), W2, b2)
    with pytest.raises(ValueError, match="bias=False"):
        _ffn(bias=False, dtype=torch.float32).load_full_weights(W1, b1, W2, b2)


def test_experts_errors():
    m = ShardedExperts(3, 8, 16, 4, activation="relu", dtype=torch.float32)
    x = torch.zeros(5, 8)
    with pytest.raises(ValueError, match="3 entries|num_experts"):
        m(x, [1, 2])
    with pytest.raises(ValueError, match="negative"):
        m(x, [1, -1, 2])
    with pytest.raises(ValueError, match="sums to 6"):
        m(x, [2, 2, 2])
    with pytest.raises(TypeError, match="ints"):
        m(x, [1.0, 2, 2])
    with pytest.raises(TypeError, match="integer tensor"):
        m(x, torch.tensor([1.0, 2.0, 2.0]))
    with pytest.raises(ValueError, match=r"\[rows, 8\]"):
        m(torch.zeros(5, 7), [1, 2, 2])
    assert m(x, torch.tensor([1, 2, 2])).shape == (5, 4)
    with pytest.raises(ValueError, match="activation"):
        ShardedExperts(3, 8, 16, activation="swish")
    with pytest.raises(ValueError, match="num_experts"):
        ShardedExperts(0, 8, 16)
    with pytest.raises(ValueError, match=r"W_out has shape"):
        ShardedExperts.from_full_weights(torch.zeros(3, 8, 16), torch.zeros(2, 16, 4))


def _not_divisible(rank, world):  # module level: spawn pickles it by name
    try:
        FusedFFN(8, 5, act1="relu", dtype=torch.float32)
    except ValueError as e:
        return str(e)
    return "no error"


def test_hidden_not_divisible_by_world():
    msgs = spawn_ranks(_not_divisible, 2)
    assert all("not divisible by the TP world size 2" in m for m in msgs), msgs


def test_fused_backend_refuses_clearly(monkeypatch):
    # on a CPU machine (CI) the fused backend says what is missing, for both modules
    with pytest.raises(NotImplementedError, match="fused compute kernel") as ei:
        _ffn(backend="fused")
    assert isinstance(ei.value, RuntimeError)
    assert "backend='reference'" in str(ei.value) and "CUDA" in str(ei.value)
    with pytest.raises(NotImplementedError, match="ShardedExperts.*fused compute kernel"):
        ShardedExperts(2, 8, 16, backend="fused")
    with pytest.raises(ValueError, match="backend='fused' only"):
        ShardedExperts(2, 8, 16, ccta=8)
    for kw in (dict(compute_options={}), dict(allreduce_band_rows=32)):
        with pytest.raises(ValueError, match="allreduce_band_rows apply to backend='fused' only"):
            _ffn(**kw)
    # only this switch off (the environment may set the others, e.g. a device machine's; the
    # guard names the first one it finds)
    for name in ("NVSHMEM_DISABLE_NVLS", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    monkeypatch.setenv("MOE_OVERLAP_ALLOW_MULTICAST", "1")
    with pytest.raises(RuntimeError, match="switch.*refuses.*TORCH_SYMM_MEM_DISABLE_MULTICAST"):
        _ffn(backend="fused", comm="switch")


@pytest.mark.parametrize("tile_m", [64, 128])
def test_padded_expert_layout_matches_a_plain_loop(tile_m):
    """The fused ShardedExperts' row layout (device ops) against the obvious Python loop."""
    from moe_overlap.ffn import padded_expert_layout
    g = torch.Generator().manual_seed(tile_m)
    for trial in range(20):
        E = int(torch.randint(1, 9, (1,), generator=g))
        rows = [int(v) if torch.rand(1, generator=g) > 0.25 else 0
                for v in torch.randint(0, 3 * tile_m, (E,), generator=g)]
        dst, tile_e, row_e, R_pad = padded_expert_layout(rows, tile_m, torch.device("cpu"))
        want_dst, want_tiles, want_rows, p0 = [], [], [], 0
        for e, n in enumerate(rows):
            pn = -(-n // tile_m) * tile_m
            want_dst += range(p0, p0 + n)
            want_tiles += [e] * (pn // tile_m)
            want_rows += [e] * pn
            p0 += pn
        assert R_pad == p0 and R_pad % tile_m == 0
        assert dst.tolist() == want_dst and dst.dtype == torch.int64
        assert tile_e.tolist() == want_tiles and tile_e.dtype == torch.int32
        assert row_e.tolist() == want_rows
        assert len(set(want_dst)) == sum(rows)  # every input row has its own padded row


@pytest.mark.parametrize("opts, grouped, local_hidden, exc, msg", [
    ([("h_pair", True)], False, 1024, TypeError, "must be a dict"),
    (dict(tile_m=64), False, 1024, ValueError, r"unknown or reserved keys \['tile_m'\]"),
    (dict(cluster_m=2), True, 1024, ValueError, "cluster_m=2 applies to FusedFFN only"),
    (dict(h_pair=True), False, 768, ValueError, r"multiple of 2 \* 256"),
    # variants that lost (bench/NOTES.md, session 10): no longer options
    (dict(h_regs=False), False, 1024, ValueError, r"unknown or reserved keys \['h_regs'\]"),
    (dict(epilogue="red"), False, 1024, ValueError, r"unknown or reserved keys \['epilogue'\]"),
    (dict(stages=1), False, 1024, ValueError, "stages must be"),
    (dict(cluster_m=3), False, 1024, ValueError, "cluster_m must be 1 or 2"),
])
def test_compute_options_errors(opts, grouped, local_hidden, exc, msg):
    # the fused layers' kernel options fail on any machine, at construction
    with pytest.raises(exc, match=msg):
        check_compute_options(opts, local_hidden, 128, 256, grouped)


def test_compute_options_pass_through_and_h_pair_default():
    opts = dict(h_pair=True, cluster_m=2, epi_stages=2)
    got = check_compute_options(opts, 1024, 128, 256, grouped=False)
    assert got == opts and got is not opts  # a copy: later edits of the caller's dict are inert
    # h_pair by default exactly where the hidden tiles pair up
    assert check_compute_options(None, 1024, 128, 256, grouped=True) == dict(h_pair=True)
    assert check_compute_options({}, 768, 128, 256, grouped=False) == dict(h_pair=False)
    assert check_compute_options({}, 384, 64, 128, grouped=False) == dict(h_pair=False)
    assert check_compute_options({}, 512, 64, 128, grouped=False) == dict(h_pair=True)
    assert check_compute_options(dict(h_pair=False), 1024, 128, 256, False)["h_pair"] is False


def test_default_ccta_grows_as_the_hidden_slice_shrinks():
    # the benchmark shapes' O/G at G = 2 and the choice measured best for each (bench/NOTES.md)
    got = {og: fused_default_ccta(og) for og in (1024, 4096, 7168, 8192, 9216, 14336)}
    assert got == {1024: 32, 4096: 24, 7168: 16, 8192: 16, 9216: 16, 14336: 16}
    ccta = [fused_default_ccta(og) for og in range(128, 20000, 128)]
    assert ccta == sorted(ccta, reverse=True)  # never more SMs for a larger slice


def test_default_allreduce_bands_divide_the_m_tile():
    for tile_m in (64, 128):
        for og in range(128, 20000, 128):
            rows = fused_default_allreduce_band_rows(og, tile_m)
            assert tile_m % rows == 0 and rows >= 32
    # coarser bands only where the all-reduce outlasts the compute (measured, bench/NOTES.md)
    assert fused_default_allreduce_band_rows(1024, 128) == 64
    assert fused_default_allreduce_band_rows(4096, 128) == 32
