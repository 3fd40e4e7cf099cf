"""The overlapped dispatch's owner side (CuTe DSL, SIMT): wait for every source's tokens, then
expand them into this rank's expert inputs in the plan layout (``MoEDispatch(backend=
"overlap")``; slot layout and a host mirror: combine/dispatch_index.py). One launcher, two
kernels on the stream, as the combine's scale (combine/scale.py):

1. arrival wait, W CTAs of one warp: CTA s, thread 0, waits (ld.acquire.sys, bounded by
   %globaltimer) until ``counter[s] >= expected[s]`` (the caller advances ``expected`` by the
   send CTAs per source before the launch: one marker per sending CTA, dispatch_send.py), polling
   source s's error word every PEER_POLL_NS (ERR_PEER_ERROR), then checks s's call tag of this
   slot against ``call_tag(epoch, fingerprint)`` (ERR_EPOCH_MISMATCH). A timeout records
   ERR_DISPATCH_TIMEOUT (source, epoch, counter, expected). fence.acq_rel.sys after the acquire;
   the kernel boundary orders the expand's loads after it. Skipped when the error word is set.
2. expand, a grid over the work items: (local expert e, source s) for e < El, s < W, and one
   item for the rows past the plan's total. Thread 0 reads the error word; if set (this call's
   wait or any earlier error: sticky until a reset) no slot is read and every row of ``out`` is
   NaN (as the scale). Item (e, s): source s's received tokens (count word of the slot, checked
   against [0, T_max]) in batches of NT, a thread per token: the number of its ids equal to
   expert g = rank * El + e, a CTA exclusive scan of it, so that each (token i, slot j) with
   ids[i, j] == g gets the row ``expert_row_start[e] + group_row_start[e, s] + (its position in
   (i, j) order)``, exactly `dispatch_to_plan`'s; the CTA then copies the batch's rows (16-byte
   vectors flattened over (row, chunk)). A position at or past the group's size in ``counts``,
   a row outside ``out`` or a group that ends short of it records ERR_DISPATCH_BAD_ROUTE (the
   routing and the counts / plan disagree: validate=False input) and the row is not written.
   Then the item zeroes the gap from the group's end to the next non-empty group's start (or the
   expert's end), and item (e, 0) the gap before the expert's first group: every row of
   [0, total_rows) that carries no token is zero, as in the reference; the last item zeroes
   [total_rows, rows).

Arrival flags (``signal_arrival``, default off: for ``GroupedGemm(wait_arrival=True)`` on this
GPU): after item (e, s)'s rows and gaps, ``bar.sync``, then thread 0 ``fence.acq_rel.gpu`` and
``atom.acq_rel.gpu`` add 1 on ``arr_count[e]`` (int32 [El]); the item that sees W - 1 resets the
count and stores ``band_arrived[b] = epoch`` (st.release.gpu) for every band b of expert e,
[ers[e], ers[e] + erows[e]) / tile_m. Every row of e (tokens and zero padding) is written by the
W items of e, so the flags follow all of them. After an error no item counts (rows NaN, no
flag); a count left part-way by an error is zeroed by the reset that clears the error word.

Per-source path (``wait="per_source"``, ``MoEDispatch(expand_wait="per_source")``, the layer's
default): one kernel, no wait kernel. Items in arrival order: item 0 the rows past the total,
then (source s = (rank + d) mod W, expert e) for d = 0 .. W-1, e < El: this rank's own source
first (its rows need no transfer), then by rank distance. Each item's thread 0 waits for source
s itself (``primitives.wait_source_call``, the wait kernel's code: bounded acquire.sys, the
peer's error word, the call tag, fence.acq_rel.sys; the same error records), the CTA-wide vote
on the error word orders it before the CTA's slot loads; so items of sources already landed
proceed while others wait. The item's rows are copied as above, but an empty group zeroes no
gap (the previous non-empty group's item zeroes it), so the items' write ranges are disjoint:
non-empty group (e, s) writes [start, next non-empty start or the expert's end), item (e, 0)
also [expert start, first non-empty start) (empty for the plans plan_combine makes).
Flags (signal_arrival): after the item's stores, bar.sync, thread 0 fence.acq_rel.gpu, then for
every band its ranges meet (below out_rows // tile_m): a band inside one range (every band of
the aligned layout, where each band holds one group and its padding) gets band_arrived[b] =
epoch at once (st.release.gpu); an edge band counts its writers from the plan (the range
holding its first row plus one per non-empty group starting inside it, plus (e, 0)'s leading
range where it meets it: packed bands straddling groups) and the item whose atom.acq_rel.gpu
add on ``state[1 + b]`` completes that count resets it and releases the flag. So a band's flag
comes once the sources with rows in it have landed, not after all W. Errors: an item that sees
the error word set after its wait writes nothing and raises no flag; the last CTA to finish
(``state[0]``, atom.acq_rel.gpu after bar.sync + fence, reset by that CTA) NaNs every row of
``out`` when the error word is set, also the rows of items that finished before the error
(their flags may be up: the consumer's own wait polls the error word, and the combine's error
path NaNs the layer's output).
Co-residency: waiting items hold their SMs. This rank's send precedes the kernel on the stream
(done before any item waits); the peers' sends run on their own GPUs (or, ranks sharing one
GPU, in their own processes' SM share), so the waits need none of this kernel's SMs, and each is
bounded. Beside a persistent consumer (the layer's side-stream GEMM leaves up_ccta SMs) the grid
is bounded by ``max_ctas`` (the layer: 2 per left SM) so that every item's CTA is resident on the
SMs left: a CTA queued behind the GEMM would hold its items back until a resident one ends.
What the two-kernel path keeps: a dispatch that nothing consumes early holds no SM while it
waits (W one-warp CTAs do) and then expands on every SM; its flags need El counts, not one per
band. Both stay (``WAITS``).
"""
DEFAULT_THREADS = 256
COPY_UNROLL = 4  # 16-byte vectors in flight per thread in the expand's row copy
WAITS = ("all", "per_source")  # build_dispatch_expand(wait=): MoEDispatch(expand_wait=)
DEFAULT_CTAS_PER_SM = 2
DEFAULT_TIMEOUT_NS = 10_000_000_000
WAIT_THREADS = 32
BF16X2_NAN = 0x7FC07FC0

# ERR_DISPATCH_BAD_ROUTE field codes (word 3; texts in kernels/errors.py DISPATCH_FIELDS)
DF_COUNT, DF_ROW_PAST_GROUP, DF_GROUP_SHORT, DF_ROW_PAST_OUT = range(4)


def build_dispatch_expand(world_size: int, topk: int, threads: int = DEFAULT_THREADS,
                          signal_arrival: bool = False, wait: str = "all"):
    """@cute.jit launcher of the wait + expand kernels for W = ``world_size`` sources;
    ``signal_arrival``: the expand also raises the per-band arrival flags (module docstring;
    the launcher then takes arr_count, band_arrived and tile_m after fingerprint_ptr).
    ``wait``: "all" (the wait kernel, then the expand) or "per_source" (one kernel whose
    items wait for their own source; its launcher always takes state, band_arrived and
    tile_m after fingerprint_ptr)."""
    W, K, NT, ARR = int(world_size), int(topk), int(threads), bool(signal_arrival)
    if wait not in WAITS:
        raise ValueError(f"wait={wait!r}; choose from {WAITS}")
    PER_SOURCE = wait == "per_source"
    if not 1 <= W <= 1024:
        raise ValueError(f"world_size={W} must be in [1, 1024]")
    if not 1 <= K <= 64:
        raise ValueError(f"topk={K} must be in [1, 64]")
    if NT % 32 or not 32 <= NT <= 1024:
        raise ValueError(f"threads={NT} must be a multiple of 32 in [32, 1024]")
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from ..kernels.errors import ERR_DISPATCH_TIMEOUT, ERR_DISPATCH_BAD_ROUTE
    from .plan_kernel import simt_helpers
    H = simt_helpers()
    lds, sts, block_scan = H.lds, H.sts, H.block_scan

    def atom_add_acq_rel_gpu_s32(addr, val):
        """The expert's arrival count: acquire the earlier items' rows, release this item's."""
        return cute.arch.inline_ptx("atom.acq_rel.gpu.global.add.s32 {$w0}, [{$r0}], {$r1};",
                                    write_only_types=[Int32], read_only_args=[addr, Int32(val)])

    @cute.kernel
    def wait_kernel(counters: Int64, expected: Int64, rank: Int32, err: Int64,
                    timeout_ns: Int64, epoch_ptr: Int64, err_peers: Int64,
                    fingerprint_ptr: Int64):
        tidx, src, _ = P.thread_block_grid()
        if tidx == Int32(0) and src < Int32(W):
            P.wait_source_call(counters, expected, Int32(W), rank, src, err, timeout_ns,
                               epoch_ptr, err_peers, fingerprint_ptr,
                               Int32(ERR_DISPATCH_TIMEOUT), Int32(1))

    @cute.jit
    def zero_rows(out: Int64, r0: Int32, r1: Int32, out_rows: Int32, n_ch: Int64,
                  row_bytes: Int64, tidx: Int32):
        """CTA-wide: rows [r0, r1) of out, clipped to [0, out_rows), set to zero."""
        lo = r0
        if lo < Int32(0):
            lo = Int32(0)
        hi = r1
        if hi > out_rows:
            hi = out_rows
        if lo < hi:
            z = Int32(0)
            i = Int64(tidx)
            total = Int64(hi - lo) * n_ch
            while i < total:
                P.st_v4(out + Int64(lo) * row_bytes + i * Int64(16), [z, z, z, z])
                i = i + Int64(NT)

    @cute.jit
    def signal_expert(e: Int32, e_start: Int32, e_end: Int32, arr_count: Int64,
                      band_arrived: Int64, tile_m: Int32, epoch: Int32, tidx: Int32):
        """After item (e, s)'s rows and gaps: the CTA's stores, then thread 0's acq_rel count;
        the W-th item of expert e resets the count and releases every band flag of e."""
        P.block_sync()
        if tidx == Int32(0):
            P.fence_acq_rel_gpu()
            old = atom_add_acq_rel_gpu_s32(arr_count + Int64(e) * Int64(4), Int32(1))
            if old == Int32(W - 1):
                P.st_s32(arr_count + Int64(e) * Int64(4), Int32(0))
                b = e_start // tile_m
                while b < e_end // tile_m:
                    P.st_release_gpu_s32(band_arrived + Int64(b) * Int64(4), epoch)
                    b = b + Int32(1)

    @cute.jit
    def expand_item(e: Int32, s: Int32, slot: Int64, ids_offset: Int64, count_offset: Int64,
                    row_bytes: Int64, n_ch: Int64, tmax: Int32, out: Int64, out_rows: Int32,
                    El: Int32, rank: Int32, ers: Int64, grs: Int64, erows: Int64,
                    counts: Int64, err: Int64, SCR: Int32, LI: Int32, LR: Int32, tidx: Int32,
                    lane: Int32, warp: Int32, E: Int32, gaps_of_empty: cutlass.Constexpr):
        """CTA-wide: item (e, s)'s rows and gaps (module docstring). ``gaps_of_empty``
        (two-kernel path): an empty group zeroes its gap too (rows the previous non-empty group
        zeroes as well); off (per-source path), the items' write ranges are disjoint.
        Returns (e_start, e_end, a, c, nxt, first): the expert's rows, the group's start and
        size, the end of its gap, the expert's first non-empty group's start."""
        g = rank * El + e
        e_start = P.ld_s32(ers + Int64(e) * Int64(4))
        e_end = e_start + P.ld_s32(erows + Int64(e) * Int64(4))
        a = e_start + P.ld_s32(grs + (Int64(e) * Int64(W) + Int64(s)) * Int64(4))
        c = Int32(P.ld_s64(counts + (Int64(s) * Int64(E) + Int64(g)) * Int64(8)))
        n = P.ld_cg_s32(slot + count_offset + Int64(s) * Int64(4))
        if P.in_range_s64(Int64(n), Int64(0), Int64(tmax) + Int64(1)) == Int32(0):
            if tidx == Int32(0):
                P.record_error(err, Int32(ERR_DISPATCH_BAD_ROUTE), rank, s,
                               Int32(DF_COUNT), Int64(n), Int64(tmax), Int64(0))
            n = Int32(0)
        run = Int32(0)
        i0 = Int32(0)
        while i0 < n:
            i = i0 + tidx
            vs = []
            m = Int32(0)
            for j in cutlass.range_constexpr(K):
                v = Int32(-1)
                if i < n:
                    v = P.ld_cg_s32(slot + ids_offset + ((Int64(s) * Int64(tmax)
                                                          + Int64(i)) * Int64(K)
                                                         + Int64(j)) * Int64(4))
                vs.append(v)
                if v == g:
                    m = m + Int32(1)
            (ex,), (tot,) = block_scan([m], SCR, lane, warp, NT // 32)
            kk = Int32(0)
            for j in cutlass.range_constexpr(K):
                if vs[j] == g:
                    sts(LI, ex + kk, i)
                    sts(LR, ex + kk, run + ex + kk)
                    kk = kk + Int32(1)
            P.block_sync()
            # a batch's (row, chunk) pairs count in 32 bits (tot <= NT * K rows of n_ch
            # chunks; DispatchExpand.launch checks NT * K * n_ch < 2^31): 32-bit division
            lim = Int32(tot) * Int32(n_ch)
            p = tidx
            while p < lim:
                # COPY_UNROLL vectors per thread in flight: every load of the group, then its
                # stores (one load at a time leaves the copy bound by the load latency)
                oks, dsts, vals = [], [], []
                for vec in cutlass.range_constexpr(COPY_UNROLL):
                    at = p + Int32(vec * NT)
                    ok = Int32(0)
                    dst = Int64(0)
                    w0 = Int32(0)
                    w1 = Int32(0)
                    w2 = Int32(0)
                    w3 = Int32(0)
                    if at < lim:
                        u = at // Int32(n_ch)
                        ch = Int64(at - u * Int32(n_ch))
                        r = lds(LR, u)
                        row = a + r
                        ok = Int32(1)
                        if r >= c:
                            ok = Int32(0)
                            if ch == Int64(0):
                                P.record_error(err, Int32(ERR_DISPATCH_BAD_ROUTE), rank, s,
                                               Int32(DF_ROW_PAST_GROUP), Int64(r), Int64(c),
                                               Int64(g))
                        elif row >= out_rows:
                            ok = Int32(0)
                            if ch == Int64(0):
                                P.record_error(err, Int32(ERR_DISPATCH_BAD_ROUTE), rank, s,
                                               Int32(DF_ROW_PAST_OUT), Int64(row),
                                               Int64(out_rows), Int64(g))
                        if ok != Int32(0):
                            src = slot + (Int64(s) * Int64(tmax)
                                          + Int64(lds(LI, u))) * row_bytes
                            dst = out + Int64(row) * row_bytes + ch * Int64(16)
                            w0, w1, w2, w3 = P.ld_v4_cg(src + ch * Int64(16))
                    oks.append(ok)
                    dsts.append(dst)
                    vals.append([w0, w1, w2, w3])
                for vec in cutlass.range_constexpr(COPY_UNROLL):
                    if oks[vec] != Int32(0):
                        P.st_v4(dsts[vec], vals[vec])
                p = p + Int32(NT * COPY_UNROLL)
            run = run + tot
            P.block_sync()  # the lists are read before the next batch writes them
            i0 = i0 + Int32(NT)
        if run < c:
            if tidx == Int32(0):
                P.record_error(err, Int32(ERR_DISPATCH_BAD_ROUTE), rank, s,
                               Int32(DF_GROUP_SHORT), Int64(run), Int64(c),
                               Int64(g))
        # the gaps: after this group to the next non-empty group (or the expert's
        # end); item (e, 0) also the gap before the expert's first group
        nxt = e_end
        first = e_end
        s2 = Int32(0)
        while s2 < Int32(W):
            a2 = e_start + P.ld_s32(grs + (Int64(e) * Int64(W) + Int64(s2))
                                    * Int64(4))
            c2 = P.ld_s64(counts + (Int64(s2) * Int64(E) + Int64(g)) * Int64(8))
            if c2 > Int64(0):
                if a2 < first:
                    first = a2
                if a2 >= a + c and a2 < nxt:
                    nxt = a2
            s2 = s2 + Int32(1)
        if cutlass.const_expr(gaps_of_empty):
            zero_rows(out, a + c, nxt, out_rows, n_ch, row_bytes, tidx)
        else:
            if c > Int32(0):
                zero_rows(out, a + c, nxt, out_rows, n_ch, row_bytes, tidx)
        if s == Int32(0):
            zero_rows(out, e_start, first, out_rows, n_ch, row_bytes, tidx)
        return e_start, e_end, a, c, nxt, first

    @cute.jit
    def expand_body(recv: Int64, slot_stride: Int64, ids_offset: Int64, count_offset: Int64,
                    row_bytes: Int64, tmax: Int32, out: Int64, out_rows: Int32, El: Int32,
                    rank: Int32, ers: Int64, grs: Int64, erows: Int64, counts: Int64,
                    total_ptr: Int64, err: Int64, epoch_ptr: Int64, arr_count: Int64,
                    band_arrived: Int64, tile_m: Int32):
        tidx, bidx, nblk = P.thread_block_grid()
        lane = tidx & Int32(31)
        warp = tidx >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        arr = alloc.allocate_array(cutlass.Int32, 32 + 2 * NT * K, byte_alignment=16).toint()
        SCR = arr  # block_scan scratch (32 words)
        LI = SCR + Int32(4 * 32)  # [NT * K] the batch's rows: received token
        LR = LI + Int32(4 * NT * K)  # [NT * K] its position in the group
        n_ch = row_bytes // Int64(16)
        E = El * Int32(W)
        e0 = Int32(0)
        if tidx == Int32(0):
            e0 = P.error_set(err)
        failed = P.block_any(e0)
        if failed != Int32(0):
            nan_rows(out, out_rows, n_ch, bidx, nblk, tidx)
        else:
            slot = recv + Int64(P.ld_s32(epoch_ptr) & Int32(1)) * slot_stride
            items = El * Int32(W) + Int32(1)
            q = bidx
            while q < items:
                if q == items - Int32(1):  # rows past the plan's total
                    zero_rows(out, P.ld_s32(total_ptr), out_rows, out_rows, n_ch, row_bytes,
                              tidx)
                else:
                    e = q // Int32(W)
                    s = q - e * Int32(W)
                    e_start, e_end, a, c, nxt, first = expand_item(
                        e, s, slot, ids_offset, count_offset, row_bytes, n_ch, tmax, out,
                        out_rows, El, rank, ers, grs, erows, counts, err, SCR, LI, LR, tidx,
                        lane, warp, E, True)
                    if cutlass.const_expr(ARR):
                        signal_expert(e, e_start, e_end, arr_count, band_arrived, tile_m,
                                      P.ld_s32(epoch_ptr), tidx)
                q = q + nblk

    @cute.jit
    def nan_rows(out: Int64, out_rows: Int32, n_ch: Int64, first_cta: Int32, ctas: Int32,
                 tidx: Int32):
        """Every row of out NaN, 16-byte vectors strided over ``ctas`` CTAs from
        ``first_cta`` (the error path)."""
        nan = Int32(BF16X2_NAN)
        i = Int64(first_cta) * Int64(NT) + Int64(tidx)
        total = Int64(out_rows) * n_ch
        while i < total:
            P.st_v4(out + i * Int64(16), [nan, nan, nan, nan])
            i = i + Int64(ctas) * Int64(NT)

    @cute.jit
    def writers_of_band(lo: Int32, hi: Int32, e: Int32, e_start: Int32, first: Int32,
                        El: Int32, rank: Int32, grs: Int64, counts: Int64):
        """Per-source path: the number of write ranges of expert e's items that meet rows
        [lo, hi) of one band: the non-empty groups' [start, next non-empty start) ranges
        partition [first, e_end) (the one holding lo, and one per start inside (lo, hi)),
        and item (e, 0)'s [e_start, first) where it meets the band."""
        E = El * Int32(W)
        g = rank * El + e
        n = Int32(0)
        cover = Int32(0)
        s2 = Int32(0)
        while s2 < Int32(W):
            a2 = e_start + P.ld_s32(grs + (Int64(e) * Int64(W) + Int64(s2)) * Int64(4))
            c2 = P.ld_s64(counts + (Int64(s2) * Int64(E) + Int64(g)) * Int64(8))
            if c2 > Int64(0):
                if a2 > lo and a2 < hi:
                    n = n + Int32(1)
                if a2 <= lo:
                    cover = Int32(1)
            s2 = s2 + Int32(1)
        n = n + cover
        if e_start < first and lo < first and hi > e_start:
            n = n + Int32(1)
        return n

    @cute.jit
    def signal_range(r0: Int32, r1: Int32, e: Int32, e_start: Int32, first: Int32,
                     El: Int32, rank: Int32, grs: Int64, counts: Int64, out_rows: Int32,
                     band_count: Int64, band_arrived: Int64, tile_m: Int32, epoch: Int32):
        """Thread 0, per-source path, after the CTA's stores of rows [r0, r1) and a
        fence.acq_rel.gpu: every band those rows meet (below out_rows // tile_m) that no other
        item writes gets band_arrived[b] = epoch at once (st.release.gpu); a band shared with
        other items counts its writers (atom.acq_rel.gpu on band_count[b]) and the last one
        resets the count and releases the flag."""
        nb = out_rows // tile_m
        if r0 < r1:
            b = r0 // tile_m
            b_end = (r1 + tile_m - Int32(1)) // tile_m
            if b_end > nb:
                b_end = nb
            while b < b_end:
                lo = b * tile_m
                hi = lo + tile_m
                last = Int32(1)
                if lo < r0 or hi > r1:  # an edge band: other items may write it too
                    n = writers_of_band(lo, hi, e, e_start, first, El, rank, grs, counts)
                    if n > Int32(1):
                        cnt = band_count + Int64(b) * Int64(4)
                        old = atom_add_acq_rel_gpu_s32(cnt, Int32(1))
                        if old == n - Int32(1):
                            P.st_s32(cnt, Int32(0))
                        else:
                            last = Int32(0)
                if last != Int32(0):
                    P.st_release_gpu_s32(band_arrived + Int64(b) * Int64(4), epoch)
                b = b + Int32(1)

    @cute.kernel
    def per_source_kernel(recv: Int64, slot_stride: Int64, ids_offset: Int64,
                          count_offset: Int64, row_bytes: Int64, tmax: Int32, out: Int64,
                          out_rows: Int32, El: Int32, rank: Int32, ers: Int64, grs: Int64,
                          erows: Int64, counts: Int64, total_ptr: Int64, err: Int64,
                          epoch_ptr: Int64, counters: Int64, expected: Int64,
                          timeout_ns: Int64, err_peers: Int64, fingerprint_ptr: Int64,
                          state: Int64, band_arrived: Int64, tile_m: Int32):
        """One kernel, items in arrival order: each (e, s) waits for source s itself."""
        tidx, bidx, nblk = P.thread_block_grid()
        lane = tidx & Int32(31)
        warp = tidx >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        arr = alloc.allocate_array(cutlass.Int32, 32 + 2 * NT * K, byte_alignment=16).toint()
        SCR = arr
        LI = SCR + Int32(4 * 32)
        LR = LI + Int32(4 * NT * K)
        n_ch = row_bytes // Int64(16)
        band_count = state + Int64(4)
        slot = recv + Int64(P.ld_s32(epoch_ptr) & Int32(1)) * slot_stride
        items = El * Int32(W) + Int32(1)
        q = bidx
        while q < items:
            if q == Int32(0):  # rows past the plan's total: no source, no wait
                e0 = Int32(0)
                if tidx == Int32(0):
                    e0 = P.error_set(err)
                if P.block_any(e0) == Int32(0):
                    zero_rows(out, P.ld_s32(total_ptr), out_rows, out_rows, n_ch, row_bytes,
                              tidx)
            else:
                d = (q - Int32(1)) // El  # rank distance: this rank's own source first
                e = q - Int32(1) - d * El
                s = rank + d
                if s >= Int32(W):
                    s = s - Int32(W)
                e0 = Int32(0)
                if tidx == Int32(0):
                    P.wait_source_call(counters, expected, Int32(W), rank, s, err, timeout_ns,
                                       epoch_ptr, err_peers, fingerprint_ptr,
                                       Int32(ERR_DISPATCH_TIMEOUT), Int32(1))
                    e0 = P.error_set(err)
                # the barrier orders thread 0's acquire (and .sys fence) before the CTA's
                # loads of the slot
                if P.block_any(e0) == Int32(0):
                    e_start, e_end, a, c, nxt, first = expand_item(
                        e, s, slot, ids_offset, count_offset, row_bytes, n_ch, tmax, out,
                        out_rows, El, rank, ers, grs, erows, counts, err, SCR, LI, LR, tidx,
                        lane, warp, El * Int32(W), False)
                    if cutlass.const_expr(ARR):
                        P.block_sync()
                        if tidx == Int32(0):
                            P.fence_acq_rel_gpu()
                            epoch = P.ld_s32(epoch_ptr)
                            if c > Int32(0):
                                signal_range(a, nxt, e, e_start, first, El, rank, grs, counts,
                                             out_rows, band_count, band_arrived, tile_m,
                                             epoch)
                            if s == Int32(0):
                                signal_range(e_start, first, e, e_start, first, El, rank, grs,
                                             counts, out_rows, band_count, band_arrived,
                                             tile_m, epoch)
            q = q + nblk
        # the last CTA to finish: after an error (this call's or an earlier one's) every row
        # of out NaN, also the rows of items that finished before it
        P.block_sync()
        done = Int32(0)
        if tidx == Int32(0):
            P.fence_acq_rel_gpu()
            old = atom_add_acq_rel_gpu_s32(state, Int32(1))
            if old == nblk - Int32(1):
                P.st_s32(state, Int32(0))
                done = P.error_set(err)
        if P.block_any(done) != Int32(0):
            nan_rows(out, out_rows, n_ch, Int32(0), Int32(1), tidx)

    if ARR:
        @cute.kernel
        def expand_kernel(recv: Int64, slot_stride: Int64, ids_offset: Int64,
                          count_offset: Int64, row_bytes: Int64, tmax: Int32, out: Int64,
                          out_rows: Int32, El: Int32, rank: Int32, ers: Int64, grs: Int64,
                          erows: Int64, counts: Int64, total_ptr: Int64, err: Int64,
                          epoch_ptr: Int64, arr_count: Int64, band_arrived: Int64,
                          tile_m: Int32):
            expand_body(recv, slot_stride, ids_offset, count_offset, row_bytes, tmax, out,
                        out_rows, El, rank, ers, grs, erows, counts, total_ptr, err, epoch_ptr,
                        arr_count, band_arrived, tile_m)
    else:
        @cute.kernel
        def expand_kernel(recv: Int64, slot_stride: Int64, ids_offset: Int64,
                          count_offset: Int64, row_bytes: Int64, tmax: Int32, out: Int64,
                          out_rows: Int32, El: Int32, rank: Int32, ers: Int64, grs: Int64,
                          erows: Int64, counts: Int64, total_ptr: Int64, err: Int64,
                          epoch_ptr: Int64):
            expand_body(recv, slot_stride, ids_offset, count_offset, row_bytes, tmax, out,
                        out_rows, El, rank, ers, grs, erows, counts, total_ptr, err, epoch_ptr,
                        Int64(0), Int64(0), Int32(1))

    @cute.jit
    def launch_both(recv: Int64, slot_stride: Int64, ids_offset: Int64, count_offset: Int64,
                    row_bytes: Int64, tmax: Int32, out: Int64, out_rows: Int32, El: Int32,
                    rank: Int32, ers: Int64, grs: Int64, erows: Int64, counts: Int64,
                    total_ptr: Int64, err: Int64, epoch_ptr: Int64, counters: Int64,
                    expected: Int64, timeout_ns: Int64, err_peers: Int64,
                    fingerprint_ptr: Int64, arr_count: Int64, band_arrived: Int64,
                    tile_m: Int32, grid: Int32, stream: cuda.CUstream):
        wait_kernel(counters, expected, rank, err, timeout_ns, epoch_ptr, err_peers,
                    fingerprint_ptr).launch(grid=[W, 1, 1], block=[WAIT_THREADS, 1, 1],
                                            stream=stream)
        if cutlass.const_expr(ARR):
            expand_kernel(recv, slot_stride, ids_offset, count_offset, row_bytes, tmax, out,
                          out_rows, El, rank, ers, grs, erows, counts, total_ptr, err,
                          epoch_ptr, arr_count, band_arrived,
                          tile_m).launch(grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)
        else:
            expand_kernel(recv, slot_stride, ids_offset, count_offset, row_bytes, tmax, out,
                          out_rows, El, rank, ers, grs, erows, counts, total_ptr, err,
                          epoch_ptr).launch(grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    if PER_SOURCE:
        @cute.jit
        def launch_per_source(recv: Int64, slot_stride: Int64, ids_offset: Int64,
                              count_offset: Int64, row_bytes: Int64, tmax: Int32, out: Int64,
                              out_rows: Int32, El: Int32, rank: Int32, ers: Int64, grs: Int64,
                              erows: Int64, counts: Int64, total_ptr: Int64, err: Int64,
                              epoch_ptr: Int64, counters: Int64, expected: Int64,
                              timeout_ns: Int64, err_peers: Int64, fingerprint_ptr: Int64,
                              state: Int64, band_arrived: Int64, tile_m: Int32, grid: Int32,
                              stream: cuda.CUstream):
            per_source_kernel(recv, slot_stride, ids_offset, count_offset, row_bytes, tmax,
                              out, out_rows, El, rank, ers, grs, erows, counts, total_ptr,
                              err, epoch_ptr, counters, expected, timeout_ns, err_peers,
                              fingerprint_ptr, state, band_arrived,
                              tile_m).launch(grid=[grid, 1, 1], block=[NT, 1, 1],
                                             stream=stream)
        return launch_per_source

    if ARR:
        return launch_both

    @cute.jit
    def launch(recv: Int64, slot_stride: Int64, ids_offset: Int64, count_offset: Int64,
               row_bytes: Int64, tmax: Int32, out: Int64, out_rows: Int32, El: Int32,
               rank: Int32, ers: Int64, grs: Int64, erows: Int64, counts: Int64,
               total_ptr: Int64, err: Int64, epoch_ptr: Int64, counters: Int64,
               expected: Int64, timeout_ns: Int64, err_peers: Int64, fingerprint_ptr: Int64,
               grid: Int32, stream: cuda.CUstream):
        launch_both(recv, slot_stride, ids_offset, count_offset, row_bytes, tmax, out,
                    out_rows, El, rank, ers, grs, erows, counts, total_ptr, err, epoch_ptr,
                    counters, expected, timeout_ns, err_peers, fingerprint_ptr, Int64(0),
                    Int64(0), Int32(1), grid, stream)

    return launch


def expand_example_args(signal_arrival: bool = False, wait: str = "all"):
    """Example arguments of the expand launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    arrival = ([Int64(0), Int64(0), Int32(64)] if signal_arrival or wait == "per_source"
               else [])
    return [Int64(0)] * 5 + [Int32(1), Int64(0), Int32(0), Int32(1), Int32(0)] + \
        [Int64(0)] * 11 + [Int64(0)] + arrival + [Int32(1), cuda.CUstream(0)]


class DispatchExpand:
    """Compiled wait + expand + launch helper (torch tensors in, never synchronizes).
    ``wait``: "all" or "per_source" (module docstring); ``max_ctas`` (per_source): the most
    CTAs of its grid (None: num_sms * ctas_per_sm), the SMs its waiting items may hold."""

    def __init__(self, world_size: int, topk: int, threads: int = DEFAULT_THREADS,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS, ctas_per_sm: int = DEFAULT_CTAS_PER_SM,
                 signal_arrival: bool = False, wait: str = "all", max_ctas: int | None = None):
        if wait not in WAITS:
            raise ValueError(f"wait={wait!r}; choose from {WAITS}")
        if max_ctas is not None and (wait != "per_source" or int(max_ctas) < 1):
            raise ValueError(f"max_ctas={max_ctas!r}: an int >= 1, with wait='per_source' only")
        self.world_size, self.topk, self.threads = int(world_size), int(topk), int(threads)
        self.signal_arrival, self.wait = bool(signal_arrival), wait
        self.max_ctas = None if max_ctas is None else int(max_ctas)
        self.timeout_ns, self.ctas_per_sm = int(timeout_ns), int(ctas_per_sm)
        self._fn = None
        self._launcher = None

    def state_words(self, band_capacity: int) -> int:
        """int32 words of the per-source kernel's state (0 between calls): its finished-CTA
        count, then (signal_arrival) one writer count per band."""
        return 1 + (int(band_capacity) if self.signal_arrival else 0)

    def compile(self):
        if self._fn is None:
            import cutlass.cute as cute
            self._fn = cute.compile(build_dispatch_expand(self.world_size, self.topk,
                                                          self.threads, self.signal_arrival,
                                                          self.wait),
                                    *expand_example_args(self.signal_arrival, self.wait))
        return self._fn

    def grid(self, num_sms: int, experts_per_rank: int) -> int:
        """CTAs of the expand (the per-source kernel's at most max_ctas)."""
        cap = num_sms * self.ctas_per_sm
        if self.wait == "per_source" and self.max_ctas is not None:
            cap = self.max_ctas
        return max(1, min(cap, experts_per_rank * self.world_size + 1))

    def warmup(self, device, experts_per_rank: int, num_sms: int, stream=None):
        """Compile, load and run the kernel(s) once with no effect (an error word of their own
        set, an output of 0 rows: no wait, no slot read, no store outside scratch), so that a
        call's first launch does not compile or load a module while the peers' sends run."""
        import torch
        from ..kernels.errors import ERR_WORDS
        from ..kernels.primitives import LaunchCache
        if self._launcher is None:
            self._launcher = LaunchCache(self.compile())
        if stream is None:
            stream = torch.cuda.current_stream(device)
        W, El = self.world_size, int(experts_per_rank)
        err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=device)
        err[0] = 1
        z = torch.zeros(max(W * W * El * 2, 16), dtype=torch.int64, device=device)
        p = z.data_ptr()
        arrival = ((p, p if self.signal_arrival else 0, 64 if self.signal_arrival else 1)
                   if self.wait == "per_source" else (p, p, 64) if self.signal_arrival else ())
        self._launcher((p, 0, 0, 0, 16, 1, p, 0, El, 0, p, p, p, p, p, err.data_ptr(), p, p, p,
                        self.timeout_ns, p, p, *arrival, self.grid(num_sms, El)),
                       stream.cuda_stream)
        torch.cuda.synchronize(device)
        if int(z.abs().sum()) != 0:  # the kernels must not have touched their scratch
            raise RuntimeError("dispatch expand warm-up wrote its scratch: the error path "
                               "changed")

    def launch(self, *, recv, slot_stride: int, layout: dict, max_tokens: int, out, plan,
               counts, err, epoch, counters, expected, err_peers, num_sms: int, stream=None,
               arr_count=None, band_arrived=None, tile_m: int = 0):
        """recv: this rank's receive buffer (slot 0; symmetric); out: [rows, D] bf16 contiguous;
        counts: int64 [W, E] contiguous (the plan's); counters: the first W words of this rank's
        communication block (its call tags follow); expected: int64 [W] (already advanced for
        this call); err_peers: int64 [W] or None. arr_count (0 between calls): wait="all" with
        signal_arrival int32 [El]; wait="per_source" int32 [state_words(band capacity)].
        signal_arrival: band_arrived int32 [rows // tile_m], tile_m the plan's."""
        import torch
        from ..kernels.primitives import LaunchCache
        if self.threads * self.topk * (layout["row_bytes"] // 16) >= 2 ** 31:
            raise ValueError(f"row_bytes={layout['row_bytes']}: a batch of {self.threads} "
                             f"tokens x topk {self.topk} rows of it overflows the expand's "
                             "32-bit chunk count")
        fn = self.compile()
        if self._launcher is None:
            self._launcher = LaunchCache(fn)
        if stream is None:
            stream = torch.cuda.current_stream(out.device)
        El = plan.experts_per_rank
        grid = self.grid(num_sms, El)
        if self.wait == "per_source":
            arrival = (arr_count.data_ptr(),
                       band_arrived.data_ptr() if self.signal_arrival else 0,
                       int(tile_m) if self.signal_arrival else 1)
        elif self.signal_arrival:
            arrival = (arr_count.data_ptr(), band_arrived.data_ptr(), int(tile_m))
        else:
            arrival = ()
        self._launcher((recv.data_ptr(), int(slot_stride), layout["ids_offset"],
                        layout["count_offset"], layout["row_bytes"], int(max_tokens),
                        out.data_ptr(), out.shape[0], El, plan.rank,
                        plan.expert_row_start.data_ptr(), plan.group_row_start.data_ptr(),
                        plan.expert_rows.data_ptr(), counts.data_ptr(),
                        plan.total_rows.data_ptr(), err.data_ptr(), epoch.data_ptr(),
                        counters.data_ptr(), expected.data_ptr(), self.timeout_ns,
                        0 if err_peers is None else err_peers.data_ptr(),
                        plan.counts_fingerprint.data_ptr(), *arrival, grid),
                       stream.cuda_stream)
