"""NVSHMEM for a torch process group: bootstrap, symmetric receive buffer + arrival counters.

    rt = NvshmemRuntime(group)                      # collective; one per process and group
    b = rt.buffers(max_recv_rows, N, key="layer0")  # collective on first call, then reused
    b.recv, b.counters, b.recv_peers, b.ctr_peers   # buffers + int64 [W] peer address tables
    rt.peer_tensor(recv, pe)                        # torch view of a peer's buffer (NVLink P2P)
    t = rt.alloc(shape, dtype); rt.free(t)          # collective symmetric tensors (CommBuffer)
    rt.finalize()                                   # collective

Bootstrap: rank 0 of the group creates an NVSHMEM unique id, broadcast to the group with
``torch.distributed.broadcast_object_list``; every rank then calls ``nvshmem.core.init`` with
(uid, group rank, group size) on its current CUDA device. Symmetric allocations are collective:
every rank must make the same calls in the same order.

Receive buffer: ``[max_recv_rows, N]`` bf16. Communication block ``int64 [3W]`` (layout in
moe_overlap/kernels/errors.py): counters = its first W words, counter[s] on rank d counts rows
that rank s has delivered to d, monotone over calls (never reset; the receiver keeps the
cumulative expected value on device), then the per-source epoch tags of the two receive slots.

Peer address tables: built for every rank that this GPU reaches by load/store (NVLink P2P); an
unreachable peer's entry is 0 and ``CombineBuffers.unreachable`` names it, so the NVSHMEM
transport (which reaches peers through NVSHMEM calls only and reads its own entry alone) works
without P2P, and ``require_p2p()`` gives the load/store transport its error. nvshmem4py is
imported lazily, so this module imports on a machine without it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import collectives


COMM_BLOCK_WORDS_PER_RANK = 3  # counters, slot-0 tags, slot-1 tags (moe_overlap/kernels/errors.py)


class NvshmemError(RuntimeError):
    pass


def _nvshmem():
    try:
        import nvshmem.core as nc
        from cuda.core import Device
    except Exception as e:  # ImportError, missing libnvshmem, ...
        raise NvshmemError(
            f"NVSHMEM is not available ({type(e).__name__}: {e}); install nvshmem4py-cu13 and "
            "nvidia-nvshmem-cu13 (pip install moe-overlap[gpu])") from e
    return nc, Device


@dataclass
class CombineBuffers:
    recv: torch.Tensor  # [rows, N] bf16, symmetric
    counters: torch.Tensor  # int64 [W], symmetric; counters[s] = rows (+ markers) from rank s
    recv_peers: torch.Tensor  # int64 [W]: recv's base address on every rank, mapped here
    ctr_peers: torch.Tensor  # int64 [W]: counters' base address on every rank, mapped here
    block: torch.Tensor | None = None  # int64 [3W]: counters + epoch tags (counters = block[:W])
    unreachable: tuple = ()  # ranks without a load/store mapping (their table entries are 0)

    def require_p2p(self, what: str = "transport='nvlink'"):
        """NvshmemError if a peer has no load/store mapping (the NVSHMEM transport needs none)."""
        if self.unreachable:
            raise NvshmemError(
                f"{what} stores to the peers' memory directly, but ranks "
                f"{list(self.unreachable)} are not reachable by load/store (no NVLink/P2P "
                "mapping) from this GPU; use transport='nvshmem' (it needs no P2P mapping)")


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty(0, dtype=dtype).element_size()


def symmetric_size_mib(need_bytes: int) -> int:
    """The NVSHMEM_SYMMETRIC_SIZE (whole MiB) that holds ``need_bytes`` of symmetric tensors:
    headroom for NVSHMEM's own allocations and alignment (1/8 + 64 MiB), rounded up."""
    return -(-(need_bytes + (need_bytes >> 3) + (64 << 20)) // (1 << 20))


def heap_error(nbytes: int, allocated: int, cause: BaseException,
               note: str = "") -> "NvshmemError":
    """The error of a failed symmetric allocation: the size asked for, what is already taken,
    and the NVSHMEM_SYMMETRIC_SIZE that would hold both (set before NVSHMEM starts); ``note``
    (e.g. what the shared combine buffer needs) is appended."""
    import os
    need = allocated + nbytes
    suggest = symmetric_size_mib(need)
    cur = os.environ.get("NVSHMEM_SYMMETRIC_SIZE")
    return NvshmemError(
        f"symmetric (NVSHMEM) allocation of {nbytes} bytes ({nbytes / 2**20:.1f} MiB) failed "
        f"with {allocated / 2**20:.1f} MiB already allocated by this runtime "
        f"({type(cause).__name__}: {cause}); the heap must hold at least {need / 2**20:.1f} MiB: "
        f"set NVSHMEM_SYMMETRIC_SIZE={suggest}M (now {cur or 'unset: NVSHMEM default'}) in the "
        "environment of every rank before NVSHMEM is initialized, or lower max_tokens_per_rank"
        + (f". {note}" if note else ""))


class NvshmemRuntime:
    _live: dict = {}  # one initialized runtime per process (NVSHMEM is process-global)
    # NVSHMEM initialisations in this process so far: kernels registered with NVSHMEM under
    # one (the nvshmem consumer) are not reused under the next
    inits = 0

    def __init__(self, group=None, device: torch.device | int | None = None):
        if not (dist.is_available() and dist.is_initialized()):
            raise NvshmemError("NvshmemRuntime needs an initialized torch.distributed group")
        if not torch.cuda.is_available():
            raise NvshmemError("NvshmemRuntime needs CUDA")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device("cuda", device if isinstance(device, int) else device.index)
        self.device = dev
        self._tensors: list[torch.Tensor] = []
        self._buffers: dict[str, CombineBuffers] = {}
        self._peer_views: list[torch.Tensor] = []
        self._peer_views_of: dict[int, list] = {}  # id(symmetric tensor) -> its peer views
        self._finalized = False
        if NvshmemRuntime._live:
            raise NvshmemError("NVSHMEM is already initialized in this process; reuse "
                               "NvshmemRuntime.get(group) or finalize() the old runtime first")
        nc, Device = _nvshmem()
        self._nc = nc
        torch.cuda.set_device(dev)
        cdev = Device(dev.index)
        cdev.set_current()
        # unique id from group rank 0, broadcast over the group
        uid = nc.get_unique_id(empty=(self.rank != 0))
        payload = [bytes(uid._data.tobytes()) if self.rank == 0 else None]
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast_object_list(payload, src=src, group=group)
        if self.rank != 0:
            import numpy as np
            uid._data.view(np.int8)[:] = np.frombuffer(payload[0], dtype=np.int8)
        try:
            nc.init(device=cdev, uid=uid, rank=self.rank, nranks=self.world_size,
                    initializer_method="uid")
        except Exception as e:
            raise NvshmemError(f"nvshmem.core.init failed on rank {self.rank}/{self.world_size} "
                               f"(device {dev}): {e}") from e
        NvshmemRuntime._live[id(self)] = self
        NvshmemRuntime.inits += 1

    @classmethod
    def get(cls, group=None) -> "NvshmemRuntime":
        """The process's live runtime (created on first use); None and the world group name
        the same group (the combine's CommBuffer and the FFN's band all-reduce share it)."""
        def same(a, b):
            world = dist.group.WORLD
            return (world if a is None else a) is (world if b is None else b)
        for rt in cls._live.values():
            if same(rt.group, group):
                return rt
        if cls._live:
            raise NvshmemError("NVSHMEM already runs for another process group")
        return cls(group)

    # ---- symmetric memory -----------------------------------------------------------------
    def alloc(self, shape, dtype, note: str = "") -> torch.Tensor:
        """Collective symmetric allocation (zeroed; returns after every rank zeroed it). A full
        heap raises ``heap_error`` (``note`` appended to its text)."""
        self._check_live()
        nbytes = _nbytes(shape, dtype)
        try:
            t = self._nc.tensor(tuple(shape), dtype=dtype)
        except Exception as e:
            raise heap_error(nbytes, self.allocated_bytes(), e, note) from e
        if t is None:
            raise NvshmemError("nvshmem4py was built without torch interop")
        t.zero_()
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._tensors.append(t)
        return t

    def free(self, t: torch.Tensor):
        """Collective: free symmetric ``t`` (allocated by ``alloc``) and drop the peer views of
        it. Synchronizes and barriers first, so no kernel of any rank still uses it."""
        self._check_live()
        i = next((i for i, x in enumerate(self._tensors) if x is t), None)
        if i is None:
            raise NvshmemError("free(): not a symmetric tensor of this runtime")
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        views = {id(v) for v in getattr(self, "_peer_views_of", {}).pop(id(t), [])}
        self._peer_views = [v for v in self._peer_views if id(v) not in views]
        del self._tensors[i]
        self._nc.free_tensor(t)

    def allocated_bytes(self) -> int:
        """Bytes of symmetric heap this runtime has allocated so far."""
        return sum(t.numel() * t.element_size() for t in self._tensors)

    def buffers(self, max_recv_rows: int, n: int, key: str = "combine"):
        """The receive buffer [max_recv_rows, n] bf16 and counters int64 [W] of ``key``,
        allocated (collectively) on the first call and reused by later calls with that key.
        Returns a CombineBuffers (recv, counters, recv_peers, ctr_peers). A later request must
        fit in the first allocation (same n, rows <= capacity). Distinct users (e.g. one MoE layer
        each) take distinct keys, created in the same order on every rank."""
        if max_recv_rows < 1 or n < 1:
            raise ValueError(f"buffers({max_recv_rows}, {n}): sizes must be positive")
        self._check_live()
        b = self._buffers.get(key)
        if b is None:
            recv = self.alloc((max_recv_rows, n), torch.bfloat16)
            # = kernels.errors.comm_block_words(W) (runtime sits below kernels; a test ties them)
            block = self.alloc((COMM_BLOCK_WORDS_PER_RANK * self.world_size,), torch.int64)
            (rp, bad), (cp, _) = self.peer_table(recv), self.peer_table(block)
            b = CombineBuffers(recv, block[:self.world_size], rp, cp, block=block,
                               unreachable=bad)
            self._buffers[key] = b
        elif n != b.recv.shape[1] or max_recv_rows > b.recv.shape[0]:
            raise NvshmemError(
                f"receive buffer request [{max_recv_rows}, {n}] exceeds the allocated "
                f"[{b.recv.shape[0]}, {b.recv.shape[1]}] of {key!r} (symmetric buffers are "
                "allocated once; construct with the largest size)")
        return b

    def peer_tensor(self, t: torch.Tensor, pe: int) -> torch.Tensor:
        """Torch view of rank pe's copy of symmetric ``t`` through NVLink P2P (load/store);
        NvshmemError if pe is not mapped here (only the NVSHMEM calls reach it then)."""
        p = self._peer_view(t, pe)
        if p is None:
            raise NvshmemError(f"rank {pe} is not reachable by load/store from rank {self.rank} "
                               "(no NVLink/P2P mapping): a load/store view of its memory cannot "
                               "exist; only NVSHMEM calls (transport='nvshmem') reach it")
        return p

    def _peer_view(self, t, pe):
        self._check_live()
        if not 0 <= pe < self.world_size:
            raise ValueError(f"pe={pe} out of range [0, {self.world_size})")
        if pe == self.rank:
            return t
        p = self._nc.get_peer_tensor(t, pe)
        if p is None or p.data_ptr() == 0:
            return None
        return p

    def peer_table(self, t: torch.Tensor):
        """(int64 [W] device tensor of ``t``'s base address on every rank as mapped here, 0 for
        a rank without a load/store mapping; the tuple of those ranks)."""
        views = [self._peer_view(t, pe) for pe in range(self.world_size)]
        kept = [v for v in views if v is not None and v is not t]
        self._peer_views.extend(kept)  # keep the owners alive
        getattr(self, "_peer_views_of", {}).setdefault(id(t), []).extend(kept)
        ptrs = [0 if v is None else v.data_ptr() for v in views]
        bad = tuple(pe for pe, v in enumerate(views) if v is None)
        return torch.tensor(ptrs, dtype=torch.int64, device=self.device), bad

    def peer_ptrs(self, t: torch.Tensor) -> torch.Tensor:
        """int64 [W] device tensor: base address of ``t`` on every rank, as mapped here."""
        views = [self.peer_tensor(t, pe) for pe in range(self.world_size)]
        self._peer_views.extend(views)  # keep the mappings' owners alive
        ptrs = [v.data_ptr() for v in views]
        return torch.tensor(ptrs, dtype=torch.int64, device=self.device)

    def barrier(self, what: str = "NvshmemRuntime.barrier"):
        """Collective: synchronize this rank's device, then a barrier over the group, bounded
        (``collectives.bounded_barrier``: a rank that never comes raises a named error on the
        others). what: the call that holds it, for that error."""
        torch.cuda.synchronize(self.device)
        collectives.bounded_barrier(self.group, f"rank {self.rank}: {what}")

    # ---- teardown -------------------------------------------------------------------------
    def _check_live(self):
        if self._finalized:
            raise NvshmemError("NvshmemRuntime was finalized")

    def finalize(self):
        """Collective: frees the symmetric tensors and finalizes NVSHMEM. Idempotent."""
        if self._finalized:
            return
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        self._buffers.clear()
        self._peer_views.clear()
        getattr(self, "_peer_views_of", {}).clear()
        for t in self._tensors:
            try:
                self._nc.free_tensor(t)
            except Exception:
                pass
        self._tensors.clear()
        self._nc.finalize()
        self._finalized = True
        NvshmemRuntime._live.pop(id(self), None)
