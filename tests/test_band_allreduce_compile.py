"""Compile-only checks of the band all-reduce (communication blocks of the fused FFN) for sm_90a.

Both backends compile for G = 2, 4, 8; the PTX carries the operations the design relies on and the
SASS (nvdisasm) shows them assembled: on sm_90a ``multimem.ld_reduce`` is the multicast-only opcode
``LDGMC`` (``LDGMC.E.ADD.F32x4.RN.STRONG.SYS``; bf16x2 with fp32 accumulation:
``LDGMC.E.F32ADD.BF16x8.RN.STRONG.SYS``), while ``multimem.st`` / ``multimem.red`` assemble to the
ordinary ``STG.E.128.STRONG.SYS`` / ``MEMBAR.ALL.SYS`` + ``REDG.E.ADD.STRONG.SYS`` (the multicast
is in the address), so those are checked in the PTX. The unicast kernel must contain no multimem
instruction and no LDGMC. Skipped without CuTe DSL; with it, a missing PTX, cubin or nvdisasm (a dev dependency) fails."""
import os
import re

import pytest

pytestmark = pytest.mark.compile

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from moe_overlap.ffn import band_allreduce  # noqa: E402
from moe_overlap.kernels.compile import compile_keep, kept_cubin, kept_ptx  # noqa: E402
from conftest import sass as _sass  # noqa: E402

_CACHE = {}


def _compiled(world, backend, act2="none", unroll=2):
    key = (world, backend, act2, unroll)
    if key not in _CACHE:
        c = band_allreduce.compile_band_allreduce(world, backend, act2, unroll=unroll, keep=True)
        _CACHE[key] = (kept_ptx(c), kept_cubin(c))
    return _CACHE[key]


def _body(ptx):
    return ptx.split(".entry", 1)[1]


@pytest.mark.parametrize("world", [2, 4, 8])
def test_switch_backend_ptx(world):
    ptx, cubin = _compiled(world, "switch")
    body = _body(ptx)
    assert "multimem.ld_reduce.relaxed.sys.global.add.v4.f32" in body
    assert "multimem.st.relaxed.sys.global.v4.f32" in body
    # arrive (step 1, and the next band's tried ahead), done
    assert body.count("multimem.red.release.sys.global.add.u32") == 3
    assert "ld.relaxed.sys.global.v4.f32" not in body  # no unicast peer loads
    assert "fence.proxy.alias" in body
    assert "ld.acquire.sys.global.s32" in body and "ld.acquire.gpu.global.s32" in body
    assert "%globaltimer" in body  # bounded waits
    assert ".local" not in body


@pytest.mark.parametrize("world", [2, 4, 8])
def test_switch_backend_sass(world):
    _, cubin = _compiled(world, "switch")
    sass = _sass(cubin)
    ldgmc = re.findall(r"LDGMC\.E\.ADD\.F32x4\.RN\.STRONG\.SYS", sass)
    assert len(ldgmc) >= 2, sass  # unrolled main loop + tail
    assert "STG.E.128.STRONG.SYS" in sass  # multimem.st
    assert "REDG.E.ADD.STRONG.SYS" in sass and "MEMBAR.ALL.SYS" in sass  # multimem.red


@pytest.mark.parametrize("world", [2, 4, 8])
def test_unicast_backend_ptx(world):
    unroll = 2
    ptx, cubin = _compiled(world, "unicast", unroll=unroll)
    body = _body(ptx)
    assert "multimem" not in body
    # load-reduce from every peer: U * G loads in the unrolled loop + G in the tail
    assert body.count("ld.relaxed.sys.global.v4.f32") == world * (unroll + 1)
    assert body.count("st.relaxed.sys.global.v4.f32") == world * (unroll + 1)
    # on each peer: arrive (step 1, and the next band's tried ahead), done
    assert body.count("red.release.sys.global.add.u32") == 3 * world
    assert "fence.acq_rel.sys" in body and "%globaltimer" in body
    assert "cvt.rn.bf16x2.f32" in body
    assert ".local" not in body


def test_without_arrive_ahead_one_arrive_site_less():
    c = band_allreduce.compile_band_allreduce(2, "unicast", arrive_ahead=False, keep=True)
    body = _body(kept_ptx(c))
    assert body.count("red.release.sys.global.add.u32") == 2 * 2
    assert body.count("ld.relaxed.sys.global.v4.f32") == 2 * (band_allreduce.DEFAULT_UNROLL + 1)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_unicast_backend_sass(world):
    unroll = 2
    _, cubin = _compiled(world, "unicast", unroll=unroll)
    sass = _sass(cubin)
    assert "LDGMC" not in sass
    assert sass.count("LDG.E.128.STRONG.SYS") == world * (unroll + 1)
    assert "STG.E.128.STRONG.SYS" in sass and "REDG.E.ADD.STRONG.SYS" in sass


@pytest.mark.parametrize("act2,needle", [("relu", "max.f32"), ("silu", "ex2.approx"),
                                          ("gelu", None), ("gelu_tanh", "tanh.approx")])
def test_act2_variants_compile(act2, needle):
    ptx, _ = _compiled(2, "unicast", act2)
    if needle:
        assert needle in _body(ptx), act2


def test_bf16_load_reduce_helper_assembles_to_ldgmc():
    """The bf16x2 form (fp32 accumulation in the switch), for a bf16 accumulator variant."""
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    L = band_allreduce.device_lib()

    @cute.kernel
    def k(src: Int64, dst: Int64):
        t, _, _ = cute.arch.thread_idx()
        off = Int64(Int32(t)) * Int64(16)
        v = L.mm_ld_reduce_v4_bf16x2(src + off)
        cute.arch.inline_ptx("st.global.v4.u32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
                             read_only_args=[dst + off, v[0], v[1], v[2], v[3]])

    @cute.jit
    def launch(src: Int64, dst: Int64, stream: cuda.CUstream):
        k(src, dst).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

    c = compile_keep(launch, Int64(0), Int64(0), cuda.CUstream(0))
    assert "multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2" in kept_ptx(c)
    assert "LDGMC.E.F32ADD.BF16x8.RN.STRONG.SYS" in _sass(kept_cubin(c))


def test_bad_options_raise_before_compiling():
    with pytest.raises(ValueError, match="backend"):
        band_allreduce.build_band_allreduce(2, "carrier-pigeon")
    with pytest.raises(ValueError, match="world"):
        band_allreduce.build_band_allreduce(0)
    with pytest.raises(ValueError, match="act2"):
        band_allreduce.build_band_allreduce(2, act2="tanh")
    with pytest.raises(ValueError, match="threads"):
        band_allreduce.build_band_allreduce(2, threads=100)
    with pytest.raises(ValueError, match="unroll"):
        band_allreduce.build_band_allreduce(2, unroll=0)
