"""Compile-only checks of the communication kernels for sm_90a (no GPU needed).

Skipped where CuTe DSL is not installed. Checks that the consumer (both transports) and the fused
wait + scale kernel compile, and that the PTX carries the memory-ordering instructions the design
relies on (acquire loads on the band flags, sys-scope release on the arrival counters, 16-byte
vectors, bounded waits on %globaltimer).
"""
import os

import pytest

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")


def _ptx(launch, *args):
    import cutlass.cute as cute
    c = cute.compile[cute.KeepPTX()](launch, *args)
    return c.__ptx__


def _consumer_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0), Int32(0)] + [Int64(0)] * 22 + [Int32(1), Int32(1),
                                                               cuda.CUstream(0)]


@pytest.mark.parametrize("unroll", [1, 4, 8])
def test_consumer_nvlink_compiles_with_ordering(unroll):
    from moe_overlap.kernels.consumer import build_consumer
    ptx = _ptx(build_consumer("nvlink", threads=512, unroll=unroll), *_consumer_args())
    assert "ld.acquire.gpu.global.s32" in ptx  # band flag wait
    assert "red.release.sys.global.add.u64" in ptx  # arrival signal on the peer's counter
    assert "fence.acq_rel.sys" in ptx
    assert "%globaltimer" in ptx  # bounded wait
    assert ptx.count("ld.global.cg.v4.u32") >= unroll  # 16-byte loads, unroll in flight
    assert "st.global.v4.u32" in ptx
    assert "bar.red.or.pred" in ptx
    assert ".local" not in ptx.split(".entry", 1)[1]  # no stack arrays


def test_consumer_nvshmem_compiles():
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed")
    import nvshmem.core
    try:
        nvshmem.core.find_device_bitcode_library(arch="90")
    except Exception as e:  # pragma: no cover
        pytest.skip(f"no NVSHMEM sm_90 device bitcode: {e}")
    from moe_overlap.kernels.consumer import compile_consumer
    assert compile_consumer("nvshmem") is not None


@pytest.mark.parametrize("topk", [1, 2, 8])
def test_scale_compiles(topk):
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from moe_overlap.kernels.scale import build_scale
    args = [Int64(0)] * 4 + [Int32(1), Int32(1), Int64(0), Int64(0), Int64(0), Int32(1),
                             Int32(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(1),
                             cuda.CUstream(0)]
    ptx = _ptx(build_scale(topk), *args)
    assert "ld.acquire.sys.global.s64" in ptx  # arrival counter wait
    assert "cvt.rn.bf16x2.f32" in ptx
    assert ptx.count("ld.global.cg.v4.u32") >= topk


def test_bad_options_raise_before_compiling():
    from moe_overlap.kernels.consumer import build_consumer
    from moe_overlap.kernels.scale import build_scale
    with pytest.raises(ValueError, match="transport"):
        build_consumer("carrier-pigeon")
    with pytest.raises(ValueError, match="threads"):
        build_consumer("nvlink", threads=100)
    with pytest.raises(ValueError, match="unroll"):
        build_consumer("nvlink", unroll=0)
    with pytest.raises(ValueError, match="topk"):
        build_scale(0)


def test_launch_cache_reuses_packed_args(monkeypatch):
    from moe_overlap.kernels.primitives import LaunchCache

    class Fake:
        def __init__(self):
            self.packs, self.runs, self.calls = 0, [], 0

        def generate_execution_args(self, *args):
            self.packs += 1
            return ([a for a in args[:-1]], None)

        def run_compiled_program(self, exe):
            self.runs.append(list(exe))

        def __call__(self, *args):
            self.calls += 1

    f = Fake()
    monkeypatch.setenv("MOE_OVERLAP_FAST_LAUNCH", "0")
    LaunchCache(f)((1, 2), 0)
    assert f.calls == 1 and f.packs == 0
    monkeypatch.setenv("MOE_OVERLAP_FAST_LAUNCH", "1")
    lc = LaunchCache(f)
    lc((1, 2), 0)
    lc((1, 2), 0)
    lc((1, 3), 0)
    assert f.packs == 2 and f.runs == [[1, 2], [1, 2], [1, 3]]
