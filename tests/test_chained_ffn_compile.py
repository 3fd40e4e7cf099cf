"""Compile-only checks of the chained FFN compute kernel for sm_90a (no GPU needed), its option and
argument checks, and its memory accounting.

CUTE_DSL_ARCH=sm_90a makes cute.compile target sm_90a without a GPU. The PTX must show what the
design relies on (moe_overlap/ffn/compute_chained.py): 64 x 256 bf16 WGMMAs with MN-major weights;
both cross-CTA waits as ld.acquire.gpu spins followed by fence.proxy.async.global before the
async-proxy accesses they guard; the counter increments as release (gpu scope) RMWs, each after
``cp.async.bulk.wait_group 0`` (writes performed, not only read from shared memory) and a proxy
fence; the band flag as st.release.gpu; the tile counter as a gpu-scope atomic. The SASS must have
no local-memory spills.
"""
import os
import re

import pytest
import torch

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


def _compiled(mod, P, hidden, N, act1, has_b1, **opts):
    key = (P, hidden, N, act1, has_b1, tuple(sorted(opts.items())))
    if key not in _CACHE:
        fn = mod.ChainedFFNCompute(**opts).compile(P, hidden, N, act1=act1, has_b1=has_b1,
                                                   keep_ptx=True)
        _CACHE[key] = (kept_ptx(fn), kept_cubin(fn))
    return _CACHE[key]


def _lines(ptx):
    return [ln.strip() for ln in ptx.split(".entry", 1)[1].splitlines()]


def _idx(lines, pattern):
    return [i for i, ln in enumerate(lines) if re.search(pattern, ln)]


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS)
def test_ptx_mma_waits_and_release_order(mod, P, hidden, N, act1, has_b1):
    ptx, _ = _compiled(mod, P, hidden, N, act1, has_b1)
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


def test_skip_slot_wait_switch_removes_one_wait(mod):
    """The private test switch must remove exactly the slot wait (the GPU test relies on it)."""
    ptx, _ = _compiled(mod, 256, 512, 512, "gelu", True)
    ptx_skip, _ = _compiled(mod, 256, 512, 512, "gelu", True, _test_skip_slot_wait=True)
    n = len(_idx(_lines(ptx), r"atom\.relaxed\.gpu\.global\.cas\.b64"))
    n_skip = len(_idx(_lines(ptx_skip), r"atom\.relaxed\.gpu\.global\.cas\.b64"))
    assert n == 2 and n_skip == 1, (n, n_skip)  # one error record per bounded wait


@pytest.mark.parametrize("P,hidden,N,act1,has_b1", CONFIGS[:2])
def test_sass_no_spills(mod, P, hidden, N, act1, has_b1):
    _, cubin = _compiled(mod, P, hidden, N, act1, has_b1)
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
    bf = dict(dtype=torch.bfloat16)
    x, w1, w2 = torch.zeros(M, P, **bf), torch.zeros(P, hidden, **bf), torch.zeros(hidden, N, **bf)
    s = c.schedule(M, P, hidden, N, grid=c.grid(M, hidden, N, sms=132))
    ring = torch.zeros(c.ring_rows(M, P, hidden, N, s.grid), hidden, **bf)
    out = torch.zeros(M, N, **bf)
    i32 = dict(dtype=torch.int32)
    args, ints = c._cute_args(x, w1, torch.zeros(hidden), w2, ring, out,
                              s.tile_table().reshape(-1).contiguous(),
                              torch.zeros(1 + 2 * s.blocks, **i32), torch.zeros(s.blocks, **i32),
                              torch.ones(1, **i32), torch.zeros(8, dtype=torch.int64), s.blocks,
                              s.ring, s.grid)
    fn = c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", True)
    assert fn is c._compiled_for(args, ints, make_fake_stream(), P, hidden, N, "relu", True)
