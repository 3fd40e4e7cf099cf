"""Per-routing preparation of the overlapped combine (`OverlapCombine.prepare`): each (t, k)
assignment's row for the scale and the per-source increment of the expected arrival counts.

`prepare_routes(..., impl="torch")` is the reference (torch ops: a stable argsort of the flattened
ids). `impl="kernel"` computes the same with two CuTe DSL kernels, a stable counting sort by
expert:
 1. histogram: CTA b counts the ids of its chunk (CHUNK consecutive assignments) per expert in
    shared memory and writes them to a [G, E] workspace.
 2. rank: CTA b sums the workspace column of each expert (all chunks: the expert's first receive
    row, by a CTA scan over experts; chunks before b: its offset inside the expert), then walks
    its chunk 1024 assignments at a time in flat order: `match.any.sync` gives the lanes of a warp
    with the same expert (rank inside the warp = lanes below with the same id), per-warp counts
    in shared memory (a byte per warp and expert: two 16-byte loads and dp4a sum the warps
    before) and a running per-expert count the earlier rounds (two CTA barriers a round: each
    warp writes and zeroes only its own bytes).
    So row = first[e] + (assignments of e before this one in (token, k) order), exactly the
    stable sort's. CTA 0 also writes expected_inc.
No host sync, CUDA-graph capturable. Ids must lie in [0, E) (the callers' checks reject others);
out-of-range ids are clamped for memory safety, where the torch reference would sort them.
"""
import torch

from .plan import recv_rows as _recv_rows

NT = 1024
ROUNDS = 4
CHUNK = ROUNDS * NT  # assignments per CTA
# workspace loads per thread in flight: the whole column up to 32 chunks (16384 tokens x top-8),
# so one global-latency round instead of one per 8 chunks
WS_IN_FLIGHT = 32
# words per expert of the rank kernel's per-warp counts: 32 count bytes (one per warp, <= 32
# each) and 16 pad bytes (a 48-byte stride puts the 8 lanes of a 16-byte access quarter on 8
# different bank quads, where 32 bytes would give 4)
WC_WORDS = 12
IMPLS = ("auto", "torch", "kernel")


# ---- reference ---------------------------------------------------------------------------------
def source_rows_torch(topk_ids, recv_rows, plan, num_experts, experts_per_rank, rank):
    """Device-only (no sync): the scale's source of each (t, k): the receive row r for remote
    experts; for local expert e (global g): -(y row) - 1 with y row = expert_row_start[e] +
    group_row_start[e, rank] + r - (first receive row of g)."""
    E, El = num_experts, experts_per_rank
    ids = topk_ids.reshape(-1).long()
    r = recv_rows.reshape(-1).long()
    cnt = torch.zeros(E, dtype=torch.long, device=ids.device).scatter_add_(
        0, ids.clamp(0, E - 1), torch.ones_like(ids))
    first = torch.cumsum(cnt, 0) - cnt
    el = ids - rank * El
    local = (el >= 0) & (el < El)
    elc = el.clamp(0, El - 1)
    yrow = (plan.expert_row_start.long()[elc] + plan.group_row_start.long()[elc, rank]
            + r - first[ids.clamp(0, E - 1)])
    return torch.where(local, -yrow - 1, r).view(topk_ids.shape)


def prepare_routes_torch(topk_ids, num_experts, world_size, rank, local_copy, plan):
    """(rows int32 [T, topk], expected_inc int64 [W]): see OverlapCombine.prepare."""
    El, W = num_experts // world_size, world_size
    owner = (topk_ids.reshape(-1).long() // El).clamp(0, W - 1)
    counted = torch.ones_like(owner) if local_copy else (owner != rank).long()
    inc = torch.ones(W, dtype=torch.int64, device=topk_ids.device).index_add_(0, owner, counted)
    rows = _recv_rows(topk_ids, num_experts)
    if not local_copy and plan is not None:
        rows = source_rows_torch(topk_ids, rows, plan, num_experts, El, rank)
    return rows.to(torch.int32).contiguous(), inc


# ---- kernels -----------------------------------------------------------------------------------
def build_routes_kernels(ids_64: bool, NE: int, y_src: bool, inverse: bool = False,
                         rounds: int = ROUNDS):
    """(histogram launcher, rank launcher). NE: power of two >= E (shared arrays); ids_64: the
    ids are int64 (else int32); y_src: local experts' rows become y rows (-(y row) - 1);
    inverse: the rank kernel writes the permutation's inverse, rows[row of i] = i (the stable
    order of a counting sort: combine/ordered_routes_kernel.py sorts tokens by key with it);
    rounds: rounds of NT assignments per CTA (its chunk: rounds x NT; the workspace is per
    chunk)."""
    n_rounds, chunk = int(rounds), int(rounds) * NT
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from .plan_kernel import simt_helpers

    H = simt_helpers()
    lds, sts, ptx1, smin, smax, block_scan = H.lds, H.sts, H.ptx1, H.smin, H.smax, H.block_scan
    sel_lt = H.sel_lt
    Y_SRC = bool(y_src)

    def ld_id_raw(ids, i):
        """ids[i] as Int32 (int64 ids: the low word, the bits cvt.u32.u64 keeps), not yet used,
        so the load stays in flight until clamp_id."""
        if cutlass.const_expr(ids_64):
            return P.ld_s32(ids + Int64(i) * Int64(8))
        return P.ld_s32(ids + Int64(i) * Int64(4))

    def clamp_id(v, E):
        """An id clamped to [0, E)."""
        return smin(smax(v, Int32(0)), E - Int32(1))

    def atom_add_shared(addr, v):
        cute.arch.inline_ptx("red.shared.add.s32 [{$r0}], {$r1};",
                             read_only_args=[Int32(addr), Int32(v)])

    def st_s64(addr, v):
        P.st_s64(addr, v)

    def st_u8(addr, v):
        cute.arch.inline_ptx("st.shared.u8 [{$r0}], {$r1};", read_only_args=[Int32(addr),
                                                                            Int32(v)])

    def warps_before(rec, warp):
        """Sum of bytes 0 .. warp-1 of the 32-byte count record at shared address rec: two
        16-byte loads, then per word the bytes of warps below masked and summed by dp4a."""
        words = []
        for h in range(2):
            words += list(cute.arch.inline_ptx(
                "ld.shared.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];",
                write_only_types=[Int32] * 4, read_only_args=[rec + Int32(16 * h)]))
        acc = Int32(0)
        for k, w in enumerate(words):
            # n = clamp(warp - 4k, 0, 4) bytes of this word; mask (1 << 8n) - 1 (shl clamps
            # the shift at 32, giving 0, so n = 4 is all ones)
            acc = ptx1("{ .reg .b32 n, m, o; "
                       f"sub.s32 n, {{$r1}}, {4 * k}; max.s32 n, n, 0; min.s32 n, n, 4; "
                       "shl.b32 n, n, 3; mov.b32 m, 1; shl.b32 m, m, n; sub.s32 m, m, 1; "
                       "and.b32 m, m, {$r0}; mov.b32 o, 0x01010101; "
                       "dp4a.u32.u32 {$w0}, m, o, {$r2}; }", w, warp, acc)
        return acc

    @cute.kernel
    def hist_kernel(ids: Int64, ws: Int64, N: Int32, E: Int32):
        tid, bidx, _ = P.thread_block_grid()
        alloc = cutlass.memory.SmemAllocator()
        hist = alloc.allocate_array(cutlass.Int32, NE, byte_alignment=16).toint()
        c0 = bidx * Int32(chunk)
        end = smin(N, c0 + Int32(chunk))
        ii = [c0 + Int32(u * NT) + tid for u in range(n_rounds)]
        raw = [ld_id_raw(ids, smin(i, smax(end - Int32(1), Int32(0)))) for i in ii]  # in flight
        e = tid  # while the ids load
        while e < E:
            sts(hist, e, Int32(0))
            e = e + Int32(NT)
        P.block_sync()
        es = [clamp_id(v, E) for v in raw]
        for i, e_ in zip(ii, es):
            if i < end:
                atom_add_shared(hist + e_ * Int32(4), Int32(1))
        P.block_sync()
        e = tid
        while e < E:
            P.st_s32(ws + (Int64(bidx) * Int64(E) + Int64(e)) * Int64(4), lds(hist, e))
            e = e + Int32(NT)

    @cute.kernel
    def rank_kernel(ids: Int64, ws: Int64, rows: Int64, inc: Int64, N: Int32, E: Int32,
                    El: Int32, W: Int32, rank: Int32, local_copy: Int32, ers: Int64, grs: Int64):
        tid, bidx, nblk = P.thread_block_grid()
        lane = tid & Int32(31)
        warp = tid >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        arr = alloc.allocate_array(cutlass.Int32, (WC_WORDS + 4) * NE + 4 * 32,
                                   byte_alignment=16).toint()
        # [NE] records of WC_WORDS words: byte w = assignments of expert e in warp w of this
        # round (<= 32); the 16 pad bytes spread the records' 16-byte halves over the banks
        WC = arr
        RUN = arr + Int32(4 * WC_WORDS * NE)  # assignments of e in earlier rounds of this chunk
        BASE = RUN + Int32(4 * NE)  # first row of e + its assignments in chunks before b
        YOFF = BASE + Int32(4 * NE)  # y_src: y row of local expert e = YOFF[e] + receive row
        ACC = YOFF + Int32(4 * NE)  # expected_inc accumulation (CTA 0), per owner rank
        SCR = ACC + Int32(4 * NE)
        c0 = bidx * Int32(chunk)
        end = smin(N, c0 + Int32(chunk))
        ii = [c0 + Int32(u * NT) + tid for u in range(n_rounds)]
        # every round's id loaded first (in flight together and with the workspace loads)
        raw = [ld_id_raw(ids, smin(i, smax(end - Int32(1), Int32(0)))) for i in ii]
        # local expert tid: its y-row offset parts (one global round, in flight with the
        # workspace loads; a load per assignment and round would pay the latency ROUNDS times)
        yo_e = Int32(0)
        yo_g = Int32(0)
        if cutlass.const_expr(Y_SRC):
            el_t = tid - rank * El
            if tid < E:
                if el_t >= Int32(0):
                    if el_t < El:
                        yo_e = P.ld_s32(ers + Int64(el_t) * Int64(4))
                        yo_g = P.ld_s32(grs + (Int64(el_t) * Int64(W) + Int64(rank)) * Int64(4))
        w_ = tid
        while w_ < Int32(WC_WORDS) * E:
            sts(WC, w_, Int32(0))
            w_ = w_ + Int32(NT)
        tot = Int32(0)
        pre = Int32(0)
        if tid < E:  # the expert's column of the workspace, WS_IN_FLIGHT loads in flight
            c = Int32(0)
            while c < nblk:
                cs = [c + Int32(u) for u in range(WS_IN_FLIGHT)]
                vs = [P.ld_s32(ws + (Int64(smin(x, nblk - Int32(1))) * Int64(E) + Int64(tid))
                               * Int64(4)) for x in cs]
                for x, v in zip(cs, vs):
                    v = sel_lt(x, nblk, v, Int32(0))
                    tot = tot + v
                    pre = pre + sel_lt(x, bidx, v, Int32(0))
                c = c + Int32(WS_IN_FLIGHT)
        if tid < W:
            sts(ACC, tid, Int32(0))
        (first,), _ = block_scan([tot], SCR, lane, warp)  # (its barriers order ACC's zeroing)
        if tid < E:
            sts(RUN, tid, Int32(0))
            sts(BASE, tid, first + pre)
            if cutlass.const_expr(Y_SRC):
                # int32 wrap-around: the same bits as ers + grs + r - first
                sts(YOFF, tid, yo_e + yo_g - first)
            if bidx == Int32(0):
                owner = tid // El
                if local_copy != Int32(0):
                    atom_add_shared(ACC + owner * Int32(4), tot)
                else:
                    if owner != rank:
                        atom_add_shared(ACC + owner * Int32(4), tot)
        P.block_sync()
        if bidx == Int32(0):
            if tid < W:
                st_s64(inc + Int64(tid) * Int64(8), Int64(lds(ACC, tid)) + Int64(1))
        lt_mask = (Int32(1) << lane) - Int32(1)  # lanes below this one
        # past the end: -1, which matches no expert and writes nothing
        es = [sel_lt(i, end, clamp_id(v, E), Int32(-1)) for i, v in zip(ii, raw)]
        for u in cutlass.range_constexpr(n_rounds):
            i = ii[u]
            e = es[u]
            m = ptx1("match.any.sync.b32 {$w0}, {$r0}, -1;", e)
            below = ptx1("popc.b32 {$w0}, {$r0};", m & lt_mask)
            cnt = ptx1("popc.b32 {$w0}, {$r0};", m)
            lead = Int32(0)
            if e >= Int32(0):
                if below == Int32(0):
                    lead = Int32(1)
                    st_u8(WC + e * Int32(4 * WC_WORDS) + warp, cnt)
            P.block_sync()
            if e >= Int32(0):
                r = lds(BASE, e) + lds(RUN, e) + below + warps_before(WC + e * Int32(4 * WC_WORDS),
                                                                      warp)
                out = r
                if cutlass.const_expr(Y_SRC):
                    el = e - rank * El
                    if el >= Int32(0):
                        if el < El:
                            out = Int32(-1) - (lds(YOFF, e) + r)
                if cutlass.const_expr(inverse):
                    P.st_s32(rows + Int64(out) * Int64(4), i)
                else:
                    P.st_s32(rows + Int64(i) * Int64(4), out)
            P.block_sync()
            if lead == Int32(1):
                atom_add_shared(RUN + e * Int32(4), cnt)
                st_u8(WC + e * Int32(4 * WC_WORDS) + warp, Int32(0))
            # no CTA barrier here: a warp zeroes only its own bytes of WC, and the next round's
            # barrier orders these RUN adds and zeros before any read; the warp barrier orders
            # a lane's zero before another lane's write of the same entry in the next round
            if cutlass.const_expr(u + 1 < n_rounds):
                cute.arch.inline_ptx("bar.warp.sync -1;")

    @cute.jit
    def launch_hist(ids: Int64, ws: Int64, N: Int32, E: Int32, grid: Int32,
                    stream: cuda.CUstream):
        hist_kernel(ids, ws, N, E).launch(grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    @cute.jit
    def launch_rank(ids: Int64, ws: Int64, rows: Int64, inc: Int64, N: Int32, E: Int32,
                    El: Int32, W: Int32, rank: Int32, local_copy: Int32, ers: Int64, grs: Int64,
                    grid: Int32, stream: cuda.CUstream):
        rank_kernel(ids, ws, rows, inc, N, E, El, W, rank, local_copy, ers, grs).launch(
            grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch_hist, launch_rank


def hist_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0), Int32(1), Int32(1), Int32(1), cuda.CUstream(0)]


def rank_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 4 + [Int32(1)] * 6 + [Int64(0), Int64(0), Int32(1), cuda.CUstream(0)]


class RoutesKernel:
    """Compiled preparation kernels, cached by (ids dtype, pow2(E), y_src)."""

    _cache: dict = {}

    @staticmethod
    def can_implement(num_experts: int, num_assignments: int, ids_dtype) -> tuple[bool, str]:
        if num_experts > NT:
            return False, f"E={num_experts} > {NT} (one expert per thread of a CTA)"
        if ids_dtype not in (torch.int32, torch.int64):
            return False, f"topk_ids dtype {ids_dtype} (int32 / int64 only)"
        if num_assignments >= 2 ** 31 - CHUNK:
            return False, f"{num_assignments} assignments exceed int32 rows"
        return True, ""

    @classmethod
    def compiled(cls, ids_64: bool, E: int, y_src: bool):
        from .plan_kernel import _pow2
        key = (bool(ids_64), max(32, _pow2(E)), bool(y_src))
        if key not in cls._cache:
            import cutlass.cute as cute
            lh, lr = build_routes_kernels(*key)
            cls._cache[key] = (cute.compile(lh, *hist_example_args()),
                               cute.compile(lr, *rank_example_args()))
        return cls._cache[key]

    def __call__(self, topk_ids, num_experts, world_size, rank, local_copy, plan, stream=None):
        import cuda.bindings.driver as cuda
        ids = topk_ids.contiguous()
        N = ids.numel()
        E, W = num_experts, world_size
        ok, why = self.can_implement(E, N, ids.dtype)
        if not ok:
            raise ValueError(f"routes kernel cannot run this: {why}")
        y_src = (not local_copy) and plan is not None
        fn_hist, fn_rank = self.compiled(ids.dtype == torch.int64, E, y_src)
        grid = max(1, -(-N // CHUNK))
        dev = ids.device
        rows = torch.empty(topk_ids.shape, dtype=torch.int32, device=dev)
        if N == 0:  # no assignment: only the call markers (the kernels would read ids[0])
            return rows, torch.ones(W, dtype=torch.int64, device=dev)
        ws = torch.empty(grid * E, dtype=torch.int32, device=dev)
        inc = torch.empty(W, dtype=torch.int64, device=dev)
        if stream is None:
            stream = torch.cuda.current_stream(dev)
        h = cuda.CUstream(stream.cuda_stream)
        ers = plan.expert_row_start.data_ptr() if y_src else 0
        grs = plan.group_row_start.contiguous().data_ptr() if y_src else 0
        fn_hist(ids.data_ptr(), ws.data_ptr(), N, E, grid, h)
        fn_rank(ids.data_ptr(), ws.data_ptr(), rows.data_ptr(), inc.data_ptr(), N, E, E // W, W,
                rank, int(bool(local_copy)), ers, grs, grid, h)
        return rows, inc


_KERNEL = RoutesKernel()


def prepare_routes(topk_ids, num_experts, world_size, rank, local_copy, plan, impl="auto"):
    """(rows int32 [T, topk], expected_inc int64 [W]) of OverlapCombine.prepare. impl: "torch"
    (the reference), "kernel" (two CuTe DSL launches) or "auto" (the kernel on CUDA where CuTe
    DSL imports and the shape fits; MOE_OVERLAP_PREPARE_IMPL sets the default of auto)."""
    import os
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; choose from {IMPLS}")
    requested = impl
    if impl == "auto":
        impl = os.environ.get("MOE_OVERLAP_PREPARE_IMPL", "auto")
        if impl not in IMPLS:
            raise ValueError(f"MOE_OVERLAP_PREPARE_IMPL={impl!r}; choose from {IMPLS}")
    if impl == "auto":
        from .plan_kernel import kernel_available
        impl = "kernel" if topk_ids.is_cuda and kernel_available() and RoutesKernel.can_implement(
            num_experts, topk_ids.numel(), topk_ids.dtype)[0] else "torch"
    if impl == "kernel":
        if not topk_ids.is_cuda:
            raise ValueError(f"impl={requested!r} -> kernel needs topk_ids on a CUDA device")
        return _KERNEL(topk_ids, num_experts, world_size, rank, local_copy, plan)
    return prepare_routes_torch(topk_ids, num_experts, world_size, rank, local_copy, plan)
