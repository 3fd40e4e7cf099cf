"""Compile-only checks (sm_90a, no GPU) of the band all-reduce's bf16-partial mode
(``partial="bf16"``, ffn/band_allreduce.py).

Unicast, G = 2, 4, 8 at the default threads / unroll (``default_threads_unroll``): the PTX carries
the operations the memory-ordering argument relies on (ld.acquire.gpu of band_ready, sys-scope
fence + red.release.sys of arrive / done on every peer, ld.acquire.sys of the counters,
ld.relaxed.sys loads and st.relaxed.sys stores of the 16-byte bf16 vectors, %globaltimer bounds),
the SASS has them assembled (LDG.E.128.STRONG.SYS / STG.E.128.STRONG.SYS, one per peer per vector)
and no local memory (no spill: every load in flight stays in registers), and the registers fit a
CTA per SM. Switch (compiled, refused at run time): the bf16x2 load-reduce is LDGMC in SASS. The
private broken-ordering switch drops the ready wait (the GPU test runs it)."""
import os

import pytest

pytestmark = pytest.mark.compile

# before cutlass is imported: it reads the target arch once (sm_100a otherwise, without a GPU)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.ffn import band_allreduce as B  # noqa: E402
from moe_overlap.kernels.compile import kept_cubin, kept_ptx  # noqa: E402
from moe_overlap.runtime.device import ctas_per_sm, cubin_resources  # noqa: E402
from conftest import ptx_body, sass  # noqa: E402

_CACHE = {}


def _compiled(world, backend="unicast", act2="none", **kw):
    threads, unroll = B.default_threads_unroll("bf16", world)
    threads, unroll = kw.pop("threads", threads), kw.pop("unroll", unroll)
    key = (world, backend, act2, threads, unroll, tuple(sorted(kw.items())))
    if key not in _CACHE:
        c = B.compile_band_allreduce(world, backend, act2, threads, unroll, keep=True,
                                     partial="bf16", **kw)
        _CACHE[key] = (ptx_body(kept_ptx(c)), kept_cubin(c), threads, unroll)
    return _CACHE[key]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_unicast_bf16_ptx(world):
    body, _, _, unroll = _compiled(world)
    assert "multimem" not in body
    # chunk loads from every rank's partial, final stores to every rank's buffer: G per vector,
    # unroll vectors in the main loop + one in the tail
    assert body.count("ld.relaxed.sys.global.v4.u32") == world * (unroll + 1)
    assert body.count("st.relaxed.sys.global.v4.u32") == world * (unroll + 1)
    assert "ld.relaxed.sys.global.v4.f32" not in body  # no fp32 accumulator traffic
    # arrive (step 1 and the one tried ahead), done: on every peer, release at sys scope
    assert body.count("red.release.sys.global.add.u32") == 3 * world
    assert "fence.acq_rel.sys" in body
    assert "ld.acquire.gpu.global.s32" in body  # band_ready (this GPU's producer)
    assert "ld.acquire.sys.global.s32" in body  # arrive / done (every rank)
    assert "%globaltimer" in body  # bounded waits
    assert "ld.global.cg.v4.u32" in body  # step 3 reads peers' stores through L2
    assert "cvt.rn.bf16x2.f32" in body
    assert ".local" not in body


@pytest.mark.parametrize("world", [2, 4, 8])
def test_unicast_bf16_sass_no_spill_and_resident(world):
    _, cubin, threads, unroll = _compiled(world, act2="silu")
    s = sass(cubin)
    assert "LDGMC" not in s
    assert s.count("LDG.E.128.STRONG.SYS") == world * (unroll + 1)
    assert s.count("STG.E.128.STRONG.SYS") == world * (unroll + 1)
    assert "REDG.E.ADD.STRONG.SYS" in s and "MEMBAR.ALL.SYS" in s
    assert "LDL" not in s and "STL" not in s, "local memory (register spills)"
    (regs, smem), = cubin_resources(cubin).values()
    assert ctas_per_sm(regs, threads, smem) >= 1, (regs, threads)


def test_too_much_unroll_spills():
    """The no-spill check can fail: 1024 threads (64 registers) x unroll 4 spill."""
    _, cubin, _, _ = _compiled(2, threads=1024, unroll=4)
    s = sass(cubin)
    assert "LDL" in s or "STL" in s


def test_switch_bf16_compiles_to_ldgmc():
    body, cubin, _, _ = _compiled(4, "switch", "gelu")
    assert "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2" in body
    assert "multimem.st.relaxed.sys.global.v4.f32" in body
    assert "fence.proxy.alias" in body
    assert "ld.relaxed.sys.global.v4.u32" not in body
    assert "LDGMC.E.F32ADD.BF16x8.RN.STRONG.SYS" in sass(cubin)


@pytest.mark.parametrize("act2,needle", [("relu", "max.f32"), ("silu", "ex2.approx"),
                                          ("gelu_tanh", "tanh.approx")])
def test_bf16_act2_variants(act2, needle):
    body, _, _, _ = _compiled(2, act2=act2)
    assert needle in body


def test_broken_ordering_switch_drops_only_the_ready_wait():
    good, _, _, _ = _compiled(2)
    bad, _, _, _ = _compiled(2, _test_skip_ready_wait=True)
    assert "ld.acquire.gpu.global.s32" in good and "ld.acquire.gpu.global.s32" not in bad
    assert bad.count("red.release.sys.global.add.u32") == good.count(
        "red.release.sys.global.add.u32")
    assert "ld.acquire.sys.global.s32" in bad  # the cross-GPU handshakes stay


def test_fp32_mode_unchanged_by_the_option():
    """partial="fp32" given explicitly is the same kernel as the default (the PTX fingerprint
    script compares the default against the previous commit)."""
    a = B.compile_band_allreduce(2, "unicast", "none", unroll=2, keep=True)
    b = B.compile_band_allreduce(2, "unicast", "none", unroll=2, keep=True, partial="fp32")
    assert ptx_body(kept_ptx(a)) == ptx_body(kept_ptx(b))


@pytest.mark.parametrize("world,backend", [(2, "unicast"), (1, "unicast"), (4, "switch")])
def test_b2_per_band_variant(world, backend):
    """b2 one row per ready flag (the grouped experts layer): a different kernel with the same
    memory operations as the shared-b2 one (only b2's address moves per band), no spills."""
    shared, _, _, _ = _compiled(world, backend)
    per_band, cubin, threads, _ = _compiled(world, backend, b2_per_band=True)
    assert per_band != shared
    for op in ("ld.relaxed.sys.global.v4.u32", "st.relaxed.sys.global.v4.u32",
               "red.release.sys.global.add.u32", "ld.acquire.gpu.global.s32",
               "ld.acquire.sys.global.s32", "ld.global.cg.v4.u32",
               "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2"):
        assert per_band.count(op) == shared.count(op), op
    s = sass(cubin)
    assert "LDL" not in s and "STL" not in s, "local memory (register spills)"
    (regs, smem), = cubin_resources(cubin).values()
    assert ctas_per_sm(regs, threads, smem) >= 1, (regs, threads)


def test_b2_per_band_needs_bf16():
    with pytest.raises(ValueError, match="b2_per_band needs partial='bf16'"):
        B.build_band_allreduce(2, b2_per_band=True)
