"""The overlapped dispatch's send kernel (CuTe DSL, SIMT): each token once to every rank that owns
any of its top-k experts, stored into that rank's receive slot (``MoEDispatch(backend=
"overlap")``; slot layout and a host mirror of the index math: combine/dispatch_index.py).

Launched on ``ctas`` CTAs of NT threads (a few SMs). Per call (epoch = ``epoch[0]``, slot parity
epoch & 1):

1. thread 0 reads the error word: if any error is recorded on this rank (sticky until a reset)
   the CTA stores nothing and posts no arrival, so the owners' waits end on this rank's error
   word or time out (as the combine's consumer).
2. every CTA takes the destinations in the order d = (rank - k) mod W, k = 0 .. W-1: its own
   rank first, then the rank before it, ... That is the order in which each owner's per-source
   expand takes its sources (owner o waits for source (o + k) mod W k-th, dispatch_expand.py),
   so at step k every rank sends to the owner that waits for it k-th. Per destination d, every
   CTA walks all tokens in batches of NT, a thread per token: whether any of its ids in
   [0, E) is owned by d (rank id // El; other ids are ignored), one ``vote.ballot`` per warp,
   the warps' popcounts before it (shared memory) and a running count of the earlier batches:
   token t's row in d's slot is the number of tokens t' < t that also go to d (token order,
   compacted per destination; computed by every CTA, so no CTA waits on another). Batch b is
   stored by CTA b % ctas: its tokens to d (a shared list) into rows base + 0, 1, ... of d's
   slot, then their int32 ids, by the transport:
   - ``nvlink``: 16-byte vector stores flattened over (row, chunk), then the ids one int32 per
     thread, through the CommBuffer's peer table (``recv_peers``: NVLink load/store mapping);
   - ``nvshmem``: one block-scoped ``put_nbi_block`` per row (a row is contiguous at both
     ends, rows are not: the list picks them from x), then every thread of a row puts that
     row's K ids (thread-scoped ``put_nbi``, the rows' ids in parallel: a block-scoped put of K
     ids per row would cost a barrier for a few dozen bytes), into d's symmetric slot address.
     The symmetric addresses are this rank's own entries of the same tables (recv_peers[rank],
     ctr_peers[rank]: the local receive buffer and communication block, which NVSHMEM
     translates for PE d), so both variants take one argument list. The sources (x, ids) are
     whatever addresses the launch passes: the caller's tensors, which NVSHMEM's P2P (NVLink)
     transport reads with the GPU's threads, or, where a peer is reachable only by a network
     transport (IB: RDMA reads symmetric or registered memory only), their copies in the
     CommBuffer's symmetric staging region (``MoEDispatch(stage_source=)``, "Staged source"
     below). The kernel is the same either way.
3. d's arrival, right after the CTA's data to d (not after every destination's): bar.sync,
   then thread 0: the count of tokens sent to d (its slot's count word of this source), the
   call tag (``call_tag(epoch, the plan's counts fingerprint)``, into word W + parity * W + rank
   of d's communication block), then the marker, 1 added to d's counter[rank]:
   - ``nvlink``: st.global of the count, st.relaxed.sys of the tag, fence.acq_rel.sys,
     red.release.sys.add (cumulative over the CTA's stores ordered before it by the barrier);
   - ``nvshmem``: ``p`` of the count, ``signal_op`` SET of the tag, ``fence`` (NVSHMEM delivers
     every earlier put and signal of this CTA to d before any later one: the pattern of its
     own ``put_signal_nbi_block``: the block's puts, a barrier, one thread's fence + signal),
     ``signal_op`` ADD of the marker; the kernel ends with ``quiet`` (x and ids may be reused
     once the kernel is done).
   So each call adds exactly ``ctas`` to every owner's counter of this source (one marker per
   CTA, 0 tokens or not): the owner's expected count advances by ``ctas`` per source and call
   with no data read (the CTA count must be the same on every rank: MoEDispatch agrees on it).
   The owner's wait and expand are the same for both transports: they read its own counters,
   tags and slot.
   Why a marker per CTA and not the rows: the owner cannot know how many tokens a source sends
   it (deduplicated per destination) without the data; the count travels in the slot and the
   marker tells that it and the rows have landed.

Staged source (nvshmem transport, ``MoEDispatch(stage_source=)``): the call copies x and the
int32 ids into the staging region (``CommBuffer.staged_source``: [T, D] bf16 rows, then [T, K]
int32 ids, the layout the kernel reads x and ids in) on the stream, then launches this kernel
with the region's addresses as x and ids. Order: (a) the copies of call c happen-before its
puts: the same stream, and a kernel starts after the stream's earlier work is complete and
visible to it; (b) the region is free to overwrite at call c: the send of call c - 1 (this
layer's or another's on the buffer, one call at a time on the stream) ended with ``quiet``,
which returns once each of its threads' puts is complete at the source side (the source read,
free for reuse), before the kernel ended and so before the copies of call c began.

Why the slots are free to write (the combine's argument, docs/CONTRACTS.md): this rank's send
of call c runs after its expand (or scale) of call c - 1 on the stream, which waited for every
owner's markers of c - 1, which each owner posted after its own reader of c - 2, the last one
of this slot.
"""

from .options import TRANSPORTS

DEFAULT_THREADS = 256
DEFAULT_CTAS = 8
COPY_UNROLL = 4  # 16-byte vectors in flight per thread in the nvlink row copy


def check_transport(transport: str):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")


def build_dispatch_send(world_size: int, topk: int, threads: int = DEFAULT_THREADS,
                        transport: str = "nvlink"):
    """@cute.jit launcher of the send kernel for W = ``world_size`` ranks (shared arrays of W
    destinations), ``topk`` ids per token and the ``transport`` of its data and arrivals."""
    check_transport(transport)
    W, K, NT = int(world_size), int(topk), int(threads)
    if not 1 <= W <= 64:
        raise ValueError(f"world_size={W} must be in [1, 64] (a 64-bit destination mask)")
    if not 1 <= K <= 64:
        raise ValueError(f"topk={K} must be in [1, 64]")
    if NT % 32 or not 32 <= NT <= 1024 or NT < W:
        raise ValueError(f"threads={NT} must be a multiple of 32 in [max(32, W), 1024]")
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from .plan_kernel import simt_helpers
    H = simt_helpers()
    lds, sts, ptx1 = H.lds, H.sts, H.ptx1
    NW = NT // 32
    use_nvshmem = transport == "nvshmem"
    if use_nvshmem:
        import nvshmem.core.device.cute as nvdev
        from nvshmem.core import SignalOp

        def gmem(dtype, addr, n):
            """Tensor view of n elements at a (symmetric or local) global address; its pointer
            claims the element's own alignment (the only one nvshmem4py's externs match)."""
            return cute.make_tensor(cute.make_ptr(dtype, addr, cute.AddressSpace.gmem,
                                                  assumed_align=dtype.width // 8),
                                    cute.make_layout(n))

    def ballot(pred):
        return ptx1("{ .reg .pred p; setp.ne.s32 p, {$r0}, 0; "
                    "vote.sync.ballot.b32 {$w0}, p, -1; }", pred)

    def popc(v):
        return ptx1("popc.b32 {$w0}, {$r0};", v)

    def bit(mask, d):
        """Int32 bit d of an Int64 mask."""
        return Int32((mask >> Int64(d)) & Int64(1))

    @cute.kernel
    def send_kernel(x: Int64, ids: Int64, T: Int32, El: Int32, row_bytes: Int64, rank: Int32,
                    tmax: Int32, recv_peers: Int64, ctr_peers: Int64, slot_bytes: Int64,
                    ids_offset: Int64, count_offset: Int64, epoch_ptr: Int64,
                    fingerprint_ptr: Int64, err: Int64):
        tidx, bidx, nblk = P.thread_block_grid()
        lane = tidx & Int32(31)
        warp = tidx >> Int32(5)
        lt_mask = (Int32(1) << lane) - Int32(1)
        alloc = cutlass.memory.SmemAllocator()
        arr = alloc.allocate_array(cutlass.Int32, NW + NT, byte_alignment=16).toint()
        CNT = arr  # [NW] the batch's tokens to d per warp
        LIST = CNT + Int32(4 * NW)  # [NT] the batch's tokens to d, in token order
        E = El * Int32(W)
        epoch = P.ld_s32(epoch_ptr)
        slot_off = Int64(epoch & Int32(1)) * slot_bytes
        if cutlass.const_expr(use_nvshmem):
            recv_sym = P.ld_s64(recv_peers + Int64(rank) * Int64(8))  # local = symmetric
            ctr_sym = P.ld_s64(ctr_peers + Int64(rank) * Int64(8))
        e0 = Int32(0)
        if tidx == Int32(0):
            e0 = P.error_set(err)
        failed = P.block_any(e0)
        nb = (T + Int32(NT - 1)) // Int32(NT)
        if failed != Int32(0):
            nb = Int32(0)
        n_ch = row_bytes // Int64(16)
        k = Int32(0)
        while k < Int32(W):
            d = (rank - k + Int32(W)) % Int32(W)
            if cutlass.const_expr(use_nvshmem):
                dst0 = recv_sym + slot_off  # d's slot: this address on PE d
            else:
                dst0 = P.ld_s64(recv_peers + Int64(d) * Int64(8)) + slot_off
            sent = Int32(0)  # tokens to d in the batches before
            b = Int32(0)
            while b < nb:
                t = b * Int32(NT) + tidx
                hit = Int32(0)
                if t < T:
                    for j in cutlass.range_constexpr(K):
                        v = P.ld_s32(ids + (Int64(t) * Int64(K) + Int64(j)) * Int64(4))
                        if P.in_range_s64(Int64(v), Int64(0), Int64(E)) != Int32(0):
                            if v // El == d:
                                hit = Int32(1)
                bl = ballot(hit)
                if lane == Int32(0):
                    sts(CNT, warp, popc(bl))
                P.block_sync()
                before = Int32(0)
                n = Int32(0)
                for w in cutlass.range_constexpr(NW):
                    cw = lds(CNT, Int32(w))
                    if Int32(w) < warp:
                        before = before + cw
                    n = n + cw
                if b % nblk == bidx:  # this CTA stores batch b
                    if hit != Int32(0):
                        sts(LIST, before + popc(bl & lt_mask), tidx)
                    P.block_sync()
                    base = Int64(rank) * Int64(tmax) + Int64(sent)
                    if cutlass.const_expr(use_nvshmem):
                        row_elems = Int32(row_bytes // Int64(2))  # bf16
                        r = Int32(0)
                        while r < n:  # CTA-uniform: every thread takes part in each put
                            tok = Int64(b * Int32(NT) + lds(LIST, r))
                            nvdev.put_nbi_block(
                                gmem(cutlass.BFloat16, dst0 + (base + Int64(r)) * row_bytes,
                                     row_elems),
                                gmem(cutlass.BFloat16, x + tok * row_bytes, row_elems), d)
                            r = r + Int32(1)
                        if tidx < n:
                            tok = Int64(b * Int32(NT) + lds(LIST, tidx))
                            nvdev.put_nbi(
                                gmem(cutlass.Int32, dst0 + ids_offset
                                     + (base + Int64(tidx)) * Int64(K * 4), K),
                                gmem(cutlass.Int32, ids + tok * Int64(K * 4), K), d)
                    else:
                        # COPY_UNROLL vectors per thread in flight: the group's loads, then
                        # its stores (n <= NT rows of n_ch chunks: 32-bit counts, checked by
                        # DispatchSend.launch)
                        lim = n * Int32(n_ch)
                        iv = tidx
                        while iv < lim:
                            oks, dsts, vals = [], [], []
                            for vec in cutlass.range_constexpr(COPY_UNROLL):
                                at = iv + Int32(vec * NT)
                                ok = Int32(0)
                                dst = Int64(0)
                                w0 = Int32(0)
                                w1 = Int32(0)
                                w2 = Int32(0)
                                w3 = Int32(0)
                                if at < lim:
                                    ri = at // Int32(n_ch)
                                    ci = Int64(at - ri * Int32(n_ch))
                                    ti = Int64(b * Int32(NT) + lds(LIST, ri))
                                    ok = Int32(1)
                                    dst = dst0 + (base + Int64(ri)) * row_bytes + ci * Int64(16)
                                    w0, w1, w2, w3 = P.ld_v4(x + ti * row_bytes + ci * Int64(16))
                                oks.append(ok)
                                dsts.append(dst)
                                vals.append([w0, w1, w2, w3])
                            for vec in cutlass.range_constexpr(COPY_UNROLL):
                                if oks[vec] != Int32(0):
                                    P.st_v4(dsts[vec], vals[vec])
                            iv = iv + Int32(NT * COPY_UNROLL)
                        i = Int64(tidx)
                        while i < Int64(n) * Int64(K):
                            r = i // Int64(K)
                            j = i - r * Int64(K)
                            tok = Int64(b * Int32(NT) + lds(LIST, Int32(r)))
                            P.st_s32(dst0 + ids_offset + ((base + r) * Int64(K) + j) * Int64(4),
                                     P.ld_s32(ids + (tok * Int64(K) + j) * Int64(4)))
                            i = i + Int64(NT)
                P.block_sync()  # the counts and the list are read before the next batch
                sent = sent + n
                b = b + Int32(1)
            # ---- d's arrival: count word, call tag, this CTA's marker (0 tokens or not)
            P.block_sync()  # every store of the CTA to d precedes the release below
            if tidx == Int32(0) and failed == Int32(0):
                if cutlass.const_expr(use_nvshmem):
                    nvdev.p(gmem(cutlass.Int32, dst0 + count_offset + Int64(rank) * Int64(4),
                                 1), sent, d)
                    tag_off = (Int64(W) + Int64(epoch & Int32(1)) * Int64(W)
                               + Int64(rank)) * Int64(8)
                    nvdev.signal_op(gmem(cutlass.Uint64, ctr_sym + tag_off, 1),
                                    P.call_tag(epoch, P.ld_s32(fingerprint_ptr)),
                                    SignalOp.SIGNAL_SET, d)
                    nvdev.fence()  # rows, ids, count and tag delivered before the marker
                    nvdev.signal_op(gmem(cutlass.Uint64, ctr_sym + Int64(rank) * Int64(8), 1),
                                    Int64(1), SignalOp.SIGNAL_ADD, d)
                else:
                    P.st_s32(dst0 + count_offset + Int64(rank) * Int64(4), sent)
                    peer_ctr = P.ld_s64(ctr_peers + Int64(d) * Int64(8))
                    P.st_relaxed_sys_s64(peer_ctr + (Int64(W) + Int64(epoch & Int32(1))
                                                     * Int64(W) + Int64(rank)) * Int64(8),
                                         P.call_tag(epoch, P.ld_s32(fingerprint_ptr)))
                    P.fence_acq_rel_sys()
                    P.red_release_sys_add_s64(peer_ctr + Int64(rank) * Int64(8), Int64(1))
            k = k + Int32(1)
        if cutlass.const_expr(use_nvshmem):
            nvdev.quiet()  # this thread's puts complete: x and ids free once the kernel ends

    @cute.jit
    def launch(x: Int64, ids: Int64, T: Int32, El: Int32, row_bytes: Int64, rank: Int32,
               tmax: Int32, recv_peers: Int64, ctr_peers: Int64, slot_bytes: Int64,
               ids_offset: Int64, count_offset: Int64, epoch_ptr: Int64, fingerprint_ptr: Int64,
               err: Int64, ctas: Int32, stream: cuda.CUstream):
        send_kernel(x, ids, T, El, row_bytes, rank, tmax, recv_peers, ctr_peers, slot_bytes,
                    ids_offset, count_offset, epoch_ptr, fingerprint_ptr, err).launch(
            grid=[ctas, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


def send_example_args():
    """Example arguments of the send launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0), Int32(0), Int32(1), Int64(16), Int32(0), Int32(1)] + \
        [Int64(0)] * 8 + [Int32(1), cuda.CUstream(0)]


# The nvshmem sends compiled in this process, kept until it ends: (W, topk, threads, NVSHMEM
# initialisation) -> (compiled, NvshmemKernelObject). Why they are never released: the
# consumer's _NVSHMEM_COMPILED (combine/consumer.py): NVSHMEM keeps the address of a registered
# library's device state, which a collected compiled function would leave stale.
_NVSHMEM_COMPILED: dict = {}


def _nvshmem_send(world_size: int, topk: int, threads: int):
    """(compiled send, its NvshmemKernelObject) of the nvshmem transport, compiled and
    registered with NVSHMEM on first use in this process's NVSHMEM initialisation."""
    from ..runtime.nvshmem import NvshmemRuntime
    key = (world_size, topk, threads, NvshmemRuntime.inits)
    hit = _NVSHMEM_COMPILED.get(key)
    if hit is None:
        from nvshmem.core.interop.cute import cute_compile_helper
        hit = _NVSHMEM_COMPILED[key] = cute_compile_helper(
            build_dispatch_send(world_size, topk, threads, "nvshmem"), *send_example_args())
    return hit


class DispatchSend:
    """Compiled send kernel + launch helper (torch tensors in, never synchronizes). transport:
    "nvlink" (peer stores) or "nvshmem" (NVSHMEM puts and signals; its compiled kernel is
    shared by every DispatchSend of the same build in the process, never unloaded)."""

    def __init__(self, world_size: int, topk: int, threads: int = DEFAULT_THREADS,
                 ctas: int = DEFAULT_CTAS, transport: str = "nvlink"):
        if not 1 <= int(ctas) <= 1024:
            raise ValueError(f"ctas={ctas} must be in [1, 1024]")
        check_transport(transport)
        self.world_size, self.topk = int(world_size), int(topk)
        self.threads, self.ctas = int(threads), int(ctas)
        self.transport = transport
        self._fn = None
        self._launcher = None

    def compile(self):
        if self._fn is None:
            from .consumer import _have_gpu, use_sm90_nvshmem_bitcode
            if self.transport == "nvshmem" and _have_gpu():
                self._fn = _nvshmem_send(self.world_size, self.topk, self.threads)[0]
            else:
                import cutlass.cute as cute
                if self.transport == "nvshmem":
                    use_sm90_nvshmem_bitcode()  # no GPU to pick the bitcode by
                self._fn = cute.compile(build_dispatch_send(self.world_size, self.topk,
                                                            self.threads, self.transport),
                                        *send_example_args())
        return self._fn

    def warmup(self, device, stream=None):
        """Compile, load and run the kernel once with no effect (an error word of its own set,
        0 tokens: it stores nothing and posts no marker), so that a call's first launch does
        not compile or load a module while a peer's wait spins on its markers."""
        import torch
        from ..kernels.errors import ERR_WORDS
        from ..kernels.primitives import LaunchCache
        if self._launcher is None:
            self._launcher = LaunchCache(self.compile())
        if stream is None:
            stream = torch.cuda.current_stream(device)
        err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)
        err[0] = 1
        table = torch.zeros(max(self.world_size, 1), dtype=torch.int64, device=device)
        word = torch.zeros(1, dtype=torch.int32, device=device)
        self._launcher((0, 0, 0, 1, 16, 0, 1, table.data_ptr(), table.data_ptr(), 0, 0, 0,
                        word.data_ptr(), word.data_ptr(), err.data_ptr(), self.ctas),
                       stream.cuda_stream)
        torch.cuda.synchronize(device)

    def launch(self, *, x, ids, experts_per_rank: int, rank: int, max_tokens: int, recv_peers,
               ctr_peers, layout: dict, slot_stride: int, epoch, fingerprint, err, stream=None):
        """x: [T, D] bf16 contiguous; ids: int32 [T, topk] contiguous (the caller's, or their
        staged copies: the module doc's "Staged source"); recv_peers / ctr_peers:
        int64 [W] (the CommBuffer's receive-buffer / communication-block base on every rank,
        mapped here; the nvshmem transport reads only this rank's entries: its symmetric
        addresses); layout: ``dispatch_index.slot_layout``; slot_stride: bytes between the
        buffer's two slots (``CommBuffer.slot_bytes``, >= layout's); epoch / fingerprint: int32
        [1]."""
        import torch
        from ..kernels.primitives import LaunchCache
        if self.threads * (layout["row_bytes"] // 16) >= 2 ** 31:
            raise ValueError(f"row_bytes={layout['row_bytes']}: a batch of {self.threads} rows "
                             "of it overflows the send's 32-bit chunk count")
        fn = self.compile()
        if self._launcher is None:
            self._launcher = LaunchCache(fn)
        if stream is None:
            stream = torch.cuda.current_stream(x.device)
        self._launcher((x.data_ptr(), ids.data_ptr(), ids.shape[0], int(experts_per_rank),
                        layout["row_bytes"], int(rank), int(max_tokens), recv_peers.data_ptr(),
                        ctr_peers.data_ptr(), int(slot_stride), layout["ids_offset"],
                        layout["count_offset"], epoch.data_ptr(), fingerprint.data_ptr(),
                        err.data_ptr(), self.ctas), stream.cuda_stream)
