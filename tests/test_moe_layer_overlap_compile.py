"""Compile-only checks (CUTE_DSL_ARCH=sm_90a, no GPU) of the kernels MoELayer(backend="overlap")
builds, made by the layer's own factories from its resolved options (``resolve_layer``,
``MoEDispatch.overlap_kernels``, ``up_projection_gemm``): the dispatch's send and its wait +
expand with the arrival flags, and the arrival-gated SwiGLU up-projection at the layer's N = 2K
and K = D."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.compile
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx  # noqa: E402

D, K, TOPK, W, TILE_M = 512, 384, 4, 4, 128


def _layer_kernels(**options):
    from moe_overlap import MoEDispatch
    from moe_overlap.moe_layer import (MoELayerOptions, expand_ctas, resolve_layer,
                                       up_projection_gemm)
    backend, o = resolve_layer("overlap", MoELayerOptions(**options), world_size=W,
                               dtype=torch.bfloat16, hidden_size=D, intermediate_size=K,
                               tile_m=TILE_M, transport="nvlink", overlap_ok=(True, ""))
    assert backend == "overlap"
    send, expand = MoEDispatch.overlap_kernels(W, TOPK, o.send_ctas, o.dispatch_timeout_s,
                                               signal_arrival=True,
                                               expand_wait=o.expand_wait,
                                               expand_ctas=expand_ctas(o))
    return o, send, expand, up_projection_gemm(o, TILE_M)


def test_the_layers_dispatch_kernels_compile_with_the_arrival_flags():
    from moe_overlap.combine.dispatch_expand import build_dispatch_expand, expand_example_args
    o, send, expand, _ = _layer_kernels(send_ctas=6, dispatch_timeout_s=2.5)
    assert (send.world_size, send.topk, send.ctas) == (W, TOPK, 6)
    assert expand.signal_arrival and expand.timeout_ns == 2_500_000_000
    # the per-source expand on 2 CTAs per SM of the 6 the side-stream GEMM leaves
    assert (expand.wait, expand.max_ctas) == ("per_source", 12)
    assert expand.grid(132, 64) == 12 and expand.grid(132, 2) == 2 * W + 1
    assert send.compile() is not None
    ptx = compile_ptx(build_dispatch_expand(W, TOPK, expand.threads, expand.signal_arrival,
                                            expand.wait),
                      *expand_example_args(expand.signal_arrival, expand.wait))
    # the flags the up-projection waits for: the expert's count, then a release store per band
    count = ptx.index("atom.acq_rel.gpu.global.add.s32")
    assert re.search(r"st\.release\.gpu\.global\.(s|b|u)32", ptx[count:])


def test_the_layers_up_projection_compiles_as_an_arrival_gated_swiglu():
    o, _, _, gemm = _layer_kernels(up_tile_n=256, arrival_timeout_s=3.0)
    assert (gemm.tile_m, gemm.tile_n, gemm.signal, gemm.wait_arrival, gemm.swiglu,
            gemm.arrival_scope, gemm.arrival_timeout_ns) == (TILE_M, 256, False, True, True,
                                                             "gpu", 3_000_000_000)
    ptx = gemm.compile(N=2 * K, K=D, keep_ptx=True).__ptx__
    acq = ptx.index("ld.acquire.gpu.global.s32")  # the band's flag, before its A rows
    assert acq < re.search(r"cp\.async\.bulk\.tensor\.2d\.shared::cta\.global", ptx).start()
    assert "ex2.approx" in ptx  # the SwiGLU epilogue
    assert "st.release.gpu" not in ptx  # signal=False: no band flags of its own
    # up_tile_fetch="dynamic" (the layer's default): the next tiles come from the work counter
    assert gemm.tile_fetch == "dynamic" and "atom.relaxed.gpu.global.add.s32" in ptx


def test_the_layers_up_projection_walks_its_tiles_statically_when_asked():
    _, _, _, gemm = _layer_kernels(up_tile_fetch="static")
    ptx = gemm.compile(N=2 * K, K=D, keep_ptx=True).__ptx__
    assert gemm.tile_fetch == "static" and "atom.relaxed.gpu.global.add.s32" not in ptx
