"""Compile-only checks (CUTE_DSL_ARCH=sm_90a, no GPU) of the grouped GEMM's up-projection
options (issue 39 item 2): wait_arrival (the A loads of a band wait for its arrival flag) and
swiglu (gate / up halves of one tile paired in the epilogue)."""
import os
import re

import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.compile
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


def _ptx(**kw):
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    return GroupedGemm(signal=False, **kw).compile(N=1024, K=512, keep_ptx=True).__ptx__


def _first(pattern, text):
    m = re.search(pattern, text, re.M)
    assert m, pattern
    return m.start()


def test_arrival_wait_gpu_scope_precedes_first_a_load_and_swiglu_epilogue():
    ptx = _ptx(wait_arrival=True, swiglu=True, cluster_n=1)
    # the default scope: the expand kernel runs on this GPU
    assert "ld.acquire.gpu.global.s32" in ptx and "ld.acquire.sys.global.s32" not in ptx
    acq = _first(r"ld\.acquire\.gpu\.global\.s32", ptx)
    fence = _first(r"fence\.proxy\.async\.global;", ptx)
    # the first TMA load (A is the first one issued per k tile, a 2-D tensor map)
    load = _first(r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)
    a_load = _first(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx)
    assert acq < fence < load == a_load
    assert "%globaltimer" in ptx[:load]  # the wait is bounded
    # SwiGLU: one silu (one ex2) per gate value of a thread's accumulator: 128 x 256 tile, two
    # consumer warpgroups -> 128 fp32 per thread, half of them gate
    assert len(re.findall(r"ex2\.approx", ptx)) == 128 * 256 // 256 // 2
    # y is half as wide: the output tensor map's tile is written with 32-column sub-tiles still
    assert "cp.async.bulk.tensor.2d.global.shared::cta" in ptx


def test_arrival_wait_sys_scope_with_clusters():
    ptx = _ptx(wait_arrival=True, arrival_scope="sys", cluster_n=2)
    assert "ld.acquire.sys.global.s32" in ptx and "ld.acquire.gpu.global.s32" not in ptx
    acq = _first(r"ld\.acquire\.sys\.global\.s32", ptx)
    assert acq < _first(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global|"
                        r"cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global", ptx)
    assert "ex2.approx" not in ptx  # no activation without swiglu


def test_options_refused():
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    with pytest.raises(ValueError, match="signal=False"):
        GroupedGemm(wait_arrival=True)
    with pytest.raises(ValueError, match="arrival_scope"):
        GroupedGemm(signal=False, wait_arrival=True, arrival_scope="cta")
    with pytest.raises(ValueError, match="epi_n"):
        GroupedGemm(tile_n=64, epi_n=64, swiglu=True)
