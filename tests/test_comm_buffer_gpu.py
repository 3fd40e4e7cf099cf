"""GPU check of the shared communication buffer on 2 GPUs (one NCCL rank each; issue 21,
"Memory"; moe_overlap/combine/comm_buffer.py).

Two ``MoECombine`` layers of different N (A: N=512, B: N=256) on the default shared buffer,
called A, B, A, B, ...; every output must equal, bit for bit, the same layer run on a buffer of
its own (``comm_buffer=CommBuffer(...)``), and be within 8e-3 of the fp32 reference. Rank 0
sleeps on the combine stream before each of A's scales, so rank 1 runs ahead into B's call
while rank 0's scale of A has not read its slot yet: the slot-reuse protection is exercised.

Broken variant (the test shows it fails): layer B keeps an epoch of its own on the shared buffer
(the epoch advanced per layer instead of per call on the buffer). A's call i and B's call i then
receive into the same slot, and rank 1's B rows overwrite the A rows rank 0 is about to read; the
epoch tags agree (both layers are at the same count), so nothing catches it: wrong outputs.

Run: ``CUDA_MODULE_LOADING=EAGER NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 python -m pytest -q tests/test_comm_buffer_gpu.py``.
"""
import pytest
import torch

from conftest import require_module, spawn_ranks

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

E, TOPK, K, TILE_M, T_MAX = 8, 2, 256, 128, 256
N_A, N_B = 512, 256
CALLS = 8  # per layer, interleaved
SLEEP_CYCLES = 100_000_000  # ~50 ms at H200 clocks: far longer than a peer's whole call


def _layer(n, comm_buffer=None):
    from moe_overlap import MoECombine
    return MoECombine(E, K, n, TOPK, T_MAX, tile_m=TILE_M, backend="overlap", ccta=8,
                      transport="nvlink", validate=False, comm_buffer=comm_buffer)


def _cases(layer, n, seed, rank, dev):
    """CALLS routings and inputs for ``layer``, planned and prepared up front (the interleaved
    loop then holds no collective that would put the ranks back in lock step)."""
    from moe_overlap.combine.dispatch import exchange_counts
    from moe_overlap.routing import route
    out = []
    for i in range(CALLS + 1):
        T = 64 + (i * 37 + seed) % (T_MAX - 63)
        ids, w = route(T, E, TOPK, mode="moderate_skew", seed=seed * 100 + i, rank=rank,
                       device=dev)
        plan = layer.plan(exchange_counts(ids, E))
        g = torch.Generator(device=dev).manual_seed(seed * 1000 + i * 10 + rank)
        h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
        wd = (torch.randn(E // 2, K, n, device=dev, generator=g) / K ** 0.5).to(torch.bfloat16)
        out.append((h, wd, plan, ids, w))
    return out


def _run(layers_cases, routes, delay_a_on_rank0=None):
    """Interleaved calls: for i, each (layer, cases) in turn; returns the outputs per layer."""
    outs = [[] for _ in layers_cases]
    for i in range(1, CALLS + 1):
        for j, (layer, cases) in enumerate(layers_cases):
            h, wd, plan, ids, w = cases[i]
            outs[j].append(layer(h, wd, plan, ids, w, routes=routes[j][i]))
    torch.cuda.synchronize()
    return outs


def _delay_scale(impl):
    """Test only: the combine stream sleeps before every scale launch of ``impl``."""
    launch = impl.scale.launch

    def delayed(**kw):
        torch.cuda._sleep(SLEEP_CYCLES)  # on the current stream: the combine stream here
        return launch(**kw)
    impl.scale.launch = delayed


def _private_epoch(impl):
    """The broken variant: this layer advances an epoch of its own on the shared buffer (as if
    the epoch were per layer), starting where the buffer's is now."""
    cls = type(impl)
    impl._own_epoch = impl.comm.epoch.clone()
    impl.__class__ = type("PerLayerEpoch", (cls,), {
        "epoch": property(lambda self: self._own_epoch)})


def _worker(rank, world):
    import torch.distributed as dist

    from moe_overlap.combine.comm_buffer import CommBuffer, OverlapError
    from moe_overlap.combine.reference import reference_combine
    dev = torch.device("cuda", torch.cuda.current_device())
    res = {}
    own_a, own_b = _layer(N_A, CommBuffer(None, "nvlink")), _layer(N_B, CommBuffer(None, "nvlink"))
    sh_a, sh_b = _layer(N_A), _layer(N_B)  # the default: one shared buffer
    res["same_buffer"] = sh_a.comm_buffer is sh_b.comm_buffer
    res["own_distinct"] = own_a.comm_buffer is not own_b.comm_buffer is not sh_a.comm_buffer
    ca, cb = _cases(sh_a, N_A, 1, rank, dev), _cases(sh_b, N_B, 2, rank, dev)
    ra = [sh_a.prepare(c[2], c[3]) for c in ca]
    rb = [sh_b.prepare(c[2], c[3]) for c in cb]
    # warm-up (compiles, first-call barriers), one call each, then every rank in step
    for layer, cases, routes in ((own_a, ca, ra), (own_b, cb, rb), (sh_a, ca, ra),
                                 (sh_b, cb, rb)):
        h, wd, plan, ids, w = cases[0]
        layer(h, wd, plan, ids, w, routes=routes[0])
    torch.cuda.synchronize()
    dist.barrier()
    buf = sh_a.comm_buffer
    res["heap_shared"] = buf.heap_bytes()
    res["heap_own"] = own_a.comm_buffer.heap_bytes() + own_b.comm_buffer.heap_bytes()
    res["slot_bytes"] = buf.slot_bytes
    res["layers_on_buffer"] = buf.num_layers

    want_a, want_b = _run([(own_a, ca), (own_b, cb)], [ra, rb])  # each on its own buffer
    dist.barrier()
    if rank == 0:
        _delay_scale(sh_a._impl)

    def compare(tag):
        res[f"{tag}_a_bitwise"] = [bool(torch.equal(x, y)) for x, y in zip(got_a, want_a)]
        res[f"{tag}_b_bitwise"] = [bool(torch.equal(x, y)) for x, y in zip(got_b, want_b)]

    epoch0 = int(buf.epoch.item())
    got_a, got_b = _run([(sh_a, ca), (sh_b, cb)], [ra, rb])
    res["epoch_advance"] = int(buf.epoch.item()) - epoch0  # 2 per round: per call on the buffer
    compare("shared")
    try:
        sh_a.check_errors()
        res["shared_err"] = ""
    except OverlapError as e:
        res["shared_err"] = str(e)
    rel = 0.0
    for cases, outs in ((ca, got_a), (cb, got_b)):
        for (h, wd, plan, ids, w), out in zip(cases[1:], outs):
            ref = reference_combine(h.float(), wd.float(), plan, ids, w)
            rel = max(rel, float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)))
    res["shared_worst_rel"] = rel

    # the broken variant: B's epoch per layer (same slots as A's), the same calls again
    dist.barrier()
    _private_epoch(sh_b._impl)
    try:
        got_a, got_b = _run([(sh_a, ca), (sh_b, cb)], [ra, rb])
        compare("broken")
        sh_a.check_errors()
        res["broken_err"] = ""
    except OverlapError as e:  # a mismatch the tags catch counts as failing loudly
        res["broken_err"] = str(e)
    return res


@pytest.fixture(scope="module")
def results():
    res = spawn_ranks(_worker, 2, backend="nccl", join_timeout_s=540, hard_exit=True)
    print(res)
    return res


def test_two_layers_share_one_buffer_bitwise_equal_to_own_buffers(results):
    for r in results:
        assert r["same_buffer"] and r["own_distinct"] and r["layers_on_buffer"] == 2, r
        assert r["epoch_advance"] == 2 * CALLS, r
        assert r["shared_err"] == "", r["shared_err"]
        assert all(r["shared_a_bitwise"]) and len(r["shared_a_bitwise"]) == CALLS, r
        assert all(r["shared_b_bitwise"]) and len(r["shared_b_bitwise"]) == CALLS, r
        assert r["shared_worst_rel"] <= 8e-3, r
        # one buffer sized for the larger layer instead of one per layer
        slot_a = T_MAX * TOPK * N_A * 2
        assert r["slot_bytes"] == slot_a, r
        # and one communication block (3 int64 words per rank) and one error record
        from moe_overlap.combine.comm_buffer import ERR_WORDS
        block = 3 * 2 * 8
        assert r["heap_shared"] == 2 * slot_a + block + ERR_WORDS * 8 < r["heap_own"], r


def test_epoch_per_layer_on_a_shared_buffer_gives_wrong_results(results):
    r0 = results[0]  # the rank whose scale of A was delayed reads B's rows
    assert r0["broken_err"] or not all(r0["broken_a_bitwise"]), r0
