"""Consumer: persistent CuTe DSL kernel that ships finished row bands of y to their owners.

Launched on ``ccta`` CTAs (one per SM) on a higher-priority stream than the producer GEMM.

Per call (epoch = ``epoch[0]``), the plan's remote segments are cut into pieces of ``piece_rows``
rows (a runtime argument; 0: one piece per segment), numbered across segments in schedule order;
CTA i ships pieces i, i + ccta, ... (with whole segments per CTA, CTAs would sit idle at the end
of a call while the last segment ships on one CTA). Per piece:
  1. thread 0 waits (ld.acquire.gpu, bounded by %globaltimer) until ``band_ready[b] == epoch`` for
     every band b = schedule[segment_start[s] + j], j < segment_bands[s] (once per segment the CTA
     has pieces of); on timeout it records
     (rank, segment, band, value, epoch) in the error buffer and the CTA exits; it also exits,
     recording nothing, once the error word is set meanwhile (e.g. the producer refused a band
     of a validate=False plan, whose flag then never comes);
     ``bar.red.or`` broadcasts the outcome to the CTA (and orders the other threads' loads after
     the acquire: producer release -> acquire -> bar.sync -> loads, causality order is transitive);
  2. the CTA copies the piece's rows (full width N, contiguous) from y row ``segment_src_row[s]``
     + r0 to rank ``segment_dest[s]``'s receive buffer at row ``segment_dest_row[s]`` + r0:
       - transport ``nvlink``: 16-byte ld.global.cg / st.global.v4 to the peer's mapped address,
         UNROLL independent loads in flight per thread before the stores;
       - transport ``nvshmem``: ``put_signal_nbi_block`` (NVSHMEM orders the signal after the data);
  3. arrival: bar.sync (all data stores of the CTA precede it), then thread 0 issues
     fence.acq_rel.sys + red.release.sys.add on the destination's counter[rank] (+rows shipped).
     The owner's scale observes it with ld.acquire.sys; the release is cumulative over the CTA's
     stores ordered before it by the barrier.

Local rows never cross the link: after its remote segments, CTA i copies the plan's local cells
i, i + ccta, ... (this rank's rows of one band each, in schedule order; in the packed layout the
first one of an expert may share its band with remote rows) from y into the rank's OWN receive
buffer (same 16-byte copy, HBM -> HBM), each once its band is ready, and adds the rows to its own
counter[rank]. The scale therefore reads every assignment from the receive buffer and waits on
every counter alike.

A band of the packed layout may hold rows of several sources: each of its remote cells belongs to
a segment of its own destination, so several segments (and the local copy) may wait on one band.

Call marker and receive slots: at kernel start CTA 0 adds 1 to counter[rank] on every rank (its
own too), after writing there this call's epoch tag (the plan's counts fingerprint << 32 | the
epoch, kernels/errors.py), and every destination row is offset by (epoch & 1) * slot_bytes
(double-buffered receive buffer). See moe_overlap/combine/overlap.py for why this makes
back-to-back calls race-free.

Options (compile-time; the builder's defaults are ``local_copy=True, copy="ldst"``; the layers
use ``CombineOptions.consumer_variant()``, which picks per transport):
- ``local_copy=False``: the local-band loop is left out; the owner's scale reads local
  assignments straight from y (see scale.py and OverlapCombine), so the rank's own counter only
  receives the call marker.
- ``copy="tma"`` (transport nvlink only): thread 0 of each CTA moves a segment as ``chunk_bytes``
  chunks through a ring of ``stages`` shared-memory buffers: ``cp.async.bulk`` global -> shared
  (completion on a per-stage mbarrier, tx bytes), then ``cp.async.bulk.global.shared::cta`` to the
  peer's mapped receive address (bulk group). Loads run ``lookahead`` chunks ahead; a stage is
  reloaded only after ``cp.async.bulk.wait_group.read`` says its store has read it, so up to
  ``stages - lookahead`` stores are in flight per CTA. Ordering: band flag ld.acquire.gpu ->
  fence.proxy.async.global -> bulk loads (async proxy reads after the acquire); before the arrival
  signal: cp.async.bulk.wait_group 0 (writes complete, not only read) -> fence.proxy.async.global
  -> fence.acq_rel.sys -> red.release.sys.

- ``arrival="segment"`` (needs ``local_copy=False``; for the ordered scale,
  moe_overlap/combine/scale_ordered.py): a piece of segment s adds its rows to the destination's
  ``seg_arrivals[rank, s]`` (int64 words after the 3W words of its communication block, row
  stride ``segment_capacity``, which must be the same on every rank) instead of
  ``counter[rank]``; the counters then carry only the call markers. Same fence / release.

Dependencies are one-way: the consumer waits on the producer's band flags, never the reverse.
All pointers are passed as 64-bit ints (``tensor.data_ptr()``), see primitives.py.
"""

import functools
import os

TRANSPORTS = ("nvlink", "nvshmem")
DEFAULT_THREADS = 512
DEFAULT_UNROLL = 4
DEFAULT_TIMEOUT_NS = 10_000_000_000  # 10 s
COPIES = ("ldst", "tma")
TMA_THREADS = 32  # copy="tma": one warp, thread 0 issues every bulk copy
DEFAULT_STAGES = 12
DEFAULT_CHUNK = 16384  # bytes per stage: 12 x 16 KiB = 192 KiB of shared memory per CTA
DEFAULT_LOOKAHEAD = 4
DEFAULT_PIECE_BYTES = 1 << 20  # OverlapCombine's default piece: rows of about 1 MiB
# arrival signal of a piece: "counter" (counter[rank] += rows, the default scale's wait) or
# "segment" (seg_arrivals[rank, segment] += rows: the ordered scale, scale_ordered.py)
ARRIVALS = ("counter", "segment")


# ERR_PLAN_BOUNDS field codes (word 3; texts in moe_overlap/kernels/errors.py PLAN_FIELDS)
PF_NSEG, PF_NCELL, PF_DEST, PF_SEG_SRC, PF_SEG_DST, PF_BAND, PF_CELL_SRC, PF_CELL_DST = range(8)


def _cute():
    import cutlass  # noqa: F401  (lazy: the package must import without CuTe DSL)
    import cutlass.cute as cute
    return cutlass, cute


def check_options(transport, copy, stages, chunk_bytes, lookahead):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")
    if copy not in COPIES:
        raise ValueError(f"copy={copy!r}; choose from {COPIES}")
    if copy == "tma":
        if transport != "nvlink":
            raise ValueError("copy='tma' needs transport='nvlink' (nvshmem ships with "
                             "put_signal_nbi_block)")
        if chunk_bytes % 16 or not 16 <= chunk_bytes <= (1 << 19):
            raise ValueError(f"chunk_bytes={chunk_bytes} must be a multiple of 16 in [16, 512K]")
        if not 1 <= lookahead < stages:
            raise ValueError(f"need 1 <= lookahead={lookahead} < stages={stages}")
        if stages * chunk_bytes + 8 * stages > 227 * 1024:
            raise ValueError(f"stages * chunk_bytes = {stages * chunk_bytes} B exceeds shared "
                             "memory (227 KiB)")


def check_arrival(arrival, local_copy):
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival={arrival!r}; choose from {ARRIVALS}")
    if arrival == "segment" and local_copy:
        raise ValueError("arrival='segment' needs local_copy=False (the ordered scale reads the "
                         "local rows from y)")


def build_consumer(transport: str = "nvlink", threads: int = DEFAULT_THREADS,
                   unroll: int = DEFAULT_UNROLL, local_copy: bool = True, copy: str = "ldst",
                   stages: int = DEFAULT_STAGES, chunk_bytes: int = DEFAULT_CHUNK,
                   lookahead: int = DEFAULT_LOOKAHEAD, arrival: str = "counter"):
    """Returns the @cute.jit launcher for one variant (see the module doc for the options).
    copy="tma" runs TMA_THREADS threads per CTA whatever ``threads`` says."""
    check_options(transport, copy, stages, chunk_bytes, lookahead)
    check_arrival(arrival, local_copy)
    SEG_ARRIVAL = arrival == "segment"
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads={threads} must be a multiple of 32 in [32, 1024]")
    if unroll < 1 or unroll > 16:
        raise ValueError(f"unroll={unroll} must be in [1, 16]")
    cutlass, cute = _cute()
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P

    use_tma = copy == "tma"
    NT = TMA_THREADS if use_tma else threads
    U = unroll
    S, C, L = stages, chunk_bytes, lookahead
    LOCAL_COPY = bool(local_copy)
    use_nvshmem = transport == "nvshmem"
    if use_nvshmem:
        import nvshmem.core.device.cute as nvdev
        from nvshmem.core import SignalOp

    def arrival_offset(src_rank, seg, world, seg_cap):
        """Byte offset of a piece's arrival word in the destination's communication block:
        counter[rank], or (arrival="segment") seg_arrivals[rank, segment], the table after the
        block's 3W words with row stride seg_cap (the same on every rank: the owner's prepare
        checks it). Plain Python at trace time: the variant is chosen here, not on the device."""
        if SEG_ARRIVAL:
            return (Int64(3) * Int64(world) + Int64(src_rank) * Int64(seg_cap)
                    + Int64(seg)) * Int64(8)
        return Int64(src_rank) * Int64(8)

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
    def tma_issue_load(src: Int64, nbytes: Int64, j: Int32, g0: Int32, smem0: Int32,
                       mbar0: Int32):
        """Thread 0: bulk-load chunk j of the transfer (global chunk number g0 + j)."""
        st = (g0 + j) % Int32(S)
        off = Int64(j) * Int64(C)
        sz = Int64(C)
        if nbytes - off < sz:
            sz = nbytes - off
        bar = mbar0 + st * Int32(8)
        P.mbar_arrive_expect_tx(bar, Int32(sz))
        P.bulk_load_g2s(smem0 + st * Int32(C), src + off, Int32(sz), bar)

    @cute.jit
    def tma_copy(src: Int64, dst: Int64, nbytes: Int64, g0: Int32, smem0: Int32, mbar0: Int32,
                 t0: Int64, timeout_ns: Int64, err: Int64, rank: Int32, seg: Int32):
        """Thread 0 only: copy nbytes (multiple of 16) src -> dst through the smem ring and wait
        until every store has COMPLETED (wait_group 0). Returns (next g0, timed_out)."""
        nch = Int32((nbytes + Int64(C - 1)) // Int64(C))
        j = Int32(0)
        while j < nch and j < Int32(L):
            tma_issue_load(src, nbytes, j, g0, smem0, mbar0)
            j = j + Int32(1)
        c = Int32(0)
        to = Int32(0)
        while c < nch and to == Int32(0):
            g = g0 + c
            st = g % Int32(S)
            to, el = P.wait_mbar_parity(mbar0 + st * Int32(8), (g // Int32(S)) & Int32(1), t0,
                                        timeout_ns)
            if to != Int32(0):
                P.record_error(err, Int32(P.ERR_COPY_TIMEOUT), rank, seg, st, Int64(c),
                               Int64(nch), el)
            else:
                off = Int64(c) * Int64(C)
                sz = Int64(C)
                if nbytes - off < sz:
                    sz = nbytes - off
                P.bulk_store_s2g(dst + off, smem0 + st * Int32(C), Int32(sz))
                P.bulk_commit_group()
                if c + Int32(L) < nch:
                    # the stage of chunk c + L last held chunk c + L - S: its store must have
                    # finished reading shared memory (at most S - L groups still reading)
                    P.bulk_wait_group_read(S - L)
                    tma_issue_load(src, nbytes, c + Int32(L), g0, smem0, mbar0)
            c = c + Int32(1)
        P.bulk_wait_group_all()  # writes complete (not only read) before any release signal
        return g0 + nch, to

    @cute.jit
    def wait_bands(sched: Int64, band_ready: Int64, pos0: Int32, nbands: Int32, epoch: Int32,
                   t0: Int64, timeout_ns: Int64, err: Int64, rank: Int32, seg: Int32,
                   flag_cap: Int32):
        """Thread-0 wait for bands sched[pos0 .. pos0+nbands) (sched: a table of band ids: the
        schedule, or the local cells' bands); a band id outside band_ready [0, flag_cap) is an
        ERR_PLAN_BOUNDS (never loaded). Returns failed (Int32)."""
        timed_out = Int32(0)
        j = Int32(0)
        while j < nbands and timed_out == Int32(0):
            b = P.ld_s32(sched + Int64(pos0 + j) * Int64(4))
            if P.in_range_s64(Int64(b), Int64(0), Int64(flag_cap)) == Int32(0):
                timed_out = Int32(1)
                P.record_error(err, Int32(P.ERR_PLAN_BOUNDS), rank, seg, Int32(PF_BAND),
                               Int64(b), Int64(flag_cap), Int64(0))
            else:
                # an error recorded meanwhile (the producer refused this band: its flag never
                # comes) ends the wait at once; the first error stays the one recorded
                st, v, el = P.wait_eq_gpu_s32_or_error(band_ready + Int64(b) * Int64(4), epoch,
                                                       err, t0, timeout_ns)
                if st != Int32(0):
                    timed_out = Int32(1)
                if st == Int32(1):
                    P.record_error(err, Int32(P.ERR_CONSUMER_TIMEOUT), rank, seg, b, Int64(v),
                                   Int64(epoch), el)
            j = j + Int32(1)
        return timed_out

    @cute.jit
    def span_ok(a: Int64, n: Int64, cap: Int64):
        """Int32 1 if rows [a, a + n) lie in [0, cap) (n >= 0)."""
        ok = Int32(0)
        if P.in_range_s64(n, Int64(0), cap + Int64(1)) != Int32(0):
            ok = P.in_range_s64(a, Int64(0), cap - n + Int64(1))
        return ok

    @cute.kernel
    def consumer_kernel(y: Int64, row_bytes: Int64, rank: Int32,
                        num_segments: Int64, seg_start: Int64, seg_bands: Int64,
                        seg_dest: Int64, seg_src_row: Int64, seg_dest_row: Int64,
                        seg_rows: Int64, schedule: Int64, num_local: Int64,
                        local_band: Int64, local_src_row: Int64, local_rows: Int64,
                        local_dest_row: Int64, band_ready: Int64, epoch_ptr: Int64,
                        fingerprint_ptr: Int64, recv_peers: Int64, ctr_peers: Int64,
                        recv_sym: Int64, ctr_sym: Int64,
                        err: Int64, timeout_ns: Int64, slot_bytes: Int64, world: Int32,
                        piece_rows: Int32, y_rows: Int32, seg_cap: Int32, cell_cap: Int32,
                        sched_cap: Int32, flag_cap: Int32):
        tidx, bidx, nblk = P.thread_block_grid()
        arrival_off = functools.partial(arrival_offset, world=world, seg_cap=seg_cap)
        epoch = P.ld_s32(epoch_ptr)
        t_start = P.globaltimer()
        slot_rows = Int64(0)
        if row_bytes > Int64(0):
            slot_rows = slot_bytes // row_bytes
        # sticky errors: after any error recorded on this rank (this call or an earlier one) the
        # consumer ships nothing and posts no call marker, so no peer slot is written after the
        # error and the peers' scales time out instead of reading a slot it may have overwritten
        e0 = Int32(0)
        if tidx == Int32(0):
            e0 = P.error_set(err)
        failed = P.block_any(e0)
        # validate=False plans: counts clamped to the tables' capacities (and recorded)
        nseg = P.ld_s32(num_segments)
        if P.in_range_s64(Int64(nseg), Int64(0), Int64(seg_cap) + Int64(1)) == Int32(0):
            if tidx == Int32(0):
                P.record_error(err, Int32(P.ERR_PLAN_BOUNDS), rank, Int32(-1), Int32(PF_NSEG),
                               Int64(nseg), Int64(seg_cap), Int64(0))
            nseg = Int32(0)
            failed = Int32(1)
        # receive slot of this call (double buffer by epoch parity, see OverlapCombine)
        slot_off = Int64(epoch & Int32(1)) * slot_bytes
        smem0 = Int32(0)
        mbar0 = Int32(0)
        gchunk = Int32(0)  # chunks moved by this CTA so far (ring stage / phase of the next one)
        if cutlass.const_expr(use_tma):
            alloc = cutlass.memory.SmemAllocator()
            ring = alloc.allocate_array(cutlass.Int8, S * C, byte_alignment=128)
            bars = alloc.allocate_array(cutlass.Int64, S, byte_alignment=8)
            smem0 = ring.toint()
            mbar0 = bars.toint()
            if tidx == Int32(0):
                for st in cutlass.range_constexpr(S):
                    P.mbar_init(mbar0 + Int32(st * 8), 1)
                P.fence_mbar_init()
            P.block_sync()

        # ---- call marker: +1 on counter[rank] of every rank (ours too). It tells each owner
        # that this rank's consumer of this call has started, i.e. (stream order) that this
        # rank's scale of the previous call is done reading its receive slot.
        # Before the marker, the same thread writes this call's tag (the plan's counts fingerprint
        # << 32 | the epoch: kernels/errors.py call_tag) into rank tidx's tag of the slot it is
        # about to fill (word W + parity * W + rank of the communication block); the marker's
        # release orders the tag before it, so an owner whose counter wait covers this marker
        # reads this tag (or a later one).
        tag_off = (Int64(world) + Int64(epoch & Int32(1)) * Int64(world) + Int64(rank)) * Int64(8)
        if bidx == Int32(0) and tidx < world and failed == Int32(0):  # world <= threads
            tag = P.call_tag(epoch, P.ld_s32(fingerprint_ptr))
            if cutlass.const_expr(use_nvshmem):
                sig_t = cute.make_tensor(cute.make_ptr(cutlass.Uint64, ctr_sym + tag_off,
                                                       cute.AddressSpace.gmem, assumed_align=8),
                                         cute.make_layout(1))
                nvdev.signal_op(sig_t, tag, SignalOp.SIGNAL_SET, tidx)
                nvdev.fence()  # the tag before the marker at that PE
                sig_m = cute.make_tensor(cute.make_ptr(cutlass.Uint64,
                                                       ctr_sym + Int64(rank) * Int64(8),
                                                       cute.AddressSpace.gmem, assumed_align=8),
                                         cute.make_layout(1))
                nvdev.signal_op(sig_m, Int64(1), SignalOp.SIGNAL_ADD, tidx)
            else:
                peer_ctr = P.ld_s64(ctr_peers + Int64(tidx) * Int64(8))
                P.st_relaxed_sys_s64(peer_ctr + tag_off, tag)
                P.red_release_sys_add_s64(peer_ctr + Int64(rank) * Int64(8), Int64(1))

        # ---- remote segments, in pieces of piece_rows rows (0: a segment is one piece) -------
        # Piece q, numbered across the segments in schedule order, goes to CTA q % nblk: every
        # CTA works on the earliest ready segments, the pieces balance the CTAs' bytes, and the
        # last segment ships on many CTAs at once instead of one. Each CTA walks every segment's
        # row count (L2 hits) to number the pieces; it waits only for segments it has pieces of.
        s = Int32(0)
        pc = Int32(0)  # pieces of the segments before s
        while s < nseg and failed == Int32(0):
            off = Int64(s) * Int64(4)
            seg_n = P.ld_s32(seg_rows + off)
            # every field of segment s in range, else ERR_PLAN_BOUNDS and stop (every thread
            # loads the same values: the outcome is uniform over the CTA, and over the CTAs)
            field = Int32(-1)
            fval = Int64(0)
            fcap = Int64(0)
            dest = P.ld_s32(seg_dest + off)
            src_row0 = P.ld_s32(seg_src_row + off)
            dst_row0 = P.ld_s32(seg_dest_row + off)
            sstart = P.ld_s32(seg_start + off)
            sbands = P.ld_s32(seg_bands + off)
            if span_ok(Int64(sstart), Int64(sbands), Int64(sched_cap)) == Int32(0):
                field, fval, fcap = Int32(PF_BAND), Int64(sstart) + Int64(sbands), Int64(sched_cap)
            if span_ok(Int64(dst_row0), Int64(seg_n), slot_rows) == Int32(0):
                field, fval, fcap = Int32(PF_SEG_DST), Int64(dst_row0) + Int64(seg_n), slot_rows
            if span_ok(Int64(src_row0), Int64(seg_n), Int64(y_rows)) == Int32(0):
                field, fval, fcap = Int32(PF_SEG_SRC), Int64(src_row0) + Int64(seg_n), Int64(y_rows)
            if P.in_range_s64(Int64(dest), Int64(0), Int64(world)) == Int32(0):
                field, fval, fcap = Int32(PF_DEST), Int64(dest), Int64(world)
            if field >= Int32(0):
                failed = Int32(1)
                seg_n = Int32(0)
                if tidx == Int32(0):
                    P.record_error(err, Int32(P.ERR_PLAN_BOUNDS), rank, s, field, fval, fcap,
                                   Int64(0))
            pr = seg_n
            if piece_rows > Int32(0):
                pr = piece_rows
            if pr < Int32(1):
                pr = Int32(1)
            npieces = (seg_n + pr - Int32(1)) // pr
            q = pc + (bidx - pc % nblk + nblk) % nblk  # this CTA's first piece >= pc
            if q < pc + npieces and failed == Int32(0):
                to = Int32(0)
                if tidx == Int32(0):
                    to = wait_bands(schedule, band_ready, sstart, sbands, epoch, t_start,
                                    timeout_ns, err, rank, s, flag_cap)
                failed = P.block_any(to)
                while q < pc + npieces and failed == Int32(0):
                    r0 = (q - pc) * pr
                    rows = seg_n - r0
                    if rows > pr:
                        rows = pr
                    src = y + Int64(src_row0 + r0) * row_bytes
                    dst_off = Int64(dst_row0 + r0) * row_bytes + slot_off
                    nbytes = Int64(rows) * row_bytes
                    if cutlass.const_expr(use_nvshmem):
                        lay = cute.make_layout(Int32(nbytes // Int64(2)))
                        dst_t = cute.make_tensor(
                            cute.make_ptr(cutlass.BFloat16, recv_sym + dst_off,
                                          cute.AddressSpace.gmem, assumed_align=2), lay)
                        src_t = cute.make_tensor(
                            cute.make_ptr(cutlass.BFloat16, src, cute.AddressSpace.gmem,
                                          assumed_align=2), lay)
                        sig_t = cute.make_tensor(
                            cute.make_ptr(cutlass.Uint64, ctr_sym + arrival_off(rank, s),
                                          cute.AddressSpace.gmem, assumed_align=8),
                            cute.make_layout(1))
                        nvdev.put_signal_nbi_block(dst_t, src_t, sig_t, Int64(rows),
                                                   SignalOp.SIGNAL_ADD, dest)
                    elif cutlass.const_expr(use_tma):
                        dst = P.ld_s64(recv_peers + Int64(dest) * Int64(8)) + dst_off
                        to2 = Int32(0)
                        if tidx == Int32(0):
                            # async-proxy reads of y after the generic acquire of the band flags
                            P.fence_proxy_async_global()
                            gchunk, to2 = tma_copy(src, dst, nbytes, gchunk, smem0, mbar0,
                                                   t_start, timeout_ns, err, rank, s)
                            if to2 == Int32(0):
                                P.fence_proxy_async_global()
                                P.fence_acq_rel_sys()
                                P.red_release_sys_add_s64(
                                    P.ld_s64(ctr_peers + Int64(dest) * Int64(8))
                                    + arrival_off(rank, s), Int64(rows))
                        failed = P.block_any(to2)
                    else:
                        dst = P.ld_s64(recv_peers + Int64(dest) * Int64(8)) + dst_off
                        copy_rows(src, dst, nbytes, tidx)
                        P.block_sync()
                        if tidx == Int32(0):
                            P.fence_acq_rel_sys()
                            P.red_release_sys_add_s64(
                                P.ld_s64(ctr_peers + Int64(dest) * Int64(8))
                                + arrival_off(rank, s), Int64(rows))
                    q = q + nblk
            pc = pc + npieces
            s = s + Int32(1)

        # ---- local cells: y -> own receive buffer (v1; left out with local_copy=False) -------
        # cell p = this rank's rows of band local_band[p], in schedule order
        if cutlass.const_expr(LOCAL_COPY):
            nl = P.ld_s32(num_local)
            if P.in_range_s64(Int64(nl), Int64(0), Int64(cell_cap) + Int64(1)) == Int32(0):
                if tidx == Int32(0):
                    P.record_error(err, Int32(P.ERR_PLAN_BOUNDS), rank, Int32(-1),
                                   Int32(PF_NCELL), Int64(nl), Int64(cell_cap), Int64(0))
                nl = Int32(0)
                failed = Int32(1)
            p = bidx
            own_recv = P.ld_s64(recv_peers + Int64(rank) * Int64(8))
            own_ctr = P.ld_s64(ctr_peers + Int64(rank) * Int64(8)) + Int64(rank) * Int64(8)
            while p < nl and failed == Int32(0):
                to = Int32(0)
                if tidx == Int32(0):
                    to = wait_bands(local_band, band_ready, p, Int32(1), epoch, t_start,
                                    timeout_ns, err, rank, Int32(-1), flag_cap)
                failed = P.block_any(to)
                coff = Int64(p) * Int64(4)
                rows = P.ld_s32(local_rows + coff)
                c_src = P.ld_s32(local_src_row + coff)
                c_dst = P.ld_s32(local_dest_row + coff)
                if failed == Int32(0):
                    field = Int32(-1)
                    fval = Int64(0)
                    fcap = Int64(0)
                    if span_ok(Int64(c_dst), Int64(rows), slot_rows) == Int32(0):
                        field, fval, fcap = (Int32(PF_CELL_DST), Int64(c_dst) + Int64(rows),
                                             slot_rows)
                    if span_ok(Int64(c_src), Int64(rows), Int64(y_rows)) == Int32(0):
                        field, fval, fcap = (Int32(PF_CELL_SRC), Int64(c_src) + Int64(rows),
                                             Int64(y_rows))
                    if field >= Int32(0):
                        failed = Int32(1)
                        if tidx == Int32(0):
                            P.record_error(err, Int32(P.ERR_PLAN_BOUNDS), rank, p, field, fval,
                                           fcap, Int64(0))
                if failed == Int32(0):
                    src = y + Int64(c_src) * row_bytes
                    dst = own_recv + slot_off + Int64(c_dst) * row_bytes
                    if cutlass.const_expr(use_tma):
                        to3 = Int32(0)
                        if tidx == Int32(0):
                            P.fence_proxy_async_global()
                            gchunk, to3 = tma_copy(src, dst, Int64(rows) * row_bytes, gchunk,
                                                   smem0, mbar0, t_start, timeout_ns, err, rank,
                                                   Int32(-1))
                            if to3 == Int32(0):
                                P.fence_proxy_async_global()
                                P.fence_acq_rel_gpu()
                                P.red_release_gpu_add_s64(own_ctr, Int64(rows))
                        failed = P.block_any(to3)
                    else:
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
               seg_rows: Int64, schedule: Int64, num_local: Int64,
               local_band: Int64, local_src_row: Int64, local_rows: Int64,
               local_dest_row: Int64, band_ready: Int64, epoch_ptr: Int64,
               fingerprint_ptr: Int64, recv_peers: Int64, ctr_peers: Int64, recv_sym: Int64,
               ctr_sym: Int64, err: Int64, timeout_ns: Int64, slot_bytes: Int64, world: Int32,
               piece_rows: Int32, y_rows: Int32, seg_cap: Int32, cell_cap: Int32,
               sched_cap: Int32, flag_cap: Int32, ccta: Int32, stream: cuda.CUstream):
        consumer_kernel(y, row_bytes, rank, num_segments, seg_start, seg_bands, seg_dest,
                        seg_src_row, seg_dest_row, seg_rows, schedule, num_local,
                        local_band, local_src_row, local_rows, local_dest_row, band_ready,
                        epoch_ptr, fingerprint_ptr, recv_peers, ctr_peers, recv_sym, ctr_sym, err,
                        timeout_ns, slot_bytes, world, piece_rows, y_rows, seg_cap, cell_cap,
                        sched_cap, flag_cap).launch(
            grid=[ccta, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


_ARG_NAMES = ("y", "row_bytes", "rank", "num_segments", "segment_start", "segment_bands",
              "segment_dest", "segment_src_row", "segment_dest_row", "segment_rows", "schedule",
              "num_local_cells", "local_cell_band", "local_cell_src_row", "local_cell_rows",
              "local_cell_dest_row", "band_ready", "epoch", "counts_fingerprint", "recv_peers",
              "ctr_peers", "recv_sym", "ctr_sym", "err",
              "timeout_ns", "slot_bytes", "world", "piece_rows", "y_rows", "segment_capacity",
              "cell_capacity", "schedule_capacity", "band_flag_capacity", "ccta")


def consumer_example_args():
    """Example arguments of the consumer launcher (types only, ``_ARG_NAMES`` then the stream),
    for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0), Int32(0)] + [Int64(0)] * 23 + [Int32(1), Int32(0)] + \
        [Int32(1)] * 5 + [Int32(1), cuda.CUstream(0)]


def compile_consumer(transport: str = "nvlink", threads: int = DEFAULT_THREADS,
                     unroll: int = DEFAULT_UNROLL, **options):
    """cute.compile the consumer (no GPU needed with CUTE_DSL_ARCH=sm_90a). Returns the compiled
    callable ``f(*ints, stream)`` taking the args of ``_ARG_NAMES`` as ints, then a CUstream.
    options: local_copy, copy, stages, chunk_bytes, lookahead, arrival (see build_consumer)."""
    cutlass, cute = _cute()
    launch = build_consumer(transport, threads, unroll, **options)
    ex = consumer_example_args()
    if transport == "nvshmem" and not _have_gpu():
        use_sm90_nvshmem_bitcode()
    return cute.compile(launch, *ex)


def _have_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def use_sm90_nvshmem_bitcode():
    """Without a GPU nvshmem4py cannot pick its device bitcode: use the sm_90 one."""
    import nvshmem.core
    import nvshmem.bindings.device.cute._bitcode as bc
    path = nvshmem.core.find_device_bitcode_library(arch="90")
    bc._device_bitcode_path = lambda: path


# The nvshmem consumers compiled in this process, kept until it ends:
# (threads, unroll, build options, NVSHMEM initialisation) -> (compiled, NvshmemKernelObject).
# cute_compile_helper's library_init hands NVSHMEM the address of the library's device state;
# NVSHMEM keeps the address (not the library) and copies its state there only when its table of
# addresses grows. CuTe DSL unloads a library when its compiled function is garbage-collected and
# nothing takes the address out of that table (nvshmem4py 0.4 registers no unload callback, and a
# library_finalize from a collector would not be collective). A dropped layer's consumer would
# leave a stale address there: the state is then written into memory that is no longer the
# library's, and the next identical build, loaded where the old one was, is counted as already
# initialised and runs on a zeroed device state (bench/NOTES.md, "Session 20: the one-process
# crash of test_overlap_gpu, by reading"). Kept here, each build is registered once and stays
# loaded; the layers share it (everything per call is a launch argument).
_NVSHMEM_COMPILED: dict = {}


def _nvshmem_consumer(threads: int, unroll: int, options: dict):
    """(compiled consumer, its NvshmemKernelObject) of the nvshmem transport for this build,
    compiled and registered with NVSHMEM on first use in this process's NVSHMEM initialisation
    (one per process and device: ``NvshmemRuntime``), never released (see above)."""
    from ..runtime.nvshmem import NvshmemRuntime
    key = (threads, unroll, tuple(sorted(options.items())), NvshmemRuntime.inits)
    hit = _NVSHMEM_COMPILED.get(key)
    if hit is None:
        from nvshmem.core.interop.cute import cute_compile_helper
        launch = build_consumer("nvshmem", threads, unroll, **options)
        hit = _NVSHMEM_COMPILED[key] = cute_compile_helper(launch, *consumer_example_args())
    return hit


class Consumer:
    """Compiled consumer + launch helper. ``launch`` takes torch tensors, never synchronizes.
    The nvshmem transport's compiled kernel is shared by every Consumer of the same build in
    the process and never unloaded (``_NVSHMEM_COMPILED``)."""

    def __init__(self, transport: str = "nvlink", threads: int = DEFAULT_THREADS,
                 unroll: int = DEFAULT_UNROLL, timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 local_copy: bool = True, copy: str = "ldst", stages: int = DEFAULT_STAGES,
                 chunk_bytes: int = DEFAULT_CHUNK, lookahead: int = DEFAULT_LOOKAHEAD,
                 arrival: str = "counter"):
        check_options(transport, copy, stages, chunk_bytes, lookahead)
        check_arrival(arrival, local_copy)
        self.transport, self.threads, self.unroll = transport, threads, unroll
        self.local_copy, self.copy, self.arrival = bool(local_copy), copy, arrival
        self.options = dict(local_copy=self.local_copy, copy=copy, stages=stages,
                            chunk_bytes=chunk_bytes, lookahead=lookahead, arrival=arrival)
        self.block_threads = TMA_THREADS if copy == "tma" else threads
        self.timeout_ns = int(timeout_ns)
        self._fn = None
        self._nvshmem_obj = None
        self._launcher = None

    def compile(self):
        if self._fn is None:
            if self.transport == "nvshmem" and _have_gpu():
                self._fn, self._nvshmem_obj = _nvshmem_consumer(self.threads, self.unroll,
                                                                self.options)
            else:
                self._fn = compile_consumer(self.transport, self.threads, self.unroll,
                                            **self.options)
        return self._fn

    def launch(self, *, y, plan, band_ready, epoch, recv_peers, ctr_peers, recv_sym, ctr_sym,
               err, ccta: int, slot_bytes: int, piece_rows: int = 0, stream=None):
        """y: [rows, N] bf16 contiguous; recv_peers / ctr_peers: int64 [W] device tables of the
        receive buffer / counter base address on every rank (own rank: local); recv_sym / ctr_sym:
        local symmetric addresses (nvshmem transport); err: int64 [8]."""
        import torch
        if plan.world_size > self.block_threads:
            raise ValueError(f"world size {plan.world_size} > {self.block_threads} threads per "
                             "CTA (one thread per rank posts the call marker)")
        fn = self.compile()
        if self._launcher is None:
            from ..kernels.primitives import LaunchCache
            self._launcher = LaunchCache(fn)
        if stream is None:
            stream = torch.cuda.current_stream(y.device)
        ints = (y.data_ptr(), y.shape[1] * y.element_size(), plan.rank,
                plan.num_segments.data_ptr(), plan.segment_start.data_ptr(),
                plan.segment_bands.data_ptr(), plan.segment_dest.data_ptr(),
                plan.segment_src_row.data_ptr(), plan.segment_dest_row.data_ptr(),
                plan.segment_rows.data_ptr(), plan.schedule.data_ptr(),
                plan.num_local_cells.data_ptr(), plan.local_cell_band.data_ptr(),
                plan.local_cell_src_row.data_ptr(), plan.local_cell_rows.data_ptr(),
                plan.local_cell_dest_row.data_ptr(), band_ready.data_ptr(), epoch.data_ptr(),
                plan.counts_fingerprint.data_ptr(), recv_peers.data_ptr(), ctr_peers.data_ptr(),
                int(recv_sym), int(ctr_sym),
                err.data_ptr(), self.timeout_ns, int(slot_bytes), plan.world_size,
                int(piece_rows), y.shape[0], plan.segment_rows.numel(),
                plan.local_cell_rows.numel(), plan.schedule.numel(), band_ready.numel(),
                int(ccta))
        self._launcher(ints, stream.cuda_stream)
