"""Compile-only checks of the producer grouped GEMM for sm_90a (no GPU needed).

CUTE_DSL_ARCH=sm_90a makes cute.compile target sm_90a on a machine without a GPU; CUTE_DSL_KEEP
keeps the PTX so we can check that the kernel really uses WGMMA, TMA and the flag epilogue.
"""
import os

import pytest
import torch

from moe_overlap.kernels.compile import kept_ptx

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

pytestmark = pytest.mark.compile


@pytest.fixture(scope="module")
def gg_mod():
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    import cutlass.cute  # noqa: F401  (installed but broken: an error, not a skip)
    from moe_overlap.combine import grouped_gemm
    return grouped_gemm


@pytest.mark.parametrize("tile_m,tile_n,signal,extra", [
    (128, 256, True, {}), (64, 256, True, {}), (128, 128, True, {}), (128, 256, False, {}),
    (128, 256, True, dict(epi_n=64, epi_stages=2)),
    (128, 256, True, dict(cluster_n=1, signal_k_tile=3)), (64, 128, True, dict(cluster_n=1)),
    (128, 256, True, dict(flag_warp=False)), (64, 128, False, dict(cluster_n=1)),
    (128, 256, True, dict(flag_warp=True)), (64, 128, True, dict(flag_warp=True, cluster_n=1)),
    (128, 256, True, dict(band_group=2)), (64, 256, False, dict(band_group=1)),
    (128, 256, True, dict(group_by="expert")),
    (64, 128, True, dict(group_by="expert", cluster_n=1)),
    (128, 256, False, dict(group_by="expert", band_group=4))])
def test_compiles_with_wgmma(gg_mod, tmp_path, monkeypatch, tile_m, tile_n, signal, extra):
    monkeypatch.setenv("CUTE_DSL_DUMP_DIR", str(tmp_path))
    g = gg_mod.GroupedGemm(tile_m=tile_m, tile_n=tile_n, signal=signal, **extra)
    # N, K small but several tiles; the compile cache is keyed on them, not on rows / experts
    fn = g.compile(N=2 * tile_n, K=256, keep_ptx=True)
    assert fn is not None
    assert g.compile(N=2 * tile_n, K=256, keep_ptx=True) is fn  # cached
    ptx = kept_ptx(fn)  # raises when the DSL kept none
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and stores
    assert "setmaxnreg" in ptx  # warp specialization
    if g.cluster_for(2 * tile_n) > 1:
        assert "multicast::cluster" in ptx
    if signal:
        assert "atom.global.acq_rel.add" in ptx or "atom.acq_rel.gpu" in ptx
        assert "st.release.gpu" in ptx
        assert "cp.async.bulk.wait_group \t0" in ptx or "cp.async.bulk.wait_group 0" in ptx
    else:
        assert "st.release.gpu" not in ptx
    if signal and extra.get("flag_warp", True):  # the store warp hands bands to the relay warp
        assert "mbarrier.arrive.shared::cta.b64" in ptx and "bar.arrive" in ptx
    elif signal:  # flag_warp=False: no relay mailbox
        assert "mbarrier.arrive.shared::cta.b64" not in ptx


@pytest.mark.parametrize("num_bands,n_tiles,cluster,group", [
    (7, 4, 1, 1), (7, 4, 2, 2), (5, 6, 1, 2), (9, 8, 2, 4), (17, 32, 2, 8), (3, 2, 1, 8),
    (8, 32, 2, 8)])
def test_tile_order_is_a_permutation_with_cluster_pairs(num_bands, n_tiles, cluster, group):
    """The kernel's tile order (mirrored in tile_order_reference): every (band, n tile) exactly
    once; a cluster's two tiles share the band at adjacent n tiles; inside a full group the
    clusters cycle over the group's bands at equal n tiles; group 1 is band-major."""
    from moe_overlap.combine.grouped_gemm import tile_order_reference
    order = tile_order_reference(num_bands, n_tiles, cluster, group)
    assert sorted(order) == [(p, n) for p in range(num_bands) for n in range(n_tiles)]
    for q in range(0, len(order), cluster):
        (p0, n0), (p1, n1) = order[q], order[q + cluster - 1]
        assert p0 == p1 and n1 == n0 + cluster - 1 and n0 % cluster == 0
    if group == 1:
        assert order == [(p, n) for p in range(num_bands) for n in range(n_tiles)]
    full = (num_bands // group) * group if group > 1 else 0
    for t in range(full * n_tiles):
        s0 = t // (group * n_tiles) * group
        q = (t - s0 * n_tiles) // cluster
        assert order[t] == (s0 + q % group, (q // group) * cluster + t % cluster)
    if group == 2:  # the pair rule the GPU tests ran first
        for t, (p, n) in enumerate(order):
            s2 = t // (2 * n_tiles) * 2
            if s2 + 1 < num_bands:
                q = (t - s2 * n_tiles) // cluster
                assert (p, n) == (s2 + q % 2, (q // 2) * cluster + (t - s2 * n_tiles) % cluster)
            else:
                assert (p, n) == (t // n_tiles, t % n_tiles)


def test_band_group_compiles(gg_mod):
    assert gg_mod.GroupedGemm().band_group == gg_mod.DEFAULT_BAND_GROUP == 8
    g = gg_mod.GroupedGemm(band_group=3)
    ptx = kept_ptx(g.compile(N=512, K=256, keep_ptx=True))
    assert "wgmma.mma_async" in ptx
    for bad in (0, True, 2.0, "auto"):
        with pytest.raises(ValueError, match="band_group"):
            gg_mod.GroupedGemm(band_group=bad)


def _entry_params(ptx):
    import re
    head = re.search(r"\.entry\s+\S+\((.*?)\)", ptx, re.S).group(1)
    return head.count(".param")


@pytest.mark.parametrize("extra", [{}, dict(cluster_n=1), dict(signal=False)])
def test_group_by_expert_adds_the_table_reads_and_checks(gg_mod, extra):
    """group_by="expert" is the fixed-group kernel plus the two tables (two more kernel
    parameters) and their two range checks in each of the four tile picks (TMA warp and
    consumer warpgroups, first and next tile); the error record is the same CAS. The default
    variants compile without either (their PTX is unchanged by the tables: compared with
    scripts/ptx_fingerprint.py against the commit before them, bench/NOTES.md)."""
    base = kept_ptx(gg_mod.GroupedGemm(**extra).compile(N=1024, K=512, keep_ptx=True))
    ex = kept_ptx(gg_mod.GroupedGemm(group_by="expert", **extra).compile(N=1024, K=512,
                                                                          keep_ptx=True))
    assert _entry_params(ex) == _entry_params(base) + 2
    assert ex.count("setp.lt.and.s64") == base.count("setp.lt.and.s64") + 2 * 4
    assert ex.count("atom.relaxed.gpu.global.cas.b64") == \
        base.count("atom.relaxed.gpu.global.cas.b64")
    assert "wgmma.mma_async" in ex


def test_band_groups_kernel_compiles():
    """The tables' kernel (combine/band_groups.py): one CTA, a warp max-scan by shuffles and
    the CTA barriers between its three passes."""
    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")
    from moe_overlap.combine.band_groups import build_band_groups_kernel, band_groups_example_args
    from moe_overlap.kernels.compile import compile_keep
    ptx = kept_ptx(compile_keep(build_band_groups_kernel(), *band_groups_example_args()))
    assert ptx.count("shfl.sync.up.b32") >= 10 and "max.s32" in ptx
    assert ptx.count("bar.sync") >= 3
    assert "st.global.s32" in ptx and "ld.global.s32" in ptx


def test_bad_inputs_raise_before_launch(gg_mod):
    with pytest.raises(ValueError, match="flag_warp"):
        gg_mod.GroupedGemm(flag_warp=True, signal=False)
    for removed in ("store_warp", "b_evict_last"):  # variants that lost (bench/NOTES.md)
        with pytest.raises(TypeError, match=removed):
            gg_mod.GroupedGemm(**{removed: True})
    g = gg_mod.GroupedGemm(tile_m=128, tile_n=256)
    i32 = dict(dtype=torch.int32)
    x = torch.zeros(256, 512, dtype=torch.bfloat16)
    w = torch.zeros(2, 512, 1024, dtype=torch.bfloat16)
    y = torch.zeros(256, 1024, dtype=torch.bfloat16)
    v = torch.zeros(4, **i32)
    one = torch.zeros(1, **i32)
    args = [x, w, y, v, v, v, one, v, one]
    # CPU tensors: a clear error, no launch
    with pytest.raises(ValueError, match="CUDA"):
        g(*args)
    chk = lambda *a, **k: g._check(*a, band_counter=None, ccta=k.get("ccta", 0), need_cuda=False)
    chk(*args)  # valid shapes pass
    with pytest.raises(ValueError, match="tile_n"):
        chk(x, torch.zeros(2, 512, 1000, dtype=torch.bfloat16),
            torch.zeros(256, 1000, dtype=torch.bfloat16), *args[3:])
    with pytest.raises(ValueError, match="tile_k"):
        chk(torch.zeros(256, 500, dtype=torch.bfloat16),
            torch.zeros(2, 500, 1024, dtype=torch.bfloat16), y, *args[3:])
    with pytest.raises(TypeError, match="bfloat16"):
        chk(x.float(), *args[1:])
    with pytest.raises(TypeError, match="int32"):
        chk(*args[:3], v.long(), *args[4:])
    with pytest.raises(ValueError, match="contiguous"):
        chk(*args[:2], torch.zeros(1024, 256, dtype=torch.bfloat16).t(), *args[3:])
    with pytest.raises(ValueError, match="K mismatch"):
        chk(x, torch.zeros(2, 256, 1024, dtype=torch.bfloat16), *args[2:])
    with pytest.raises(ValueError, match="ccta"):
        chk(*args, ccta=-1)
    with pytest.raises(ValueError, match="tile_m"):
        gg_mod.GroupedGemm(tile_m=96)


def test_reference_semantics():
    from moe_overlap.combine.grouped_gemm import grouped_gemm_reference
    tile_m = 4
    x = torch.randn(16, 8)
    w = torch.randn(2, 8, 6)
    y = torch.full((16, 6), float("nan"))
    band_expert = torch.tensor([0, 1, 1, -1], dtype=torch.int32)
    band_src_row = torch.tensor([0, 4, 8, -1], dtype=torch.int32)
    schedule = torch.tensor([2, 0, 1, -1], dtype=torch.int32)
    ready = torch.zeros(4, dtype=torch.int32)
    grouped_gemm_reference(x, w, y, band_expert, band_src_row, schedule,
                           torch.tensor([3], dtype=torch.int32), tile_m, ready,
                           torch.tensor([7], dtype=torch.int32))
    torch.testing.assert_close(y[:4], x[:4] @ w[0])
    torch.testing.assert_close(y[4:12], x[4:12] @ w[1])
    assert torch.isnan(y[12:]).all()
    assert ready.tolist() == [7, 7, 7, 0]
