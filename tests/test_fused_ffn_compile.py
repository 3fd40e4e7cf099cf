"""Compile-only checks of the fused FFN compute kernel for sm_90a (no GPU needed), its argument
checks and its torch reference.

CUTE_DSL_ARCH=sm_90a makes cute.compile target sm_90a without a GPU. The PTX must show the pieces
the design relies on: WGMMA (both GEMMs, B transposed = MN-major weights; GEMM2's A from
registers, with h_pair the second H tile by stmatrix into shared memory + the async-proxy fence),
the TMA reduce-add into the fp32 accumulator
(``cp.reduce.async.bulk.tensor...add``), and the flag protocol (``cp.async.bulk.wait_group 0``,
``fence.proxy.async.global``, ``atom...acq_rel`` counter, ``st.release.gpu`` flag). The SASS
(nvdisasm, skipped where missing) must have the TMA reduce (UTMAREDG) and no local-memory spills.
"""
import os
import re

import pytest
import torch

from moe_overlap.kernels.compile import kept_cubin, kept_ptx

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.compile

_CACHE = {}


@pytest.fixture(scope="module")
def ffn_mod():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import cutlass.cute  # noqa: F401  (installed but broken: an error, not a skip)
    from moe_overlap.ffn import compute_reduce as fused_ffn
    return fused_ffn


def _compiled(mod, tile_m, act1, tile_o=128, h_pair=False):
    key = (tile_m, act1, tile_o, h_pair)
    if key not in _CACHE:
        fn = mod.FusedFFNCompute(tile_m=tile_m, tile_o=tile_o, h_pair=h_pair).compile(
            P=256, O=512, N=256, act1=act1, keep_ptx=True)
        _CACHE[key] = (kept_ptx(fn), kept_cubin(fn))
    return _CACHE[key]


@pytest.mark.parametrize("tile_m,act1,tile_o,h_pair", [
    (128, "gelu", 128, False), (64, "relu", 128, False), (128, "gelu", 256, False),
    (64, "silu", 128, True), (128, "gelu", 256, True)])
def test_ptx_has_wgmma_reduce_and_flags(ffn_mod, tile_m, act1, tile_o, h_pair):
    ptx, _ = _compiled(ffn_mod, tile_m, act1, tile_o, h_pair)
    body = ptx.split(".entry", 1)[1]
    def wgmma(n):  # bf16 WGMMAs, A from shared memory, B transposed (MN-major weights)
        return re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.bf16\.bf16 "
                          r"\{[^}]*\}, %rd\d+, %rd\d+, p, 1,\s*1, 0, 1;", body)
    def wgmma_rs(n):  # A from four registers (H), B transposed
        return re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.bf16\.bf16 "
                          r"\{[^}]*\}, \{[^}]*\}, %rd\d+, p, 1,\s*1, 1;", body)
    # GEMM1: one 64 x tile_o WGMMA per k16 step (4 per 64-wide k tile); GEMM2: 64 x 128, tile_o / 16
    # k16 steps per n tile (two W2 chunks) from registers, as many from sH with h_pair
    assert len(wgmma(tile_o)) >= 4 and len(wgmma_rs(128)) >= tile_o // 16
    if h_pair:
        assert len(wgmma(128)) >= (4 if tile_o == 128 else 0) + tile_o // 16
        assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in body  # the first H tile -> sH
        assert "fence.proxy.async.shared::cta" in body
    else:
        assert "stmatrix" not in body  # H never goes to shared memory
    red = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add\.tile", body)
    epi_n = ffn_mod.FusedFFNCompute(tile_m=tile_m, tile_o=tile_o, h_pair=h_pair).epi_n
    assert len(red) == 128 // epi_n  # one TMA reduce-add per fp32 sub-tile of an n tile
    assert not re.findall(r"red\.global\.add\.v2\.f32", body)
    assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", body)
    assert "fence.proxy.async.global" in body
    assert "atom.global.acq_rel.add" in body or "atom.acq_rel.gpu" in body
    assert "st.release.gpu" in body
    assert "setmaxnreg" in body and "mbarrier.try_wait" in body
    assert ".local" not in body


@pytest.mark.parametrize("tile_m,tile_o", [(128, 256), (64, 128)])
def test_cluster_multicast_compiles(ffn_mod, tile_m, tile_o):
    """cluster_m=2: W1 tiles and W2 chunks come by TMA multicast, half issued per CTA."""
    from moe_overlap.kernels.compile import require_nvdisasm, sass_of
    fn = ffn_mod.FusedFFNCompute(tile_m=tile_m, tile_o=tile_o, cluster_m=2).compile(
        P=256, O=512, N=256, act1="gelu", keep_ptx=True)
    body = kept_ptx(fn).split(".entry", 1)[1]
    # W1 and W2 loads multicast (3-d: the expert mode), X per CTA
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cluster\.global\.\S*"
                          r"multicast::cluster", body)) >= 2
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", body)
    assert "mbarrier.arrive.shared::cluster" in body  # stage release to both CTAs
    sass = sass_of(kept_cubin(fn), require_nvdisasm())
    assert "HGMMA" in sass and "UTMAREDG" in sass
    assert len(re.findall(r"\b(STL|LDL)\b", sass)) <= 12  # gelu's erf constants at most


def _bench_fused_compute():
    import importlib.util
    import pathlib
    import sys
    bench_dir = pathlib.Path(__file__).resolve().parents[1] / "bench"
    spec = importlib.util.spec_from_file_location("bench_fused_compute",
                                                  bench_dir / "bench_fused_compute.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(bench_dir))  # the bench imports its sibling bench_ffn
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(bench_dir))
    return mod


@pytest.mark.parametrize("skip", ["gemm1", "gemm2", "epilogue", "gemm1+epilogue"])
def test_phase_split_diagnostics_compile(ffn_mod, skip):
    """The benchmark's timing splits (a FusedFFNKernel subclass defined in the bench, nothing in
    the product constructor) leave one GEMM (or GEMM2's reductions) out on both sides of the
    ring; the GEMM2 products stay in the code when their reductions do not."""
    bench = _bench_fused_compute()
    fn = bench.diag_compute(skip).compile(P=256, O=512, N=256, act1="relu", keep_ptx=True)
    body = kept_ptx(fn).split(".entry", 1)[1]
    n256 = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", body))
    n128 = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16", body))
    red = len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", body))
    assert (n256 == 0) == skip.startswith("gemm1")
    assert (n128 == 0) == (skip == "gemm2")
    assert (red == 0) == (skip != "gemm1")
    with pytest.raises(ValueError, match="skip"):
        bench.diag_compute("both")
    for removed in ("_diag_skip", "_diag_plain_store", "epilogue", "h_regs"):
        with pytest.raises(TypeError, match=removed):
            ffn_mod.FusedFFNCompute(**{removed: None})


def test_plain_store_diagnostic_compiles(ffn_mod):
    """plain_store: a plain TMA store where the product kernel reduce-adds."""
    fn = _bench_fused_compute().diag_compute(plain_store=True).compile(
        P=256, O=512, N=256, act1="relu", keep_ptx=True)
    body = kept_ptx(fn).split(".entry", 1)[1]
    assert not re.findall(r"cp\.reduce\.async\.bulk\.tensor", body)
    assert re.findall(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", body)


@pytest.mark.parametrize("tile_m,tile_o,act1", [(128, 256, "gelu"), (64, 128, "silu")])
def test_h_in_registers_compiles_to_rs_wgmma(ffn_mod, tile_m, tile_o, act1):
    """GEMM2 reads H from registers (WGMMA RS, no sH), which leaves shared memory for a deep
    ring and 128-byte epilogue rows; no WGMMA serialization, no new spills."""
    from moe_overlap.kernels.compile import require_nvdisasm, sass_of
    c = ffn_mod.FusedFFNCompute(tile_m=tile_m, tile_o=tile_o)
    assert c.epi_n == 32
    if tile_o == 256:  # 4 x 48 KiB stages + 2 x 32-column fp32 buffers
        assert c.stages == 4
    fn = c.compile(P=256, O=512, N=256, act1=act1, keep_ptx=True)
    body = kept_ptx(fn).split(".entry", 1)[1]
    # GEMM2: A as four .b32 registers, B as a descriptor; GEMM1 still A and B from smem
    rs = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\s*\{[^}]*\},"
                    r"\s*\{[^}]*\}", body)
    assert rs and all(r.count("%r") >= 4 for r in rs)
    assert "stmatrix" not in body  # no H store to shared memory (the fp32 epilogue: st.shared)
    sass = sass_of(kept_cubin(fn), require_nvdisasm())
    assert re.search(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)
    spills = len(re.findall(r"\b(STL|LDL)\b", sass))
    assert spills <= 12, spills


@pytest.mark.parametrize("tile_m,tile_o,act1,extra", [(128, 256, "gelu", {}),
                                                     (64, 128, "relu", dict(cluster_m=2))])
def test_h_pair_compiles_with_both_gemm2_operand_sources(ffn_mod, tile_m, tile_o, act1, extra):
    """h_pair: per n tile, GEMM2 takes one H tile from registers (RS) and one from sH (SS), then
    one fp32 reduce-add per sub-tile (half the reduce traffic of two units); the ring keeps at
    most two W2 chunks per consumer, so four chunks pass through 3 stages."""
    from moe_overlap.kernels.compile import require_nvdisasm, sass_of
    c = ffn_mod.FusedFFNCompute(tile_m=tile_m, tile_o=tile_o, h_pair=True, **extra)
    fn = c.compile(P=256, O=1024, N=256, act1=act1, keep_ptx=True)
    body = kept_ptx(fn).split(".entry", 1)[1]
    rs = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\s*"
                    r"\{[^}]*\},\s*\{[^}]*\}", body)
    ss = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16\s*"
                    r"\{[^}]*\},\s*%rd", body)
    assert len(rs) >= tile_o // 16 and len(ss) >= tile_o // 16
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" in body  # the second H tile -> sH
    red = re.findall(r"cp\.reduce\.async\.bulk\.tensor\.2d\.global\.shared::cta\.add\.tile", body)
    assert len(red) == 128 // c.epi_n  # one reduce-add per sub-tile of an n tile, as before
    sass = sass_of(kept_cubin(fn), require_nvdisasm())
    assert re.search(r"HGMMA\.64x128x16\.F32\.BF16 R\d+, R\d+, gdesc", sass)
    lines = sass.splitlines()
    spills = [i for i, l in enumerate(lines) if re.search(r"\b(STL|LDL)\b", l)]
    gemm2 = [i for i, l in enumerate(lines) if "HGMMA.64x128x16" in l]
    # exact gelu's constants spill around the activations (16 at 64 x 256 per warpgroup),
    # never inside the GEMM2 n-tile loop
    assert len(spills) <= (24 if act1 == "gelu" else 0), len(spills)
    assert not [i for i in spills if gemm2[0] <= i <= gemm2[-1]]
    assert c.stages == ffn_mod._ring_plan(tile_m, tile_o, 128, 64, None, None, 2,
                                          True)[0]  # one H tile in smem
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2 \\* tile_o"):  # an odd number of hidden tiles
        c.check(x, torch.zeros(256, 3 * tile_o, dtype=torch.bfloat16), None,
                torch.zeros(3 * tile_o, 256, dtype=torch.bfloat16), torch.zeros(128, 256),
                torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                need_cuda=False)


def test_cluster_options_checked(ffn_mod, monkeypatch):
    with pytest.raises(ValueError, match="cluster_m"):
        ffn_mod.FusedFFNCompute(cluster_m=4)
    monkeypatch.setattr(ffn_mod, "num_sms", lambda device: 132)
    c = ffn_mod.FusedFFNCompute(cluster_m=2)
    assert c.grid(M=8192, O=7168, device="cpu", ccta=17) == 114  # whole clusters
    assert c.grid(M=200, O=256, device="cpu", ccta=0) == 2  # 2 m-tiles x 1 j-tile
    assert c.grid(M=100, O=512, device="cpu", ccta=0) == 4  # 1 m-tile (+ its phantom) x 2
    with pytest.raises(ValueError, match="whole cluster"):
        c.grid(M=8192, O=7168, device="cpu", ccta=131)
    x = torch.zeros(128, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dense call only"):
        c.grouped(x, torch.zeros(2, 256, 512, dtype=torch.bfloat16), None,
                  torch.zeros(2, 512, 256, dtype=torch.bfloat16), torch.zeros(128, 256),
                  torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                  torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize("act1,needle", [("silu", "ex2.approx"), ("gelu_tanh", "tanh.approx")])
def test_act1_variants_compile(ffn_mod, act1, needle):
    ptx, _ = _compiled(ffn_mod, 128, act1)
    assert needle in ptx.split(".entry", 1)[1]


@pytest.mark.parametrize("tile_o,act1,h_pair", [
    (128, "gelu", False), (256, "silu", False), (256, "relu", True), (256, "gelu", False)])
def test_sass_reduce_no_spills(ffn_mod, tile_o, act1, h_pair):
    from moe_overlap.kernels.compile import require_nvdisasm, sass_of
    _, cubin = _compiled(ffn_mod, 128, act1, tile_o, h_pair)
    sass = sass_of(cubin, require_nvdisasm())
    assert "UTMAREDG" in sass
    assert "HGMMA" in sass
    spills = len(re.findall(r"\b(STL|LDL)\b", sass))
    if act1 == "gelu" and tile_o == 256:
        # exact gelu's erf polynomial next to a 64 x 256 fp32 accumulator: ptxas keeps 5 of its
        # constants in registers and spills them (5 stores before the unit loop, 5 loads per
        # unit). A spill inside an unrolled k loop would show dozens.
        assert spills <= 12, spills
    else:
        assert spills == 0, "register spills"


def test_compile_cache_keys_on_every_kernel_option(ffn_mod, monkeypatch):
    """The same options and shapes compile once (also from a new instance); each option or
    shape that changes the kernel compiles its own. cute.compile is replaced by a counter (a new
    object per call), so this checks the key, not the compiler."""
    import cutlass.cute as cute
    built = []
    monkeypatch.setattr(cute, "compile", lambda kernel, *args: built.append(kernel) or object())
    monkeypatch.setattr(ffn_mod.FusedFFNCompute, "_compiled", {})
    F = ffn_mod.FusedFFNCompute
    first = F(tile_m=64).compile(256, 256, 256, "relu")
    assert F(tile_m=64).compile(256, 256, 256, "relu") is first and len(built) == 1
    others = [(F(tile_m=128), (256, 256, 256, "relu")), (F(tile_m=64), (256, 256, 256, "silu")),
              (F(tile_m=64, tile_o=128), (256, 256, 256, "relu")),
              (F(tile_m=64, h_pair=True), (256, 256, 256, "relu")),
              (F(tile_m=64, h_pair=True, stages=2), (256, 256, 256, "relu")),
              (F(tile_m=64, stages=2), (256, 256, 256, "relu")),
              (F(tile_m=64, epi_stages=1), (256, 256, 256, "relu")),
              (F(tile_m=64, cluster_m=2), (256, 256, 256, "relu")),
              (F(tile_m=64), (512, 256, 256, "relu")), (F(tile_m=64), (256, 512, 256, "relu")),
              (F(tile_m=64), (256, 256, 512, "relu"))]
    fns = [c.compile(*a) for c, a in others]
    assert len(built) == 1 + len(others) and len({id(f) for f in fns + [first]}) == len(built)
    assert [c.compile(*a) for c, a in others] == fns and len(built) == 1 + len(others)


def test_bad_inputs_raise_before_launch(ffn_mod):
    c = ffn_mod.FusedFFNCompute(tile_m=128)
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    M, P, O, N = 300, 128, 256, 256
    x = torch.zeros(M, P, dtype=bf)
    w1 = torch.zeros(P, O, dtype=bf)
    b1 = torch.zeros(O, dtype=bf)
    w2 = torch.zeros(O, N, dtype=bf)
    acc = torch.zeros(M, N, dtype=f32)
    ready = torch.zeros(3, dtype=i32)
    epoch = torch.zeros(1, dtype=i32)
    args = [x, w1, b1, w2, acc, ready, epoch]
    with pytest.raises(ValueError, match="CUDA"):  # CPU tensors: a clear error, no launch
        c(*args)
    chk = lambda *a, **k: c.check(*a, need_cuda=False, **k)  # noqa: E731
    assert chk(*args) == (M, P, O, N)
    assert chk(x, w1, None, w2, acc, ready, epoch) == (M, P, O, N)
    with pytest.raises(ValueError, match="tile_k"):
        chk(torch.zeros(M, 100, dtype=bf), torch.zeros(100, O, dtype=bf), *args[2:])
    with pytest.raises(ValueError, match="tile_o"):
        chk(x, torch.zeros(P, 200, dtype=bf), torch.zeros(200, dtype=bf),
            torch.zeros(200, N, dtype=bf), *args[4:])
    with pytest.raises(ValueError, match="tile_n"):
        chk(x, w1, b1, torch.zeros(O, 200, dtype=bf), torch.zeros(M, 200, dtype=f32),
            *args[5:])
    with pytest.raises(TypeError, match="bfloat16"):
        chk(x.float(), *args[1:])
    with pytest.raises(TypeError, match="float32"):
        chk(*args[:4], acc.to(bf), *args[5:])
    with pytest.raises(TypeError, match="int32"):
        chk(*args[:5], ready.long(), epoch)
    with pytest.raises(ValueError, match="contiguous"):
        chk(*args[:3], torch.zeros(N, O, dtype=bf).t(), *args[4:])
    with pytest.raises(ValueError, match="P mismatch"):
        chk(x, torch.zeros(64, O, dtype=bf), *args[2:])
    with pytest.raises(ValueError, match="hidden mismatch"):
        chk(x, w1, b1, torch.zeros(128, N, dtype=bf), *args[4:])
    with pytest.raises(ValueError, match="acc must be"):
        chk(*args[:4], torch.zeros(M - 1, N, dtype=f32), *args[5:])
    with pytest.raises(ValueError, match="band_ready"):
        chk(*args[:5], torch.zeros(2, dtype=i32), epoch)  # ceil(300 / 128) = 3 bands
    with pytest.raises(ValueError, match="b1"):
        chk(x, w1, torch.zeros(O + 1, dtype=bf), *args[3:])
    with pytest.raises(ValueError, match="ccta"):
        chk(*args, ccta=-1)
    with pytest.raises(ValueError, match="act1"):
        chk(*args, act1="tanh")
    with pytest.raises(ValueError, match="at least one row"):
        chk(x[:0], w1, b1, w2, acc[:0], ready, epoch)
    for kw, msg in [(dict(tile_m=96), "tile_m"), (dict(tile_o=64), "tile_o"),
                    (dict(tile_n=256), "tile_n"), (dict(band_rows=192), "band_rows"),
                    (dict(epi_n=8), "epi_n"), (dict(stages=1), "stages"), (dict(stages=5), "fit"),
                    (dict(stages=4, h_pair=True), "fit"), (dict(cluster_m=3), "cluster_m")]:
        with pytest.raises(ValueError, match=msg):
            ffn_mod.FusedFFNCompute(**kw)
    assert ffn_mod.FusedFFNCompute(tile_m=64, band_rows=256).band_rows == 256


def test_shared_memory_plan(ffn_mod):
    """The ring is as deep as fits next to H (h_pair: one tile in shared memory, else a 1 KiB
    stub) and the epilogue buffers (227 KiB per CTA)."""
    plan = ffn_mod._ring_plan
    # h_pair, tile_o 256: 48 KiB stages; 32-column epilogue buffers would leave only 2, so 16
    assert plan(128, 256, 128, 64, None, None, 2, True) == (3, 16)
    assert plan(128, 256, 128, 64, None, 32, 2, True) == (2, 32)
    assert plan(128, 128, 128, 64, None, None, 2, True) == (5, 32)  # 32 KiB stages
    assert plan(64, 256, 128, 64, None, None, 2, True) == (4, 32)
    for tile_m, tile_o in [(128, 256), (128, 128), (64, 256)]:
        st, epi_n = plan(tile_m, tile_o, 128, 64, None, None, 2, True)
        used = 1024 + st * (tile_m + tile_o) * 64 * 2 + tile_m * tile_o * 2 \
            + tile_m * epi_n * 4 * 2
        assert used <= ffn_mod._SMEM_CAPACITY_SM90
        assert used + (tile_m + tile_o) * 64 * 2 > ffn_mod._SMEM_CAPACITY_SM90  # one more: no
    with pytest.raises(ValueError, match="fit"):
        plan(128, 256, 128, 64, 4, None, 2, True)
    with pytest.raises(ValueError, match="tile_n"):
        plan(128, 256, 256, 64, None, None, 2, False)
    # one H tile, in registers (a 1 KiB stub): 4 stages and 32-column buffers at tile_o 256
    assert plan(128, 256, 128, 64, None, None, 2, False) == (4, 32)
    for tile_m, tile_o in [(128, 256), (128, 128), (64, 256), (64, 128)]:
        st, epi_n = plan(tile_m, tile_o, 128, 64, None, None, 2, False)
        used = 1024 + st * (tile_m + tile_o) * 64 * 2 + 1024 + tile_m * epi_n * 4 * 2
        assert used <= ffn_mod._SMEM_CAPACITY_SM90
    c = ffn_mod.FusedFFNCompute()
    assert (c.tile_o, c.stages, c.epi_n, c.h_pair) == (256, 4, 32, False)
    p = ffn_mod.FusedFFNCompute(h_pair=True)
    assert (p.stages, p.epi_n) == (3, 16)
    # the static check gives the same plan without building anything
    assert ffn_mod.FusedFFNCompute.check_options(h_pair=True) == (3, 16)


def test_reference_semantics():
    from moe_overlap.ffn.activations import activation
    from moe_overlap.ffn.compute_reduce import fused_ffn_compute_reference
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=g).to(torch.bfloat16)
    w1 = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    b1 = torch.randn(6, generator=g).to(torch.bfloat16)
    w2 = torch.randn(6, 4, generator=g).to(torch.bfloat16)
    h = activation(x.double() @ w1.double() + b1.double(), "silu")
    truth = h @ w2.double()
    acc = torch.ones(5, 4)
    out = fused_ffn_compute_reference(x, w1, b1, w2, "silu", acc=acc)
    assert out is acc
    assert ((acc.double() - 1 - truth).norm() / truth.norm()).item() < 1e-2
    y = fused_ffn_compute_reference(x, w1, None, w2, "relu")
    torch.testing.assert_close(
        y, (torch.relu(x.float() @ w1.float()).to(torch.bfloat16).float() @ w2.float()))
    with pytest.raises(ValueError, match="act1"):
        fused_ffn_compute_reference(x, w1, b1, w2, "tanh")


def test_runtime_argument_path_compiles(ffn_mod):
    """The launcher's own path (torch tensors -> from_dlpack -> cute.compile), with CPU tensors
    standing in for CUDA ones (compiling reads only their metadata): ragged M, no b1."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.runtime import make_fake_stream
    c = ffn_mod.FusedFFNCompute(tile_m=64, band_rows=128)
    M, P, O, N = 300, 128, 256, 384
    x = torch.zeros(M, P, dtype=torch.bfloat16)
    w1 = torch.zeros(P, O, dtype=torch.bfloat16)
    w2 = torch.zeros(O, N, dtype=torch.bfloat16)
    acc = torch.zeros(M, N)
    ready = torch.zeros(3, dtype=torch.int32)
    epoch = torch.zeros(1, dtype=torch.int32)
    assert c.check(x, w1, None, w2, acc, ready, epoch, need_cuda=False) == (M, P, O, N)
    mte = torch.zeros(5, dtype=torch.int32)
    args = c._cute_args(x, w1.unsqueeze(0), torch.zeros(1, O), w2.unsqueeze(0), acc, ready,
                        c.counter_for(ready), epoch, mte)
    fn = cute.compile(c._kernel("silu"), *args, cutlass.Int32(2), cutlass.Int32(8),
                      make_fake_stream())
    assert fn is not None
    # grouped (ShardedExperts): 3 experts, the same compiled kernel signature
    w1g = torch.zeros(3, P, O, dtype=torch.bfloat16)
    w2g = torch.zeros(3, O, N, dtype=torch.bfloat16)
    args = c._cute_args(x, w1g, torch.zeros(3, O), w2g, acc, ready, c.counter_for(ready), epoch,
                        mte)
    assert cute.compile(c._kernel("silu"), *args, cutlass.Int32(2), cutlass.Int32(8),
                        make_fake_stream()) is not None


def test_grouped_argument_errors(ffn_mod):
    c = ffn_mod.FusedFFNCompute()
    bf = torch.bfloat16
    x = torch.zeros(256, 128, dtype=bf)
    acc = torch.zeros(256, 128)
    ready = torch.zeros(2, dtype=torch.int32)
    epoch = torch.zeros(1, dtype=torch.int32)
    mte = torch.zeros(2, dtype=torch.int32)
    w1 = torch.zeros(2, 128, 128, dtype=bf)
    w2 = torch.zeros(2, 128, 128, dtype=bf)
    with pytest.raises(ValueError, match="3-D"):
        c.grouped(x, w1[0], None, w2, acc, ready, epoch, mte)
    with pytest.raises(ValueError, match="experts"):
        c.grouped(x, w1, None, w2[:1], acc, ready, epoch, mte)
    with pytest.raises(ValueError, match="b1"):
        c.grouped(x, w1, torch.zeros(3, 128), w2, acc, ready, epoch, mte)
    with pytest.raises(ValueError, match="CUDA"):  # CPU tensors: refused before any launch
        c.grouped(x, w1, None, w2, acc, ready, epoch, mte)
