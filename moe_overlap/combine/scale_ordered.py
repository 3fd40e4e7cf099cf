"""Ordered scale (design B of bench/NOTES.md, "Session 11"): the owner's scale done token tile by
token tile in completion order, each tile after a bounded wait for exactly the signals its rows
need. Used by ``OverlapCombine`` with ``CombineOptions(scale="ordered")`` as design A: one launch
on the producer's stream after the producer (``wait_bands=False``); the consumer workers of
design B are not built (see the NOTES).

One persistent kernel, ``grid`` CTAs of ``threads``:

1. CTA b < world, thread 0 (``check_tags``): the call marker of source b (``counter[b] >=
   expected[b]``, ld.acquire.sys, bounded) and its epoch tag of this call's slot (the counts
   fingerprint and the epoch, ``P.check_call_tag``), as scale.py's wait kernel (in this design
   the counters carry only the markers; rows are counted per segment). Doing it inside the
   kernel keeps the slot-reuse argument: the kernel, hence this rank's next consumer, ends after
   every source's marker of this call was seen.
2. Tiles: thread 0 claims the next tile ``j = atom.add.relaxed.gpu(queue, 1)`` (the queue is
   zeroed on the stream before the call; no data passes through it) and shares j through shared
   memory. Tile j's dependencies ``dep_start[j] .. dep_start[j + 1]`` are polled in parallel, one
   per thread: a local band (``wait_bands`` != 0: the consumer workers, beside the producer)
   ``band_ready[b] == epoch`` with ld.acquire.gpu (the producer's release is gpu scope); a remote
   segment ``seg_arrivals[s, i] >= seg_expected[s, i]`` with ld.acquire.sys (the sender's consumer
   adds each piece's rows with red.release.sys after fence.acq_rel.sys). Every wait is bounded by
   %globaltimer and names rank, tile and band / (source, segment) on timeout. ``bar.red.or`` then
   joins the outcome and orders every thread's row loads after all the acquires (acquire ->
   bar.sync -> loads: causality order is transitive).
3. The tile's tokens ``order[tile_start[j] .. tile_start[j + 1]]``: each thread owns 8 columns of
   one (token, column chunk) at a time, TOPK 16-byte loads (rows r >= 0: receive slot row, r < 0:
   y row -r - 1, as scale.py with ``y_src``), fp32 fma in k order, cvt.rn.bf16x2: the same
   expression as scale.py, so the result is bitwise equal to the default scale's.

Peers: the waits on a source's marker and segments also end once that source's error word
(``err_peers[src]``, as scale.py's wait) is set, recording ERR_PEER_ERROR (index: the source,
word 3: this rank's epoch, observed: the source's code, expected: the counter when the wait
stopped): a rank that recorded an error ships nothing more, so waiting for it would only reach
the timeout.

Errors: the error word is read at every claim; once any error is recorded on this rank (this call
or earlier; sticky until a reset) a claimed tile reads no slot and its rows are NaN. So after an
error each row of ``out`` is either correct (its tile finished before) or NaN. A row index outside
the slot / y records ERR_SCALE_BAD_ROW and its token is NaN, as in scale.py. Dependency entries
outside band_ready or the arrival table record ERR_PLAN_BOUNDS (fields 8 / 9) and are never
loaded.

Requires ``local_copy=False`` (local rows straight from y): with the local copy, the local rows
would come from this rank's own consumer, whose CTAs the scale's could crowd out.
"""

from ..kernels.errors import (ERR_PEER_ERROR, ERR_PLAN_BOUNDS, ERR_SCALE_BAD_ROW,
                              ERR_SCALE_TIMEOUT, ERR_TILE_BAND_TIMEOUT, ERR_TILE_SEGMENT_TIMEOUT)
from .ordered_scale import LOCAL  # the dependency kinds of the tables (REMOTE otherwise)
from .scale import BF16X2_NAN, DEFAULT_TIMEOUT_NS, check_fingerprint

# 512 threads x 2 CTAs per SM and 16-token tiles: the plain scale's rate after the GEMM
# (bench/NOTES.md, session 12; 256 x 4 with 32-token tiles left 400 of 528 CTAs idle)
DEFAULT_THREADS = 512
DEFAULT_CTAS_PER_SM = 2
PF_TILE_BAND, PF_TILE_SEGMENT = 8, 9  # ERR_PLAN_BOUNDS fields (kernels/errors.py PLAN_FIELDS)


def build_ordered_scale(topk: int, threads: int = DEFAULT_THREADS):
    if topk < 1 or topk > 64:
        raise ValueError(f"topk={topk} must be in [1, 64]")
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"threads={threads} must be a multiple of 32 in [32, 1024]")
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Float32, Int32, Int64
    from ..kernels import primitives as P

    NT = threads
    K = topk

    as_f32, pack_bf16x2 = P.as_f32, P.pack_bf16x2
    select_s32, select_s64 = P.select_s32, P.select_s64

    def claim(queue):
        return cute.arch.inline_ptx("atom.relaxed.gpu.global.add.u32 {$w0}, [{$r0}], 1;",
                                    write_only_types=[Int32], read_only_args=[queue])

    @cute.jit
    def record_error_wide(err: Int64, code: Int32, rank: Int32, index: Int32, word3: Int64,
                          observed: Int64, expected: Int64, elapsed: Int64):
        """P.record_error with a 64-bit word 3 (source << 32 | segment: errors.segment_word)."""
        old = P.atom_cas_s64(err, Int64(0), Int64(code))
        if old == Int64(0):
            P.st_s64(err + Int64(8), Int64(rank))
            P.st_s64(err + Int64(16), Int64(index))
            P.st_s64(err + Int64(24), word3)
            P.st_s64(err + Int64(32), observed)
            P.st_s64(err + Int64(40), expected)
            P.st_s64(err + Int64(48), elapsed)
            P.fence_acq_rel_sys()

    @cute.jit
    def wait_dep(kind: Int32, src: Int32, idx: Int32, band_ready: Int64, flag_cap: Int32,
                 wait_bands: Int32, seg_arr: Int64, seg_exp: Int64, seg_cap: Int32,
                 world: Int32, epoch: Int32, t0: Int64, timeout_ns: Int64, err: Int64,
                 rank: Int32, tile: Int32, err_peers: Int64):
        """One thread's dependency: bounded acquire wait. Returns Int32 1 on failure."""
        bad = Int32(0)
        if kind == Int32(LOCAL):
            if wait_bands != Int32(0):
                if P.in_range_s64(Int64(idx), Int64(0), Int64(flag_cap)) == Int32(0):
                    bad = Int32(1)
                    P.record_error(err, Int32(ERR_PLAN_BOUNDS), rank, tile, Int32(PF_TILE_BAND),
                                   Int64(idx), Int64(flag_cap), Int64(0))
                else:
                    to, v, el = P.wait_eq_gpu_s32(band_ready + Int64(idx) * Int64(4), epoch, t0,
                                                  timeout_ns)
                    if to != Int32(0):
                        bad = Int32(1)
                        P.record_error(err, Int32(ERR_TILE_BAND_TIMEOUT), rank, tile, idx,
                                       Int64(v), Int64(epoch), el)
        else:
            ok = P.in_range_s64(Int64(src), Int64(0), Int64(world))
            if ok != Int32(0):
                ok = P.in_range_s64(Int64(idx), Int64(0), Int64(seg_cap))
            if ok == Int32(0):
                bad = Int32(1)
                P.record_error(err, Int32(ERR_PLAN_BOUNDS), rank, tile, Int32(PF_TILE_SEGMENT),
                               (Int64(src) << Int64(32)) | Int64(idx), Int64(seg_cap), Int64(0))
            else:
                off = (Int64(src) * Int64(seg_cap) + Int64(idx)) * Int64(8)
                exp = P.ld_s64(seg_exp + off)
                st, v, el, code = P.wait_ge_sys_s64_or_peer_error(
                    seg_arr + off, exp, P.peer_error_word(err_peers, src, err), t0, timeout_ns)
                if st == Int32(1):
                    bad = Int32(1)
                    record_error_wide(err, Int32(ERR_TILE_SEGMENT_TIMEOUT), rank, tile,
                                      (Int64(src) << Int64(32)) | Int64(idx), v, exp, el)
                elif st == Int32(2):
                    bad = Int32(1)
                    P.record_error(err, Int32(ERR_PEER_ERROR), rank, src, epoch, code, v, el)
        return bad

    @cute.kernel
    def ordered_kernel(recv: Int64, rows: Int64, weights: Int64, out: Int64, n_chunks: Int32,
                       row_bytes: Int64, rank: Int32, err: Int64, timeout_ns: Int64,
                       epoch_ptr: Int64, slot_bytes: Int64, y: Int64, y_rows: Int32,
                       slot_rows: Int64, order: Int64, tile_start: Int64, n_tiles: Int32,
                       dep_start: Int64, dep_kind: Int64, dep_src: Int64, dep_index: Int64,
                       band_ready: Int64, flag_cap: Int32, wait_bands: Int32, seg_arr: Int64,
                       seg_exp: Int64, seg_cap: Int32, queue: Int64, counters: Int64,
                       expected: Int64, world: Int32, check_tags: Int32, err_peers: Int64,
                       fingerprint_ptr: Int64):
        tidx, bidx, _ = P.thread_block_grid()
        alloc = cutlass.memory.SmemAllocator()
        shared = alloc.allocate_array(cutlass.Int32, 2, byte_alignment=8)
        sj = shared.toint()
        epoch = P.ld_s32(epoch_ptr)
        t0 = P.globaltimer()
        e0 = Int32(0)
        if tidx == Int32(0):
            e0 = P.error_set(err)
        failed = P.block_any(e0)
        # 1. call markers and epoch tags (one source per CTA, thread 0)
        if check_tags != Int32(0) and tidx == Int32(0) and bidx < world and failed == Int32(0):
            exp = P.ld_s64(expected + Int64(bidx) * Int64(8))
            st, v, el, code = P.wait_ge_sys_s64_or_peer_error(
                counters + Int64(bidx) * Int64(8), exp, P.peer_error_word(err_peers, bidx, err),
                t0, timeout_ns)
            if st == Int32(1):
                P.record_error(err, Int32(ERR_SCALE_TIMEOUT), rank, bidx, epoch, v, exp, el)
            elif st == Int32(2):
                P.record_error(err, Int32(ERR_PEER_ERROR), rank, bidx, epoch, code, v, el)
            else:
                P.check_call_tag(err, rank, bidx, counters + (
                    Int64(world) + Int64(epoch & Int32(1)) * Int64(world) + Int64(bidx))
                    * Int64(8), epoch, P.ld_s32(fingerprint_ptr))
        base = recv + Int64(epoch & Int32(1)) * slot_bytes
        more = Int32(1)
        while more != Int32(0):
            # 2. claim the next tile in completion order (thread 0), share it with the CTA
            if tidx == Int32(0):
                P.st_shared_s32(sj, claim(queue))
                P.st_shared_s32(sj + Int32(4), P.error_set(err))
            P.block_sync()
            j = P.ld_shared_s32(sj)
            stop = P.ld_shared_s32(sj + Int32(4))
            if j >= n_tiles:
                more = Int32(0)
            bad = Int32(0)
            if more != Int32(0) and stop == Int32(0):
                d = P.ld_s32(dep_start + Int64(j) * Int64(4)) + tidx
                d1 = P.ld_s32(dep_start + Int64(j + Int32(1)) * Int64(4))
                while d < d1 and bad == Int32(0):
                    o4 = Int64(d) * Int64(4)
                    bad = wait_dep(P.ld_s32(dep_kind + o4), P.ld_s32(dep_src + o4),
                                   P.ld_s32(dep_index + o4), band_ready, flag_cap, wait_bands,
                                   seg_arr, seg_exp, seg_cap, world, epoch, t0, timeout_ns, err,
                                   rank, j, err_peers)
                    d = d + Int32(NT)
            # joins the waits (and every thread's read of the shared slot before the next claim)
            nan_tile = P.block_any(bad | stop)
            if more != Int32(0):
                # 3. the tile's tokens: (token, 16-byte column chunk) items, NT at a time
                a0 = P.ld_s32(tile_start + Int64(j) * Int64(4))
                a1 = P.ld_s32(tile_start + Int64(j + Int32(1)) * Int64(4))
                total = (a1 - a0) * n_chunks
                i = tidx
                while i < total:
                    tl = i // n_chunks
                    c = Int64(i - tl * n_chunks)
                    t = Int64(P.ld_s32(order + Int64(a0 + tl) * Int64(4)))
                    dst = out + t * row_bytes + c * Int64(16)
                    if nan_tile != Int32(0):
                        nan = Int32(BF16X2_NAN)
                        P.st_v4(dst, [nan, nan, nan, nan])
                    else:
                        ws, vs = [], []
                        badrow = Int32(0)
                        for k in cutlass.range_constexpr(K):
                            a = t * Int64(K) + Int64(k)
                            r = P.ld_s32(rows + a * Int64(4))
                            ws.append(cute.arch.inline_ptx("ld.global.f32 {$w0}, [{$r0}];",
                                                           write_only_types=[Float32],
                                                           read_only_args=[weights
                                                                           + a * Int64(4)]))
                            ok = P.in_range_s64(Int64(r), Int64(0), slot_rows)
                            is_y = Int32(0)
                            bound = slot_rows
                            src = base + Int64(r) * row_bytes
                            yr = Int64(Int32(-1) - r)
                            if r < Int32(0):  # local expert: row -r - 1 of y
                                ok = P.in_range_s64(yr, Int64(0), Int64(y_rows))
                                src = y + yr * row_bytes
                                is_y = Int32(1)
                                bound = Int64(y_rows)
                            if ok == Int32(0):
                                src = base
                                badrow = Int32(1)
                                if c == Int64(0):  # one report per assignment
                                    P.record_error(err, Int32(ERR_SCALE_BAD_ROW), rank,
                                                   Int32(a), is_y,
                                                   select_s64(is_y, yr, Int64(r)), bound,
                                                   Int64(0))
                            vs.append(P.ld_v4_cg(src + c * Int64(16)))
                        acc = [Float32(0.0)] * 8
                        for k in cutlass.range_constexpr(K):
                            w = ws[k]
                            v4 = vs[k]
                            for q in cutlass.range_constexpr(4):
                                lo = as_f32(v4[q] << Int32(16))
                                hi = as_f32(v4[q] & Int32(-65536))
                                acc[2 * q] = acc[2 * q] + w * lo
                                acc[2 * q + 1] = acc[2 * q + 1] + w * hi
                        P.st_v4(dst, [select_s32(badrow, Int32(BF16X2_NAN),
                                                 pack_bf16x2(acc[2 * q], acc[2 * q + 1]))
                                      for q in range(4)])
                    i = i + Int32(NT)

    @cute.jit
    def launch(recv: Int64, rows: Int64, weights: Int64, out: Int64, n_chunks: Int32,
               row_bytes: Int64, rank: Int32, err: Int64, timeout_ns: Int64, epoch_ptr: Int64,
               slot_bytes: Int64, y: Int64, y_rows: Int32, slot_rows: Int64, order: Int64,
               tile_start: Int64, n_tiles: Int32, dep_start: Int64, dep_kind: Int64,
               dep_src: Int64, dep_index: Int64, band_ready: Int64, flag_cap: Int32,
               wait_bands: Int32, seg_arr: Int64, seg_exp: Int64, seg_cap: Int32,
               queue: Int64, counters: Int64, expected: Int64, world: Int32, check_tags: Int32,
               err_peers: Int64, fingerprint_ptr: Int64, grid: Int32, stream: cuda.CUstream):
        ordered_kernel(recv, rows, weights, out, n_chunks, row_bytes, rank, err, timeout_ns,
                       epoch_ptr, slot_bytes, y, y_rows, slot_rows, order, tile_start, n_tiles,
                       dep_start, dep_kind, dep_src, dep_index, band_ready, flag_cap,
                       wait_bands, seg_arr, seg_exp, seg_cap, queue, counters, expected, world,
                       check_tags, err_peers, fingerprint_ptr).launch(
            grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


_ARG_TYPES = ("i64 " * 4 + "i32 i64 i32 i64 i64 i64 i64 i64 i32 i64 i64 i64 i32 i64 i64 i64 i64 "
              "i64 i32 i32 i64 i64 i32 i64 i64 i64 i32 i32 i64 i64 i32").split()


def ordered_scale_example_args():
    """Example arguments of the launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0) if t == "i64" else Int32(1) for t in _ARG_TYPES] + [cuda.CUstream(0)]


def compile_ordered_scale(topk: int, threads: int = DEFAULT_THREADS):
    import cutlass.cute as cute
    return cute.compile(build_ordered_scale(topk, threads), *ordered_scale_example_args())


class OrderedScale:
    """Compiled ordered scale + launch helper. ``launch`` never synchronizes."""

    def __init__(self, topk: int, threads: int = DEFAULT_THREADS,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 ctas_per_sm: int = DEFAULT_CTAS_PER_SM):
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"threads={threads} must be a multiple of 32 in [32, 1024]")
        if not 1 <= ctas_per_sm <= 2048 // threads:
            raise ValueError(f"ctas_per_sm={ctas_per_sm} must be in [1, {2048 // threads}] "
                             f"for {threads} threads")
        self.topk, self.threads, self.timeout_ns = int(topk), int(threads), int(timeout_ns)
        self.ctas_per_sm = int(ctas_per_sm)
        self._fn = None
        self._launcher = None

    def compile(self):
        if self._fn is None:
            self._fn = compile_ordered_scale(self.topk, self.threads)
        return self._fn

    def check(self, *, rows, weights, out, tables, band_ready, seg_arrivals, seg_expected,
              queue, err, epoch):
        """ValueError / TypeError for inputs the kernel cannot take (before any launch)."""
        import torch
        T, N = out.shape
        want = {"rows": (rows, torch.int32, (T, self.topk)),
                "weights": (weights, torch.float32, (T, self.topk)),
                "queue": (queue, torch.int32, (1,)), "err": (err, torch.int64, (8,)),
                "epoch": (epoch, torch.int32, (1,)), "band_ready": (band_ready, torch.int32, None),
                "seg_arrivals": (seg_arrivals, torch.int64, None),
                "seg_expected": (seg_expected, torch.int64, tuple(seg_arrivals.shape))}
        for name in ("order", "tile_start", "dep_start", "dep_kind", "dep_source", "dep_index"):
            want[name] = (tables[name], torch.int32, None)
        if out.dtype != torch.bfloat16 or not out.is_contiguous() or N % 8:
            raise ValueError("out must be a contiguous bf16 [T, N] tensor with N % 8 == 0")
        for name, (t, dt, shape) in want.items():
            if t.dtype != dt:
                raise TypeError(f"{name} must be {dt}, got {t.dtype}")
            if shape is not None and tuple(t.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
            if not t.is_contiguous() or t.device != out.device:
                raise ValueError(f"{name} must be contiguous on {out.device}")
        if seg_arrivals.dim() != 2:
            raise ValueError("seg_arrivals must be [W, segment capacity]")
        if tables["order"].numel() != T or tables["tile_start"].numel() < 1:
            raise ValueError(f"the tile tables are for {tables['order'].numel()} tokens, out "
                             f"has {T}")
        # the dependency arrays may be longer than the tiles' lists (padded to a capacity by
        # the device preparation, combine/ordered_routes.py): the kernel reads tile j's entries
        # dep_start[j] .. dep_start[j + 1] only, and takes n_tiles from tile_start's length
        if tables["dep_start"].numel() != tables["tile_start"].numel():
            raise ValueError(f"dep_start has {tables['dep_start'].numel()} entries, tile_start "
                             f"{tables['tile_start'].numel()} (n_tiles + 1 each)")
        lens = {n: tables[n].numel() for n in ("dep_kind", "dep_source", "dep_index")}
        if len(set(lens.values())) != 1:
            raise ValueError(f"dep_kind, dep_source and dep_index must be equally long, got "
                             f"{lens}")

    def launch(self, *, recv, rows, weights, out, y, tables, band_ready, seg_arrivals,
               seg_expected, queue, counters, expected, rank, err, epoch, slot_bytes,
               grid: int, wait_bands: bool, check_tags: bool, stream=None, err_peers=None,
               fingerprint=None):
        """recv: receive buffer base (slot 0; slot_bytes > 0: two slots of that size); rows:
        int32 [T, topk] (y_src encoding: r < 0 is y row -r - 1); weights fp32 [T, topk]; out
        bf16 [T, N]; y: the producer's output [rows, N]; tables: int32 on the device,
        ``ordered_routes.ordered_routes_device``'s (dependency arrays padded) or
        ``ordered_scale.tile_tables``' (exact); band_ready: the producer's flags;
        seg_arrivals / seg_expected: int64 [W, Sc] (this rank's per-segment arrival counters
        and their cumulative expectation);
        queue: int32 [1], zeroed on the stream before the call; counters / expected: int64 [W]
        (markers and, with check_tags, the epoch tags after them, checked against this rank's
        tag as Scale.launch: ``fingerprint``, the plan's ``counts_fingerprint``, needed then).
        wait_bands: wait on the local bands' flags (a launch beside the producer); False after
        the producer's kernel boundary. grid: CTAs (persistent). err_peers: int64 [W] device
        table of every rank's error word as mapped here (0: not reachable;
        ``CommBuffer.err_peers``): the waits for source s also end, recording ERR_PEER_ERROR,
        once that word is set; None: a peer's error shows as a timeout."""
        import torch
        self.check(rows=rows, weights=weights, out=out, tables=tables, band_ready=band_ready,
                   seg_arrivals=seg_arrivals, seg_expected=seg_expected, queue=queue, err=err,
                   epoch=epoch)
        if err_peers is not None and (err_peers.dtype != torch.int64 or
                                      tuple(err_peers.shape) != (seg_arrivals.shape[0],) or
                                      err_peers.device != out.device):
            raise ValueError(f"err_peers must be int64 [{seg_arrivals.shape[0]}] on {out.device}")
        if check_tags:
            check_fingerprint(fingerprint, out.device)
        fn = self.compile()
        if self._launcher is None:
            from ..kernels.primitives import LaunchCache
            self._launcher = LaunchCache(fn)
        if stream is None:
            stream = torch.cuda.current_stream(out.device)
        T, N = out.shape
        W, Sc = seg_arrivals.shape
        slot_rows = int(slot_bytes) // (N * 2) if slot_bytes else recv.numel() // N
        self._launcher((recv.data_ptr(), rows.data_ptr(), weights.data_ptr(), out.data_ptr(),
                        N // 8, N * 2, int(rank), err.data_ptr(), self.timeout_ns,
                        epoch.data_ptr(), int(slot_bytes), y.data_ptr(), y.shape[0], slot_rows,
                        tables["order"].data_ptr(), tables["tile_start"].data_ptr(),
                        tables["tile_start"].numel() - 1, tables["dep_start"].data_ptr(),
                        tables["dep_kind"].data_ptr(), tables["dep_source"].data_ptr(),
                        tables["dep_index"].data_ptr(), band_ready.data_ptr(),
                        band_ready.numel(), int(bool(wait_bands)), seg_arrivals.data_ptr(),
                        seg_expected.data_ptr(), Sc, queue.data_ptr(), counters.data_ptr(),
                        expected.data_ptr(), W, int(bool(check_tags)),
                        0 if err_peers is None else err_peers.data_ptr(),
                        0 if fingerprint is None else fingerprint.data_ptr(), max(1, int(grid))),
                       stream.cuda_stream)
