"""GPU checks of the device counts exchange (combine/counts_exchange.py through
``CommBuffer.exchange_counts``, ``exchange_counts(comm_buffer=)``), ranks as processes: 2 / 4
GPUs, or one GPU shared with MOE_OVERLAP_SHARE_GPU=1 (ranks over gloo: tests/conftest.py
spawn_ranks). NOT RUN yet (written on a machine without a GPU).

Per rank, W = 2 and 4, both transports of the CommBuffer (nvlink: peer stores; nvshmem: put with
signal): the int64 [W, E] counts bitwise equal to the host exchange (``exchange_counts`` without
a buffer: the process group's all-gather) over random and skewed routings, a rank with 0 tokens
and ids outside [0, E) (validate=False: not counted), with validate=True too (its checks, then
the device exchange); many calls in a row (both parities, the epoch advanced on the device);
a CUDA graph of the exchange captured once (on the gloo group of shared-GPU ranks too: no host
collective in it) and replayed with new routings written into the captured ids, each replay
equal to the host exchange; the error word stays 0; then a rank that skips a call: the others
record ERR_COUNTS_TIMEOUT naming it and the epoch (or ERR_PEER_ERROR: a rank that saw the first
one's error), and reset() recovers.

Run: ``MOE_OVERLAP_SHARE_GPU=1 CUDA_MODULE_LOADING=EAGER NVSHMEM_DISABLE_NVLS=1
python -m pytest -q tests/test_counts_exchange_gpu.py``.
"""
import pytest
import torch

from conftest import WORLD_TRANSPORTS, require_module, spawn_over_transport, world_transport_id

pytestmark = [pytest.mark.gpu, pytest.mark.two_gpus]

require_module(gpus=2)

EL, D, K, T_MAX = 4, 64, 4, 96


def _ids(rank, W, T, seed, bad=False):
    from moe_overlap.routing import route
    dev = torch.device("cuda", torch.cuda.current_device())
    E = EL * W
    if T and seed % 2:
        ids = route(T, E, K, "stress_skew", seed=seed, rank=rank)[0].reshape(T, K)
    else:
        g = torch.Generator().manual_seed(seed * 100 + rank)
        ids = torch.randint(0, E, (T, K), generator=g)
    if bad and T:
        ids[0, 0], ids[-1, -1] = -1, E + 3
    return ids.to(dev)


def _worker(rank, W, transport):
    from moe_overlap import MoEDispatch
    from moe_overlap.combine import exchange_counts
    from moe_overlap.combine.comm_buffer import CommBuffer, OverlapError
    E = EL * W
    comm = CommBuffer(None, transport)
    # attaches the counts table (counts_experts=E) with the dispatch's slots
    disp = MoEDispatch(E, D, K, T_MAX, backend="overlap", comm_buffer=comm, validate=False,
                       timeout_s=2.0)
    res = {"eager": [], "graph": [], "W": W, "transport": disp.sender.transport}
    calls = 0
    with torch.no_grad():
        for i in range(12):
            T = 0 if (rank == 1 and i % 3 == 0) else 1 + (17 * i + 29 * rank) % T_MAX
            ids = _ids(rank, W, T, seed=i, bad=i % 4 == 1)
            got = exchange_counts(ids, E, validate=False, comm_buffer=comm)
            want = exchange_counts(ids, E, validate=False)
            res["eager"].append((i, T, got.dtype == torch.int64 and torch.equal(got, want)))
            calls += 1
            if i % 4 != 1:  # validate=True: in-range ids only
                got = exchange_counts(ids, E, comm_buffer=comm)
                res["eager"].append((i, "validated", torch.equal(got, want)))
                calls += 1
        comm.check_errors()
        res["epoch"] = (int(comm.counts_epoch), calls)
        # CUDA graph: the exchange captured once, new routings written into its input
        T = 40 + 9 * rank
        ids_in = _ids(rank, W, T, seed=500)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            disp.exchange_counts(ids_in)  # warm
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            counts_g = disp.exchange_counts(ids_in)
        for r in range(8):
            ids_in.copy_(_ids(rank, W, T, seed=600 + r, bad=r == 3))
            graph.replay()
            torch.cuda.synchronize()
            res["graph"].append(torch.equal(counts_g, exchange_counts(ids_in, E,
                                                                      validate=False)))
        comm.check_errors()
        res["err_word"] = [int(v) for v in comm.err.tolist()]
        res["epoch_after_graph"] = int(comm.counts_epoch)
        # a rank that skips a call: the others' gathers time out naming it
        torch.distributed.barrier()
        ids = _ids(rank, W, 10, seed=7)
        if rank != W - 1:
            out = exchange_counts(ids, E, validate=False, comm_buffer=comm, timeout_s=1.0)
            torch.cuda.synchronize()
            res["skip_err"] = [int(v) for v in comm.err.tolist()]
            res["skip_zero"] = not bool(out.any())
            try:
                comm.check_errors()
                res["skip_raised"] = ""
            except OverlapError as e:
                res["skip_raised"] = str(e)
        torch.distributed.barrier()
        comm.reset()
        got = exchange_counts(ids, E, validate=False, comm_buffer=comm)
        res["after_reset"] = torch.equal(got, exchange_counts(ids, E, validate=False))
        comm.check_errors()
    return res


@pytest.fixture(scope="module", params=WORLD_TRANSPORTS, ids=world_transport_id)
def results(request):  # spawn_ranks skips, naming why, where these GPU ranks cannot run
    return spawn_over_transport(_worker, request.param)


def test_device_counts_are_bitwise_the_host_exchange(results):
    for rank, r in enumerate(results):
        bad = [c for c in r["eager"] if not c[-1]]
        assert r["eager"] and not bad, (rank, bad)
        got, calls = r["epoch"]
        assert got == calls, (rank, r["epoch"])  # one epoch per call, on the device


def test_graph_replays_exchange_new_routings(results):
    for rank, r in enumerate(results):
        assert len(r["graph"]) == 8 and all(r["graph"]), (rank, r["graph"])
        assert r["err_word"] == [0] * 8, rank
        assert r["epoch_after_graph"] == r["epoch"][1] + 1 + 8, rank  # replays advance it


def test_a_rank_that_skips_an_exchange_is_named_and_reset_recovers(results):
    from moe_overlap.kernels import errors as Er
    W = results[0]["W"]
    for rank, r in enumerate(results[:-1]):
        err = r["skip_err"]
        assert err[0] in (Er.ERR_COUNTS_TIMEOUT, Er.ERR_PEER_ERROR), (rank, err)
        if err[0] == Er.ERR_COUNTS_TIMEOUT:
            # rank, source, epoch (the calls so far + 1)
            assert err[1:4] == [rank, W - 1, r["epoch_after_graph"] + 1], (rank, err)
        assert r["skip_zero"] and r["skip_raised"], rank
    for rank, r in enumerate(results):
        assert r["after_reset"], rank
