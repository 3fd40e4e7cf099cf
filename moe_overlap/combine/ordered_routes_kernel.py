"""The ordered scale's per-routing tables in a few CuTe DSL kernels (``ordered_routes_device``'s
``impl="kernel"``): the same tables as the torch path (combine/ordered_routes.py) and the host
reference (``ordered_scale.ordered_routes``), with a launch count fixed by nothing but the path
(the torch path launches about 200 small kernels).

On the stream, in order (no host sync, CUDA-graph capturable):

1. zero: one memset of the bucket histogram [G, KEY_BUCKETS] (T words, whatever the capacity).
2. senders (``build_plan_kernels(senders=True)``): CTA s of a (1, W) grid plans rank s from the
   counts (the planner kernel's phases, so exactly its plan) and keeps what the owner needs
   (`SendersLayout`): per rank its segment count and each segment's receive row on the
   destination, seg_inc (rows of each segment to the owner, 0 for a segment to another rank:
   row s's first num_segments words, the rest of the [W, Sc] table unwritten, so nothing
   scales with the arrival table's capacity), and per remote expert e the first
   segment and the segment count of its group to the owner (a group's segments are consecutive
   and ascend in receive rows); the owner's CTA writes its num_bands and every band's schedule
   position.
3. keys (a thread per (t, k), whole tokens per CTA): the row's signal from its prepared row
   (``prepare_routes``: remote receive row, or -(y row) - 1 for local rows): a local row's band
   is y row >> lg; a remote row's segment is found by a binary search over its expert's group
   of segments. Its code (kind << 56 | source << 32 | index + 1: ascending codes are
   ``torch.unique(dim=0)``'s (kind, source, index) order) and its integer completion key
   (``ordered_scale.completion_keys``); the token's key is the largest of its k, counted per
   SORT_CHUNK-token chunk into the histogram (the workspace of the routes rank kernel).
4. sort: the routes rank kernel (combine/routes.py, ``inverse=True``, one round per CTA) with
   the token keys as ids and KEY_BUCKETS as experts: the stable counting sort's inverse is the
   token order.
5. tiles (a CTA per tile): its tile_tokens x k codes gathered in processing order, a bitonic
   sort in shared memory (the planner's, ``simt_helpers().bitonic_sort64``), the distinct ones
   (a CTA scan of "differs from the previous") written to a per-tile staging row, their count.
6. compact: every CTA scans the tile counts (dep_start), copies its tiles' distinct codes to
   the CSR arrays decoded into (kind, source, index), and fills the padding with -1.

Limits (``can_implement``): E <= 1024 (a group per thread of the planning CTA and an expert per
thread of the routes kernels), tile_tokens x topk <= 1024 (a code per thread of the tile CTA).
Inputs are vouched for by the caller (``validate=False``): bad ones give wrong tables, every
index is clamped so no access leaves its array.
"""

import torch

from .ordered_scale import KEY_BUCKETS
from .plan_kernel import NT, _LAYOUT_CODE, _pow2

# the counting sort's chunk: one round of NT tokens per CTA of the routes rank kernel (a CTA
# runs its rounds one after another, so more and shorter chunks finish sooner)
SORT_ROUNDS = 1
SORT_CHUNK = SORT_ROUNDS * NT

CODE_KIND_SHIFT, CODE_SOURCE_SHIFT = 56, 32
MAX_TILE_CODES = 1024  # tile_tokens x topk: one code per thread of a tile CTA
assert KEY_BUCKETS == NT  # the keys kernel's histogram: two buckets per thread


def _empty(n: int, dtype, device) -> torch.Tensor:
    """Every output and workspace, uninitialized: the kernels write each word that is read (the
    GPU tests replace this with a poisoned buffer to check that)."""
    return torch.empty(n, dtype=dtype, device=device)


class SendersLayout:
    """Word offsets (int32) of the senders kernel's output buffer; the kernel computes the same.
    nb: the owner's num_bands [1]; nseg [W]: every rank's num_segments (0 for the owner: the
    valid prefix of its seg_inc row, as ``OrderedRoutes.seg_count``); first / count [E]: per
    remote expert its group's first segment and segment count at its rank; pos [B]: the owner's
    schedule position of each band; dest_row [W, Sc]: each segment's receive row; seg_inc
    int64 [W, Sc] (row s valid up to nseg[s]); then (zeroed by one memset) the key histogram
    [G, KEY_BUCKETS] and 2 spare words (the sort kernel's unused count output)."""

    def __init__(self, W, E, B, S, T):
        self.nb = 0
        self.nseg = 1
        self.first = self.nseg + W
        self.count = self.first + E
        self.pos = self.count + E
        self.dest_row = self.pos + B
        self.seg_inc = (self.dest_row + W * S + 1) // 2 * 2
        self.hist = self.seg_inc + 2 * W * S
        self.groups = max(1, -(-T // SORT_CHUNK))
        self.spare = self.hist + self.groups * KEY_BUCKETS
        self.total = self.spare + 2


def build_keys_kernel(ids_64: bool):
    """The keys launcher (step 3 of the module doc)."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from .plan_kernel import simt_helpers

    H = simt_helpers()
    lds, sts, ptx1, smin, smax = H.lds, H.sts, H.ptx1, H.smin, H.smax
    Q = KEY_BUCKETS

    def ld_id(ids, i):
        if cutlass.const_expr(ids_64):
            return P.ld_s32(ids + Int64(i) * Int64(8))
        return P.ld_s32(ids + Int64(i) * Int64(4))

    def ldw(buf, off):
        return P.ld_s32(buf + Int64(off) * Int64(4))

    @cute.kernel
    def keys_kernel(rows: Int64, ids: Int64, so: Int64, codes: Int64, bucket: Int64,
                    T: Int32, k: Int32, W: Int32, E: Int32, El: Int32, owner: Int32, lg: Int32,
                    B: Int32, S: Int32):
        tid, bidx, _ = P.thread_block_grid()
        alloc = cutlass.memory.SmemAllocator()
        arr = alloc.allocate_array(cutlass.Int32, NT + 2 * Q, byte_alignment=16).toint()
        KEY = arr  # per token of this CTA: the largest key of its rows
        HIST = arr + Int32(4 * NT)  # [2, Q]: the (at most two) sort chunks of this CTA
        o_first = Int32(1) + W
        o_cnt = o_first + E
        o_pos = o_cnt + E
        o_dr = o_pos + B
        o_inc = ((o_dr + W * S + Int32(1)) >> Int32(1)) << Int32(1)
        o_hist = o_inc + Int32(2) * W * S
        tpc = Int32(NT) // k  # whole tokens per CTA
        t0 = bidx * tpc
        tl = tid // k
        kk = tid - tl * k
        t = t0 + tl
        sts(KEY, tid, Int32(0))
        sts(HIST, tid, Int32(0))
        sts(HIST, tid + Int32(NT), Int32(0))
        P.block_sync()
        if tl < tpc:
            if t < T:
                i = t * k + kk
                row = P.ld_s32(rows + Int64(i) * Int64(4))
                e = smin(smax(ld_id(ids, i), Int32(0)), E - Int32(1))
                key = Int32(0)
                code = Int64(0)
                if row < Int32(0):
                    band = smin(smax((Int32(-1) - row) >> lg, Int32(0)), B - Int32(1))
                    nb = smax(ldw(so, Int32(0)), Int32(1))
                    key = (ldw(so, o_pos + band) * Int32(Q)) // nb
                    code = (Int64(owner) << Int64(CODE_SOURCE_SHIFT)) | Int64(band + Int32(1))
                else:
                    s = smin(e // El, W - Int32(1))
                    lo = smin(smax(ldw(so, o_first + e), Int32(0)), S - Int32(1))
                    n = ldw(so, o_cnt + e)
                    base = o_dr + s * S
                    # the last segment of the group whose first receive row <= row
                    while n > Int32(1):
                        half = n >> Int32(1)
                        mid = smin(lo + half, S - Int32(1))
                        if ldw(so, base + mid) <= row:
                            lo = mid
                        n = n - half
                    ns = smax(ldw(so, Int32(1) + s), Int32(1))
                    key = (lo * Int32(Q)) // ns
                    code = (Int64(1) << Int64(CODE_KIND_SHIFT)) | \
                        (Int64(s) << Int64(CODE_SOURCE_SHIFT)) | Int64(lo + Int32(1))
                key = smin(smax(key, Int32(0)), Int32(Q - 1))
                P.st_s64(codes + Int64(i) * Int64(8), code)
                cute.arch.inline_ptx("red.shared.max.s32 [{$r0}], {$r1};",
                                     read_only_args=[KEY + tl * Int32(4), key])
        P.block_sync()
        tt_ = t0 + tid
        if tid < tpc:
            if tt_ < T:
                kt = lds(KEY, tid)
                P.st_s32(bucket + Int64(tt_) * Int64(4), kt)
                slot = tt_ // Int32(SORT_CHUNK) - t0 // Int32(SORT_CHUNK)
                cute.arch.inline_ptx("red.shared.add.s32 [{$r0}], 1;",
                                     read_only_args=[HIST + (slot * Int32(Q) + kt) * Int32(4)])
        P.block_sync()
        g0 = t0 // Int32(SORT_CHUNK)
        for h in cutlass.range_constexpr(2 * Q // NT):
            q = tid + Int32(h * NT)
            v = lds(HIST, q)
            if v > Int32(0):
                cute.arch.inline_ptx(
                    "red.relaxed.gpu.global.add.s32 [{$r0}], {$r1};",
                    read_only_args=[so + (Int64(o_hist) + Int64(g0) * Int64(Q) + Int64(q))
                                    * Int64(4), v])

    @cute.jit
    def launch_keys(rows: Int64, ids: Int64, so: Int64, codes: Int64, bucket: Int64, T: Int32,
                    k: Int32, W: Int32, E: Int32, El: Int32, owner: Int32, lg: Int32, B: Int32,
                    S: Int32, grid: Int32, stream: cuda.CUstream):
        keys_kernel(rows, ids, so, codes, bucket, T, k, W, E, El, owner, lg, B, S).launch(
            grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch_keys


def keys_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 5 + [Int32(1)] * 10 + [cuda.CUstream(0)]


def build_tiles_kernels(NTT: int):
    """(tiles launcher, compact launcher): steps 5 and 6 of the module doc. NTT: threads of a
    tile CTA, a power of two >= tile_tokens x topk (>= 32)."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from .plan_kernel import simt_helpers

    H = simt_helpers()
    lds, sts, lds64, sts64, smin, block_scan = H.lds, H.sts, H.lds64, H.sts64, H.smin, \
        H.block_scan
    bitonic_sort64 = H.bitonic_sort64
    NONE = 0x7FFFFFFFFFFFFFFF  # sorts after every code

    @cute.kernel
    def tiles_kernel(order: Int64, codes: Int64, stage: Int64, cnt: Int64, T: Int32, k: Int32,
                     tt: Int32):
        tid, j_tile, _ = P.thread_block_grid()
        lane = tid & Int32(31)
        warp = tid >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        SK = alloc.allocate_array(cutlass.Int64, NTT, byte_alignment=16).toint()
        SCR = alloc.allocate_array(cutlass.Int32, 32, byte_alignment=16).toint()
        cap = tt * k
        if tid < Int32(32):
            sts(SCR, tid, Int32(0))  # the scan reads 32 warp totals; fewer warps run here
        p = j_tile * tt + tid // k
        code = Int64(NONE)
        if tid < cap:
            if p < T:
                tok = smin(P.ld_s32(order + Int64(p) * Int64(4)), T - Int32(1))
                code = P.ld_s64(codes + (Int64(tok) * Int64(k) + Int64(tid % k)) * Int64(8))
        sts64(SK, tid, code)
        P.block_sync()
        bitonic_sort64(SK, tid, NTT)
        d = lds64(SK, tid)
        new = Int32(0)
        if d != Int64(NONE):
            new = Int32(1)
            if tid > Int32(0):
                if lds64(SK, tid - Int32(1)) == d:
                    new = Int32(0)
        (ex,), (tot,) = block_scan([new], SCR, lane, warp, NTT // 32)
        if new == Int32(1):
            P.st_s64(stage + (Int64(j_tile) * Int64(cap) + Int64(ex)) * Int64(8), d)
        if tid == Int32(0):
            P.st_s32(cnt + Int64(j_tile) * Int64(4), tot)

    @cute.kernel
    def compact_kernel(stage: Int64, cnt: Int64, tile_start: Int64, dep_start: Int64,
                       dk: Int64, ds: Int64, di: Int64, n_tiles: Int32, tpb: Int32, T: Int32,
                       k: Int32, tt: Int32, R: Int32):
        tid, bidx, nblk = P.thread_block_grid()
        lane = tid & Int32(31)
        warp = tid >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        arr = alloc.allocate_array(cutlass.Int32, 2 * NT + 4 * 32, byte_alignment=16).toint()
        START = arr
        CNT = arr + Int32(4 * NT)
        SCR = arr + Int32(8 * NT)
        cap = tt * k
        j0 = bidx * tpb
        pre = Int32(0)
        tot = Int32(0)
        jj = tid
        while jj < n_tiles:
            v = P.ld_s32(cnt + Int64(jj) * Int64(4))
            tot = tot + v
            if jj < j0:
                pre = pre + v
            jj = jj + Int32(NT)
        cj = Int32(0)
        mine = Int32(0)
        if tid < tpb:
            if j0 + tid < n_tiles:
                mine = Int32(1)
                cj = P.ld_s32(cnt + Int64(j0 + tid) * Int64(4))
        (exj, _, _), (_, pre_s, tot_s) = block_scan([cj, pre, tot], SCR, lane, warp)
        if mine == Int32(1):
            jt = j0 + tid
            sts(START, tid, pre_s + exj)
            sts(CNT, tid, cj)
            P.st_s32(dep_start + Int64(jt) * Int64(4), pre_s + exj)
            P.st_s32(tile_start + Int64(jt) * Int64(4), smin(jt * tt, T))
        if bidx == Int32(0):
            if tid == Int32(0):
                P.st_s32(dep_start + Int64(n_tiles) * Int64(4), tot_s)
                P.st_s32(tile_start + Int64(n_tiles) * Int64(4), T)
        P.block_sync()
        jl = tid // cap
        p = tid - jl * cap
        if jl < tpb:
            if j0 + jl < n_tiles:
                if p < lds(CNT, jl):
                    c = P.ld_s64(stage + (Int64(j0 + jl) * Int64(cap) + Int64(p)) * Int64(8))
                    q = Int64(lds(START, jl) + p) * Int64(4)
                    P.st_s32(dk + q, Int32(c >> Int64(CODE_KIND_SHIFT)))
                    P.st_s32(ds + q, Int32((c >> Int64(CODE_SOURCE_SHIFT)) & Int64(0xFFFFFF)))
                    P.st_s32(di + q, Int32(c & Int64(0xFFFFFFFF)) - Int32(1))
        q = tot_s + bidx * Int32(NT) + tid
        while q < R:
            P.st_s32(dk + Int64(q) * Int64(4), Int32(-1))
            P.st_s32(ds + Int64(q) * Int64(4), Int32(-1))
            P.st_s32(di + Int64(q) * Int64(4), Int32(-1))
            q = q + nblk * Int32(NT)

    @cute.jit
    def launch_tiles(order: Int64, codes: Int64, stage: Int64, cnt: Int64, T: Int32, k: Int32,
                     tt: Int32, grid: Int32, stream: cuda.CUstream):
        tiles_kernel(order, codes, stage, cnt, T, k, tt).launch(
            grid=[grid, 1, 1], block=[NTT, 1, 1], stream=stream)

    @cute.jit
    def launch_compact(stage: Int64, cnt: Int64, tile_start: Int64, dep_start: Int64, dk: Int64,
                       ds: Int64, di: Int64, n_tiles: Int32, tpb: Int32, T: Int32, k: Int32,
                       tt: Int32, R: Int32, grid: Int32, stream: cuda.CUstream):
        compact_kernel(stage, cnt, tile_start, dep_start, dk, ds, di, n_tiles, tpb, T, k, tt,
                       R).launch(grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch_tiles, launch_compact


def tiles_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 4 + [Int32(1)] * 4 + [cuda.CUstream(0)]


def compact_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 7 + [Int32(1)] * 7 + [cuda.CUstream(0)]


def build_seg_add_kernel():
    """The launcher of ``seg_expected[s, :seg_count[s]] += seg_inc[s, :seg_count[s]]`` (int64
    [W, S], seg_count int32 [W]): a (G, W) grid, CTA (g, s) strides over row s's valid prefix,
    so the work follows the routing's segments, not the table's capacity S."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from .plan_kernel import simt_helpers

    H = simt_helpers()
    smin, smax = H.smin, H.smax

    @cute.kernel
    def seg_add_kernel(exp: Int64, inc: Int64, cnt: Int64, S: Int32):
        tid, g, ng = P.thread_block_grid()
        _, s, _ = cute.arch.block_idx()
        n = smin(smax(P.ld_s32(cnt + Int64(s) * Int64(4)), Int32(0)), S)
        j = g * Int32(NT) + tid
        while j < n:
            off = (Int64(s) * Int64(S) + Int64(j)) * Int64(8)
            P.st_s64(exp + off, P.ld_s64(exp + off) + P.ld_s64(inc + off))
            j = j + ng * Int32(NT)

    @cute.jit
    def launch_seg_add(exp: Int64, inc: Int64, cnt: Int64, S: Int32, W: Int32, grid: Int32,
                       stream: cuda.CUstream):
        seg_add_kernel(exp, inc, cnt, S).launch(grid=[grid, W, 1], block=[NT, 1, 1],
                                                stream=stream)

    return launch_seg_add


def seg_add_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 3 + [Int32(1)] * 3 + [cuda.CUstream(0)]


SEG_ADD_CTAS = 256  # CTAs of a seg_add launch in all (at least one per sender)


class OrderedRoutesKernel:
    """The compiled kernels of the module doc, cached by their host facts; ``__call__`` launches
    them on the current stream."""

    _cache: dict = {}

    @staticmethod
    def can_implement(num_experts: int, topk: int, tile_tokens: int, ids_dtype,
                      counts_dtype) -> tuple[bool, str]:
        if num_experts > NT:
            return False, f"E={num_experts} > {NT} (a group per thread of the planning CTA)"
        if tile_tokens * topk > MAX_TILE_CODES:
            return False, (f"tile_tokens x topk = {tile_tokens * topk} > {MAX_TILE_CODES} (a "
                           "code per thread of a tile CTA)")
        if topk > NT:
            return False, f"topk={topk} > {NT}"
        if ids_dtype not in (torch.int32, torch.int64):
            return False, f"topk_ids dtype {ids_dtype} (int32 / int64 only)"
        if counts_dtype not in (torch.int32, torch.int64):
            return False, f"counts dtype {counts_dtype} (int32 / int64 only)"
        return True, ""

    @classmethod
    def _compiled(cls, key, build, args):
        if key not in cls._cache:
            import cutlass.cute as cute
            built = build()
            cls._cache[key] = (tuple(cute.compile(b, *a) for b, a in zip(built, args))
                               if isinstance(built, tuple) else cute.compile(built, *args))
        return cls._cache[key]

    def senders(self, counts_64, E, El, order):
        from .plan_kernel import PlanKernel, build_plan_kernels, plan_example_args
        v = PlanKernel.variant(counts_64, E, El, order)
        return self._compiled(("senders",) + v, lambda: build_plan_kernels(*v, senders=True),
                              plan_example_args())

    def keys(self, ids_64):
        return self._compiled(("keys", bool(ids_64)), lambda: build_keys_kernel(ids_64),
                              keys_example_args())

    def sort(self):
        from .routes import build_routes_kernels, rank_example_args
        return self._compiled(("sort",), lambda: build_routes_kernels(
            False, KEY_BUCKETS, False, inverse=True, rounds=SORT_ROUNDS)[1], rank_example_args())

    def tiles(self, NTT):
        return self._compiled(("tiles", NTT), lambda: build_tiles_kernels(NTT),
                              (tiles_example_args(), compact_example_args()))

    def seg_add(self, seg_expected, seg_inc, seg_count):
        """``seg_expected[s, :seg_count[s]] += seg_inc[s, :seg_count[s]]`` on the current
        stream (int64 [W, S] both, seg_count int32 [W], on one CUDA device; caller-checked)."""
        import cuda.bindings.driver as cuda
        W, S = seg_expected.shape
        f = self._compiled(("seg_add",), build_seg_add_kernel, seg_add_example_args())
        grid = max(1, min(-(-S // NT), SEG_ADD_CTAS // max(W, 1)))
        h = cuda.CUstream(torch.cuda.current_stream(seg_expected.device).cuda_stream)
        f(seg_expected.data_ptr(), seg_inc.data_ptr(), seg_count.data_ptr(), S, W, grid, h)

    def start(self, topk_ids, expert_counts, plan, tile_tokens, stream):
        """Steps 1 and 2 (they need the counts only) on ``stream``; returns the state that
        ``finish`` continues from. The caller has checked the host facts."""
        import cuda.bindings.driver as cuda
        W, E = expert_counts.shape
        El = E // W
        T, k = topk_ids.shape
        R = T * k
        B, S = plan.band_capacity, plan.segment_capacity
        dev = topk_ids.device
        counts = expert_counts
        if counts.dtype not in (torch.int32, torch.int64):
            counts = counts.to(torch.int32)
        counts = counts.contiguous()
        lay = SendersLayout(W, E, B, S, T)
        n_tiles = -(-T // tile_tokens)
        cap = tile_tokens * k
        # allocated on the caller's stream, which waits for ``stream`` before it reads them
        st = dict(lay=lay, n_tiles=n_tiles, cap=cap, T=T, k=k, R=R, W=W, E=E, El=El, B=B, S=S,
                  dev=dev, so=_empty(lay.total, torch.int32, dev))
        st["tables"] = {"order": _empty(T, torch.int32, dev),
                        "tile_start": _empty(n_tiles + 1, torch.int32, dev),
                        "dep_start": _empty(n_tiles + 1, torch.int32, dev)}
        for n in ("dep_kind", "dep_source", "dep_index"):
            st["tables"][n] = _empty(R, torch.int32, dev)
        st["codes"] = _empty(R, torch.int64, dev)
        st["bucket"] = _empty(T, torch.int32, dev)
        st["stage"] = _empty(max(n_tiles * cap, 1), torch.int64, dev)
        st["cnt"] = _empty(max(n_tiles, 1), torch.int32, dev)
        with torch.cuda.stream(stream):
            st["so"][lay.hist:].zero_()
            if T == 0:
                st["tables"]["tile_start"].zero_()
                st["tables"]["dep_start"].zero_()
        h = cuda.CUstream(stream.cuda_stream)
        lg = int(plan.tile_m).bit_length() - 1
        st["lg"] = lg
        f_senders = self.senders(counts.dtype == torch.int64, E, El, plan.order)
        f_senders(counts.data_ptr(), st["so"].data_ptr(), W, E, El, plan.rank, lg, plan.mgb,
                  _LAYOUT_CODE[plan.layout], B, S, 1, h)
        return st

    def finish(self, st, topk_ids, plan, rows, tile_tokens, stream):
        """Steps 3 to 6 on ``stream`` (after ``start``'s): (tables, seg_inc, seg_count) as
        ``ordered_routes_device`` returns them. rows: int32 [T, topk] (``prepare_routes(...,
        local_copy=False, plan)``: remote receive rows, -(y row) - 1 for local ones)."""
        import cuda.bindings.driver as cuda
        lay, T, k, R, W, E, El, B, S = (st[n] for n in ("lay", "T", "k", "R", "W", "E", "El",
                                                         "B", "S"))
        tables, so = st["tables"], st["so"]
        seg_inc = so[lay.seg_inc:lay.hist].view(torch.int64).view(W, S)
        seg_count = so[lay.nseg:lay.nseg + W]
        if T == 0:
            return tables, seg_inc, seg_count
        ids = topk_ids.contiguous()
        rows = rows.to(torch.int32).contiguous()
        h = cuda.CUstream(stream.cuda_stream)
        base = so.data_ptr()
        tpc = NT // k
        self.keys(ids.dtype == torch.int64)(
            rows.data_ptr(), ids.data_ptr(), base, st["codes"].data_ptr(),
            st["bucket"].data_ptr(), T, k, W, E, El, plan.rank, st["lg"], B, S, -(-T // tpc), h)
        self.sort()(st["bucket"].data_ptr(), base + 4 * lay.hist, tables["order"].data_ptr(),
                    base + 4 * lay.spare, T, KEY_BUCKETS, KEY_BUCKETS, 1, 0, 0, 0, 0,
                    lay.groups, h)
        n_tiles, cap = st["n_tiles"], st["cap"]
        f_tiles, f_compact = self.tiles(max(32, _pow2(cap)))
        f_tiles(tables["order"].data_ptr(), st["codes"].data_ptr(), st["stage"].data_ptr(),
                st["cnt"].data_ptr(), T, k, tile_tokens, n_tiles, h)
        tpb = max(1, NT // cap)
        f_compact(st["stage"].data_ptr(), st["cnt"].data_ptr(), tables["tile_start"].data_ptr(),
                  tables["dep_start"].data_ptr(), tables["dep_kind"].data_ptr(),
                  tables["dep_source"].data_ptr(), tables["dep_index"].data_ptr(), n_tiles, tpb,
                  T, k, tile_tokens, R, -(-n_tiles // tpb), h)
        return tables, seg_inc, seg_count

    def __call__(self, topk_ids, expert_counts, plan, tile_tokens, rows=None):
        """(tables, seg_inc, seg_count, rows) on the current stream. rows None:
        ``prepare_routes`` computes them on the current stream while steps 1 and 2 run on a side
        stream (both only read their inputs; joined before step 3), so the senders' plans hide
        under prepare."""
        main = torch.cuda.current_stream(topk_ids.device)
        if rows is not None:
            st = self.start(topk_ids, expert_counts, plan, tile_tokens, main)
        else:
            from .routes import prepare_routes
            side = _side_stream(topk_ids.device)
            side.wait_stream(main)
            st = self.start(topk_ids, expert_counts, plan, tile_tokens, side)
            W, E = expert_counts.shape
            rows, _ = prepare_routes(topk_ids, E, W, plan.rank, False, plan, impl="kernel")
            main.wait_stream(side)
        tables, seg_inc, seg_count = self.finish(st, topk_ids, plan, rows, tile_tokens, main)
        return tables, seg_inc, seg_count, rows


_SIDE: dict = {}


def _side_stream(device) -> torch.cuda.Stream:
    """One side stream per device for the senders' plans (created once, outside any capture)."""
    d = torch.device(device).index
    if d not in _SIDE:
        _SIDE[d] = torch.cuda.Stream(device)
    return _SIDE[d]


_KERNEL = OrderedRoutesKernel()


def ordered_tables_kernel(topk_ids, expert_counts, plan, tile_tokens, rows=None):
    return _KERNEL(topk_ids, expert_counts, plan, tile_tokens, rows)


def seg_add(seg_expected, seg_inc, seg_count):
    _KERNEL.seg_add(seg_expected, seg_inc, seg_count)
