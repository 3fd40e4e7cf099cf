"""GroupedGemm(skip_padding=True): a band whose valid rows (plan.band_valid, a prefix) fit in the
first half of the tile runs no WGMMA in the MMA warpgroup of the second half. The option, its
host side, and the kernel compiled for sm_90a without a GPU; the default kernel's PTX is held by
tests/test_grouped_gemm_tile_fetch_compile.py's hashes (unchanged by this option). Its speed and
its bits on a GPU: bench_producer_models --variants default,skip_padding=True (bitwise the
default's valid rows, checked there per point)."""
import os
import re

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from moe_overlap.combine.grouped_gemm import GroupedGemm  # noqa: E402


# ---------------------------------------------------------------- the option (CPU, no CuTe DSL)
def test_the_option_needs_the_two_mma_warpgroups():
    assert not GroupedGemm().skip_padding
    assert GroupedGemm(skip_padding=True, tile_m=128, tile_n=256).skip_padding
    for kw in (dict(tile_m=64), dict(tile_n=128), dict(tile_m=64, tile_n=64)):
        with pytest.raises(ValueError, match="second MMA warpgroup"):
            GroupedGemm(skip_padding=True, **kw)
    with pytest.raises(ValueError, match="bool"):
        GroupedGemm(skip_padding=1)


def test_combine_options_take_it_as_a_gemm_option():
    from moe_overlap.combine.options import CombineOptions
    assert CombineOptions(gemm_options={"skip_padding": True}).check_gemm_options(128) == \
        {"skip_padding": True}
    with pytest.raises(ValueError, match="second MMA warpgroup"):
        CombineOptions(gemm_options={"skip_padding": True}).check_gemm_options(64)


def _call_args(bcap=6, rows=256, E=2, K=128, N=256):
    i32 = dict(dtype=torch.int32)
    return (torch.zeros(rows, K, dtype=torch.bfloat16), torch.zeros(E, K, N, dtype=torch.bfloat16),
            torch.zeros(rows, N, dtype=torch.bfloat16), torch.zeros(bcap, **i32),
            torch.zeros(bcap, **i32), torch.zeros(bcap, **i32), torch.zeros(1, **i32),
            torch.zeros(bcap, **i32), torch.ones(1, **i32), None, 0)


def test_band_valid_is_required_by_the_option_and_refused_without_it():
    args = _call_args()
    valid = torch.full((6,), 100, dtype=torch.int32)
    GroupedGemm(skip_padding=True)._check(*args, need_cuda=False, band_valid=valid)
    GroupedGemm()._check(*args, need_cuda=False)
    with pytest.raises(ValueError, match="band_valid is the valid rows of skip_padding"):
        GroupedGemm(skip_padding=True)._check(*args, need_cuda=False)
    with pytest.raises(ValueError, match="band_valid is the valid rows of skip_padding"):
        GroupedGemm()._check(*args, need_cuda=False, band_valid=valid)
    for bad in (valid[:5], valid.long(), valid.view(2, 3)):
        with pytest.raises(ValueError, match=r"band_valid must be a contiguous int32 \[6\]"):
            GroupedGemm(skip_padding=True)._check(*args, need_cuda=False, band_valid=bad)


def test_compile_key_and_trailing_arguments():
    """The default's key and argument list are the ones they had; the option adds one key
    element and the valid rows as the last trailing argument."""
    st, sk = GroupedGemm(), GroupedGemm(skip_padding=True)
    assert "skip_padding" not in st._key(1024, 512) and sk._key(1024, 512) != st._key(1024, 512)
    T = GroupedGemm._trailing
    assert T(None, None, None) == () and T(None, None, "c") == (None, None, None, "c")
    assert T(None, None, None, "v") == (None, None, None, None, "v")
    assert T(("f", "s"), "a", "c", "v") == ("f", "s", "a", "c", "v")


# ---------------------------------------------------------------- compile-only (CuTe DSL)
@pytest.fixture(scope="module")
def dsl():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import cutlass.cute  # noqa: F401  (installed but broken: an error, not a skip)


def _ptx(**kw):
    from moe_overlap.kernels.compile import kept_ptx
    return kept_ptx(GroupedGemm(**kw).compile(N=1024, K=512, keep_ptx=True))


def _body(ptx):
    return ptx[ptx.index(".entry"):]


def _params(ptx):
    return re.search(r"\.entry\s+\S+\((.*?)\)", ptx, re.S).group(1).count(".param")


WGMMA = "wgmma.mma_async"


@pytest.mark.compile
@pytest.mark.parametrize("extra", [dict(), dict(cluster_n=1), dict(tile_fetch="dynamic"),
                                   dict(group_by="expert")])
def test_the_kernel_reads_the_valid_rows_and_branches_around_the_second_half(dsl, extra):
    """One kernel parameter more (band_valid), the same WGMMAs (now behind a branch, not
    removed: the first warpgroup runs them on every band), a compare of the loaded count with
    tile_m / 2 = 64 that the default kernel does not make."""
    base, skip = _body(_ptx(**extra)), _body(_ptx(skip_padding=True, **extra))
    assert _params(skip) == _params(base) + 1
    assert skip.count(WGMMA) == base.count(WGMMA) > 0
    cmp64 = r"setp\.(?:gt|le)\.s32\s+%p\d+, %r\d+, 64;"
    assert len(re.findall(cmp64, skip)) > len(re.findall(cmp64, base))
