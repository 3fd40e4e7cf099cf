"""GPU checks of GroupedGemm(skip_padding=True) (skipped without CUDA / CuTe DSL), on rank 0's plans
of skewed model routings (tests/test_grouped_gemm_gpu.py's MODEL_PLANS), x random on every row,
padding rows too (so a padding row the kernel computes is not zero): against the default kernel
on the same inputs, every valid row (the prefix of band_valid[b] rows of each band) is bitwise
the same; a band with at most 64 valid rows has zeros in its rows 64-127, where the default
wrote x @ w (not zero: the skip is seen); a band with more keeps the default's bits on all 128
rows (its second warpgroup ran); rows of no band stay NaN; flags, band counters and the error
word as the default's."""
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

sys.path.insert(0, os.path.dirname(__file__))
from test_grouped_gemm_gpu import N  # noqa: E402
from test_grouped_gemm_tile_fetch_gpu import TILE_M, TILE_N, _setup  # noqa: E402

from moe_overlap.combine.grouped_gemm import GroupedGemm  # noqa: E402

DEV = "cuda"
HALF = TILE_M // 2  # the second MMA warpgroup's first row


def _run(gemm, plan, x, w, rows, ccta):
    y = torch.full((rows, N), float("nan"), device=DEV, dtype=torch.bfloat16)
    ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=DEV)
    epoch = torch.full((1,), 3, dtype=torch.int32, device=DEV)
    gemm(x, w, y, plan.band_expert, plan.band_src_row, plan.schedule, plan.num_bands, ready,
         epoch, ccta=ccta, band_valid=plan.band_valid if gemm.skip_padding else None)
    torch.cuda.synchronize()
    return y, ready


CASES = [  # (plan, GroupedGemm options besides skip_padding, ccta)
    ("deepseek-v3@4096 W8", dict(), 0),
    ("deepseek-v3@4096 W2 expert order", dict(cluster_n=1), 8),
    ("deepseek-v3@16384", dict(tile_fetch="dynamic"), 16),
    ("mixtral@16384", dict(group_by="expert"), 0),
]


@pytest.mark.parametrize("name,extra,ccta", CASES)
def test_short_bands_skip_their_second_half_and_keep_every_valid_row(name, extra, ccta):
    plan, x, w, rows = _setup(name)  # x random on every row, padding rows too
    base = GroupedGemm(tile_m=TILE_M, tile_n=TILE_N, **extra)
    skip = GroupedGemm(tile_m=TILE_M, tile_n=TILE_N, skip_padding=True, **extra)
    y0, r0 = _run(base, plan, x, w, rows, ccta)
    y1, r1 = _run(skip, plan, x, w, rows, ccta)
    nb = int(plan.num_bands.item())
    bands = plan.schedule[:nb].long()
    starts = plan.band_src_row[bands].long().tolist()
    valid = plan.band_valid[bands].long().tolist()
    short = [(s, v) for s, v in zip(starts, valid) if v <= HALF]
    assert short and len(short) < nb, (name, len(short), nb)  # both kinds of band present
    i16 = lambda t: t.view(torch.int16)  # noqa: E731
    seen = torch.zeros(rows, dtype=torch.bool, device=DEV)
    for s, v in zip(starts, valid):
        seen[s:s + TILE_M] = True
        assert 0 < v <= TILE_M, (s, v)
        assert torch.equal(i16(y1[s:s + v]), i16(y0[s:s + v])), ("valid rows", s, v)
        if v <= HALF:
            assert bool((y1[s + HALF:s + TILE_M] == 0).all()), ("skipped half", s, v)
        else:
            assert torch.equal(i16(y1[s:s + TILE_M]), i16(y0[s:s + TILE_M])), ("full band", s)
    # the default computed the skipped halves from random padding rows: not zero there
    assert any(bool((y0[s + HALF:s + TILE_M] != 0).any()) for s, _ in short)
    assert torch.isnan(y1[~seen].float()).all(), "rows of no band were written"
    assert torch.equal(r0, r1) and int((r1 != 0).sum()) == nb
    assert int(skip._counters[(x.device, plan.band_capacity)].abs().sum()) == 0
    assert int(skip.error_word(x.device).abs().sum()) == 0, "error word set"
