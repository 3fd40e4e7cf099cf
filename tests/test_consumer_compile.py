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

from conftest import compile_ptx as _ptx, compile_ptx_cubin as _compile_keep, sass as _sass  # noqa: E402
from conftest import nvshmem_calls, nvshmem_consumer_body  # noqa: E402


def _consumer_args():
    from moe_overlap.combine.consumer import consumer_example_args
    return consumer_example_args()


@pytest.mark.parametrize("unroll", [1, 4, 8])
def test_consumer_nvlink_compiles_with_ordering(unroll):
    from moe_overlap.combine.consumer import build_consumer
    ptx = _ptx(build_consumer("nvlink", threads=512, unroll=unroll), *_consumer_args())
    assert "ld.acquire.gpu.global.s32" in ptx  # band flag wait
    assert "red.release.sys.global.add.u64" in ptx  # arrival signal on the peer's counter
    assert "fence.acq_rel.sys" in ptx
    assert "%globaltimer" in ptx  # bounded wait
    assert ptx.count("ld.global.cg.v4.u32") >= unroll  # 16-byte loads, unroll in flight
    assert "st.global.v4.u32" in ptx
    assert "bar.red.or.pred" in ptx
    assert ".local" not in ptx.split(".entry", 1)[1]  # no stack arrays


@pytest.mark.parametrize("local_copy", [True, False])
def test_consumer_nvshmem_ships_through_put_signal_after_the_band_wait(local_copy):
    """nvshmem transport: the error word first, the band flags by a bounded acquire wait, the
    remote rows by NVSHMEM's put-with-signal (no peer stores or sys-scope counter adds of the
    nvlink path), then a quiet before the kernel ends; local bands by the 16-byte copy and a
    gpu-scope release on the own counter, only with local_copy."""
    body = nvshmem_consumer_body(local_copy=local_copy)
    calls = nvshmem_calls(body)
    assert [k for _, k in calls] == ["signal", "fence", "signal", "put", "quiet"]
    i_put = next(i for i, k in calls if k == "put")
    i_err = body.index("ld.relaxed.gpu.global.s64")
    assert i_err < calls[0][0]  # nothing reaches a peer before the error word is read
    assert i_err < body.index("ld.acquire.gpu.global.s32") < i_put  # band flags, then the put
    assert "%globaltimer" in body
    assert "red.release.sys.global" not in body
    assert ("red.release.gpu.global.add.u64" in body) == local_copy
    assert ("st.global.v4.u32" in body) == local_copy


@pytest.mark.parametrize("topk,y_src,unroll", [(1, False, 1), (2, False, 1), (8, False, 1),
                                                (2, True, 1), (8, True, 1), (4, True, 2),
                                                (4, False, 4)])
def test_scale_compiles(topk, y_src, unroll):
    from moe_overlap.combine.scale import build_scale, scale_example_args
    ptx = _ptx(build_scale(topk, y_src=y_src, unroll=unroll), *scale_example_args())
    assert "ld.acquire.sys.global.s64" in ptx  # arrival counter wait
    assert "cvt.rn.bf16x2.f32" in ptx
    assert ptx.count("ld.global.cg.v4.u32") >= topk * unroll  # every pair's loads issued
    assert ptx.count("st.global.v4") >= unroll
    assert ".local" not in ptx.split(".entry", 1)[1]


# ---- consumer v2: local_copy=False, copy="tma" ------------------------------------------------
@pytest.mark.parametrize("local_copy", [True, False])
def test_consumer_tma_compiles_with_bulk_copies(local_copy):
    from moe_overlap.combine.consumer import build_consumer
    ptx, cubin = _compile_keep(build_consumer("nvlink", copy="tma", local_copy=local_copy),
                               *_consumer_args())
    body = ptx.split(".entry", 1)[1]
    assert "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes" in body  # y -> smem
    assert "cp.async.bulk.global.shared::cta.bulk_group" in body  # smem -> peer
    assert "cp.async.bulk.commit_group" in body
    assert "cp.async.bulk.wait_group.read" in body  # stage reuse
    assert "cp.async.bulk.wait_group 0" in body  # writes complete before the release signal
    assert "mbarrier.try_wait.parity.shared::cta.b64" in body
    assert "mbarrier.arrive.expect_tx.shared::cta.b64" in body
    assert "fence.proxy.async.global" in body  # acquire -> async-proxy loads; stores -> release
    assert "ld.acquire.gpu.global.s32" in body and "red.release.sys.global.add.u64" in body
    assert "%globaltimer" in body
    assert "ld.global.cg.v4.u32" not in body  # no thread-copy fallback left in
    # band flag acquire (generic proxy), then a proxy fence, then the first bulk load of y
    i_acq = body.index("ld.acquire.gpu.global.s32")
    i_load = body.index("cp.async.bulk.shared::cluster.global", i_acq)
    assert "fence.proxy.async.global" in body[i_acq:i_load]
    # order inside the shipping path: wait_group 0, then the sys fence, then the remote signal
    i_wait = body.index("cp.async.bulk.wait_group 0")
    assert body.index("fence.acq_rel.sys", i_wait) < body.index("red.release.sys.global",
                                                                 i_wait)
    assert ("red.release.gpu.global.add.u64" in body) == local_copy  # own counter: local bands
    assert ".reqntid 32" in ptx
    sass = _sass(cubin)
    assert "UBLKCP.S.G" in sass and "UBLKCP.G.S" in sass, "no bulk copies in SASS"


def test_consumer_tma_small_ring_compiles():
    """The ring the GPU test uses to wrap mbarrier phases often: 3 x 4 KiB, lookahead 1."""
    from moe_overlap.combine.consumer import build_consumer
    ptx = _ptx(build_consumer("nvlink", copy="tma", stages=3, chunk_bytes=4096, lookahead=1),
               *_consumer_args())
    assert "cp.async.bulk.wait_group.read 2;" in ptx  # stages - lookahead groups may read
    assert ptx.count("mbarrier.init.shared::cta.b64") == 3


@pytest.mark.parametrize("copy", ["ldst"])
def test_consumer_no_local_copy_compiles(copy):
    from moe_overlap.combine.consumer import build_consumer
    ptx = _ptx(build_consumer("nvlink", local_copy=False, copy=copy), *_consumer_args())
    body = ptx.split(".entry", 1)[1]
    assert "red.release.gpu.global.add.u64" not in body  # no local-band signal
    assert "red.release.sys.global.add.u64" in body and "st.global.v4.u32" in body
    assert "cp.async.bulk" not in body


def test_consumer_v1_ptx_unchanged_by_default():
    """The default build is v1: thread copies, local bands copied, no bulk copies."""
    from moe_overlap.combine.consumer import build_consumer
    body = _ptx(build_consumer("nvlink"), *_consumer_args()).split(".entry", 1)[1]
    assert "cp.async.bulk" not in body and "mbarrier" not in body
    assert "red.release.gpu.global.add.u64" in body


def test_bad_options_raise_before_compiling():
    from moe_overlap.combine.consumer import build_consumer
    from moe_overlap.combine.scale import build_scale
    with pytest.raises(ValueError, match="transport"):
        build_consumer("carrier-pigeon")
    with pytest.raises(ValueError, match="threads"):
        build_consumer("nvlink", threads=100)
    with pytest.raises(ValueError, match="unroll"):
        build_consumer("nvlink", unroll=0)
    with pytest.raises(ValueError, match="topk"):
        build_scale(0)
    with pytest.raises(ValueError, match="unroll"):
        build_scale(4, unroll=3)
    from moe_overlap.combine.scale import Scale
    with pytest.raises(ValueError, match="ctas_per_sm"):
        Scale(4, threads=256, ctas_per_sm=9)  # 9 x 256 threads do not fit on one SM
    with pytest.raises(ValueError, match="copy"):
        build_consumer("nvlink", copy="dma")
    with pytest.raises(ValueError, match="tma"):
        build_consumer("nvshmem", copy="tma")
    with pytest.raises(ValueError, match="shared"):
        build_consumer("nvlink", copy="tma", stages=16, chunk_bytes=32768)
    with pytest.raises(ValueError, match="lookahead"):
        build_consumer("nvlink", copy="tma", stages=4, lookahead=4)


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
