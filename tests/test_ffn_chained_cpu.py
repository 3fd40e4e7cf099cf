"""CPU checks of FusedFFN(compute="chained") and the band all-reduce's bf16-partial mode: option
validation, buffer sizing, the host order of one overlapped call (recorder kernels), and the
torch model of the bf16 reduce-scatter / all-gather (every rank's output bitwise equal, and equal
to the fixed-order fp32 sum). No GPU, no CuTe DSL."""
import pytest
import torch

from moe_overlap.ffn import FFNOptions, FusedFFN, ShardedExperts
from moe_overlap.ffn import band_allreduce as B
from moe_overlap.ffn.activations import activation
from moe_overlap.ffn.options import FFNFacts


# ---------------------------------------------------------------- options
def test_compute_option_values():
    assert FFNOptions().compute == "reduce"  # "chained" is not the default before its GPU run
    assert FFNOptions(compute="chained").compute == "chained"
    with pytest.raises(ValueError, match="compute='fast'.*choose from"):
        FFNOptions(compute="fast")


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(compute="chained", tile_m=64), ValueError, "tile_m=128"),
    (dict(compute="chained", compute_options=dict(cluster_m=2)), ValueError,
     "unknown or reserved keys \\['cluster_m'\\]"),
    (dict(compute="chained", compute_options=dict(h_pair=True)), ValueError, "h_pair"),
    (dict(compute="reduce", compute_options=dict(group=2)), ValueError, "group"),
])
def test_chained_options_refused_at_construction(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        FFNOptions(**kw)


def test_chained_resolve():
    r = FFNOptions(compute="chained").resolve(FFNFacts(local_hidden=1024, num_sms=132))
    assert r.is_resolved and r.compute == "chained" and dict(r.compute_options) == {}
    r32 = FFNOptions().resolve(FFNFacts(local_hidden=1024, num_sms=132))
    assert (r.ccta, r.allreduce_band_rows) == (r32.ccta, r32.allreduce_band_rows) == (32, 64)
    r = FFNOptions(compute="chained", compute_options=dict(group=2, epi_n=64)).resolve(
        FFNFacts(local_hidden=512))
    assert dict(r.compute_options) == dict(group=2, epi_n=64)
    # ShardedExperts: the grouped chained kernel, the same options
    rg = FFNOptions(compute="chained").resolve(FFNFacts(local_hidden=1024, grouped=True))
    assert rg.compute == "chained" and dict(rg.compute_options) == {}
    with pytest.raises(ValueError, match="multiple of 256"):
        FFNOptions(compute="chained").resolve(FFNFacts(local_hidden=384))
    with pytest.raises(ValueError, match="epi_n must be 32 or 64"):
        FFNOptions(compute="chained", compute_options=dict(epi_n=48)).resolve(
            FFNFacts(local_hidden=512))
    with pytest.raises(ValueError, match="group=0"):
        FFNOptions(compute="chained", compute_options=dict(group=0)).resolve(
            FFNFacts(local_hidden=512))
    r = FFNOptions(compute="chained", compute_options=dict(group=8, patch=2)).resolve(
        FFNFacts(local_hidden=512))
    assert dict(r.compute_options) == dict(group=8, patch=2)
    with pytest.raises(ValueError, match="patch=0"):
        FFNOptions(compute="chained", compute_options=dict(patch=0)).resolve(
            FFNFacts(local_hidden=512))
    r = FFNOptions(compute="chained", compute_options=dict(group=8, split="auto")).resolve(
        FFNFacts(local_hidden=512))
    assert dict(r.compute_options) == dict(group=8, split="auto")
    for bad in (-1, "early", True, 1.5):
        with pytest.raises(ValueError, match="split="):
            FFNOptions(compute="chained", compute_options=dict(split=bad)).resolve(
                FFNFacts(local_hidden=512))


def test_reference_backend_refuses_compute():
    with pytest.raises(ValueError, match="compute applies to backend='fused' only"):
        FusedFFN(64, 128, compute="chained")
    with pytest.raises(ValueError, match="compute applies to backend='fused' only"):
        ShardedExperts(2, 64, 128, compute="reduce")
    with pytest.raises(ValueError, match="compute='fast'"):
        FusedFFN(64, 128, backend="fused", compute="fast")  # checked before the CUDA check


def test_fused_chained_without_cuda_says_why():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    with pytest.raises(NotImplementedError, match="cannot run here"):
        FusedFFN(256, 512, 256, backend="fused", compute="chained")


# ---------------------------------------------------------------- all-reduce host checks
def test_bf16_mode_refusals_before_cuda():
    with pytest.raises(ValueError, match="partial='fp16'"):
        B.BandAllReduce(128, 64, partial="fp16")
    with pytest.raises(ValueError, match="multiple of 8 with partial='bf16'"):
        B.BandAllReduce(128, 68, partial="bf16")
    with pytest.raises(ValueError, match="partial"):
        B.build_band_allreduce(2, partial="int8")


def test_symmetric_layout_bf16_is_half_the_data():
    d32, off32, fb32, tot32 = B.symmetric_layout(8192, 4096, 32, "fp32")
    d16, off16, fb16, tot16 = B.symmetric_layout(8192, 4096, 32, "bf16")
    assert d32 == 8192 * 4096 * 4 and d16 == d32 // 2
    assert fb16 == fb32 == 256 * 4  # 256 bands, one u32 each
    assert off16 % 256 == 0 and off16 >= d16 and tot16 == off16 + 2 * fb16
    d, off, fb, tot = B.symmetric_layout(3, 8, 128, "bf16")  # ragged: 48 bytes, one band
    assert (d, off, fb, tot) == (48, 256, 256, 768)


def test_default_threads_unroll():
    assert B.default_threads_unroll("fp32", 2) == (B.DEFAULT_THREADS, B.DEFAULT_UNROLL)
    # bf16: 8 / G vectors in flight per thread (G loads each): the registers hold them all
    assert [B.default_threads_unroll("bf16", g) for g in (2, 4, 8)] == \
        [(512, 4), (512, 2), (512, 1)]


# ---------------------------------------------------------------- torch model of the schedule
CASES = [  # G, M, N, band_rows, grid, act2, bias
    (2, 256, 64, 128, 1, "none", False),
    (2, 300, 40, 32, 3, "silu", True),  # ragged last band, N/8 odd
    (3, 129, 24, 32, 8, "relu", True),  # G=3: the order of the sum matters (see below)
    (4, 77, 8, 16, 2, "gelu", True),  # a chunk shorter than a row, some ranks' chunks empty
    (8, 5, 16, 128, 4, "gelu_tanh", False),  # 10 vectors for 8 ranks
]


def _partials(G, M, N, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(M + 2, N, generator=g) * 3).to(torch.bfloat16) for _ in range(G)]


@pytest.mark.parametrize("G,M,N,band_rows,grid,act2,bias", CASES)
def test_bf16_model_all_ranks_bitwise_equal(G, M, N, band_rows, grid, act2, bias):
    parts = _partials(G, M, N, G * 100 + M)
    bufs = [p.clone() for p in parts]
    g = torch.Generator().manual_seed(7)
    b2 = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    outs, cov = B.emulate_band_allreduce_bf16(bufs, M, band_rows, b2, act2, grid)
    assert bool((cov == 1).all()), cov  # every vector finalized by exactly one rank
    for r in range(1, G):
        assert torch.equal(outs[0], outs[r]), r  # bitwise, whatever rank computed a chunk
    ref = B.bf16_allreduce_reference([p[:M] for p in parts], b2, act2)
    if act2 in ("none", "relu"):
        assert torch.equal(outs[0], ref)  # the fixed rank-order fp32 sum, rounded once
    else:
        # torch's CPU tanh / erf / exp take a SIMD or a scalar path depending on where an element
        # falls in the tensor, and the two differ in the last fp32 bit (deep in the negative tail,
        # -0 vs -1.5e-7): the model's chunks and the reference's one tensor cut differently, so
        # the order of the sum is checked bitwise before the activation and the activation to
        # one bf16 step after it.
        pre, _ = B.emulate_band_allreduce_bf16([p.clone() for p in parts], M, band_rows, b2,
                                               "none", grid)
        assert torch.equal(pre[0], B.bf16_allreduce_reference([p[:M] for p in parts], b2))
        step = torch.finfo(torch.bfloat16).eps * ref.float().abs() + 1e-6
        assert bool(((outs[0].float() - ref.float()).abs() <= step).all())
    truth = activation(sum(p[:M].double() for p in parts) + (b2.double() if bias else 0), act2)
    err = ((outs[0].double() - truth).abs().max() / truth.abs().max()).item()
    assert err <= 8e-3, err
    for r in range(G):
        assert torch.equal(bufs[r][M:], parts[r][M:])  # rows past M untouched
        assert torch.equal(bufs[r][:M], outs[r])  # the buffer holds the final values


def test_rank_dependent_order_would_not_be_bitwise_equal():
    """Why the order is fixed: with G = 3, a rank summing its own partial first (an all-reduce
    whose order depends on the rank) rounds differently wherever the partials' magnitudes span
    more than fp32's 24 bits less bf16's 8 (a few bf16 values of similar size sum exactly)."""
    g = torch.Generator().manual_seed(5)
    parts = [(torch.randn(64, 64, generator=g)
              * torch.exp2(torch.randint(-12, 13, (64, 64), generator=g).float()))
             .to(torch.bfloat16).float() for _ in range(3)]
    own_first = [parts[r] + parts[(r + 1) % 3] + parts[(r + 2) % 3] for r in range(3)]
    assert not all(torch.equal(own_first[0], o) for o in own_first[1:])
    fixed = [parts[0] + parts[1] + parts[2] for _ in range(3)]  # what the kernel does
    assert all(torch.equal(fixed[0], o) for o in fixed[1:])


# ---------------------------------------------------------------- host order of one call
class _Stream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits {other.name}")


class _FakeAR:
    def __init__(self, log, M, N):
        self.log = log
        self.max_rows, self.N = M, N
        self.acc = None
        self.partial = torch.full((M, N), float("nan"), dtype=torch.bfloat16)
        self.band_ready = torch.zeros(M // 128 + 1, dtype=torch.int32)
        self.epoch = torch.zeros(1, dtype=torch.int32)
        self.err = torch.zeros(8, dtype=torch.int64)
        self.arrive = torch.zeros(4, dtype=torch.int32)
        self.done, self.expected = self.arrive.clone(), self.arrive.clone()

    def __call__(self, M, b2=None, out=None, *, producer=False, stream=None, bump_epoch=True):
        self.log.append(("allreduce", stream.name, producer, bump_epoch))
        return out


class _FakeChained:
    def __init__(self, log):
        self.log = log
        self.err = torch.zeros(8, dtype=torch.int64)

    def prepare(self, M, P, hidden, N, device, ccta=0, has_b1=True, grouped=False):
        self.log.append(("prepare", M) if not grouped else ("prepare grouped", M))
        return 128

    def error_word(self, device=None):
        return self.err

    def __call__(self, x, w1, b1, w2, out=None, band_ready=None, epoch=None, act1="gelu",
                 ccta=0, stream=None, h_ring=None):
        self.log.append(("compute", stream.name, out.dtype, tuple(out.shape),
                         tuple(h_ring.shape), int(epoch)))


def _wire_fake_chained(mod, compute, allreduce, log, keep_for):
    """mod (a FusedFFN or ShardedExperts built on the reference backend) as the fused backend
    with compute="chained" on fakes: the compute object, the all-reduce, both error watches and
    two logging streams ("cur", the compute's, and "comm")."""
    from moe_overlap.diagnostics import FFNDebug
    from moe_overlap.ffn.compute_chained import describe_chained_error
    from moe_overlap.runtime.error_watch import ErrorWatch
    name = type(mod).__name__
    mod.backend, mod.options = "fused", FFNOptions(compute="chained")
    mod.ccta, mod.tile_m, mod.max_tokens = 4, 128, None
    mod._debug, mod._chained = FFNDebug(), True
    mod._compute, mod._allreduce = compute, allreduce
    mod._comm_stream = _Stream(log, "comm")
    mod._warm, mod._b1_cache = True, None
    mod._watch = ErrorWatch(allreduce.err, B.describe_error, f"{name} (rank 0)")
    mod._cwatch = ErrorWatch(compute.err, describe_chained_error, f"{name} compute")
    cur = _Stream(log, "cur")
    mod._streams = lambda device: (cur, mod._comm_stream)
    mod._keep_for = keep_for


def test_chained_call_host_order(monkeypatch):
    log = []
    mod = FusedFFN(256, 512, 256, act1="gelu", bias=True)
    _wire_fake_chained(mod, _FakeChained(log), _FakeAR(log, 256, 256), log,
                       keep_for=lambda t, s: log.append("keep"))
    x = torch.zeros(200, 256, dtype=torch.bfloat16)
    with torch.no_grad():
        mod(x)
        mod(x)
    launches = [e for e in log if isinstance(e, tuple) and e[0] in ("compute", "allreduce")]
    assert launches == [("compute", "cur", torch.bfloat16, (200, 256), (128, 512), 1),
                        ("allreduce", "comm", True, False),
                        ("compute", "cur", torch.bfloat16, (200, 256), (128, 512), 2),
                        ("allreduce", "comm", True, False)], log
    i = log.index(launches[0])
    assert log[i + 1] == launches[1]  # nothing on the host between the two launches
    assert ("prepare", 200) in log[:i]  # ring, table and scratch exist before the launch
    assert log[i - 1] == "comm waits cur"  # the epoch advance is ordered before both kernels
    assert log[i + 3] == "cur waits comm"  # join: the partial is free for the next call
    # a device error of the compute kernel surfaces on the next call (asynchronous read-back)
    mod._compute.err[0] = 7
    with torch.no_grad():
        mod(x)
        with pytest.raises(RuntimeError, match="FusedFFN compute: chained FFN: unknown device "
                                               "error code 7"):
            mod(x)


# ---------------------------------------------------------------- ShardedExperts(compute="chained")
def test_b2_per_band_refusals_before_cuda():
    with pytest.raises(ValueError, match="b2_per_band needs partial='bf16'"):
        B.BandAllReduce(128, 64, b2_per_band=True)
    with pytest.raises(TypeError, match="b2_per_band"):
        B.BandAllReduce(128, 64, partial="bf16", b2_per_band=1)


@pytest.mark.parametrize("G,M,N,band_rows,ready_rows,grid,act2", [
    (2, 300, 64, 32, 128, 3, "none"),  # 3 ready bands (ragged), 4 all-reduce bands each
    (3, 256, 24, 64, 64, 2, "relu"),
    (1, 129, 16, 128, 128, 1, "none"),  # one rank: a band of 1 row in the second ready band
])
def test_bf16_model_b2_per_band(G, M, N, band_rows, ready_rows, grid, act2):
    """b2 one row per ready flag: band b adds row b * band_rows // ready_rows, the reference
    adds row r to rows [r * ready_rows, (r + 1) * ready_rows)."""
    parts = _partials(G, M, N, 31 + G + M)
    g = torch.Generator().manual_seed(9)
    nr = -(-M // ready_rows)
    b2 = (torch.randn(nr + 1, N, generator=g)).to(torch.bfloat16)  # one row more than needed
    outs, cov = B.emulate_band_allreduce_bf16([p.clone() for p in parts], M, band_rows, b2, act2,
                                              grid, ready_rows=ready_rows)
    assert bool((cov == 1).all())
    ref = B.bf16_allreduce_reference([p[:M] for p in parts], b2, act2, ready_rows=ready_rows)
    for r in range(G):
        assert torch.equal(outs[r], ref), r
    by_hand = sum(p[:M].float() for p in parts) + torch.cat(
        [b2[i // ready_rows].float().view(1, N) for i in range(M)])
    assert torch.equal(ref, activation(by_hand, act2).to(torch.bfloat16))
    # the rows matter: a b2 with its rows swapped gives another result where they differ
    swapped = b2.flip(0)[-(nr + 1):].contiguous()
    other = B.bf16_allreduce_reference([p[:M] for p in parts], swapped, act2, ready_rows=ready_rows)
    assert not torch.equal(other, ref)
    with pytest.raises(ValueError, match="needs ready_rows"):
        B.bf16_allreduce_reference([p[:M] for p in parts], b2, act2)
    assert nr > 1  # every case has more than one ready band
    with pytest.raises(ValueError, match="b2 has 1 rows"):
        B.bf16_allreduce_reference([p[:M] for p in parts], b2[:1], act2, ready_rows=ready_rows)


class _FakeGroupedChained(_FakeChained):
    """The chained compute object on the CPU: ``grouped`` stores the grouped reference's bf16
    partial (what the kernel writes) and logs its arguments."""

    def grouped(self, x, w1, b1, w2, out=None, band_ready=None, epoch=None, block_expert=None,
                ccta=0, act1="gelu", stream=None, h_ring=None, check_experts=False):
        from moe_overlap.ffn.compute_chained import chained_ffn_grouped_reference
        self.log.append(("grouped", stream.name, tuple(out.shape), block_expert.tolist(),
                         b1 is not None, act1, tuple(h_ring.shape)))
        out.copy_(chained_ffn_grouped_reference(x, w1, b1, w2, block_expert, act1)
                  .to(torch.bfloat16))


class _EmulatedAR(_FakeAR):
    """The band all-reduce on one rank, through the bf16 emulator (b2 per ready band)."""

    def __init__(self, log, M, N, band_rows, b2_per_band):
        super().__init__(log, M, N)
        self.band_rows, self.ready_rows, self.b2_per_band = band_rows, 128, b2_per_band

    def __call__(self, M, b2=None, out=None, *, producer=False, stream=None, bump_epoch=True):
        self.log.append(("allreduce", stream.name, None if b2 is None else tuple(b2.shape)))
        if b2 is not None:
            assert self.b2_per_band and b2.dim() == 2
        outs, cov = B.emulate_band_allreduce_bf16([self.partial], M, self.band_rows, b2, "none",
                                                  grid=2, ready_rows=self.ready_rows)
        assert bool((cov == 1).all())
        out.copy_(outs[0])
        return out


@pytest.mark.parametrize("bias", [True, False])
def test_sharded_experts_chained_emulated(bias):
    """ShardedExperts(compute="chained")'s host path on one rank with the kernels replaced by
    their CPU models (grouped reference, bf16 all-reduce emulator): padded layout, one expert
    per 128-row block (expert 1 without rows, expert 2 with a non-multiple of 128), b_out of
    each block's expert as the all-reduce's b2 rows; against the float64 truth within 8e-3,
    two calls."""
    from moe_overlap.ffn.reference import experts_truth
    E, P, O, N, rows = 3, 128, 256, 256, [130, 0, 250]
    g = torch.Generator().manual_seed(4)
    W_in = (torch.randn(E, P, O, generator=g) / P ** 0.5).to(torch.bfloat16)
    W_out = (torch.randn(E, O, N, generator=g) / O ** 0.5).to(torch.bfloat16)
    b_in = (torch.randn(E, O, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    b_out = (torch.randn(E, N, generator=g) * 0.5).to(torch.bfloat16) if bias else None
    mod = ShardedExperts.from_full_weights(W_in, W_out, b_in, b_out, activation="gelu")
    log = []
    assert mod._b2_per_band == bias
    _wire_fake_chained(mod, _FakeGroupedChained(log),
                       _EmulatedAR(log, 768, N, 32, b2_per_band=mod._b2_per_band), log,
                       keep_for=lambda t, s: None)
    for call in range(2):
        x = torch.randn(sum(rows) + 3, P, generator=g).to(torch.bfloat16)
        with torch.no_grad():
            y = mod(x, rows)
        truth = experts_truth(x, rows, W_in, W_out, b_in, b_out, "gelu")
        err = ((y.double() - truth).abs().max() / truth.abs().max()).item()
        assert err <= 8e-3, (call, err)
        assert bool((y[sum(rows):] == 0).all())
    launches = [e for e in log if isinstance(e, tuple) and e[0] in ("grouped", "allreduce")]
    # padded layout: expert 0 two blocks (130 rows), expert 2 two blocks (250), expert 1 none
    want_c = ("grouped", "cur", (512, N), [0, 0, 2, 2], bias, "gelu", (128, O))
    want_a = ("allreduce", "comm", (4, N) if bias else None)
    assert launches == [want_c, want_a, want_c, want_a], launches
    assert log.count(("prepare grouped", 512)) == 2  # the grouped table, before each call
    if bias:
        assert torch.equal(mod._block_b2_buf[:4], b_out[[0, 0, 2, 2]])
    # bias=False with compute="chained" on the layer: acc_init stays refused (the reduce path's)
    with pytest.raises(NotImplementedError, match="acc_init needs compute='reduce'"):
        mod._fused_call(torch.zeros(128, P, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.int32),
                        acc_init=lambda acc: None)


def test_chained_reads_the_bf16_bias_parameter_itself():
    """compute="chained" hands the kernel the bf16 b1 parameter (no fp32 copy, per call or
    cached); the reduce kernel gets one fp32 copy per weight version."""
    log = []
    mod = FusedFFN(256, 512, 256, act1="gelu", bias=True)
    _wire_fake_chained(mod, _FakeChained(log), _FakeAR(log, 256, 256), log,
                       keep_for=lambda t, s: None)
    b1 = mod._fused_b1_param()
    assert b1.dtype == torch.bfloat16
    got = mod._b1_for_compute()
    assert got.dtype == torch.bfloat16 and got.data_ptr() == b1.data_ptr()
    assert mod._b1_cache is None
    mod._chained = False
    f = mod._b1_for_compute()
    assert f.dtype == torch.float32 and torch.equal(f, b1.float())
    assert mod._b1_for_compute() is f  # converted once
    with torch.no_grad():
        b1.add_(1)  # a new weight version: converted again
    assert torch.equal(mod._b1_for_compute(), b1.float())
