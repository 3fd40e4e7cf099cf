"""Consumer: persistent CuTe DSL kernel that ships finished row bands of y to their owners.

Launched on ``ccta`` CTAs (one per SM) on a higher-priority stream than the producer GEMM.

Per call (epoch = ``epoch[0]``), CTA i walks the plan's remote segments i, i + ccta, ...:
  1. thread 0 waits (ld.acquire.gpu, bounded by %globaltimer) until ``band_ready[b] == epoch`` for
     every band b = schedule[segment_start[s] + j], j < segment_bands[s]; on timeout it records
     (rank, segment, band, value, epoch) in the error buffer and the CTA exits;
     ``bar.red.or`` broadcasts the outcome to the CTA (and orders the other threads' loads after
     the acquire: producer release -> acquire -> bar.sync -> loads, causality order is transitive);
  2. the CTA copies ``segment_rows[s] * N`` bf16 (contiguous) from y row ``segment_src_row[s]`` to
     rank ``segment_dest[s]``'s receive buffer at row ``segment_dest_row[s]``:
       - transport ``nvlink``: 16-byte ld.global.cg / st.global.v4 to the peer's mapped address,
         UNROLL independent loads in flight per thread before the stores;
       - transport ``nvshmem``: ``put_signal_nbi_block`` (NVSHMEM orders the signal after the data);
  3. arrival: bar.sync (all data stores of the CTA precede it), then thread 0 issues
     fence.acq_rel.sys + red.release.sys.add on the destination's counter[rank] (+rows shipped).
     The owner's scale observes it with ld.acquire.sys; the release is cumulative over the CTA's
     stores ordered before it by the barrier.

Local bands (dest == rank, schedule positions [num_remote_bands, num_bands)) never cross the link:
after its remote segments, CTA i copies local bands i, i + ccta, ... from y into the rank's OWN
receive buffer (same 16-byte copy, HBM -> HBM) and adds the rows to its own counter[rank]. The
scale therefore reads every assignment from the receive buffer and waits on every counter alike.

Call marker and receive slots: at kernel start CTA 0 adds 1 to counter[rank] on every rank (its
own too), and every destination row is offset by (epoch & 1) * slot_bytes (double-buffered receive
buffer). See moe_overlap/overlap.py for why this makes back-to-back calls race-free.

Dependencies are one-way: the consumer waits on the producer's band flags, never the reverse.
All pointers are passed as 64-bit ints (``tensor.data_ptr()``), see primitives.py.
"""

import os

TRANSPORTS = ("nvlink", "nvshmem")
DEFAULT_THREADS = 512
DEFAULT_UNROLL = 4
DEFAULT_TIMEOUT_NS = 10_000_000_000  # 10 s


def _cute():
    import cutlass  # noqa: F401  (lazy: the package must import without CuTe DSL)
    import cutlass.cute as cute
    return cutlass, cute


def build_consumer(transport: str = "nvlink", threads: int = DEFAULT_THREADS,
                   unroll: int = DEFAULT_UNROLL):
    """Returns the @cute.jit launcher for one (transport, threads, unroll) variant."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads={threads} must be a multiple of 32 in [32, 1024]")
    if unroll < 1 or unroll > 16:
        raise ValueError(f"unroll={unroll} must be in [1, 16]")
    cutlass, cute = _cute()
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from . import primitives as P

    NT = threads
    U = unroll
    use_nvshmem = transport == "nvshmem"
    if use_nvshmem:
        import nvshmem.core.device.cute as nvdev
        from nvshmem.core import SignalOp

    @cute.jit
    def copy_rows(src: Int64, dst: Int64, nbytes: Int64, tidx: Int32):
        """CTA-wide contiguous copy of nbytes (multiple of 16) with 16-byte vectors."""
        nvec = nbytes // Int64(16)
        chunk = Int64(NT * U)
        full = (nvec // chunk) * chunk
        i0 = Int64(0)
        while i0 < full:
            vals = []
            for u in cutlass.range_constexpr(U):
                vals.append(P.ld_v4_cg(src + (i0 + Int64(u * NT) + Int64(tidx)) * Int64(16)))
            for u in cutlass.range_constexpr(U):
                P.st_v4(dst + (i0 + Int64(u * NT) + Int64(tidx)) * Int64(16), vals[u])
            i0 = i0 + chunk
        i = full + Int64(tidx)
        while i < nvec:
            P.st_v4(dst + i * Int64(16), P.ld_v4_cg(src + i * Int64(16)))
            i = i + Int64(NT)

    @cute.jit
    def wait_bands(sched: Int64, band_ready: Int64, pos0: Int32, nbands: Int32, epoch: Int32,
                   t0: Int64, timeout_ns: Int64, err: Int64, rank: Int32, seg: Int32):
        """Thread-0 wait for bands schedule[pos0 .. pos0+nbands); returns timed_out (Int32)."""
        timed_out = Int32(0)
        j = Int32(0)
        while j < nbands and timed_out == Int32(0):
            b = P.ld_s32(sched + Int64(pos0 + j) * Int64(4))
            to, v, el = P.wait_eq_gpu_s32(band_ready + Int64(b) * Int64(4), epoch, t0,
                                          timeout_ns)
            if to != Int32(0):
                timed_out = Int32(1)
                P.record_error(err, Int32(P.ERR_CONSUMER_TIMEOUT), rank, seg, b, Int64(v),
                               Int64(epoch), el)
            j = j + Int32(1)
        return timed_out

    @cute.kernel
    def consumer_kernel(y: Int64, row_bytes: Int64, rank: Int32,
                        num_segments: Int64, seg_start: Int64, seg_bands: Int64,
                        seg_dest: Int64, seg_src_row: Int64, seg_dest_row: Int64,
                        seg_rows: Int64, schedule: Int64, num_bands: Int64,
                        num_remote_bands: Int64, band_src_row: Int64, band_valid: Int64,
                        band_dest_row: Int64, band_ready: Int64, epoch_ptr: Int64,
                        recv_peers: Int64, ctr_peers: Int64, recv_sym: Int64, ctr_sym: Int64,
                        err: Int64, timeout_ns: Int64, slot_bytes: Int64, world: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tidx = Int32(tidx)
        bidx = Int32(bidx)
        nblk = Int32(nblk)
        epoch = P.ld_s32(epoch_ptr)
        nseg = P.ld_s32(num_segments)
        failed = Int32(0)
        t_start = P.globaltimer()
        # receive slot of this call (double buffer by epoch parity, see OverlapCombine)
        slot_off = Int64(epoch & Int32(1)) * slot_bytes

        # ---- call marker: +1 on counter[rank] of every rank (ours too). It tells each owner
        # that this rank's consumer of this call has started, i.e. (stream order) that this
        # rank's scale of the previous call is done reading its receive slot.
        if bidx == Int32(0) and tidx < world:
            if cutlass.const_expr(use_nvshmem):
                sig_m = cute.make_tensor(cute.make_ptr(cutlass.Uint64,
                                                       ctr_sym + Int64(rank) * Int64(8),
                                                       cute.AddressSpace.gmem, assumed_align=8),
                                         cute.make_layout(1))
                nvdev.signal_op(sig_m, Int64(1), SignalOp.SIGNAL_ADD, tidx)
            else:
                P.red_release_sys_add_s64(
                    P.ld_s64(ctr_peers + Int64(tidx) * Int64(8)) + Int64(rank) * Int64(8),
                    Int64(1))

        # ---- remote segments -----------------------------------------------------------------
        s = bidx
        while s < nseg and failed == Int32(0):
            off = Int64(s) * Int64(4)
            to = Int32(0)
            if tidx == Int32(0):
                to = wait_bands(schedule, band_ready, P.ld_s32(seg_start + off),
                                P.ld_s32(seg_bands + off), epoch, t_start, timeout_ns, err,
                                rank, s)
            failed = P.block_any(to)
            if failed == Int32(0):
                dest = P.ld_s32(seg_dest + off)
                rows = P.ld_s32(seg_rows + off)
                src = y + Int64(P.ld_s32(seg_src_row + off)) * row_bytes
                dst_off = Int64(P.ld_s32(seg_dest_row + off)) * row_bytes + slot_off
                nbytes = Int64(rows) * row_bytes
                if cutlass.const_expr(use_nvshmem):
                    n_el = Int32(nbytes // Int64(2))
                    lay = cute.make_layout(n_el)
                    dst_t = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, recv_sym + dst_off,
                                                           cute.AddressSpace.gmem,
                                                           assumed_align=2), lay)
                    src_t = cute.make_tensor(cute.make_ptr(cutlass.BFloat16, src,
                                                           cute.AddressSpace.gmem,
                                                           assumed_align=2), lay)
                    sig_t = cute.make_tensor(cute.make_ptr(cutlass.Uint64,
                                                           ctr_sym + Int64(rank) * Int64(8),
                                                           cute.AddressSpace.gmem,
                                                           assumed_align=8),
                                             cute.make_layout(1))
                    nvdev.put_signal_nbi_block(dst_t, src_t, sig_t, Int64(rows),
                                               SignalOp.SIGNAL_ADD, dest)
                else:
                    dst = P.ld_s64(recv_peers + Int64(dest) * Int64(8)) + dst_off
                    copy_rows(src, dst, nbytes, tidx)
                    P.block_sync()
                    if tidx == Int32(0):
                        P.fence_acq_rel_sys()
                        P.red_release_sys_add_s64(
                            P.ld_s64(ctr_peers + Int64(dest) * Int64(8)) + Int64(rank) * Int64(8),
                            Int64(rows))
            s = s + nblk

        # ---- local bands: y -> own receive buffer --------------------------------------------
        nb = P.ld_s32(num_bands)
        p = P.ld_s32(num_remote_bands) + bidx
        own_recv = P.ld_s64(recv_peers + Int64(rank) * Int64(8))
        own_ctr = P.ld_s64(ctr_peers + Int64(rank) * Int64(8)) + Int64(rank) * Int64(8)
        while p < nb and failed == Int32(0):
            to = Int32(0)
            if tidx == Int32(0):
                to = wait_bands(schedule, band_ready, p, Int32(1), epoch, t_start, timeout_ns,
                                err, rank, Int32(-1))
            failed = P.block_any(to)
            if failed == Int32(0):
                b = P.ld_s32(schedule + Int64(p) * Int64(4))
                boff = Int64(b) * Int64(4)
                rows = P.ld_s32(band_valid + boff)
                src = y + Int64(P.ld_s32(band_src_row + boff)) * row_bytes
                dst = own_recv + slot_off + Int64(P.ld_s32(band_dest_row + boff)) * row_bytes
                copy_rows(src, dst, Int64(rows) * row_bytes, tidx)
                P.block_sync()
                if tidx == Int32(0):
                    P.fence_acq_rel_gpu()
                    P.red_release_gpu_add_s64(own_ctr, Int64(rows))
            p = p + nblk
        if cutlass.const_expr(use_nvshmem):
            nvdev.quiet()

    @cute.jit
    def launch(y: Int64, row_bytes: Int64, rank: Int32,
               num_segments: Int64, seg_start: Int64, seg_bands: Int64,
               seg_dest: Int64, seg_src_row: Int64, seg_dest_row: Int64,
               seg_rows: Int64, schedule: Int64, num_bands: Int64,
               num_remote_bands: Int64, band_src_row: Int64, band_valid: Int64,
               band_dest_row: Int64, band_ready: Int64, epoch_ptr: Int64,
               recv_peers: Int64, ctr_peers: Int64, recv_sym: Int64, ctr_sym: Int64,
               err: Int64, timeout_ns: Int64, slot_bytes: Int64, world: Int32, ccta: Int32,
               stream: cuda.CUstream):
        consumer_kernel(y, row_bytes, rank, num_segments, seg_start, seg_bands, seg_dest,
                        seg_src_row, seg_dest_row, seg_rows, schedule, num_bands,
                        num_remote_bands, band_src_row, band_valid, band_dest_row, band_ready,
                        epoch_ptr, recv_peers, ctr_peers, recv_sym, ctr_sym, err,
                        timeout_ns, slot_bytes, world).launch(grid=[ccta, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


_ARG_NAMES = ("y", "row_bytes", "rank", "num_segments", "segment_start", "segment_bands",
              "segment_dest", "segment_src_row", "segment_dest_row", "segment_rows", "schedule",
              "num_bands", "num_remote_bands", "band_src_row", "band_valid", "band_dest_row",
              "band_ready", "epoch", "recv_peers", "ctr_peers", "recv_sym", "ctr_sym", "err",
              "timeout_ns", "slot_bytes", "world", "ccta")


def compile_consumer(transport: str = "nvlink", threads: int = DEFAULT_THREADS,
                     unroll: int = DEFAULT_UNROLL):
    """cute.compile the consumer (no GPU needed with CUTE_DSL_ARCH=sm_90a). Returns the compiled
    callable ``f(*ints, stream)`` taking the args of ``_ARG_NAMES`` as ints, then a CUstream."""
    cutlass, cute = _cute()
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    launch = build_consumer(transport, threads, unroll)
    ex = [Int64(0), Int64(0), Int32(0)] + [Int64(0)] * 22 + [Int32(1), Int32(1), cuda.CUstream(0)]
    if transport == "nvshmem" and not _have_gpu():
        _point_nvshmem_bitcode_at_sm90()
    return cute.compile(launch, *ex)


def _have_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def _point_nvshmem_bitcode_at_sm90():
    """Without a GPU nvshmem4py cannot pick its device bitcode: use the sm_90 one."""
    import nvshmem.core
    import nvshmem.bindings.device.cute._bitcode as bc
    path = nvshmem.core.find_device_bitcode_library(arch="90")
    bc._device_bitcode_path = lambda: path


class Consumer:
    """Compiled consumer + launch helper. ``launch`` takes torch tensors, never synchronizes."""

    def __init__(self, transport: str = "nvlink", threads: int = DEFAULT_THREADS,
                 unroll: int = DEFAULT_UNROLL, timeout_ns: int = DEFAULT_TIMEOUT_NS):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")
        self.transport, self.threads, self.unroll = transport, threads, unroll
        self.timeout_ns = int(timeout_ns)
        self._fn = None
        self._nvshmem_obj = None
        self._launcher = None

    def compile(self):
        if self._fn is None:
            if self.transport == "nvshmem" and _have_gpu():
                from nvshmem.core.interop.cute import cute_compile_helper
                import cuda.bindings.driver as cuda
                from cutlass import Int32, Int64
                launch = build_consumer(self.transport, self.threads, self.unroll)
                ex = [Int64(0), Int64(0), Int32(0)] + [Int64(0)] * 22 + [Int32(1), Int32(1),
                                                                        cuda.CUstream(0)]
                self._fn, self._nvshmem_obj = cute_compile_helper(launch, *ex)
            else:
                self._fn = compile_consumer(self.transport, self.threads, self.unroll)
        return self._fn

    def launch(self, *, y, plan, band_ready, epoch, recv_peers, ctr_peers, recv_sym, ctr_sym,
               err, ccta: int, slot_bytes: int, stream=None):
        """y: [rows, N] bf16 contiguous; recv_peers / ctr_peers: int64 [W] device tables of the
        receive buffer / counter base address on every rank (own rank: local); recv_sym / ctr_sym:
        local symmetric addresses (nvshmem transport); err: int64 [8]."""
        import torch
        fn = self.compile()
        if self._launcher is None:
            from .primitives import LaunchCache
            self._launcher = LaunchCache(fn)
        if stream is None:
            stream = torch.cuda.current_stream(y.device)
        ints = (y.data_ptr(), y.shape[1] * y.element_size(), plan.rank,
                plan.num_segments.data_ptr(), plan.segment_start.data_ptr(),
                plan.segment_bands.data_ptr(), plan.segment_dest.data_ptr(),
                plan.segment_src_row.data_ptr(), plan.segment_dest_row.data_ptr(),
                plan.segment_rows.data_ptr(), plan.schedule.data_ptr(),
                plan.num_bands.data_ptr(), plan.num_remote_bands.data_ptr(),
                plan.band_src_row.data_ptr(), plan.band_valid.data_ptr(),
                plan.band_dest_row.data_ptr(), band_ready.data_ptr(), epoch.data_ptr(),
                recv_peers.data_ptr(), ctr_peers.data_ptr(), int(recv_sym), int(ctr_sym),
                err.data_ptr(), self.timeout_ns, int(slot_bytes), plan.world_size, int(ccta))
        self._launcher(ints, stream.cuda_stream)
