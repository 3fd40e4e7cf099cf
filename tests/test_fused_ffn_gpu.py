"""GPU checks of the fused FFN compute kernel (moe_overlap/ffn/compute_reduce.py). Skipped without
CUDA (Hopper) or CuTe DSL.

Single GPU (``-k single``; runs alone: ``python -m pytest -q tests/test_fused_ffn_gpu.py -k single``):
the compute kernel on its own, in a child process with a watchdog (a hang fails the test instead
of blocking the run), against the float32 torch reference with H rounded to bf16
(``fused_ffn_compute_reference``), ||out - ref|| / ||ref|| < 1e-2, fresh random inputs per case:
every act1, tile_m 128 / 64, tile_o 128 / 256, red / TMA epilogues, ragged M (TMA clips the last m-tile), band_rows = tile_m and
2 tile_m, b1 present / absent, ccta 0 / 16 / 120; after each call every band's flag equals the
epoch and the scratch counters are back to zero; two calls in a row (the test re-zeroes acc and
advances the epoch, like the all-reduce's epilogue and FusedFFN.forward do).

Two GPUs (NCCL, ``moe_overlap.launch.spawn``): ``FusedFFN(backend="fused")`` (compute kernel ||
BandAllReduce on a high-priority stream) against ``FusedFFN(backend="reference")`` and the float64
truth, several act1 / act2 / bias / ragged-M cases, two calls in a row per module. Run with
``NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
CUDA_MODULE_LOADING=EAGER`` (never multicast). With one GPU and ``MOE_OVERLAP_SHARE_GPU=1`` the
two ranks share it: the band all-reduce's symmetric buffer then comes from NVSHMEM
(``symmetric="auto"``, checked), host collectives go through ``moe_overlap.runtime.collectives``.
"""
import os

import pytest
import torch

from conftest import gpu_ranks_available, ranks_share_gpus, require_symmetric, spawn_ranks

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if torch.cuda.get_device_capability(0)[0] != 9:
    pytest.skip("needs a Hopper (sm_90) GPU", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

SINGLE_TIMEOUT_S = 600

# (M, P, O_g, N, act1, tile_m, band_rows, bias, ccta, extra FusedFFNCompute options)
SINGLE_CASES = [  # defaults: tile_o 256, TMA reduce-add epilogue, ring as deep as fits
    (256, 512, 256, 256, "relu", 128, 128, True, 0, {}),
    (300, 256, 384, 384, "gelu", 128, 128, True, 16, dict(tile_o=128)),  # ragged last m-tile
    (777, 512, 256, 128, "silu", 128, 256, False, 16, {}),  # 2 m-tiles per band, ragged
    (64, 128, 128, 256, "gelu_tanh", 64, 64, True, 120, dict(tile_o=128)),  # one unit: grid 1
    (1000, 1024, 512, 512, "silu", 64, 128, True, 16, {}),
    (520, 512, 768, 384, "gelu", 128, 128, True, 16, {}),  # ragged
    (384, 256, 512, 256, "relu", 64, 128, False, 0, dict(tile_o=128, signal_k_tile=-1)),
    (300, 256, 512, 256, "gelu", 128, 128, True, 16, dict(stages=2, epi_n=32)),
    (520, 512, 768, 384, "silu", 128, 256, True, 0, dict(tile_o=128, epi_stages=1)),
    # clusters of 2 with W1 / W2 multicast: odd m-tile counts (a phantom unit past M), odd ccta
    (300, 256, 384, 384, "gelu", 128, 128, True, 16, dict(tile_o=128, cluster_m=2)),
    (777, 512, 256, 128, "silu", 128, 256, False, 17, dict(cluster_m=2)),
    (1000, 1024, 512, 512, "gelu", 64, 128, True, 0, dict(cluster_m=2, signal_k_tile=1)),
    (64, 128, 128, 256, "relu", 64, 64, True, 0, dict(tile_o=128, cluster_m=2)),
    (777, 512, 256, 128, "gelu_tanh", 128, 256, False, 17, dict(cluster_m=2)),
    (300, 256, 512, 256, "gelu", 128, 128, True, 16, dict(epi_n=16, epi_stages=1)),
    # two hidden tiles per unit (one H in registers, one in sH), O_g a multiple of 2 tile_o
    (256, 512, 512, 256, "relu", 128, 128, True, 0, dict(h_pair=True)),
    (300, 256, 768, 384, "gelu", 128, 128, True, 16, dict(tile_o=128, h_pair=True)),  # 3 pairs
    (1000, 1024, 1024, 512, "silu", 64, 128, True, 16, dict(h_pair=True)),
    (777, 512, 512, 128, "gelu_tanh", 128, 256, False, 17, dict(h_pair=True, cluster_m=2)),
    (520, 512, 1024, 384, "gelu", 128, 128, True, 16, dict(h_pair=True, epi_n=32, stages=2)),
]


def _single_worker(q):
    try:
        from moe_overlap.ffn.compute_reduce import (FusedFFNCompute,
                                                   fused_ffn_compute_reference)
        torch.cuda.set_device(0)
        dev = torch.device("cuda", 0)
        res = []
        for i, (M, P, O, N, act1, tm, br, bias, ccta, kw) in enumerate(SINGLE_CASES):
            g = torch.Generator(device=dev).manual_seed(100 + i)
            comp = FusedFFNCompute(tile_m=tm, band_rows=br, **kw)
            nb = -(-M // br)
            ready = torch.zeros(nb + 2, dtype=torch.int32, device=dev)
            epoch = torch.zeros(1, dtype=torch.int32, device=dev)
            acc = torch.zeros(M, N, dtype=torch.float32, device=dev)
            for call in range(2):
                x = torch.randn(M, P, generator=g, device=dev).to(torch.bfloat16)
                w1 = (torch.randn(P, O, generator=g, device=dev) / P ** 0.5).to(torch.bfloat16)
                b1 = ((torch.randn(O, generator=g, device=dev) * 0.1).to(torch.bfloat16)
                      if bias else None)
                w2 = (torch.randn(O, N, generator=g, device=dev) / O ** 0.5).to(torch.bfloat16)
                acc.zero_()  # what the all-reduce's epilogue does for the next call
                epoch.add_(1)  # what FusedFFN.forward does before each call
                comp(x, w1, b1, w2, acc, ready, epoch, ccta=ccta, act1=act1)
                torch.cuda.synchronize()
                ref = fused_ffn_compute_reference(x, w1, b1, w2, act1)
                err = ((acc - ref).norm() / ref.norm()).item()
                flags = ready.tolist()
                counter = comp.counter_for(ready).tolist()
                res.append(dict(case=i, call=call, err=err, epoch=int(epoch.item()),
                                flags=flags[:nb], tail=flags[nb:], counter=counter,
                                finite=bool(torch.isfinite(acc).all().item())))
        # grouped launch (ShardedExperts): 3 experts, groups padded to tile_m, one empty
        gres = []
        for tile_o, h_pair in ((128, False), (128, True), (256, False), (256, True)):
            g = torch.Generator(device=dev).manual_seed(300 + tile_o)
            E, P, O, N, tm = 3, 256, 512, 256, 128
            tiles = [0, 0, 2, 2, 2]  # expert of each m-tile (expert 1 has no rows)
            M = len(tiles) * tm
            comp = FusedFFNCompute(tile_m=tm, tile_o=tile_o, h_pair=h_pair)
            x = torch.randn(M, P, generator=g, device=dev).to(torch.bfloat16)
            w1 = (torch.randn(E, P, O, generator=g, device=dev) / P ** 0.5).to(torch.bfloat16)
            b1 = (torch.randn(E, O, generator=g, device=dev) * 0.1).to(torch.bfloat16)
            w2 = (torch.randn(E, O, N, generator=g, device=dev) / O ** 0.5).to(torch.bfloat16)
            acc = torch.zeros(M, N, device=dev)  # the kernel adds into it
            ready = torch.zeros(len(tiles), dtype=torch.int32, device=dev)
            epoch = torch.ones(1, dtype=torch.int32, device=dev)
            mte = torch.tensor(tiles, dtype=torch.int32, device=dev)
            comp.grouped(x, w1, b1, w2, acc, ready, epoch, mte, ccta=16, act1="silu")
            torch.cuda.synchronize()
            ref = torch.cat([fused_ffn_compute_reference(x[t * tm:(t + 1) * tm], w1[e], b1[e],
                                                         w2[e], "silu")
                             for t, e in enumerate(tiles)])
            gres.append(dict(tile_o=tile_o, err=((acc - ref).norm() / ref.norm()).item(),
                             flags=ready.tolist()))
        # errors raised before any launch (CUDA tensors)
        comp = FusedFFNCompute()
        x = torch.zeros(256, 100, dtype=torch.bfloat16, device=dev)
        errs = []
        for args in [
            (x, torch.zeros(100, 128, dtype=torch.bfloat16, device=dev)),
            (x[:, :64].contiguous(), torch.zeros(64, 100, dtype=torch.bfloat16, device=dev)),
        ]:
            try:
                O = args[1].shape[1]
                comp(args[0], args[1], None, torch.zeros(O, 128, dtype=torch.bfloat16,
                                                         device=dev),
                     torch.zeros(256, 128, device=dev), ready, epoch)
                errs.append("no error")
            except ValueError as e:
                errs.append(str(e))
        q.put(("ok", res, (errs, gres)))
    except Exception:  # noqa: BLE001 - reported to the parent
        import traceback
        q.put(("error", traceback.format_exc(), None))


def _single_rank(rank, world):  # spawn_ranks entry (one process; the watchdog: join_timeout_s)
    import queue
    q = queue.Queue()
    _single_worker(q)
    return q.get()


@pytest.fixture(scope="module")
def single_results():
    status, res, errs = spawn_ranks(_single_rank, 1, join_timeout_s=SINGLE_TIMEOUT_S)[0]
    if status != "ok":
        pytest.fail(f"single-GPU worker failed:\n{res}")
    return res, errs


def test_single_grouped_matches_reference(single_results):
    _, (_, gres) = single_results
    assert len(gres) == 4
    for r in gres:
        assert r["err"] < 1e-2, r
        assert r["flags"] == [1] * 5, r


def test_single_compute_matches_reference(single_results):
    res, _ = single_results
    assert len(res) == 2 * len(SINGLE_CASES)
    for r in res:
        assert r["finite"], r
        assert r["err"] < 1e-2, r


def test_single_flags_equal_epoch_and_counters_reset(single_results):
    res, _ = single_results
    for r in res:
        assert all(f == r["epoch"] for f in r["flags"]), r
        assert all(f == 0 for f in r["tail"]), r  # bands past M untouched
        assert all(c == 0 for c in r["counter"]), r


def test_single_bad_shapes_raise(single_results):
    _, (errs, _) = single_results
    assert "tile_k" in errs[0], errs
    assert "tile_o" in errs[1], errs


# ---------------------------------------------------------------- 2 GPUs: FusedFFN end to end
def _compare(y, yr, truth, group):
    """Fused output y against the float64 truth and the reference backend's yr, and the largest
    difference to rank 0's y (every rank must hold the same all-reduced output)."""
    import torch.distributed as dist

    from moe_overlap.ffn.reference import rel_err
    from moe_overlap.runtime import collectives
    y0 = y.clone()
    collectives.broadcast(y0, dist.get_global_rank(group, 0), group=group)
    return dict(err_truth=rel_err(y, truth), err_ref=rel_err(y, yr.double()),
                rank_diff=(y.float() - y0.float()).abs().max().item())



FFN_CASES = [  # (T, P, O, N, act1, act2, bias)
    (256, 512, 512, 512, "gelu", None, True),
    (300, 256, 1024, 384, "silu", "relu", True),  # ragged band; O/G = 512: h_pair
    (1000, 512, 512, 256, "relu", "gelu_tanh", False),
    (200, 256, 768, 256, "gelu", None, True),  # O/G = 384: tile_o 128 (the others use 256)
]


def _ffn_worker(rank, world):
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed as dist

    from moe_overlap.ffn import FusedFFN
    from moe_overlap.ffn.reference import ffn_truth, rel_err
    from moe_overlap.launch import rank_device
    dev = rank_device()
    group = dist.group.WORLD
    res = []
    for i, (T, P, O, N, act1, act2, bias) in _cases(FFN_CASES, 2, world):
        g = torch.Generator().manual_seed(7 + i)  # same weights on every rank
        W1 = (torch.randn(P, O, generator=g) / P ** 0.5).to(torch.bfloat16).to(dev)
        W2 = (torch.randn(O, N, generator=g) / O ** 0.5).to(torch.bfloat16).to(dev)
        b1 = (torch.randn(O, generator=g) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        b2 = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        fused = FusedFFN.from_full_weights(W1, b1, W2, b2, group, act1=act1, act2=act2,
                                           backend="fused", ccta=8)
        ref = FusedFFN.from_full_weights(W1, b1, W2, b2, group, act1=act1, act2=act2)
        for call in range(2):
            x = torch.randn(T, P, generator=g).to(torch.bfloat16).to(dev)
            with torch.no_grad():
                y = fused(x)
                yr = ref(x)
            fused.check_fused()
            truth = ffn_truth(x, W1, b1, W2, b2, act1, act2 or "none")
            res.append(dict(case=i, call=call, ref_err_truth=rel_err(yr, truth),
                            symmetric=fused._allreduce.symmetric,
                            **_compare(y, yr, truth, group)))
    return res


def _cases(cases, o_at, world):
    """(index, case) of the cases whose hidden width O (case[o_at]) splits over ``world`` ranks
    into whole 128-column tiles (the fused layer's tile_o); every case at 2 ranks."""
    return [(i, c) for i, c in enumerate(cases) if c[o_at] % (128 * world) == 0]


def _ranks(world):
    """Skip, naming why, where ``world`` GPU ranks cannot run here (2 are the two_gpus marker's;
    4 need 4 GPUs or one shared, MOE_OVERLAP_SHARE_GPU=1)."""
    if not gpu_ranks_available(world):
        pytest.skip(f"needs {world} GPU ranks (GPUs, or one with MOE_OVERLAP_SHARE_GPU=1)")
    require_symmetric(world)


def _assert_layer_matches(r, world=2):
    """One call's _compare result of a fused layer on GPU ranks (its symmetric allocator, where
    recorded: NVSHMEM where the ranks share a GPU, else torch symmetric memory)."""
    if "symmetric" in r:
        assert r["symmetric"] == ("nvshmem" if ranks_share_gpus(world) else "torch"), r
    assert r["err_truth"] < 1.5e-2, r  # bf16 tolerance of the layer (ffn/reference.py)
    assert r["err_ref"] < 1e-2, r
    assert r["rank_diff"] == 0.0, r  # every rank holds the same all-reduced output


@pytest.mark.two_gpus
@pytest.mark.parametrize("world", [2, 4])
def test_fused_ffn_matches_reference_on_two_gpus(world):
    _ranks(world)
    cases = _cases(FFN_CASES, 2, world)
    assert cases  # every world size runs some case
    for rank_res in spawn_ranks(_ffn_worker, world, backend="nccl", hard_exit=True):
        assert len(rank_res) == 2 * len(cases)
        for r in rank_res:
            _assert_layer_matches(r, world)


# ---------------------------------------------------------------- 2 GPUs: ShardedExperts
EXPERT_CASES = [  # (E, rows_per_expert, P, O, N, activation, bias, extra rows)
    (3, [100, 0, 250], 256, 512, 256, "silu", True, 5),
    (2, [128, 77], 512, 768, 384, "gelu", False, 0),  # O/G = 384: tile_o 128
    (2, [130, 60], 256, 1024, 256, "gelu", True, 3),  # O/G = 512: h_pair (the default)
]


def _experts_worker(rank, world):
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed as dist

    from moe_overlap.ffn import ShardedExperts
    from moe_overlap.ffn.reference import experts_truth
    from moe_overlap.launch import rank_device
    dev = rank_device()
    group = dist.group.WORLD
    res = []
    for i, (E, rows, P, O, N, act, bias, extra) in _cases(EXPERT_CASES, 3, world):
        g = torch.Generator().manual_seed(11 + i)  # same weights and x on every rank
        W_in = (torch.randn(E, P, O, generator=g) / P ** 0.5).to(torch.bfloat16).to(dev)
        W_out = (torch.randn(E, O, N, generator=g) / O ** 0.5).to(torch.bfloat16).to(dev)
        b_in = (torch.randn(E, O, generator=g) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        b_out = (torch.randn(E, N, generator=g) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        fused = ShardedExperts.from_full_weights(W_in, W_out, b_in, b_out, group, activation=act,
                                                 backend="fused", ccta=8)
        ref = ShardedExperts.from_full_weights(W_in, W_out, b_in, b_out, group, activation=act)
        for call in range(2):
            x = torch.randn(sum(rows) + extra, P, generator=g).to(torch.bfloat16).to(dev)
            with torch.no_grad():
                y = fused(x, rows)
                yr = ref(x, rows)
            fused.check_fused()
            truth = experts_truth(x, rows, W_in, W_out, b_in, b_out, act)
            res.append(dict(case=i, call=call, tail_zero=bool((y[sum(rows):] == 0).all().item()),
                            symmetric=fused._allreduce.symmetric,
                            **_compare(y, yr, truth, group)))
    return res


@pytest.mark.two_gpus
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_experts_fused_matches_reference_on_two_gpus(world):
    _ranks(world)
    cases = _cases(EXPERT_CASES, 3, world)
    assert cases
    for rank_res in spawn_ranks(_experts_worker, world, backend="nccl", hard_exit=True):
        assert len(rank_res) == 2 * len(cases)
        for r in rank_res:
            _assert_layer_matches(r, world)
            assert r["tail_zero"], r


# ---------------------------------------------------------------- 2 GPUs: backend="auto"
AUTO_CASE = (300, 256, 1024, 384)  # T (= max_tokens), P, O, N


def _auto_worker(rank, world, cache_path):
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.distributed as dist

    from moe_overlap.ffn import FusedFFN
    from moe_overlap.ffn.reference import ffn_truth
    from moe_overlap.launch import rank_device
    dev = rank_device()
    group = dist.group.WORLD
    T, P, O, N = AUTO_CASE
    g = torch.Generator().manual_seed(5)
    W1 = (torch.randn(P, O, generator=g) / P ** 0.5).to(torch.bfloat16).to(dev)
    W2 = (torch.randn(O, N, generator=g) / O ** 0.5).to(torch.bfloat16).to(dev)
    b1 = (torch.randn(O, generator=g) * 0.1).to(torch.bfloat16).to(dev)
    b2 = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(dev)
    out = {}
    os.environ["MOE_OVERLAP_FFN_TUNE_CACHE"] = os.path.join(cache_path, "absent.json")
    m = FusedFFN.from_full_weights(W1, b1, W2, b2, group, backend="auto", max_tokens=T)
    out["model"] = (m.backend, m.backend_reason)
    os.environ["MOE_OVERLAP_FFN_TUNE_CACHE"] = os.path.join(cache_path, "fused_faster.json")
    m = FusedFFN.from_full_weights(W1, b1, W2, b2, group, backend="auto", max_tokens=T)
    out["cache"] = (m.backend, m.backend_reason)
    ref = FusedFFN.from_full_weights(W1, b1, W2, b2, group)
    x = torch.randn(T, P, generator=g).to(torch.bfloat16).to(dev)
    with torch.no_grad():
        y, yr = m(x), ref(x)
    m.check_errors()
    out["cmp"] = _compare(y, yr, ffn_truth(x, W1, b1, W2, b2, "gelu", "none"), group)
    return out


@pytest.mark.two_gpus
def test_auto_backend_on_two_gpus(tmp_path):
    """On 2 Hopper GPUs the fused backend can run, so the decision is the model's (the
    reference) until a tune-cache entry measures the fused layer faster; then "auto" runs the
    fused layer, and it matches the reference."""
    from moe_overlap.ffn.tuning import FFNTuneCache, ffn_tune_key
    T, P, O, N = AUTO_CASE
    key = ffn_tune_key(torch.cuda.get_device_name(0), 2, P, O, N, False, T)
    FFNTuneCache(str(tmp_path / "fused_faster.json")).put(key, fused_ms=1.0, reference_ms=1.2)
    require_symmetric(2)
    for r in spawn_ranks(_auto_worker, 2, str(tmp_path), backend="nccl", hard_exit=True):
        assert r["model"][0] == "reference" and "modelled" in r["model"][1], r
        assert r["cache"][0] == "fused" and "measured" in r["cache"][1], r
        _assert_layer_matches(r["cmp"])
