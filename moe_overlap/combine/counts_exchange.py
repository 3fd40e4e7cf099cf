"""The routing counts all-gathered on the device (CuTe DSL, SIMT): every rank's per-expert counts
(int64 [E]) into every rank's table in the CommBuffer's symmetric memory, then copied out as the
int64 [W, E] that ``exchange_counts`` returns (``CommBuffer.exchange_counts``;
``exchange_counts(..., comm_buffer=)``). The host path (``runtime/collectives.all_gather``) is
the reference: bitwise the same counts, but a host collective per call, which a CUDA graph on a
gloo group (or ranks sharing one GPU, where NCCL refuses) cannot capture.

Counts table (``CommBuffer.counts_table``, symmetric int64, ``counts_table_words(W, E_cap)``
for the most experts E_cap of any layer attached): flags first, ``[p * W + s]`` for parity p
in {0, 1} and source s (the epoch of the call with which source s last wrote row p of this
rank), then the rows, ``[2W + (p * W + s) * E_cap + e]``, a call of E experts using the first E
words of each. Rows strided by the capacity, not by the call's E, so that layers of different
E sharing the buffer keep one row per (parity, source): with a stride of E, a larger E's row of
parity 0 would cover a smaller E's row of parity 1 and a fast rank's next call could overwrite
what a slow rank still reads (the argument below is per row). The flags come first, at the same
words for every E.

Per call, two kernels of one CTA (NT threads) on the stream, epoch = ``epoch[0] + 1`` (int64,
``CommBuffer.counts_epoch``: the calls completed on the buffer; it advances on the device, so
graph replays count too), parity p = epoch & 1:

1. post: thread 0 reads the error word first; if any error is recorded on this rank (sticky
   until a reset) the CTA stores nothing and posts no flag, so the peers' waits end on this
   rank's error word (ERR_PEER_ERROR) or time out. Else this rank's row into row (p, rank) of
   every rank's table and then flag (p, rank) = epoch there, by the transport:
   - ``nvlink``: the row's words as plain stores through the peer table (``counts_peers``),
     flattened over (destination, expert); bar.sync; then one thread per destination:
     fence.acq_rel.sys and st.release.sys of the flag (cumulative over the CTA's stores that
     the barrier ordered before it: dispatch_send.py's marker);
   - ``nvshmem``: one block-scoped ``put_signal_nbi_block`` per destination (the row, then the
     flag set to the epoch: NVSHMEM delivers the signal after the data), into the symmetric
     address of this rank's own table (NVSHMEM translates it for the destination PE), then
     ``quiet`` (the counts tensor may be reused once the kernel is done). The source row is
     read by the GPU's threads: NVSHMEM's P2P transport, as the dispatch's send.
2. gather: unless the error word is set, thread s (and s + NT, ...) waits for flag (p, s) of this
   rank's table to reach the epoch: ld.acquire.sys bounded by %globaltimer
   (``primitives.wait_ge_sys_s64_or_peer_error``: the source's error word polled through
   ``err_peers``), then fence.acq_rel.sys. A timeout records ERR_COUNTS_TIMEOUT (rank, source,
   epoch, flag, expected, elapsed); a source with an error recorded ERR_PEER_ERROR; a flag past
   the epoch (a rank reset alone, or ranks out of step) ERR_EPOCH_MISMATCH. bar.sync; then the
   CTA copies rows (p, 0 .. W-1) into ``out`` (L2-only loads: peers wrote them), or, with the
   error word set, zeros (the plan of an error call is empty; the later kernels refuse anyway
   and the host raises at the next call). bar.sync; thread 0 stores the epoch (the next call's
   post reads it after the kernel boundary).

Why two parities are enough (no fast rank overwrites a row a slow rank still reads): rank r
writes row (p, r) of rank d at call c (p = c & 1) and next writes that row at call c + 2. Its
post of c + 2 runs after its own gather of c + 1 on its stream, which waited for d's flag of
c + 1, which d posted in its post of c + 1, after its gather of c (the same stream): d's reads
of row (p, r) for call c are done before r can write it again. One table would not do: r's
post of c + 1 may run while d still reads c.

Why flag >= epoch is the wait and == the check: a flag of parity p holds the epochs c - 2, c,
... of that parity, and by the argument above it cannot pass c before this rank's gather of c
ends; a larger value means the ranks do not count the same calls.
"""

from .options import TRANSPORTS

DEFAULT_THREADS = 256
DEFAULT_TIMEOUT_NS = 10_000_000_000


def counts_table_words(world_size: int, num_experts: int) -> int:
    """int64 words of the counts table for W ranks and E experts: 2 x W flags, 2 x W x E row
    words (two parities)."""
    return 2 * int(world_size) * (int(num_experts) + 1)


def table_capacity(world_size: int, words: int) -> int:
    """The most experts E_cap a counts table of ``words`` int64 words holds for W ranks (the
    rows' stride): the inverse of ``counts_table_words``."""
    return int(words) // (2 * int(world_size)) - 1


def counts_table_bytes(world_size: int, num_experts: int) -> int:
    return 8 * counts_table_words(world_size, num_experts)


def check_transport(transport: str):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")


def build_counts_exchange(world_size: int, threads: int = DEFAULT_THREADS,
                          transport: str = "nvlink"):
    """@cute.jit launcher of the post and gather kernels for W = ``world_size`` ranks and the
    ``transport`` of the rows and flags (module docstring)."""
    check_transport(transport)
    W, NT = int(world_size), int(threads)
    if not 1 <= W <= 1024:
        raise ValueError(f"world_size={W} must be in [1, 1024]")
    if NT % 32 or not 32 <= NT <= 1024:
        raise ValueError(f"threads={NT} must be a multiple of 32 in [32, 1024]")
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from ..kernels.errors import ERR_COUNTS_TIMEOUT, ERR_EPOCH_MISMATCH, ERR_PEER_ERROR
    use_nvshmem = transport == "nvshmem"
    if use_nvshmem:
        import nvshmem.core.device.cute as nvdev
        from nvshmem.core import SignalOp

        def gmem(dtype, addr, n):
            """Tensor view of n elements at a (symmetric or local) global address (its pointer
            claims the element's own alignment, as dispatch_send.py's)."""
            return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem,
                                                  assumed_align=dtype.width // 8),
                                    cute.make_layout(n))

    @cute.kernel
    def post_kernel(counts: Int64, E: Int32, E_cap: Int32, rank: Int32, table: Int64,
                    table_peers: Int64, epoch_ptr: Int64, err: Int64):
        tidx, _, _ = P.thread_block_grid()
        e0 = Int32(0)
        if tidx == Int32(0):
            e0 = P.error_set(err)
        failed = P.block_any(e0)
        epoch = P.ld_s64(epoch_ptr) + Int64(1)
        p = epoch & Int64(1)
        flag_off = (p * Int64(W) + Int64(rank)) * Int64(8)
        row_off = (Int64(2 * W) + (p * Int64(W) + Int64(rank)) * Int64(E_cap)) * Int64(8)
        if failed == Int32(0):
            if cutlass.const_expr(use_nvshmem):
                d = Int32(0)
                while d < Int32(W):  # CTA-uniform: every thread takes part in each put
                    nvdev.put_signal_nbi_block(
                        gmem(cutlass.Int32, table + row_off, E * Int32(2)),
                        gmem(cutlass.Int32, counts, E * Int32(2)),
                        gmem(cutlass.Uint64, table + flag_off, 1), epoch,
                        SignalOp.SIGNAL_SET, d)
                    d = d + Int32(1)
                nvdev.quiet()
            else:
                i = Int64(tidx)
                while i < Int64(W) * Int64(E):
                    d = i // Int64(E)
                    e = i - d * Int64(E)
                    peer = P.ld_s64(table_peers + d * Int64(8))
                    P.st_s64(peer + row_off + e * Int64(8), P.ld_s64(counts + e * Int64(8)))
                    i = i + Int64(NT)
                P.block_sync()  # every row store of the CTA precedes the releases below
                d = tidx
                while d < Int32(W):
                    peer = P.ld_s64(table_peers + Int64(d) * Int64(8))
                    P.fence_acq_rel_sys()
                    P.st_release_sys_s64(peer + flag_off, epoch)
                    d = d + Int32(NT)

    @cute.kernel
    def gather_kernel(out: Int64, E: Int32, E_cap: Int32, rank: Int32, table: Int64,
                      epoch_ptr: Int64, err: Int64, err_peers: Int64, timeout_ns: Int64):
        tidx, _, _ = P.thread_block_grid()
        epoch = P.ld_s64(epoch_ptr) + Int64(1)
        p = epoch & Int64(1)
        s = tidx
        while s < Int32(W):
            if P.error_set(err) == Int32(0):
                t0 = P.globaltimer()
                st, v, el, code = P.wait_ge_sys_s64_or_peer_error(
                    table + (p * Int64(W) + Int64(s)) * Int64(8), epoch,
                    P.peer_error_word(err_peers, s, err), t0, timeout_ns)
                if st == Int32(1):
                    P.record_error(err, Int32(ERR_COUNTS_TIMEOUT), rank, s, Int32(epoch), v,
                                   epoch, el)
                elif st == Int32(2):
                    P.record_error(err, Int32(ERR_PEER_ERROR), rank, s, Int32(epoch), code, v,
                                   el)
                elif v != epoch:
                    P.record_error(err, Int32(ERR_EPOCH_MISMATCH), rank, s, s,
                                   P.call_tag(Int32(v), Int32(0)),
                                   P.call_tag(Int32(epoch), Int32(0)), Int64(0))
                P.fence_acq_rel_sys()
            s = s + Int32(NT)
        P.block_sync()  # every wait (and any error it recorded) before the copy
        e1 = Int32(0)
        if tidx == Int32(0):
            e1 = P.error_set(err)
        failed = P.block_any(e1)
        rows = table + (Int64(2 * W) + p * Int64(W) * Int64(E_cap)) * Int64(8)
        i = Int64(tidx)
        while i < Int64(W) * Int64(E):
            v = Int64(0)
            if failed == Int32(0):
                s_i = i // Int64(E)
                v = P.ld_cg_s64(rows + (s_i * Int64(E_cap) + i - s_i * Int64(E)) * Int64(8))
            P.st_s64(out + i * Int64(8), v)
            i = i + Int64(NT)
        P.block_sync()  # every thread has read the epoch before it advances
        if tidx == Int32(0):
            P.st_s64(epoch_ptr, epoch)

    @cute.jit
    def launch(counts: Int64, out: Int64, E: Int32, E_cap: Int32, rank: Int32, table: Int64,
               table_peers: Int64, epoch_ptr: Int64, err: Int64, err_peers: Int64,
               timeout_ns: Int64, stream: cuda.CUstream):
        post_kernel(counts, E, E_cap, rank, table, table_peers, epoch_ptr, err).launch(
            grid=[1, 1, 1], block=[NT, 1, 1], stream=stream)
        gather_kernel(out, E, E_cap, rank, table, epoch_ptr, err, err_peers, timeout_ns).launch(
            grid=[1, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


def counts_exchange_example_args():
    """Example arguments of the launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0), Int32(1), Int32(1), Int32(0)] + [Int64(0)] * 5 + \
        [Int64(DEFAULT_TIMEOUT_NS), cuda.CUstream(0)]


# The compiled launchers of this process: (W, threads, transport, NVSHMEM initialisation) ->
# compiled (nvshmem: (compiled, NvshmemKernelObject)). Kept until the process ends, as
# dispatch_send.py's _NVSHMEM_COMPILED: NVSHMEM keeps the address of a registered library's
# device state, which a collected compiled function would leave stale.
_COMPILED: dict = {}


class CountsExchange:
    """The compiled post + gather launcher of one (W, transport) and its launch helper (torch
    tensors in, never synchronizes; shared by every CommBuffer of that key in the process)."""

    def __init__(self, world_size: int, transport: str = "nvlink",
                 threads: int = DEFAULT_THREADS):
        check_transport(transport)
        self.world_size, self.transport, self.threads = int(world_size), transport, int(threads)
        self._launcher = None

    def compile(self):
        from .consumer import _have_gpu, use_sm90_nvshmem_bitcode
        nvshmem = self.transport == "nvshmem" and _have_gpu()
        if nvshmem:
            from ..runtime.nvshmem import NvshmemRuntime
            key = (self.world_size, self.threads, self.transport, NvshmemRuntime.inits)
        else:
            key = (self.world_size, self.threads, self.transport, None)
        hit = _COMPILED.get(key)
        if hit is None:
            launch = build_counts_exchange(self.world_size, self.threads, self.transport)
            if nvshmem:
                from nvshmem.core.interop.cute import cute_compile_helper
                hit = cute_compile_helper(launch, *counts_exchange_example_args())[0]
            else:
                import cutlass.cute as cute
                if self.transport == "nvshmem":
                    use_sm90_nvshmem_bitcode()  # no GPU to pick the bitcode by
                hit = cute.compile(launch, *counts_exchange_example_args())
            _COMPILED[key] = hit
        return hit

    def _launch(self, ints, stream):
        from ..kernels.primitives import LaunchCache
        if self._launcher is None:
            self._launcher = LaunchCache(self.compile())
        self._launcher(ints, stream.cuda_stream)

    def warmup(self, device, num_experts: int, stream=None):
        """Compile, load and run the launcher once with no effect (an error word of its own
        set: the post stores nothing, the gather waits for nothing, zeroes a scratch output and
        advances a scratch epoch), so that a call's first launch does not compile or load a
        module while a peer's gather spins on its flag."""
        import torch
        from ..kernels.errors import ERR_WORDS
        if stream is None:
            stream = torch.cuda.current_stream(device)
        W, E = self.world_size, int(num_experts)
        err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)
        err[0] = 1
        counts = torch.zeros(E, dtype=torch.int64, device=device)
        out = torch.empty(W, E, dtype=torch.int64, device=device)
        table = torch.zeros(counts_table_words(W, E), dtype=torch.int64, device=device)
        peers = torch.full((W,), table.data_ptr(), dtype=torch.int64, device=device)
        epoch = torch.zeros(1, dtype=torch.int64, device=device)
        self._launch((counts.data_ptr(), out.data_ptr(), E, E, 0, table.data_ptr(),
                      peers.data_ptr(), epoch.data_ptr(), err.data_ptr(), 0, 1), stream)
        torch.cuda.synchronize(device)

    def launch(self, *, counts, out, rank: int, table, table_peers, epoch, err, err_peers,
               timeout_ns: int, stream=None):
        """counts: int64 [E] contiguous (this rank's); out: int64 [W, E] contiguous; table:
        this rank's counts table (symmetric, ``counts_table_words(W, E_cap)`` words for its
        capacity E_cap >= E: the rows' stride, read from its size);
        table_peers: int64 [W] (every rank's table as mapped here; the nvshmem transport reads
        none: its symmetric address is ``table``); epoch: int64 [1]; err: this rank's error
        word; err_peers: int64 [W] (or None)."""
        import torch
        if stream is None:
            stream = torch.cuda.current_stream(out.device)
        self._launch((counts.data_ptr(), out.data_ptr(), counts.numel(),
                      table_capacity(self.world_size, table.numel()), int(rank),
                      table.data_ptr(), table_peers.data_ptr(), epoch.data_ptr(),
                      err.data_ptr(), 0 if err_peers is None else err_peers.data_ptr(),
                      int(timeout_ns)), stream)
