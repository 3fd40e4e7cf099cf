"""A CPU stand-in for nvshmem4py under the real ``NvshmemRuntime`` (the allocation seam of the
combine's CommBuffer tests): symmetric tensors are CPU tensors, a heap limit makes allocations
fail like a full NVSHMEM heap, barriers and frees are logged. Everything above the nvshmem4py
calls (alloc / free / peer tables / heap_error / CommBuffer) is the product code."""
import types

import torch


def fake_runtime(monkeypatch, log=None, world=2, rank=0, heap_limit=None, patch_sync=True,
                 unreachable=()):
    """unreachable: peers without a load/store mapping (their peer views are None, as
    nvshmem4py's get_peer_tensor gives where NVSHMEM has no P2P path)."""
    from moe_overlap.runtime import nvshmem as N
    log = [] if log is None else log
    rt = N.NvshmemRuntime.__new__(N.NvshmemRuntime)
    rt.group, rt.rank, rt.world_size = None, rank, world
    rt.device = torch.device("cpu")
    rt._tensors, rt._buffers, rt._peer_views, rt._finalized = [], {}, [], False
    rt._peer_views_of = {}
    state = {"live": 0}

    def tensor(shape, dtype):
        n = 1
        for d in shape:
            n *= d
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if heap_limit is not None and state["live"] + nbytes > heap_limit:
            raise RuntimeError("nvshmem_malloc failed: out of symmetric memory")
        state["live"] += nbytes
        log.append(("alloc", tuple(shape)))
        return torch.zeros(shape, dtype=dtype)

    def free_tensor(t):
        state["live"] -= t.numel() * t.element_size()
        log.append(("free", tuple(t.shape)))

    rt._nc = types.SimpleNamespace(tensor=tensor, free_tensor=free_tensor,
                                   get_peer_tensor=lambda t, pe: None if pe in unreachable
                                   else torch.zeros_like(t))
    if patch_sync:  # (a test that records syncs patches them itself)
        monkeypatch.setattr(N.torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(N.dist, "barrier", lambda *a, **k: log.append("barrier"))
    # the runtime's barrier (bounded like the agreement) is the collective these tests log
    monkeypatch.setattr(N.collectives, "bounded_barrier", lambda *a, **k: log.append("barrier"))
    rt.log, rt.heap_state = log, state
    return rt
