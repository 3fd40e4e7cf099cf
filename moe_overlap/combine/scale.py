"""Owner's scale: out[t] = sum_k w[t, k] * recv[row(t, k)] (fp32 accumulate, bf16 out), fused
with the bounded wait for the arrivals.

Each CTA first waits (threads s < W, ld.acquire.sys bounded by %globaltimer) until
``counter[s] >= expected_cum[s]`` for every source rank s; ``expected_cum`` lives on the device and
is advanced by the caller on the stream before the launch (``expected_cum += rows from s + 1``: the
consumer adds one call marker per call besides the rows), so no host ints change between calls and
CUDA graphs replay. On timeout the kernel records (rank, source, counter, expected) in the error
buffer and exits. ``bar.red.or`` then orders every thread's receive-buffer loads after the acquire.

Then each thread owns 8 columns (16 bytes) of ``unroll`` (token, column-chunk) pairs at a time:
TOPK 16-byte loads of recv[row(t, k)] each (all issued before any arithmetic: every load needs the
row index first, so two dependent memory latencies per iteration, and the loads in flight per
thread set the bandwidth), bf16 -> fp32 by shifts, fma with w[t, k] (fp32), cvt.rn.bf16x2 and one
16-byte store. Grid-stride over the pairs; the grid fills ``ctas_per_sm`` CTAs per SM.

``y_src=True`` (OverlapCombine(local_copy=False)): a negative entry r of ``rows`` names row
``-r - 1`` of ``y`` (the producer's output on this GPU: assignments to this rank's own experts,
which the consumer no longer copies); r >= 0 is a receive-slot row as before. The caller orders
the scale after the producer on the stream (kernel boundary: y is final and visible), so the
kernel itself waits only on the arrival counters (the own counter then expects just the call
marker).
"""
import os

DEFAULT_THREADS = 256
DEFAULT_UNROLL = 1
DEFAULT_CTAS_PER_SM = 8  # the fastest in bench/bench_scale.py (docs/RESULTS.md)
DEFAULT_TIMEOUT_NS = 10_000_000_000


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

    def as_f32(bits):
        return cute.arch.inline_ptx("mov.b32 {$w0}, {$r0};", write_only_types=[Float32],
                                    read_only_args=[bits])

    def pack_bf16x2(lo, hi):
        return cute.arch.inline_ptx("cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};",
                                    write_only_types=[Int32], read_only_args=[hi, lo])

    @cute.kernel
    def scale_kernel(recv: Int64, rows: Int64, weights: Int64, out: Int64, T: Int32,
                     n_chunks: Int32, row_bytes: Int64, counters: Int64, expected: Int64,
                     world: Int32, rank: Int32, err: Int64, timeout_ns: Int64, epoch_ptr: Int64,
                     slot_bytes: Int64, y: Int64):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        nblk, _, _ = cute.arch.grid_dim()
        tidx = Int32(tidx)
        to = Int32(0)
        if tidx < world:
            t0 = P.globaltimer()
            exp = P.ld_s64(expected + Int64(tidx) * Int64(8))
            to2, v, el = P.wait_ge_sys_s64(counters + Int64(tidx) * Int64(8), exp, t0,
                                           timeout_ns)
            if to2 != Int32(0):
                to = Int32(1)
                P.record_error(err, Int32(P.ERR_SCALE_TIMEOUT), rank, tidx, Int32(-1), v, exp,
                               el)
        failed = P.block_any(to)
        if failed == Int32(0):
            base = recv + Int64(P.ld_s32(epoch_ptr) & Int32(1)) * slot_bytes
            total = Int64(T) * Int64(n_chunks)
            i = Int64(Int32(bidx) * Int32(NT) + tidx)
            stride = Int64(Int32(nblk) * Int32(NT))
            while i < total:
                # U pairs i, i + stride, ...: a pair past the end is clamped to the last one
                # (loads stay in bounds, one basic block) and not stored
                ts, cs, ws, vs = [], [], [], []
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
                    for k in cutlass.range_constexpr(K):
                        a = ts[u] * Int64(K) + Int64(k)
                        r = P.ld_s32(rows + a * Int64(4))
                        ws.append(cute.arch.inline_ptx("ld.global.f32 {$w0}, [{$r0}];",
                                                       write_only_types=[Float32],
                                                       read_only_args=[weights + a * Int64(4)]))
                        src = base + Int64(r) * row_bytes
                        if cutlass.const_expr(Y_SRC):
                            if r < Int32(0):  # local expert: row -r - 1 of y
                                src = y + Int64(Int32(-1) - r) * row_bytes
                        vs.append(P.ld_v4_cg(src + cs[u] * Int64(16)))
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
                    o = [pack_bf16x2(acc[2 * j], acc[2 * j + 1]) for j in range(4)]
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
               grid: Int32, stream: cuda.CUstream):
        scale_kernel(recv, rows, weights, out, T, n_chunks, row_bytes, counters, expected, world,
                     rank, err, timeout_ns, epoch_ptr, slot_bytes, y).launch(
            grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


def scale_example_args():
    """Example arguments of the scale launcher (types only), for cute.compile."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 4 + [Int32(1), Int32(1), Int64(0), Int64(0), Int64(0), Int32(1),
                             Int32(0), Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(1),
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
               slot_bytes, num_sms: int, stream=None, y=None):
        """recv: receive buffer base (slot 0); rows: int32 [T, topk] (y_src: negative = y row
        -r - 1); weights: fp32 [T, topk]; out: [T, N] bf16; counters / expected: int64 [W];
        y: [rows, N] bf16 (needed with y_src)."""
        if self.y_src and y is None:
            raise ValueError("Scale(y_src=True) needs y")
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
        self._launcher((recv.data_ptr(), rows.data_ptr(), weights.data_ptr(), out.data_ptr(), T,
                        n_chunks, N * 2, counters.data_ptr(), expected.data_ptr(),
                        counters.numel(), rank, err.data_ptr(), self.timeout_ns, epoch.data_ptr(),
                        int(slot_bytes), 0 if y is None else y.data_ptr(), grid),
                       stream.cuda_stream)


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
