"""Owner's scale: out[t] = sum_k w[t, k] * recv[row(t, k)] (fp32 accumulate, bf16 out), after a
bounded wait for the arrivals. One launcher, two kernels on the stream:

1. arrival wait, W CTAs of one warp (few CTAs spin on the peers, so a kernel of another stream
   that a peer needs, e.g. NCCL, is not starved of SMs): CTA s, thread 0, waits (ld.acquire.sys,
   bounded by %globaltimer) until ``counter[s] >= expected_cum[s]``; ``expected_cum`` lives on the
   device and is advanced by the caller on the stream before the launch (``expected_cum += rows
   from s + 1``: the consumer adds one call marker per call besides the rows), so no host ints
   change between calls and CUDA graphs replay. Then it reads source s's epoch tag of this call's
   slot (communication block word W + (epoch & 1) * W + s, moe_overlap/kernels/errors.py): the
   sender wrote it before its marker, so it must equal this rank's tag (the plan's counts
   fingerprint << 32 | the epoch's 32 bits: the same across the wrap); otherwise the ranks are
   out of step (one made a call the others did not, skipped one, or was reset alone, or planned
   from other counts) and it records ERR_EPOCH_MISMATCH (source, both tags). A timeout records
   ERR_SCALE_TIMEOUT (source, epoch, counter, expected). The same spin also polls source s's
   error code (word 0 of its symmetric error word, ``err_peers[s]``, ld.relaxed.sys, every
   ``PEER_POLL_NS`` = 20 us of waiting: the hot spin stays local, kernels/primitives.py): a source
   that has recorded an error ships nothing more (sticky), so once its code is set the wait
   records ERR_PEER_ERROR (source, epoch, its code, the counter) and stops, instead of waiting
   for the timeout (a counter already reached wins: those rows did arrive).
   ``fence.acq_rel.sys`` after the acquire; the kernel boundary then orders the scale's loads
   after it (causality is transitive).
   Skipped (nothing waited for) when the error word is already set.
   Why a kernel boundary rather than a device flag the other CTAs wait on: CTAs waiting on a
   flag are resident all the same and hold the SMs (registers, threads) that another stream's
   kernel would need; the second kernel's CTAs do not exist until the wait is over. Its cost is
   one kernel boundary per call (measure with bench/bench_combine_split.py).
2. scale, ``ctas_per_sm`` CTAs per SM, started only once every arrival is complete (the kernel
   boundary is the release of the work): thread 0 of each CTA reads the error word; if any error
   is recorded on this rank (this call's wait or consumer, or any earlier call: errors are sticky
   until a reset), the kernel reads no receive slot and writes NaN to every row of ``out``.
   Every row index is checked against the slot (``0 <= r < slot_rows``; with y_src a negative r
   against y's rows); a bad one records ERR_SCALE_BAD_ROW, is never loaded, and its token's
   row is NaN.

Then each thread owns 8 columns (16 bytes) of ``unroll`` (token, column-chunk) pairs at a time:
TOPK 16-byte loads of recv[row(t, k)] each (all issued before any arithmetic: every load needs the
row index first, so two dependent memory latencies per iteration, and the loads in flight per
thread set the bandwidth), bf16 -> fp32 by shifts, fma with w[t, k] (fp32), cvt.rn.bf16x2 and one
16-byte store. Grid-stride over the pairs; the grid fills ``ctas_per_sm`` CTAs per SM.

``y_src=True`` (OverlapCombine(local_copy=False)): a negative entry r of ``rows`` names row
``-r - 1`` of ``y`` (the producer's output on this GPU: assignments to this rank's own experts,
which the consumer does not copy then); r >= 0 is a receive-slot row. The caller orders
the scale after the producer on the stream (kernel boundary: y is final and visible), so the
kernel itself waits only on the arrival counters (the own counter then expects just the call
marker).
"""
import os

DEFAULT_THREADS = 256
DEFAULT_UNROLL = 1
DEFAULT_CTAS_PER_SM = 8  # the fastest in bench/bench_scale.py (docs/RESULTS.md)
DEFAULT_TIMEOUT_NS = 10_000_000_000
WAIT_THREADS = 32  # the arrival-wait kernel: one warp per source rank
BF16X2_NAN = 0x7FC07FC0  # two bf16 quiet NaNs


def build_scale(topk: int, threads: int = DEFAULT_THREADS, y_src: bool = False,
                unroll: int = DEFAULT_UNROLL):
    if topk < 1 or topk > 64:
        raise ValueError(f"topk={topk} must be in [1, 64]")
    if unroll not in (1, 2, 4):
        raise ValueError(f"unroll={unroll} must be 1, 2 or 4")
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64, Float32
    from ..kernels import primitives as P

    NT = threads
    K = topk
    U = int(unroll)
    Y_SRC = bool(y_src)

    as_f32, pack_bf16x2 = P.as_f32, P.pack_bf16x2
    select_s32, select_s64 = P.select_s32, P.select_s64

    @cute.kernel
    def wait_kernel(counters: Int64, expected: Int64, world: Int32, rank: Int32, err: Int64,
                    timeout_ns: Int64, epoch_ptr: Int64, check_tags: Int32, err_peers: Int64,
                    fingerprint_ptr: Int64):
        tidx, src, _ = P.thread_block_grid()
        if tidx == Int32(0) and src < world:
            P.wait_source_call(counters, expected, world, rank, src, err, timeout_ns, epoch_ptr,
                               err_peers, fingerprint_ptr, Int32(P.ERR_SCALE_TIMEOUT),
                               check_tags)

    @cute.kernel
    def scale_kernel(recv: Int64, rows: Int64, weights: Int64, out: Int64, T: Int32,
                     n_chunks: Int32, row_bytes: Int64, rank: Int32, err: Int64,
                     epoch_ptr: Int64, slot_bytes: Int64, y: Int64, y_rows: Int32,
                     slot_rows: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tidx = Int32(tidx)
        e0 = Int32(0)
        if tidx == Int32(0):
            e0 = P.error_set(err)
        failed = P.block_any(e0)
        total = Int64(T) * Int64(n_chunks)
        stride = Int64(Int32(nblk) * Int32(NT))
        if failed != Int32(0):
            # an error is recorded on this rank: read no slot, NaN in every row of out
            nan = Int32(BF16X2_NAN)
            i = Int64(Int32(bidx) * Int32(NT) + tidx)
            while i < total:
                t = i // Int64(n_chunks)
                P.st_v4(out + t * row_bytes + (i - t * Int64(n_chunks)) * Int64(16),
                        [nan, nan, nan, nan])
                i = i + stride
        else:
            base = recv + Int64(P.ld_s32(epoch_ptr) & Int32(1)) * slot_bytes
            i = Int64(Int32(bidx) * Int32(NT) + tidx)
            while i < total:
                # U pairs i, i + stride, ...: a pair past the end is clamped to the last one
                # (loads stay in bounds, one basic block) and not stored
                ts, cs, ws, vs, bads = [], [], [], [], []
                for u in cutlass.range_constexpr(U):
                    iu = i + Int64(u) * stride
                    if cutlass.const_expr(u > 0):
                        iu = cute.arch.inline_ptx("min.s64 {$w0}, {$r0}, {$r1};",
                                                  write_only_types=[Int64],
                                                  read_only_args=[iu, total - Int64(1)])
                    t = iu // Int64(n_chunks)
                    ts.append(t)
                    cs.append(iu - t * Int64(n_chunks))
                for u in cutlass.range_constexpr(U):
                    bad = Int32(0)
                    for k in cutlass.range_constexpr(K):
                        a = ts[u] * Int64(K) + Int64(k)
                        r = P.ld_s32(rows + a * Int64(4))
                        ws.append(cute.arch.inline_ptx("ld.global.f32 {$w0}, [{$r0}];",
                                                       write_only_types=[Float32],
                                                       read_only_args=[weights + a * Int64(4)]))
                        # a row outside the slot (or y) is never loaded: row 0 of the slot is
                        # read instead (in bounds whenever there is a pair) and the token is NaN
                        ok = P.in_range_s64(Int64(r), Int64(0), slot_rows)
                        is_y = Int32(0)
                        bound = slot_rows
                        src = base + Int64(r) * row_bytes
                        yr = Int64(Int32(-1) - r)
                        if cutlass.const_expr(Y_SRC):
                            if r < Int32(0):  # local expert: row -r - 1 of y
                                ok = P.in_range_s64(yr, Int64(0), Int64(y_rows))
                                src = y + yr * row_bytes
                                is_y = Int32(1)
                                bound = Int64(y_rows)
                        if ok == Int32(0):
                            src = base
                            bad = Int32(1)
                            if cs[u] == Int64(0):  # one report per assignment
                                P.record_error(err, Int32(P.ERR_SCALE_BAD_ROW), rank, Int32(a),
                                               is_y, select_s64(is_y, yr, Int64(r)), bound,
                                               Int64(0))
                        vs.append(P.ld_v4_cg(src + cs[u] * Int64(16)))
                    bads.append(bad)
                for u in cutlass.range_constexpr(U):
                    acc = [Float32(0.0)] * 8
                    for k in cutlass.range_constexpr(K):
                        w = ws[u * K + k]
                        v4 = vs[u * K + k]
                        for j in cutlass.range_constexpr(4):
                            lo = as_f32(v4[j] << Int32(16))
                            hi = as_f32(v4[j] & Int32(-65536))
                            acc[2 * j] = acc[2 * j] + w * lo
                            acc[2 * j + 1] = acc[2 * j + 1] + w * hi
                    o = [select_s32(bads[u], Int32(BF16X2_NAN),
                                    pack_bf16x2(acc[2 * j], acc[2 * j + 1])) for j in range(4)]
                    if cutlass.const_expr(u == 0):
                        P.st_v4(out + ts[u] * row_bytes + cs[u] * Int64(16), o)
                    else:
                        if i + Int64(u) * stride < total:
                            P.st_v4(out + ts[u] * row_bytes + cs[u] * Int64(16), o)
                i = i + stride * Int64(U)

    @cute.jit
    def launch(recv: Int64, rows: Int64, weights: Int64, out: Int64, T: Int32, n_chunks: Int32,
               row_bytes: Int64, counters: Int64, expected: Int64, world: Int32, rank: Int32,
               err: Int64, timeout_ns: Int64, epoch_ptr: Int64, slot_bytes: Int64, y: Int64,
               y_rows: Int32, slot_rows: Int64, check_tags: Int32, wait_grid: Int32, grid: Int32,
               err_peers: Int64, fingerprint_ptr: Int64, stream: cuda.CUstream):
        wait_kernel(counters, expected, world, rank, err, timeout_ns, epoch_ptr,
                    check_tags, err_peers, fingerprint_ptr).launch(
            grid=[wait_grid, 1, 1], block=[WAIT_THREADS, 1, 1], stream=stream)
        scale_kernel(recv, rows, weights, out, T, n_chunks, row_bytes, rank, err, epoch_ptr,
                     slot_bytes, y, y_rows, slot_rows).launch(
            grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


def scale_example_args():
    """Example arguments of the scale launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 4 + [Int32(1), Int32(1), Int64(0), Int64(0), Int64(0), Int32(1),
                             Int32(0), Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(0),
                             Int64(0), Int32(0), Int32(1), Int32(1), Int64(0), Int64(0),
                             cuda.CUstream(0)]


def compile_scale(topk: int, threads: int = DEFAULT_THREADS, y_src: bool = False,
                  unroll: int = DEFAULT_UNROLL):
    import cutlass.cute as cute
    launch = build_scale(topk, threads, y_src, unroll)
    return cute.compile(launch, *scale_example_args())


class Scale:
    """Compiled fused wait + scale. ``launch`` never synchronizes."""

    def __init__(self, topk: int, threads: int = DEFAULT_THREADS,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS, y_src: bool = False,
                 unroll: int = DEFAULT_UNROLL, ctas_per_sm: int = DEFAULT_CTAS_PER_SM):
        self.topk, self.threads, self.timeout_ns = topk, threads, int(timeout_ns)
        self.y_src = bool(y_src)
        if unroll not in (1, 2, 4):
            raise ValueError(f"unroll={unroll} must be 1, 2 or 4")
        if not 1 <= ctas_per_sm <= 2048 // threads:
            raise ValueError(f"ctas_per_sm={ctas_per_sm} must be in [1, {2048 // threads}] "
                             f"for {threads} threads")
        self.unroll, self.ctas_per_sm = int(unroll), int(ctas_per_sm)
        self._fn = None
        self._launcher = None

    def compile(self):
        if self._fn is None:
            self._fn = compile_scale(self.topk, self.threads, self.y_src, self.unroll)
        return self._fn

    def launch(self, *, recv, rows, weights, out, counters, expected, rank, err, epoch,
               slot_bytes, num_sms: int, stream=None, y=None, epoch_tags: bool = False,
               err_peers=None, fingerprint=None):
        """recv: receive buffer base (slot 0); rows: int32 [T, topk] (y_src: negative = y row
        -r - 1); weights: fp32 [T, topk]; out: [T, N] bf16; counters / expected: int64 [W]
        (counters: the first W words of the communication block, whose epoch tags follow them);
        y: [rows, N] bf16 (needed with y_src). slot_bytes > 0: recv holds slots of that size
        (row indices are checked against its rows); 0: recv is the one slot.
        epoch_tags: the source epoch tags follow ``counters`` (the communication block of
        moe_overlap/kernels/errors.py, OverlapCombine); each is checked against this rank's
        ``call_tag(epoch, fingerprint)``: ``fingerprint`` (needed then) is the plan's
        ``counts_fingerprint`` (int32 [1] on the device).
        err_peers: int64 [W] device table of every rank's error word as mapped here (0: not
        reachable; ``CommBuffer.err_peers``): the wait for source s also ends, recording
        ERR_PEER_ERROR, once s's code word is set. None: the wait ends on this rank's own
        error only (a peer's error shows as ERR_SCALE_TIMEOUT)."""
        if self.y_src and y is None:
            raise ValueError("Scale(y_src=True) needs y")
        if epoch_tags:
            check_fingerprint(fingerprint, out.device)
        import torch
        import cuda.bindings.driver as cuda
        fn = self.compile()
        if self._launcher is None:
            from ..kernels.primitives import LaunchCache
            self._launcher = LaunchCache(fn)
        T, N = out.shape
        n_chunks = N // 8
        if stream is None:
            stream = torch.cuda.current_stream(out.device)
        work = max(1, T * n_chunks)
        per_cta = self.threads * self.unroll
        grid = max(1, min(num_sms * self.ctas_per_sm, (work + per_cta - 1) // per_cta))
        W = counters.numel()
        self._launcher((recv.data_ptr(), rows.data_ptr(), weights.data_ptr(), out.data_ptr(), T,
                        n_chunks, N * 2, counters.data_ptr(), expected.data_ptr(),
                        W, rank, err.data_ptr(), self.timeout_ns, epoch.data_ptr(),
                        int(slot_bytes), 0 if y is None else y.data_ptr(),
                        0 if y is None else y.shape[0],
                        int(slot_bytes) // (N * 2) if slot_bytes else recv.numel() // N,
                        int(bool(epoch_tags)), max(1, W), grid,
                        0 if err_peers is None else err_peers.data_ptr(),
                        0 if fingerprint is None else fingerprint.data_ptr()),
                       stream.cuda_stream)


def check_fingerprint(fingerprint, device):
    """ValueError unless ``fingerprint`` is an int32 [1] tensor on ``device`` (a plan's
    ``counts_fingerprint``: the scales compare the epoch tags with it)."""
    import torch
    if not isinstance(fingerprint, torch.Tensor) or fingerprint.dtype != torch.int32 or \
            fingerprint.numel() != 1 or fingerprint.device != device:
        raise ValueError(f"the epoch tag check needs fingerprint=plan.counts_fingerprint (int32 "
                         f"[1] on {device}), got {getattr(fingerprint, 'shape', fingerprint)!r}")


def scale_torch(recv_slot, rows, weights, y=None):
    """Reference of the arithmetic (no wait): fp32 accumulate, bf16 out. With y, negative rows
    r read y[-r - 1] (y_src encoding)."""
    import torch
    T, K = rows.shape
    r = rows.reshape(-1).long()
    if y is None:
        g = recv_slot[r]
    else:
        g = torch.where((r < 0)[:, None], y[(-r - 1).clamp(min=0)], recv_slot[r.clamp(min=0)])
    g = g.view(T, K, -1).float()
    return (g * weights.float().unsqueeze(-1)).sum(1).to(torch.bfloat16)
