"""2-GPU checks of the band all-reduce (unicast backend) against NCCL ``all_reduce``. Skipped
without 2 CUDA GPUs or CuTe DSL. One spawn of 2 NCCL ranks runs every check; the lead runs it with
``NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` set (never
multicast).

Per rank, each check: fp32 partials written into the symmetric accumulator, the kernel's bf16
output compared with ``act2(all_reduce(partial) + b2)`` computed in fp32 from NCCL's fp32 sum
(tolerance: one bf16 rounding), and the accumulator zeroed afterwards:
  - shapes with a ragged last band, N not a multiple of the band chunking, several CTAs per band
    set, every act2, b2 present / absent, three consecutive calls (epochs 1..3, counters never
    reset), a call with fewer rows than the previous one, then more again;
  - producer mode with one ready flag per 4 bands (ready_rows), flags raised out of order by
    another stream while the kernel waits;
  - a timeout: producer=True but no producer writes band_ready -> check() raises naming band 0.
The switch backend is not run (multicast is forbidden); its refusal is tested on CPU.
With one GPU and ``MOE_OVERLAP_SHARE_GPU=1`` the two ranks are processes sharing it: the symmetric
buffer then comes from NVSHMEM (``symmetric="auto"``, checked per rank), the host collectives go
through ``moe_overlap.runtime.collectives`` (gloo) and ccta is capped at the rank's SM share.
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

CASES = [  # (M, N, act2, bias, band_rows, ccta)
    (256, 512, "none", False, 128, 2),
    (300, 1024, "silu", True, 128, 3),  # ragged last band
    (77, 4096, "gelu", True, 64, 132),  # fewer rows than the previous call
    (1000, 264, "relu", True, 32, 8),  # N / 4 not a multiple of G * threads
    (1000, 264, "gelu_tanh", False, 32, 8),
]


def _ref(partial, b2, act2):
    from moe_overlap.ffn.activations import activation
    from moe_overlap.runtime import collectives
    s = partial.clone()
    collectives.all_reduce(s)
    if b2 is not None:
        s += b2.float()
    return activation(s, act2)


def _worker(rank, world):
    import os
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    from moe_overlap.ffn.band_allreduce import BandAllReduce
    from moe_overlap.launch import rank_device
    from moe_overlap.runtime import collectives
    from moe_overlap.runtime.device import num_sms
    dev = rank_device()
    sms = num_sms(dev)  # under MPS: this rank's share
    res = []
    ars = {}
    for i, (M, N, act2, bias, band_rows, ccta) in enumerate(CASES):
        key = (N, act2, band_rows)
        if key not in ars:
            ars[key] = BandAllReduce(1024, N, backend="unicast", act2=act2, band_rows=band_rows,
                                     ccta=min(ccta, sms), timeout_ns=5_000_000_000)
        ar = ars[key]
        g = torch.Generator(device=dev).manual_seed(1000 * i + rank)
        b2 = (torch.randn(N, generator=g, device=dev) * 0.1).to(torch.bfloat16) if bias else None
        if b2 is not None:
            collectives.broadcast(b2, 0)
        for call in range(3):
            partial = torch.randn(M, N, generator=g, device=dev)
            ar.acc[:M].copy_(partial)
            out = ar(M, b2=b2)
            ar.check()
            ref = _ref(partial, b2, act2)
            err = ((out.float() - ref).abs() / (ref.abs() + 1e-2)).max().item()
            zeroed = bool((ar.acc[:M] == 0).all().item())
            res.append(dict(case=i, call=call, err=err, zeroed=zeroed))
    # producer mode with coarser ready flags (ready_rows = 4 bands): a side stream runs the
    # all-reduce; this stream writes the partial, then raises the ready flags, the last ones
    # first; the epoch the flags must reach is the call count (a fresh object starts at 0)
    M, N = 300, 512
    ar = BandAllReduce(1024, N, backend="unicast", act2="silu", band_rows=32, ready_rows=128,
                       ccta=4, timeout_ns=5_000_000_000)
    side = torch.cuda.Stream(device=dev)
    cur = torch.cuda.current_stream(dev)
    nready = -(-M // 128)
    g = torch.Generator(device=dev).manual_seed(77 + rank)
    b2 = (torch.randn(N, generator=g, device=dev) * 0.1).to(torch.bfloat16)
    collectives.broadcast(b2, 0)
    for call in range(3):
        partial = torch.randn(M, N, generator=g, device=dev)
        side.wait_stream(cur)
        out = ar(M, b2=b2, producer=True, stream=side)
        ar.acc[:M].copy_(partial)
        ar.band_ready[nready - 1:nready].fill_(call + 1)
        ar.band_ready[:nready - 1].fill_(call + 1)
        cur.wait_stream(side)
        ar.check()
        ref = _ref(partial, b2, "silu")
        err = ((out.float() - ref).abs() / (ref.abs() + 1e-2)).max().item()
        res.append(dict(case="producer", call=call, err=err,
                        zeroed=bool((ar.acc[:M] == 0).all().item())))
    # timeout: nobody marks the bands ready
    ar = next(iter(ars.values()))
    ar.timeout_ns = 200_000_000
    ar(64, producer=True)  # nobody writes band_ready
    try:
        ar.check()
        res.append(dict(timeout="no error"))
    except RuntimeError as e:
        res.append(dict(timeout=str(e)))
    res.append(dict(symmetric=ar.symmetric))
    return res


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2, backend="nccl", hard_exit=True)


def test_unicast_allreduce_matches_nccl(results):
    for rank_res in results:
        for r in rank_res[:-2]:
            assert r["err"] < 1e-2, r  # one bf16 rounding of the fp32 result
            assert r["zeroed"], r


def test_timeout_is_reported(results):
    for rank_res in results:
        msg = rank_res[-2]["timeout"]
        assert "timed out waiting for band_ready" in msg and "band 0 (ready flag 0)" in msg, msg


def test_symmetric_allocator_follows_the_placement(results):
    """auto: NVSHMEM where the ranks share a GPU (torch symmetric memory refuses them), else torch
    symmetric memory as before."""
    want = "nvshmem" if ranks_share_gpus(2) else "torch"
    assert [rank_res[-1]["symmetric"] for rank_res in results] == [want, want]
