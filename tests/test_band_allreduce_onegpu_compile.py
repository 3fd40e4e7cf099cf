"""Compile-only (sm_90a, no GPU) check of every band all-reduce variant the one-GPU emulated-rank
test and bench launch (tests/band_allreduce_onegpu_cases.py): each is built as the GPU run builds
it (``BandAllReduce._emulated_rank`` on CPU buffers, then ``compile()``: the same cached variant,
the same co-residency bound from its cubin), and ``world * ccta`` of its CTAs fit an H200 at
one per SM, as ``EmulatedRanks`` requires."""
import os

import pytest

pytestmark = pytest.mark.compile

# before cutlass is imported: it reads the target arch once
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

import torch  # noqa: E402

from band_allreduce_onegpu_cases import H200_SMS, variants  # noqa: E402
from conftest import ptx_body  # noqa: E402
from moe_overlap.ffn import band_allreduce as B  # noqa: E402
from moe_overlap.kernels.compile import kept_ptx  # noqa: E402
from moe_overlap.runtime.device import require_coresident  # noqa: E402


@pytest.mark.parametrize("partial,G,act2,per_band,skip,ccta", variants(),
                         ids=lambda v: str(v))
def test_variant_compiles_and_fits(partial, G, act2, per_band, skip, ccta):
    max_rows, N, band_rows = 256, 512, 32
    total = B.symmetric_layout(max_rows, N, band_rows, partial)[3]
    bufs = [torch.zeros(total, dtype=torch.uint8) for _ in range(G)]
    ar = B.BandAllReduce._emulated_rank(0, bufs, torch.device("cpu"), H200_SMS, max_rows, N,
                                        partial=partial, act2=act2, band_rows=band_rows,
                                        ready_rows=128 if per_band else None, ccta=ccta,
                                        b2_per_band=per_band, _test_skip_ready_wait=skip)
    fn = ar.compile()
    assert ar.ctas_per_sm >= 1
    assert G * ccta <= H200_SMS
    require_coresident(G * ccta, H200_SMS, ar.ctas_per_sm, "emulated ranks")
    body = ptx_body(kept_ptx(fn))
    assert body.count("red.release.sys.global.add.u32") == 3 * G  # arrive, arrive ahead, done
    assert ("ld.acquire.gpu.global.s32" in body) == (not skip)  # the ready wait (or not)
