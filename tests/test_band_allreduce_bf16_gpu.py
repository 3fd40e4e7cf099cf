"""2-GPU checks of the band all-reduce's bf16-partial mode and of ``FusedFFN(compute="chained")``.
Skipped without 2 CUDA GPUs or CuTe DSL. One spawn of 2 NCCL ranks runs every part; run it with
multicast off:

    NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
    CUDA_MODULE_LOADING=EAGER python3 -m pytest -q tests/test_band_allreduce_bf16_gpu.py

Parts (fresh random inputs on every call, every output and the symmetric partial buffer poisoned
with NaN before each call):
  A. ``BandAllReduce(partial="bf16")`` alone (producer=False): bf16 partials written into the
     symmetric buffer; the output must be bitwise equal on both ranks, bitwise equal to
     ``bf16_allreduce_reference`` of the gathered partials for act2 none / relu (fp32 sum in
     rank order, + b2, rounded once), within 1e-2 of it for the fast-math act2s; ragged bands,
     several CTAs, three calls per object, fewer rows then more.
  B. producer mode with the chained compute kernel (the real producer): the compute stream
     sleeps ~50 ms before the chained kernel stores its partial and raises band_ready, while the
     all-reduce already runs; the output must match the fp32 and float64 references (<= 8e-3,
     relative Frobenius) and be bitwise equal across ranks. The same with the deliberately broken
     ordering (``_test_skip_ready_wait``: the all-reduce does not wait for band_ready) must be
     wrong (it reads the NaN poison): the check above can fail.
  C. ``FusedFFN(backend="fused", compute="chained")``: several shapes / act1 / act2 / bias, ragged
     T, two calls each, against fp32 and float64 references (<= 8e-3) and bitwise equal across
     ranks; check_errors() clean; then reset() and one more correct call.
With one GPU and ``MOE_OVERLAP_SHARE_GPU=1`` the two ranks share it: every symmetric buffer then
comes from NVSHMEM (``symmetric="auto"``, checked), host collectives go through
``moe_overlap.runtime.collectives`` (gloo).
"""
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

from conftest import gpu_ranks_available  # noqa: E402

if not gpu_ranks_available(2):
    pytest.skip("needs 2 CUDA GPUs, or one with MOE_OVERLAP_SHARE_GPU=1", allow_module_level=True)
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import ranks_share_gpus, require_symmetric, spawn_ranks  # noqa: E402

require_symmetric(2)

TOL = 8e-3
NAN = float("nan")

A_CASES = [  # (M, N, act2, bias, band_rows, ccta)
    (256, 512, "none", False, 128, 2),
    (300, 1024, "relu", True, 32, 3),  # ragged last band
    (77, 1024, "relu", True, 32, 3),  # the same object: fewer rows than its previous calls
    (77, 4096, "silu", True, 64, 16),
    (1000, 264, "none", True, 32, 8),  # N / 8 odd
    (1000, 264, "gelu_tanh", False, 32, 8),
]

B_SHAPE = (2048, 1024, 2048, 1024)  # M, P, hidden (full; 1024 per rank), N
C_CASES = [  # (T, P, O, N, act1, act2, bias)
    (1000, 1024, 2048, 1024, "gelu", None, True),
    (8192, 1024, 2048, 1024, "silu", "relu", False),
    (300, 512, 1024, 768, "gelu_tanh", "silu", True),
]


def _gather(t):
    import torch.distributed as dist

    from moe_overlap.runtime import collectives
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    collectives.all_gather(parts, t.contiguous())
    return parts


def _rank_equal(t):
    parts = _gather(t)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def _rel(a, ref):
    a, ref = a.double(), ref.double()
    d = (a - ref)
    d[torch.isnan(d)] = float("inf")
    return (d.norm() / ref.norm()).item()


def _ffn_ref(x, w1, b1, w2, b2, act1, act2, dtype=torch.float32):
    """The unsplit layer in fp32 (the baseline's precision, H not rounded) or float64 (the
    truth), on the GPU (float64 on the CPU would take minutes at 8192 tokens)."""
    from moe_overlap.ffn.activations import activation
    h = x.to(dtype) @ w1.to(dtype)
    if b1 is not None:
        h = h + b1.to(dtype)
    y = activation(h, act1) @ w2.to(dtype)
    if b2 is not None:
        y = y + b2.to(dtype)
    return activation(y, act2)


def _part_a(rank, dev, res):
    from moe_overlap.ffn.band_allreduce import BandAllReduce, bf16_allreduce_reference
    ars = {}
    for i, (M, N, act2, bias, band_rows, ccta) in enumerate(A_CASES):
        key = (N, act2, band_rows)
        if key not in ars:
            ars[key] = BandAllReduce(1024, N, act2=act2, band_rows=band_rows, ccta=ccta,
                                     partial="bf16", timeout_ns=5_000_000_000)
        ar = ars[key]
        g = torch.Generator(device=dev).manual_seed(1000 * i + rank)
        b2 = (torch.randn(N, generator=g, device=dev) * 0.1).to(torch.bfloat16) if bias else None
        if b2 is not None:
            from moe_overlap.runtime import collectives
            collectives.broadcast(b2, 0)
        for call in range(3):
            ar.partial.fill_(NAN)
            part = (torch.randn(M, N, generator=g, device=dev) * 2).to(torch.bfloat16)
            ar.partial[:M].copy_(part)
            out = torch.full((M, N), NAN, dtype=torch.bfloat16, device=dev)
            ar(M, b2=b2, out=out)
            ar.check()
            ref = bf16_allreduce_reference(_gather(part), b2, act2)
            exact = act2 in ("none", "relu")
            err = ((out.float() - ref.float()).abs() / (ref.float().abs() + 1e-2)).max().item()
            res.append(dict(part="A", case=i, call=call, exact=exact,
                            bitwise_ref=torch.equal(out, ref), err=err, nan=bool(out.isnan().any()),
                            rank_equal=_rank_equal(out)))
    res.append(dict(part="symmetric", what="A", symmetric=ar.symmetric))


def _part_b(rank, world, dev, res):
    """The chained kernel as the producer, the all-reduce waiting (or, broken, not waiting)."""
    from moe_overlap.ffn.band_allreduce import BandAllReduce
    from moe_overlap.ffn.compute_chained import ChainedFFNCompute
    M, P, O, N = B_SHAPE
    o = O // world
    g = torch.Generator().manual_seed(11)  # the same weights and inputs on every rank
    W1 = (torch.randn(P, O, generator=g) / P ** 0.5).to(torch.bfloat16).to(dev)
    W2 = (torch.randn(O, N, generator=g) / O ** 0.5).to(torch.bfloat16).to(dev)
    b1 = (torch.randn(O, generator=g) * 0.1).to(torch.bfloat16).to(dev)
    b2 = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(dev)
    w1, w2, b1s = W1[:, rank * o:(rank + 1) * o].contiguous(), \
        W2[rank * o:(rank + 1) * o].contiguous(), b1[rank * o:(rank + 1) * o].float()
    comp = ChainedFFNCompute()
    ccta = 16
    side = torch.cuda.Stream(device=dev)
    cur = torch.cuda.current_stream(dev)
    for broken in (False, True):
        ar = BandAllReduce(M, N, act2="silu", band_rows=32, ready_rows=128, ccta=ccta,
                           partial="bf16", timeout_ns=5_000_000_000,
                           _test_skip_ready_wait=broken)
        # warm-up: both kernels loaded and run alone before they overlap
        comp(torch.zeros(128, P, dtype=torch.bfloat16, device=dev), w1, b1s, w2, act1="gelu")
        ar.compile()
        torch.cuda.synchronize(dev)
        torch.distributed.barrier()
        ar(128)
        torch.cuda.synchronize(dev)
        ar.check()
        comp.check(dev)
        for call in range(2):
            x = torch.randn(M, P, generator=g).to(torch.bfloat16).to(dev)
            ring = torch.full((comp.ring_rows(M, P, o, N, comp.grid(M, o, N, dev, ccta)), o),
                              NAN, dtype=torch.bfloat16, device=dev)
            out = torch.full((M, N), NAN, dtype=torch.bfloat16, device=dev)
            ar.partial.fill_(NAN)
            ar.epoch.add_(1)
            torch.cuda.synchronize(dev)
            torch.distributed.barrier()
            side.wait_stream(cur)
            torch.cuda._sleep(100_000_000)  # ~50 ms: the all-reduce runs before any band is ready
            comp(x, w1, b1s, w2, out=ar.partial[:M], band_ready=ar.band_ready, epoch=ar.epoch,
                 act1="gelu", ccta=ccta, stream=cur, h_ring=ring)
            ar(M, b2=b2, out=out, producer=True, bump_epoch=False, stream=side)
            cur.wait_stream(side)
            torch.cuda.synchronize(dev)
            ar.check()
            comp.check(dev)
            y32 = _ffn_ref(x, W1, b1, W2, b2, "gelu", "silu")
            truth = _ffn_ref(x, W1, b1, W2, b2, "gelu", "silu", torch.float64)
            res.append(dict(part="B", broken=broken, call=call, err32=_rel(out, y32),
                            err64=_rel(out, truth), nan=bool(out.isnan().any()),
                            rank_equal=_rank_equal(out)))
        res.append(dict(part="symmetric", what="B", symmetric=ar.symmetric))
        ar.release()  # collective (NVSHMEM: its buffer goes back to the heap now)


def _part_c(rank, world, dev, res):
    from moe_overlap.ffn import FusedFFN
    for i, (T, P, O, N, act1, act2, bias) in enumerate(C_CASES):
        g = torch.Generator().manual_seed(70 + i)
        W1 = (torch.randn(P, O, generator=g) / P ** 0.5).to(torch.bfloat16).to(dev)
        W2 = (torch.randn(O, N, generator=g) / O ** 0.5).to(torch.bfloat16).to(dev)
        b1 = (torch.randn(O, generator=g) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        b2 = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16).to(dev) if bias else None
        mod = FusedFFN.from_full_weights(W1, b1, W2, b2, None, act1=act1, act2=act2,
                                         backend="fused", compute="chained")
        assert mod._chained and mod.allreduce_for(T).partial is not None
        res.append(dict(part="symmetric", what="C", symmetric=mod.allreduce_for(T).symmetric))
        for call in range(3):
            if call == 2:
                mod.reset()  # collective; the next call starts from epoch 0 again
            x = torch.randn(T, P, generator=g).to(torch.bfloat16).to(dev)
            mod.allreduce_for(T).partial.fill_(NAN)
            with torch.no_grad():
                y = mod(x)
            mod.check_errors()
            y32 = _ffn_ref(x, W1, b1, W2, b2, act1, act2 or "none")
            truth = _ffn_ref(x, W1, b1, W2, b2, act1, act2 or "none", torch.float64)
            res.append(dict(part="C", case=i, call=call, err32=_rel(y, y32),
                            err64=_rel(y, truth), nan=bool(y.isnan().any()),
                            rank_equal=_rank_equal(y)))


def _worker(rank, world):
    import os
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from moe_overlap.launch import rank_device
    dev = rank_device()
    res = []
    _part_a(rank, dev, res)
    _part_b(rank, world, dev, res)
    _part_c(rank, world, dev, res)
    return res


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2, backend="nccl", join_timeout_s=900, hard_exit=True)


def _parts(results, name):
    out = [r for rank_res in results for r in rank_res if r["part"] == name]
    assert out, f"no results of part {name}"
    return out


def test_bf16_allreduce_alone_exact_and_rank_equal(results):
    rs = _parts(results, "A")
    assert len(rs) == 2 * 3 * len(A_CASES)
    for r in rs:
        assert not r["nan"] and r["rank_equal"], r
        if r["exact"]:
            assert r["bitwise_ref"], r  # fixed-order fp32 sum, rounded once
        assert r["err"] < 1e-2, r


def test_chained_producer_overlapped(results):
    rs = [r for r in _parts(results, "B") if not r["broken"]]
    assert len(rs) == 4
    for r in rs:
        assert not r["nan"] and r["rank_equal"], r
        assert r["err32"] <= TOL and r["err64"] <= TOL, r


def test_broken_ordering_is_caught(results):
    rs = [r for r in _parts(results, "B") if r["broken"]]
    assert len(rs) == 4
    for r in rs:  # read the NaN poison (or stale bands) before the producer wrote them
        assert r["nan"] or r["err32"] > TOL, r


def test_fused_ffn_chained_layer(results):
    rs = _parts(results, "C")
    assert len(rs) == 2 * 3 * len(C_CASES)
    for r in rs:
        assert not r["nan"] and r["rank_equal"], r
        assert r["err32"] <= TOL and r["err64"] <= TOL, r


def test_symmetric_allocator_follows_the_placement(results):
    """auto: NVSHMEM where the ranks share a GPU (torch symmetric memory refuses them), else
    torch symmetric memory as before; the same for the standalone all-reduce and the layer's."""
    want = "nvshmem" if ranks_share_gpus(2) else "torch"
    rs = _parts(results, "symmetric")
    assert len(rs) == 2 * (1 + 2 + len(C_CASES)) and {r["symmetric"] for r in rs} == {want}, rs
