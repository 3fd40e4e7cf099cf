"""Compile-only checks of the chained FFN compute kernel for sm_90a (no GPU needed), its option and
argument checks, and its memory accounting.

CUTE_DSL_ARCH=sm_90a makes cute.compile target sm_90a without a GPU. The PTX must show what the
design relies on (moe_overlap/ffn/compute_chained.py): 64 x 256 bf16 WGMMAs with MN-major weights;
both cross-CTA waits as ld.acquire.gpu spins followed by fence.proxy.async.global before the
async-proxy accesses they guard; the counter increments as release (gpu scope) RMWs, each after
``cp.async.bulk.wait_group 0`` (writes performed, not only read from shared memory) and a proxy
fence; the band flag as st.release.gpu; the tile counter as a gpu-scope atomic. The SASS must have
no local-memory spills. The grouped kernel (``grouped=True``, ChainedFFNCompute.grouped) must
keep all of that and load its weights with 3-D TMA (the expert as the last coordinate), with one
more error record (the expert range check).
"""
import os
import re

import pytest
import torch

from conftest import chained_launch_args
from moe_overlap.kernels.compile import kept_cubin, kept_ptx, require_nvdisasm, sass_of

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.compile

_CACHE = {}
CONFIGS = [  # (P, hidden, N, act1, b1 given)
    (256, 512, 512, "gelu", True),
    (4096, 7168, 4096, "silu", False),
    (512, 1024, 768, "none", True),
]


@pytest.fixture(scope="module")
def mod():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import cutlass.cute  # noqa: F401  (installed but broken: an error, not a skip)
    from moe_overlap.ffn import compute_chained
    return compute_chained


def _compiled(mod, P, hidden, N, act1, has_b1, grouped=False, b1_dtype=torch.float32, **opts):
    key = (P, hidden, N, act1, has_b1, grouped, b1_dtype, tuple(sorted(opts.items())))
    if key not in _CACHE:
        fn = mod.ChainedFFNCompute(**opts).compile(P, hidden, N, act1=act1, has_b1=has_b1,
                                                   keep_ptx=True, grouped=grouped,
                                                   b1_dtype=b1_dtype)
        _CACHE[key] = (kept_ptx(fn), kept_cubin(fn))
    return _CACHE[key]


def _lines(ptx):
    return [ln.strip() for ln in ptx.split(".entry", 1)[1].splitlines()]


def _idx(lines, pattern):
    return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS)
def test_ptx_mma_waits_and_release_order(mod, P, hidden, N, act1, has_b1):
    ptx, _ = _compiled(mod, P, hidden, N, act1, has_b1)
    _check_protocol(ptx)


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS[:2])
def test_grouped_ptx_keeps_the_protocol(mod, P, hidden, N, act1, has_b1):
    """The grouped kernel: the dense kernel's MMA, waits, fences and releases, weights through
    3-D TMA loads (x and the H ring stay 2-D), and three error records (the two waits and the
    TMA warp's expert range check)."""
    ptx, _ = _compiled(mod, P, hidden, N, act1, has_b1, grouped=True)
    _check_protocol(ptx)
    body = "\n".join(_lines(ptx))
    loads3 = re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", body)
    loads2 = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", body)
    assert loads3 and loads2, (len(loads3), len(loads2))
    dense, _ = _compiled(mod, P, hidden, N, act1, has_b1)
    dbody = "\n".join(_lines(dense))
    assert not re.findall(r"cp\.async\.bulk\.tensor\.3d", dbody)
    # the dense kernel's 2-D weight loads became the 3-D ones: as many TMA loads in all
    assert len(loads3) + len(loads2) == len(re.findall(
        r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", dbody))
    n = len(_idx(_lines(ptx), r"atom\.relaxed\.gpu\.global\.cas\.b64"))
    assert n == 3, f"expected 3 error records (two waits, the expert check), got {n}"


def _check_protocol(ptx):
    lines = _lines(ptx)
    body = "\n".join(lines)
    # WGMMA 64 x 256 x 16, A (x / H ring) K-major from smem, B (weights) transposed = MN-major
    mma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16\.f32\.bf16\.bf16 "
                     r"\{[^}]*\}, %rd\d+, %rd\d+, p, 1,\s*1, 0, 1;", body)
    assert len(mma) >= 4, f"expected >= 4 m64n256k16 WGMMAs (one 64-wide k tile), got {len(mma)}"

    # the tile counter: gpu-scope atomics (relaxed: it only hands out list positions; the fetch
    # is inlined before and inside the tile loop), and no atomic without an explicit scope
    assert len(_idx(lines, r"atom\.relaxed\.gpu\.global\.add\.s32")) >= 1
    assert not _idx(lines, r"atom\.global\.")

    # both bounded waits (slot free, block complete): acquire loads at gpu scope, each spin
    # followed by a proxy fence before the next bulk (TMA) instruction
    acq = _idx(lines, r"ld\.acquire\.gpu\.global\.s32")
    assert len(acq) >= 2, "expected the two cross-CTA waits as ld.acquire.gpu spins"
    assert not _idx(lines, r"ld\.relaxed\.gpu\.global\.s32|ld\.volatile\.global\.s32")
    fences = _idx(lines, r"^fence\.proxy\.async\.global;")
    bulk = _idx(lines, r"^cp\.async\.bulk\.tensor")
    waits = []  # last acquire load of each spin (spins are separated by a proxy fence)
    for f in fences:
        before = [a for a in acq if a < f]
        if before and not any(before[-1] < g < f for g in fences if g != f):
            waits.append((before[-1], f))
    guarded = 0
    for a, f in waits:
        nxt = [b for b in bulk if b > a]
        if nxt and f < nxt[0]:
            guarded += 1
    assert guarded >= 2, (f"each acquire spin must be followed by fence.proxy.async.global "
                          f"before the TMA it guards; found {guarded} of 2 (acquire lines {acq}, "
                          f"fences {fences})")

    # counter increments: release at gpu scope, after wait_group 0 + proxy fence
    rel = _idx(lines, r"red\.release\.gpu\.global\.add\.s32|atom\.acq_rel\.gpu\.global\.add\.s32")
    assert len(_idx(lines, r"red\.release\.gpu\.global\.add\.s32")) == 1  # g1_done
    assert len(_idx(lines, r"atom\.acq_rel\.gpu\.global\.add\.s32")) == 1  # g2_done
    bulk_waits = _idx(lines, r"^cp\.async\.bulk\.wait_group")
    for r in rel:
        w = [i for i in bulk_waits if i < r]
        assert w, f"no cp.async.bulk.wait_group before the release at line {r}"
        assert re.match(r"cp\.async\.bulk\.wait_group\s+0;", lines[w[-1]]), (
            f"the bulk wait before the release at line {r} is {lines[w[-1]]!r}, not "
            f"'cp.async.bulk.wait_group 0' (the writes must be performed, not only read)")
        assert any(w[-1] < f < r for f in fences), \
            f"no fence.proxy.async.global between the bulk wait and the release at line {r}"
    # the band flag
    flags = _idx(lines, r"st\.release\.gpu\.global\.(b|s|u)32")
    assert len(flags) == 1 and flags[0] > max(_idx(lines, r"atom\.acq_rel\.gpu")), \
        "band_ready must be stored with st.release.gpu after the g2_done RMW"
    # H and out through TMA stores, operands through TMA loads
    assert re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta\.bulk_group", body) or \
        re.search(r"cp\.async\.bulk\.tensor\.2d\.global\.shared::cta", body)
    assert "stmatrix.sync.aligned" in body


@pytest.mark.parametrize("grouped", [False, True])
def test_bf16_b1_is_read_as_it_is(mod, grouped):
    """A bf16 b1 (the layers' and the baseline's bias) is read in bf16 and widened in registers,
    with no per-call fp32 copy: 16-bit loads, each converted to fp32, where the fp32 kernel
    has 32-bit loads and no conversion; the protocol and the no-spill property are kept."""
    P, hidden, N = 256, 512, 512
    p32, _ = _compiled(mod, P, hidden, N, "gelu", True, grouped=grouped)
    p16, cubin = _compiled(mod, P, hidden, N, "gelu", True, grouped=grouped,
                           b1_dtype=torch.bfloat16)
    _check_protocol(p16)
    b16 = lambda p: len(re.findall(r"ld\.global\.b16", p))
    b32 = lambda p: len(re.findall(r"ld\.global\.b32", p))
    cvt = lambda p: len(re.findall(r"cvt\.f32\.bf16", p))
    assert b16(p32) == 0 and cvt(p32) == 0
    assert b16(p16) > 0 and cvt(p16) == b16(p16)
    assert b32(p32) - b32(p16) == b16(p16)  # the bias loads, and only they, narrowed
    sass = sass_of(cubin, require_nvdisasm())
    assert not re.findall(r"\b(STL|LDL)\b", sass)
    # any other float dtype is read through its fp32 copy: the same kernel as fp32's
    assert mod.b1_read_dtype(torch.float16) == torch.float32
    assert mod.b1_read_dtype(torch.bfloat16) == torch.bfloat16


def test_skip_slot_wait_switch_removes_one_wait(mod):
    """The private test switch must remove exactly the slot wait (the GPU test relies on it)."""
    ptx, _ = _compiled(mod, 256, 512, 512, "gelu", True)
    ptx_skip, _ = _compiled(mod, 256, 512, 512, "gelu", True, _test_skip_slot_wait=True)
    n = len(_idx(_lines(ptx), r"atom\.relaxed\.gpu\.global\.cas\.b64"))
    n_skip = len(_idx(_lines(ptx_skip), r"atom\.relaxed\.gpu\.global\.cas\.b64"))
    assert n == 2 and n_skip == 1, (n, n_skip)  # one error record per bounded wait


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS[:2])
def test_sass_no_spills(mod, P, hidden, N, act1, has_b1, grouped):
    _, cubin = _compiled(mod, P, hidden, N, act1, has_b1, grouped=grouped)
    sass = sass_of(cubin, require_nvdisasm())
    assert re.search(r"\bHGMMA\.64x256x16", sass), "no 64x256 HGMMA in the SASS"
    spills = re.findall(r"\b(STL|LDL)\b", sass)
    assert not spills, f"{len(spills)} local-memory spill instructions"


# ------------------------------------------------------------------ host-side checks (no GPU)
def test_options_and_shapes():
    from moe_overlap.ffn.compute_chained import ChainedFFNCompute as C
    assert C.can_implement(4096, 7168, 4096, "gelu")
    assert C.can_implement(7168, 1024, 7168, "none")
    assert not C.can_implement(4096, 7000, 4096)  # hidden % 256
    assert not C.can_implement(4100, 7168, 4096)  # P % 64
    assert not C.can_implement(4096, 7168, 4000)  # N % 256
    assert not C.can_implement(4096, 7168, 4096, "tanh")
    assert not C.can_implement(4096, 7168, 4096, tile_m=64)
    assert not C.can_implement(4096, 7168, 4096, stages=9)
    with pytest.raises(ValueError, match="tile_h and tile_n"):
        C(tile_n=128)
    with pytest.raises(ValueError, match="stages"):
        C(stages=1)
    with pytest.raises(ValueError, match="_test_ring"):
        C(_test_ring=0)
    assert C().stages == 4  # 4 x 48 KiB operand stages + 32 KiB epilogue buffers


def test_argument_checks_before_launch():
    from moe_overlap.ffn.compute_chained import ChainedFFNCompute
    c = ChainedFFNCompute()
    bf = dict(dtype=torch.bfloat16)
    x, w1, w2 = torch.zeros(100, 256, **bf), torch.zeros(256, 512, **bf), torch.zeros(512, 256, **bf)
    assert c.check_args(x, w1, None, w2, None, None, None, "gelu", 0, need_cuda=False) == \
        (100, 256, 512, 256)
    with pytest.raises(ValueError, match="CUDA"):
        c.check_args(x, w1, None, w2, None, None, None, "gelu", 0)
    with pytest.raises(ValueError, match="hidden mismatch"):
        c.check_args(x, w1, None, torch.zeros(256, 256, **bf), None, None, None, "gelu", 0,
                     need_cuda=False)
    with pytest.raises(TypeError, match="bfloat16"):
        c.check_args(x.float(), w1, None, w2, None, None, None, "gelu", 0, need_cuda=False)
    with pytest.raises(ValueError, match="b1 must be"):
        c.check_args(x, w1, torch.zeros(3), w2, None, None, None, "gelu", 0, need_cuda=False)
    with pytest.raises(ValueError, match="band_ready"):
        c.check_args(x, w1, None, w2, None, torch.zeros(0, dtype=torch.int32),
                     torch.zeros(1, dtype=torch.int32), "gelu", 0, need_cuda=False)
    with pytest.raises(ValueError, match="both band_ready and epoch"):
        c.check_args(x, w1, None, w2, None, torch.zeros(1, dtype=torch.int32), None, "gelu", 0,
                     need_cuda=False)
    with pytest.raises(ValueError, match="act1"):
        c.check_args(x, w1, None, w2, None, None, None, "tanh", 0, need_cuda=False)
    with pytest.raises(ValueError, match="ccta"):
        c.check_args(x, w1, None, w2, None, None, None, "gelu", -1, need_cuda=False)


def test_ring_bytes_is_the_schedule_ring():
    from moe_overlap.ffn.chained_schedule import derive
    from moe_overlap.ffn.compute_chained import ChainedFFNCompute
    c = ChainedFFNCompute(group=1)  # derive's order (auto: tests/test_chained_auto_group_cpu.py)
    for M, P, hidden, N in ((8192, 4096, 7168, 4096), (100, 7168, 1024, 7168),
                            (32768, 8192, 14336, 8192)):
        s = derive(M, hidden, N, grid=132, inputs=P)
        assert c.ring_bytes(M, P, hidden, N, grid=132) == s.ring_bytes
        assert c.ring_rows(M, P, hidden, N, grid=132) * hidden * 2 == s.ring_bytes
    # llama3-8b slice at 8192 tokens: the ring (11 blocks) is far smaller than H [T, hidden]
    assert c.ring_bytes(8192, 4096, 7168, 4096) == 11 * 128 * 7168 * 2
    assert c.grid(1, 256, 256, sms=132) == 2  # capped at the number of tiles
    with pytest.raises(ValueError, match="ccta"):
        c.grid(8192, 7168, 4096, sms=132, ccta=132)


def test_launch_path_compiles_from_torch_tensors(mod):
    """The argument conversion of __call__ (DLPack views: weights as MN-major transposes, dynamic
    M / table / ring / flags) compiles on CPU tensors: the GPU run does not meet it first."""
    from cutlass.runtime import make_fake_stream
    c = mod.ChainedFFNCompute()
    M, P, hidden, N = 300, 256, 512, 512
    s = c.schedule(M, P, hidden, N, grid=c.grid(M, hidden, N, sms=132))
    args, ints = chained_launch_args(c, s, M, P, hidden, N)
    fn = c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", True)
    assert fn is c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", True)
    # a bf16 b1 (read as it is): its own kernel
    args16, ints16 = chained_launch_args(c, s, M, P, hidden, N, b1_dtype=torch.bfloat16)
    fn16 = c._compiled_for(args16, ints16, make_fake_stream(), P, hidden, N, "relu", True,
                           b1_dtype=torch.bfloat16)
    assert fn16 is not fn


def test_grouped_launch_path_compiles_from_torch_tensors(mod):
    """grouped(): w1 [E, P, hidden] / w2 [E, hidden, N] as (hidden, P, E) / (N, hidden, E) DLPack
    views with E dynamic, b1 [E, hidden] (or the [1, hidden] zero stub), the table with the
    blocks' experts after its tile rows."""
    from cutlass.runtime import make_fake_stream
    c = mod.ChainedFFNCompute()
    M, P, hidden, N, E = 300, 256, 512, 512, 3
    bf = dict(dtype=torch.bfloat16)
    x = torch.zeros(M, P, **bf)
    w1, w2 = torch.zeros(E, P, hidden, **bf), torch.zeros(E, hidden, N, **bf)
    s = c.schedule(M, P, hidden, N, grid=c.grid(M, hidden, N, sms=132))
    table = c._table(s, torch.device("cpu"), grouped=True)
    assert table.numel() == 3 * len(s.tiles()) + s.blocks
    assert torch.equal(table[:3 * len(s.tiles())], s.tile_table().reshape(-1))
    ring = torch.zeros(c.ring_rows(M, P, hidden, N, s.grid), hidden, **bf)
    i32 = dict(dtype=torch.int32)
    for b1f, has_b1 in ((torch.zeros(E, hidden), True), (torch.zeros(1, hidden), False)):
        args, ints = c._cute_args(x, w1, b1f, w2, ring, torch.zeros(M, N, **bf), table,
                                  torch.zeros(1 + 2 * s.blocks, **i32),
                                  torch.zeros(s.blocks, **i32), torch.ones(1, **i32),
                                  torch.zeros(8, dtype=torch.int64), s.blocks, s.ring, s.grid,
                                  grouped=True, num_tiles=len(s.tiles()))
        fn = c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", has_b1,
                             grouped=True)
        assert fn is c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu",
                                     has_b1, grouped=True)
        assert fn is not c._compiled.get(("dlpack",) + c._key(P, hidden, N, "relu", has_b1))


def test_grouped_argument_checks_before_launch():
    from moe_overlap.ffn.compute_chained import ChainedFFNCompute
    c = ChainedFFNCompute()
    bf = dict(dtype=torch.bfloat16)
    E, M, P, hidden, N = 3, 300, 256, 512, 256
    x = torch.zeros(M, P, **bf)
    w1, w2 = torch.zeros(E, P, hidden, **bf), torch.zeros(E, hidden, N, **bf)
    b1 = torch.zeros(E, hidden)
    be = torch.tensor([0, 2, 1], dtype=torch.int32)

    def chk(x=x, w1=w1, b1=b1, w2=w2, be=be, out=None):
        return c.check_grouped_args(x, w1, b1, w2, out, None, None, be, "gelu", 0,
                                    need_cuda=False)

    assert chk() == (M, P, hidden, N, E)
    assert chk(b1=None) == (M, P, hidden, N, E)
    with pytest.raises(ValueError, match="w1 must be a 3-D tensor"):
        chk(w1=w1[0])
    with pytest.raises(ValueError, match="w1 has 3 experts, w2 2"):
        chk(w2=w2[:2].contiguous())
    with pytest.raises(ValueError, match="b1 must be \\[E=3, hidden\\]"):
        chk(b1=torch.zeros(hidden))
    with pytest.raises(ValueError, match="b1 must be"):
        chk(b1=torch.zeros(E, hidden + 1))
    with pytest.raises(ValueError, match="hidden mismatch"):
        chk(w2=torch.zeros(E, 256, N, **bf))
    with pytest.raises(ValueError, match="w1 must be contiguous"):
        chk(w1=torch.zeros(E, hidden, P, **bf).transpose(1, 2))
    with pytest.raises(TypeError, match="block_expert must be int32"):
        chk(be=be.long())
    with pytest.raises(TypeError, match="block_expert must be an int32 tensor"):
        chk(be=[0, 1, 2])
    with pytest.raises(ValueError, match=">= ceil\\(M / tile_m\\) = 3"):
        chk(be=be[:2])
    with pytest.raises(ValueError, match="block_expert must be 1-D"):
        chk(be=be.view(1, 3))
    with pytest.raises(ValueError, match="out must be"):
        chk(out=torch.zeros(M, N + 1, **bf))
    with pytest.raises(ValueError, match="CUDA"):
        c.check_grouped_args(x, w1, b1, w2, None, None, None, be, "gelu", 0)
    with pytest.raises(TypeError, match="needs block_expert"):
        c.grouped(x, w1, b1, w2)
    # the host range check (check_experts=True) names the first bad block
    c.check_block_experts(be, E, 3)
    c.check_block_experts(torch.tensor([0, 2, 1, 7], dtype=torch.int32), E, 3)  # past blocks
    with pytest.raises(ValueError, match="row block 1 names expert 3"):
        c.check_block_experts(torch.tensor([0, 3, 1], dtype=torch.int32), E, 3)
    with pytest.raises(ValueError, match="row block 0 names expert -1"):
        c.check_block_experts(torch.tensor([-1, 0, 1], dtype=torch.int32), E, 3)


def test_grouped_reference_is_the_per_block_reference():
    from moe_overlap.ffn.compute_chained import (chained_ffn_grouped_reference,
                                                 chained_ffn_reference)
    g = torch.Generator().manual_seed(3)
    E, M, P, hidden, N = 3, 300, 64, 256, 256
    x = torch.randn(M, P, generator=g).to(torch.bfloat16)
    w1 = (torch.randn(E, P, hidden, generator=g) / 8).to(torch.bfloat16)
    b1 = torch.randn(E, hidden, generator=g)
    w2 = (torch.randn(E, hidden, N, generator=g) / 16).to(torch.bfloat16)
    be = torch.tensor([2, 0, 2], dtype=torch.int32)
    for bias in (b1, None):
        y = chained_ffn_grouped_reference(x, w1, bias, w2, be, "silu")
        for blk, e in enumerate((2, 0, 2)):
            r0, r1 = blk * 128, min(M, blk * 128 + 128)
            want = chained_ffn_reference(x[r0:r1], w1[e], None if bias is None else bias[e],
                                         w2[e], "silu")
            assert torch.equal(y[r0:r1], want), blk
    # a different expert for a block changes exactly that block
    y2 = chained_ffn_grouped_reference(x, w1, b1, w2, torch.tensor([2, 1, 2],
                                                                   dtype=torch.int32), "silu")
    y1 = chained_ffn_grouped_reference(x, w1, b1, w2, be, "silu")
    assert torch.equal(y1[:128], y2[:128]) and torch.equal(y1[256:], y2[256:])
    assert not torch.equal(y1[128:256], y2[128:256])
    with pytest.raises(ValueError, match="block_expert has 2 entries"):
        chained_ffn_grouped_reference(x, w1, b1, w2, be[:2], "silu")


def test_describe_expert_range_error():
    from moe_overlap.ffn.chained_schedule import ERR_EXPERT_RANGE
    from moe_overlap.ffn.compute_chained import describe_chained_error
    msg = describe_chained_error([ERR_EXPERT_RANGE, 0, 17, 4, 9, 3, 0, 0])
    assert "row block 4 (tile at list position 17)" in msg and "expert 9, outside [0, 3)" in msg
