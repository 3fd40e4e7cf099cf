"""The combine planner as one CuTe DSL kernel: `PlanKernel` fills every tensor of a CombinePlan
exactly as the torch planner (`moe_overlap.combine.plan.plan_combine(impl="torch")`, the
reference) does, from the counts alone, without a host sync (CUDA-graph capturable).

CTA 0 (1024 threads, shared memory): every field has a closed form from prefix sums over the
E = El * W groups (<= 1024, one per thread), so no sort is needed except ranking the El experts
(a bitonic sort of El keys in shared memory) for order="remote_first"; order="expert" (a
separately compiled variant) schedules the bands in their own order and ranks nothing. The
phases are those of
`moe_overlap.combine.plan_closed_form.closed_form_plan`, the same algorithm in plain Python that
the CPU tests check against the torch planner; the per-band and per-remote-cell loops are
strided over the threads, so the work follows the bands of this routing, not the capacity.
CTAs 1.. (same launch, no wait on CTA 0): recv_rows_per_rank (the row totals of the counts,
so CTA 0 reads only the entries before its experts) and the -1 tails of the capacity-length
tensors. Each runs the group phases CTA 0 runs (so it knows num_bands exactly) and two
order-free sums: the local cells (sum of local-band flags + num_bands - sum of remote bands)
and R, the remote cells, an upper bound of num_segments (every segment starts at its own
remote cell). CTA 0 writes -1 to the segment fields in [num_segments, R), the tail CTAs from R
on; many CTAs, so the worst-case capacity costs about a memory-bandwidth microsecond or two,
and no second launch. CTA 1 also computes the counts fingerprint (plan_closed_form.py FP_KEY)
over all W * E entries: a sum of per-entry terms, so any order of adding them gives the torch
planner's value.

Counts the capacities cannot hold (validate=False) plan nothing, num_bands flagging it, as
the torch planner does; every store index derived from the counts is guarded by its capacity
(docs/CONTRACTS.md, "Device bounds").

All outputs are views of one int32 buffer allocated with torch.empty (one allocation, one base
pointer for the kernels); the layout is `_Layout`.
"""

import math

import torch

from .plan_closed_form import BAND_FIELDS, FP_KEY, FP_MUL1, FP_MUL2, SEGMENT_FIELDS

NT = 1024  # threads of the planning CTA: one group (and one expert) per thread
P1_LOADS = 16  # phase 1: counts loads per source and lane in flight (two sources per round)
TAIL_WORDS_PER_CTA = 2048  # per field: the capacity over this is the tail CTA count (<= 64)
MAX_GROUPS = 1024  # E = El * W, one per thread of the planning CTA
SCALARS = ("packed", "num_bands", "num_remote_bands", "num_segments", "num_local_cells",
           "total_rows", "valid_rows", "counts_fingerprint")  # [1] each, offsets 0..7
_LAYOUT_CODE = {"aligned": 0, "packed": 1, "auto": 2}
ORDERS = ("remote_first", "expert")  # plan_combine(order=); a compiled variant each


def _s32(c: int) -> int:
    return c - (1 << 32) if c & 0x80000000 else c


# One term of the counts fingerprint (plan_closed_form.py FP_KEY): fmix32(v ^ (i * FP_KEY)) for
# entry i ({$r0}) holding v ({$r1}), the term in {$w0}; logical shifts, multiplies mod 2^32 (the
# low word of mul.lo is the same signed or unsigned). tests/test_plan_kernel_compile.py runs this
# text on the host against plan_closed_form.counts_fingerprint.
FINGERPRINT_TERM_PTX = (
    "{ .reg .b32 hx, sx; "
    f"mul.lo.s32 hx, {{$r0}}, {_s32(FP_KEY)}; xor.b32 hx, hx, {{$r1}}; "
    "shr.u32 sx, hx, 16; xor.b32 hx, hx, sx; "
    f"mul.lo.s32 hx, hx, {_s32(FP_MUL1)}; "
    "shr.u32 sx, hx, 13; xor.b32 hx, hx, sx; "
    f"mul.lo.s32 hx, hx, {_s32(FP_MUL2)}; "
    "shr.u32 sx, hx, 16; xor.b32 {$w0}, hx, sx; }")


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


class _Layout:
    """Element offsets of every field in the plan buffer (the kernels compute the same)."""

    def __init__(self, W, E, El, B, S):
        self.o_grs = 8
        self.o_er = self.o_grs + E
        self.o_ers = self.o_er + El
        self.o_rrpr = self.o_ers + El
        self.o_rc = self.o_rrpr + W
        self.o_bands = self.o_rc + E
        self.o_segs = self.o_bands + len(BAND_FIELDS) * B
        self.total = self.o_segs + len(SEGMENT_FIELDS) * S

    def views(self, buf, W, E, El, B, S):
        v = {n: buf[i:i + 1] for i, n in enumerate(SCALARS)}
        v["group_row_start"] = buf[self.o_grs:self.o_grs + E].view(El, W)
        v["expert_rows"] = buf[self.o_er:self.o_er + El]
        v["expert_row_start"] = buf[self.o_ers:self.o_ers + El]
        v["recv_rows_per_rank"] = buf[self.o_rrpr:self.o_rrpr + W]
        v["routed_counts"] = buf[self.o_rc:self.o_rc + E]
        for f, n in enumerate(BAND_FIELDS):
            v[n] = buf[self.o_bands + f * B:self.o_bands + (f + 1) * B]
        for f, n in enumerate(SEGMENT_FIELDS):
            v[n] = buf[self.o_segs + f * S:self.o_segs + (f + 1) * S]
        return v


def simt_helpers():
    """Straight-line device helpers of the SIMT kernels here (no Python control flow on device
    values, so they need no @cute.jit): shared-memory words by raw 32-bit address, selects and
    predicated stores in PTX, warp scans by shuffles and a CTA-wide exclusive scan."""
    from types import SimpleNamespace

    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64
    from ..kernels import primitives as P

    def ptx1(code, *args):
        return cute.arch.inline_ptx(code, write_only_types=[Int32],
                                    read_only_args=[Int32(a) for a in args])

    def smin(a, b):
        return ptx1("min.s32 {$w0}, {$r0}, {$r1};", a, b)

    def smax(a, b):
        return ptx1("max.s32 {$w0}, {$r0}, {$r1};", a, b)

    def sel_lt(a, b, x, y):
        """x if a < b else y."""
        return ptx1("{ .reg .pred p; setp.lt.s32 p, {$r0}, {$r1}; "
                    "selp.s32 {$w0}, {$r2}, {$r3}, p; }", a, b, x, y)

    def sel_eq(a, b, x, y):
        """x if a == b else y."""
        return ptx1("{ .reg .pred p; setp.eq.s32 p, {$r0}, {$r1}; "
                    "selp.s32 {$w0}, {$r2}, {$r3}, p; }", a, b, x, y)

    def fingerprint_term(i, v):
        """The counts fingerprint's term of entry i holding v (``FINGERPRINT_TERM_PTX``)."""
        return ptx1(FINGERPRINT_TERM_PTX, i, v)

    def lds(base, i):
        return P.ld_shared_s32(base + Int32(i) * Int32(4))

    def sts(base, i, v):
        P.st_shared_s32(base + Int32(i) * Int32(4), v)

    def sts_if_eq(a, b, base, i, v):
        cute.arch.inline_ptx("{ .reg .pred p; setp.eq.s32 p, {$r0}, {$r1}; "
                             "@p st.shared.s32 [{$r2}], {$r3}; }",
                             read_only_args=[Int32(a), Int32(b), base + Int32(i) * Int32(4),
                                             Int32(v)])

    def lds64(base, i):
        return cute.arch.inline_ptx("ld.shared.s64 {$w0}, [{$r0}];", write_only_types=[Int64],
                                    read_only_args=[base + Int32(i) * Int32(8)])

    def sts64(base, i, v):
        cute.arch.inline_ptx("st.shared.s64 [{$r0}], {$r1};",
                             read_only_args=[base + Int32(i) * Int32(8), Int64(v)])

    def ld_s64_as_s32(addr):
        return cute.arch.inline_ptx(
            "{ .reg .b64 x; ld.global.b64 x, [{$r0}]; cvt.u32.u64 {$w0}, x; }",
            write_only_types=[Int32], read_only_args=[addr])

    def stg(out, off, v):
        P.st_s32(out + Int64(off) * Int64(4), v)

    def warp_incl_scan(v, op="add.s32"):
        """Lane i: op over lanes 0..i (``op``: a PTX s32 binary op, "add.s32" or "max.s32")."""
        for off in (1, 2, 4, 8, 16):
            v = ptx1("{ .reg .pred p; .reg .b32 n; "
                     f"shfl.sync.up.b32 n|p, {{$r0}}, {off}, 0, -1; "
                     f"@p {op} n, n, {{$r0}}; mov.b32 {{$w0}}, n; @!p mov.b32 {{$w0}}, {{$r0}}; }}",
                     v)
        return v

    def shfl_idx(v, lane):
        return ptx1("shfl.sync.idx.b32 {$w0}, {$r0}, {$r1}, 31, -1;", v, lane)

    def warp_sum(v):
        for off in (16, 8, 4, 2, 1):
            v = v + ptx1(f"shfl.sync.bfly.b32 {{$w0}}, {{$r0}}, {off}, 31, -1;", v)
        return v

    def block_scan(vals, scratch, lane, warp, num_warps: int = 32):
        """Exclusive prefix sums over the CTA's threads (thread order) of each value, and the
        totals. Every thread calls it (two CTA barriers); `scratch` holds 32 words per value.
        num_warps: the CTA's warps (its threads / 32); below 32 the scratch words of warps the
        CTA does not have are read as 0 (shared memory is not cleared between kernels: they
        hold whatever the SM's last kernel left there)."""
        incl = [warp_incl_scan(Int32(v)) for v in vals]
        for i, x in enumerate(incl):
            sts_if_eq(lane, 31, scratch, i * 32 + warp, x)
        P.block_sync()
        ex, tot = [], []
        for i, (v, x) in enumerate(zip(vals, incl)):
            w = lds(scratch, Int32(i * 32) + lane)
            if num_warps < 32:
                w = sel_lt(lane, Int32(num_warps), w, Int32(0))
            wt = warp_incl_scan(w)  # inclusive over warps
            before = shfl_idx(wt, smax(warp - Int32(1), Int32(0)))
            before = sel_eq(warp, 0, Int32(0), before)
            ex.append(x - Int32(v) + before)
            tot.append(shfl_idx(wt, Int32(31)))
        P.block_sync()  # scratch is reused by the next scan
        return ex, tot

    @cute.jit
    def bitonic_sort64(keys, tid, n: cutlass.Constexpr):
        """Ascending sort of the n (a power of two) 64-bit keys at shared address ``keys``, a
        key per thread tid < n; every thread of the CTA calls it (a barrier per stage)."""
        for kk in cutlass.range_constexpr(int(math.log2(n))):
            k = 2 << kk
            for jj in cutlass.range_constexpr(kk + 1):
                j = k >> (jj + 1)
                if tid < Int32(n):
                    ixj = tid ^ Int32(j)
                    if ixj > tid:
                        ka = lds64(keys, tid)
                        kb = lds64(keys, ixj)
                        if (tid & Int32(k)) == Int32(0):
                            if ka > kb:
                                sts64(keys, tid, kb)
                                sts64(keys, ixj, ka)
                        else:
                            if ka < kb:
                                sts64(keys, tid, kb)
                                sts64(keys, ixj, ka)
                P.block_sync()

    return SimpleNamespace(**{k: v for k, v in locals().items() if callable(v) and k not in (
        "SimpleNamespace", "cutlass", "Int32", "Int64")})


def build_plan_kernels(counts_64: bool, NE: int, NPS: int, by_expert: bool = False,
                       senders: bool = False):
    """The plan launcher (one kernel: CTA 0 plans, CTAs 1.. the row totals and the -1 tails).
    NE: shared array length (power of two >= E); NPS: sort length (power of two >= El);
    counts_64: the counts are int64 (else int32); by_expert: the schedule of
    plan_combine(order="expert"), the band order (no expert ranking: NPS unused), else that of
    "remote_first".

    senders: the variant of the ordered scale's tables (combine/ordered_routes_kernel.py): CTA
    (0, s) of a (1, W) grid plans rank s (``rank`` is the owner) and writes, instead of a plan,
    what the owner needs of it (`SendersLayout`): the number of segments, each segment's
    receive row on its destination, the rows it ships to the owner (seg_inc int64, 0 for a
    segment to another rank; row s's first num_segments words) and, per expert of s, the first
    segment and segment count of its group to the owner; the owner's own CTA writes its
    num_bands and each band's schedule position."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P

    LOG_NE = int(math.log2(NE))
    N_BAND_F, N_SEG_F = len(BAND_FIELDS), len(SEGMENT_FIELDS)

    H = simt_helpers()
    smin, smax, sel_lt, sel_eq = H.smin, H.smax, H.sel_lt, H.sel_eq
    lds, sts, lds64, sts64, stg = H.lds, H.sts, H.lds64, H.sts64, H.stg
    block_scan, warp_sum = H.block_scan, H.warp_sum

    def ldc(counts, i):
        """counts[i] (flat) as Int32: for int64 counts the low (little-endian first) word, the
        bits a 64-bit load and cvt.u32.u64 would give, in one register instead of two."""
        if cutlass.const_expr(counts_64):
            return P.ld_s32(counts + Int64(i) * Int64(8))
        return P.ld_s32(counts + Int64(i) * Int64(4))

    def group_source(j, rank, W):
        """Source rank of group j: remote ranks ascending, the local rank last."""
        return sel_eq(j, W - Int32(1), rank, sel_lt(j, rank, j, j + Int32(1)))

    PLAN_OUT = not senders  # the plan's fields (else the senders' tables)

    def in_cap(i, cap):
        """1 if 0 <= i < cap (one unsigned compare), else 0: the guard of every store whose
        index comes from the counts (a validate=False plan's counts may be anything)."""
        return H.ptx1("{ .reg .pred p; setp.lt.u32 p, {$r0}, {$r1}; selp.s32 {$w0}, 1, 0, p; }",
                      i, cap)

    @cute.kernel
    def plan_kernel(counts: Int64, out: Int64, W: Int32, E: Int32, El: Int32, rank: Int32,
                    lg: Int32, mgb: Int32, layout: Int32, B: Int32, S: Int32):
        tid, bidx, nblk = P.thread_block_grid()
        owner = rank
        if cutlass.const_expr(senders):
            _, bidy, _ = cute.arch.block_idx()
            rank = Int32(bidy)  # the rank planned here; owner: the ordered scale's rank
            so_nseg = Int32(1)
            so_first = so_nseg + W
            so_cnt = so_first + E
            so_pos = so_cnt + E
            so_dr = so_pos + B
            so_inc = ((so_dr + W * S + Int32(1)) >> Int32(1)) << Int32(1)  # 8-byte aligned
        lane = tid & Int32(31)
        warp = tid >> Int32(5)
        t = Int32(1) << lg
        tm1 = t - Int32(1)
        o_grs = Int32(8)
        o_er = o_grs + E
        o_ers = o_er + El
        o_rrpr = o_ers + El
        o_rc = o_rrpr + W
        o_bands = o_rc + E
        o_segs = o_bands + Int32(N_BAND_F) * B

        alloc = cutlass.memory.SmemAllocator()
        keys = alloc.allocate_array(cutlass.Int64, NPS, byte_alignment=16).toint()
        arr = alloc.allocate_array(cutlass.Int32, 17 * NE + 4 * 32, byte_alignment=16).toint()
        A = [arr + Int32(4 * NE * n) for n in range(17)]
        G_C, G_ST, G_DR, TMP1, TMP2, RO_A, RO_SB, E_RS, E_NRB, E_RB, E_LB, E_FB, E_SC, \
            E_RA, E_F, SRT, SRC_BEFORE = A
        SCR = arr + Int32(4 * 17 * NE)

        # groups, source-major (x = s * El + e): count (every CTA: the tail CTAs size the
        # valid lengths from them); loads issued first, in flight with phase 1's
        x = tid
        vx = Int32(0)
        if x < E:
            vx = ldc(counts, (x // El) * E + rank * El + x % El)
        if bidx == Int32(0):
            # ---- phase 1: per source s (a warp each, two per round): rows before ours at s
            # (its rank * El first entries; the row totals are the tail CTAs'); P1_LOADS loads
            # per source and lane in flight (a loop of one load each would pay the global
            # latency once per 32 entries)
            rcv = Int32(0)
            if cutlass.const_expr(PLAN_OUT):
                if tid < E:  # E <= NT
                    rcv = ldc(counts, rank * E + tid)
            nbef = rank * El
            s = warp
            while s < W:
                s2 = s + Int32(32)
                s2c = smin(s2, W - Int32(1))
                bef = Int32(0)
                bef2 = Int32(0)
                e = lane
                while e < nbef:
                    es = [e + Int32(32 * u) for u in range(P1_LOADS)]
                    va = [ldc(counts, s * E + smin(x_, nbef - Int32(1))) for x_ in es]
                    vb = [ldc(counts, s2c * E + smin(x_, nbef - Int32(1))) for x_ in es]
                    for x_, v, v2 in zip(es, va, vb):
                        bef = bef + sel_lt(x_, nbef, v, Int32(0))
                        bef2 = bef2 + sel_lt(x_, nbef, v2, Int32(0))
                    e = e + Int32(32 * P1_LOADS)
                bef = warp_sum(bef)
                bef2 = warp_sum(bef2)
                if lane == Int32(0):
                    sts(SRC_BEFORE, s, bef)
                    if s2 < W:
                        sts(SRC_BEFORE, s2, bef2)
                s = s + Int32(64)
            if cutlass.const_expr(PLAN_OUT):
                if tid < E:
                    stg(out, o_rc + tid, rcv)
        else:
            # the tail CTAs: rows each source receives back (row totals of the counts), a warp
            # per source; outputs only, so CTA 0 does not wait for them
            s = (bidx - Int32(1)) * Int32(32) + warp
            while s < W:
                tot = Int32(0)
                e = lane
                while e < E:
                    es = [e + Int32(32 * u) for u in range(2 * P1_LOADS)]
                    vs = [ldc(counts, s * E + smin(x_, E - Int32(1))) for x_ in es]
                    for x_, v in zip(es, vs):
                        tot = tot + sel_lt(x_, E, v, Int32(0))
                    e = e + Int32(64 * P1_LOADS)
                tot = warp_sum(tot)
                if lane == Int32(0):
                    stg(out, o_rrpr + s, tot)
                s = s + (nblk - Int32(1)) * Int32(32)
        # first receive row at the source of each group
        (exx,), _ = block_scan([vx], SCR, lane, warp)
        if x < E:
            sts(TMP1, x, exx)
        P.block_sync()  # TMP1 and SRC_BEFORE complete
        if x < E:
            sx = x // El
            ex_ = x % El
            jx = sel_lt(sx, rank, sx, sel_eq(sx, rank, W - Int32(1), sx - Int32(1)))
            gx = ex_ * W + jx
            sts(G_C, gx, vx)
            if bidx == Int32(0):
                sts(G_DR, gx, lds(SRC_BEFORE, sx) + exx - lds(TMP1, sx * El))
        P.block_sync()

        # ---- phase 2: per group g = e * W + j: aligned and packed starts, per expert rows
        g = tid
        eg = g // W
        jg = g - eg * W
        cg = Int32(0)
        if g < E:
            cg = lds(G_C, g)
        ag = ((cg + tm1) >> lg) << lg
        (exa, exc), _ = block_scan([ag, cg], SCR, lane, warp)
        if g < E:
            sts(TMP1, g, exa)
            sts(TMP2, g, exc)
        P.block_sync()
        sa = Int32(0)
        sp = Int32(0)
        if g < E:
            sa = exa - lds(TMP1, eg * W)
            sp = exc - lds(TMP2, eg * W)
            if jg == W - Int32(1):
                sts(E_RA, eg, sa + ag)
                sts(E_SC, eg, sp + cg)
        P.block_sync()
        ra = Int32(0)
        sc = Int32(0)
        if tid < El:
            ra = lds(E_RA, tid)
            sc = lds(E_SC, tid)
        rp = ((sc + tm1) >> lg) << lg
        # a local count no plan of this capacity holds: negative, or more bands than B alone
        bad_g = Int32(0)
        if g < E:
            if cg < Int32(0):
                bad_g = Int32(1)
            if (cg >> lg) > B:
                bad_g = Int32(1)
        _, (tot_ra, tot_rp, tot_sc, n_bad) = block_scan([ra, rp, sc, bad_g], SCR, lane, warp)
        packed = layout
        if layout == Int32(2):
            packed = sel_lt(tot_rp, tot_ra, Int32(1), Int32(0))
        erows = sel_eq(packed, 1, rp, ra)
        (ers,), (total_rows,) = block_scan([erows], SCR, lane, warp)
        nb = total_rows >> lg
        # overflow (validate=False counts the plan does not fit, CTA-uniform): no band,
        # schedule, cell or segment entry is written (every capacity field is -1 from the
        # tails) and num_bands says it: the bands needed where more than B, else -1 (negative
        # counts, or sums past int32), outside [0, B] either way, which the producer refuses
        ovf = Int32(0)
        if n_bad > Int32(0):
            ovf = Int32(1)
        if total_rows < Int32(0):
            ovf = Int32(1)
        if nb > B:
            ovf = Int32(1)
        nb_out = nb
        if ovf == Int32(1):
            nb_out = sel_lt(B, nb, nb, Int32(-1))
        if tid < El:
            sts(E_RS, tid, ers)
            if cutlass.const_expr(PLAN_OUT):
                if bidx == Int32(0):
                    stg(out, o_er + tid, erows)
                    stg(out, o_ers + tid, ers)
        if tid == Int32(0):
            if bidx == Int32(0):
                if cutlass.const_expr(PLAN_OUT):
                    stg(out, Int32(0), packed)
                    stg(out, Int32(1), nb_out)
                    stg(out, Int32(5), total_rows)
                    stg(out, Int32(6), tot_sc)
                else:
                    if rank == owner:
                        stg(out, Int32(0), nb_out)
        if g < E:
            st = sel_eq(packed, 1, sp, sa)
            sts(G_ST, g, st)
            if cutlass.const_expr(PLAN_OUT):
                if bidx == Int32(0):
                    stg(out, o_grs + eg * W + group_source(jg, rank, W), st)
            if jg == W - Int32(1):
                sts(E_NRB, eg, (st + tm1) >> lg)
                f = Int32(0)
                if cg > Int32(0):
                    if (st & tm1) != Int32(0):
                        f = Int32(1)
                sts(E_F, eg, f)
        P.block_sync()

        if bidx == Int32(0):
            if cutlass.const_expr(by_expert):
                # ---- phase 3, expert order: the rank order is the expert order and the
                # schedule the band order, so expert e's first band sits at position
                # ers_e / tile_m and its first local cell after those of the experts before it
                # (f_e in its last remote band, then one per local band)
                x_nrb = Int32(0)
                x_lc = Int32(0)
                if tid < El:
                    sts(SRT, tid, tid)
                    x_nrb = lds(E_NRB, tid)
                    x_nxt = total_rows
                    if tid + Int32(1) < El:
                        x_nxt = lds(E_RS, tid + Int32(1))
                    x_lc = ((x_nxt - lds(E_RS, tid)) >> lg) - x_nrb + lds(E_F, tid)
                (_, x_lcb), (num_remote, num_lc) = block_scan([x_nrb, x_lc], SCR, lane, warp)
                if tid < El:
                    sts(E_RB, tid, lds(E_RS, tid) >> lg)
                    sts(E_FB, tid, x_lcb)
                if cutlass.const_expr(PLAN_OUT):
                    if tid == Int32(0):
                        stg(out, Int32(2), sel_eq(ovf, 1, Int32(0), num_remote))
                        stg(out, Int32(4), sel_eq(ovf, 1, Int32(0), num_lc))
            else:
                # ---- phase 3: experts ranked by (-remote bands, e): bitonic sort of El keys
                if tid < Int32(NPS):
                    key = Int64(0x7FFFFFFFFFFFFFFF)
                    if tid < El:
                        key = (Int64(Int32(0x7FFFFFFF) - lds(E_NRB, tid)) << Int64(32)) | \
                            Int64(tid)
                    sts64(keys, tid, key)
                P.block_sync()
                H.bitonic_sort64(keys, tid, NPS)
                if tid < El:
                    sts(SRT, tid, Int32(lds64(keys, tid) & Int64(0xFFFFFFFF)))
                P.block_sync()
                # rank order: remote-band base, local-band base, base of local cells in remote
                # bands
                er = Int32(0)
                v_nrb = Int32(0)
                v_lb = Int32(0)
                v_f = Int32(0)
                if tid < El:
                    er = lds(SRT, tid)
                    v_nrb = lds(E_NRB, er)
                    nxt = total_rows
                    if er + Int32(1) < El:
                        nxt = lds(E_RS, er + Int32(1))
                    v_lb = ((nxt - lds(E_RS, er)) >> lg) - v_nrb
                    v_f = lds(E_F, er)
                (x_rb, x_lb, x_fb), (num_remote, num_lb, num_f) = block_scan(
                    [v_nrb, v_lb, v_f], SCR, lane, warp)
                if tid < El:
                    sts(E_RB, er, x_rb)
                    sts(E_LB, er, x_lb)
                    sts(E_FB, er, x_fb)
                if cutlass.const_expr(PLAN_OUT):
                    if tid == Int32(0):
                        stg(out, Int32(2), sel_eq(ovf, 1, Int32(0), num_remote))
                        stg(out, Int32(4), sel_eq(ovf, 1, Int32(0), num_f + num_lb))
            # groups in rank order (i = r * W + j): first remote-cell index, segment base
            ri = tid // W
            ji = tid - ri * W
            L = Int32(0)
            if tid < E:
                gi = lds(SRT, ri) * W + ji
                if ji < W - Int32(1):
                    ci = lds(G_C, gi)
                    if ci > Int32(0):
                        sti = lds(G_ST, gi)
                        L = ((sti + ci - Int32(1)) >> lg) - (sti >> lg) + Int32(1)
            (a0,), (R,) = block_scan([L], SCR, lane, warp)
            nst = Int32(0)
            if L > Int32(0):
                reg = Int32(0)
                if a0 == Int32(0):
                    nst = Int32(1) + (L - Int32(1) + mgb - Int32(1)) // mgb
                    if L == Int32(1):
                        reg = Int32(1)
                    else:
                        if (L - Int32(2)) % mgb == Int32(0):
                            reg = Int32(1)
                else:
                    nst = (L + mgb - Int32(1)) // mgb
                    if (L - Int32(1)) % mgb == Int32(0):
                        reg = Int32(1)
                if a0 + L == R:
                    if reg == Int32(0):
                        nst = nst + Int32(1)
            (sb,), (nseg,) = block_scan([nst], SCR, lane, warp)
            # the segments written and walked: none on overflow; R <= S otherwise (a remote
            # cell per band and group at most), so the clamp only bounds an overflow's work
            nseg = sel_eq(ovf, 1, Int32(0), nseg)
            R = sel_eq(ovf, 1, Int32(0), smin(R, S))
            if tid < E:
                sts(RO_A, tid, a0)
                sts(RO_SB, tid, sb)
            if tid == Int32(0):
                if cutlass.const_expr(PLAN_OUT):
                    stg(out, Int32(3), nseg)
                else:
                    # seg_inc's valid prefix: the owner's own segments never come to it
                    stg(out, so_nseg + rank, sel_eq(rank, owner, Int32(0), nseg))
            n_band_loop = sel_eq(ovf, 1, Int32(0), smin(nb, B))  # nb <= B unless overflow
            if cutlass.const_expr(senders):
                # the owner's groups at this rank: first segment and count per expert of rank
                if tid < E:
                    if ji < W - Int32(1):
                        if group_source(ji, rank, W) == owner:
                            e_own = rank * El + lds(SRT, ri)
                            stg(out, so_first + e_own, sb)
                            stg(out, so_cnt + e_own, nst)
                if rank != owner:
                    n_band_loop = Int32(0)  # only the owner's band positions are needed
            P.block_sync()

            # ---- phase 4: bands (stacked row order), strided over the threads
            b = tid
            while b < n_band_loop:
                ep = Int32(0)  # the last expert whose first band is <= b
                for st_ in cutlass.range_constexpr(LOG_NE):
                    cand = ep + Int32(NE >> (st_ + 1))
                    if cand < El:
                        if (lds(E_RS, cand) >> lg) <= b:
                            ep = cand
                eb = ep
                ers_b = lds(E_RS, eb)
                kb_ = b - (ers_b >> lg)
                kt = kb_ << lg
                base_g = eb * W
                jp = Int32(0)  # the group holding row kt: the last j with start <= kt
                for st_ in cutlass.range_constexpr(LOG_NE):
                    cand = jp + Int32(NE >> (st_ + 1))
                    if cand < W:
                        if lds(G_ST, base_g + cand) <= kt:
                            jp = cand
                gb = base_g + jp
                stb = lds(G_ST, gb)
                endb = stb + lds(G_C, gb)
                if packed == Int32(1):
                    endb = lds(E_SC, eb)
                if cutlass.const_expr(PLAN_OUT):
                    stg(out, o_bands + b, eb)
                    stg(out, o_bands + B + b, kt)
                    stg(out, o_bands + Int32(2) * B + b, ers_b + kt)
                    stg(out, o_bands + Int32(3) * B + b, group_source(jp, rank, W))
                    stg(out, o_bands + Int32(4) * B + b, smin(t, endb - kt))
                    stg(out, o_bands + Int32(5) * B + b, lds(G_DR, gb) + kt - stb)
                if cutlass.const_expr(by_expert):
                    pos = b
                    # the local group's bands from the one holding its first row
                    lq = lds(E_FB, eb) + kb_ - (lds(G_ST, base_g + W - Int32(1)) >> lg)
                else:
                    nrb_b = lds(E_NRB, eb)
                    pos = num_remote + lds(E_LB, eb) + kb_ - nrb_b
                    lq = num_f + lds(E_LB, eb) + kb_ - nrb_b
                    if kb_ < nrb_b:
                        pos = lds(E_RB, eb) + kb_
                        lq = lds(E_FB, eb)
                if cutlass.const_expr(PLAN_OUT):
                    if in_cap(pos, B) == Int32(1):
                        stg(out, o_bands + Int32(6) * B + pos, b)
                    gl = base_g + W - Int32(1)
                    lsb = lds(G_ST, gl)
                    lo = smax(lsb, kt)
                    hi = smin(lsb + lds(G_C, gl), kt + t)
                    if hi > lo:  # the band holds local rows: its local cell
                        if in_cap(lq, B) == Int32(1):
                            stg(out, o_bands + Int32(7) * B + lq, b)
                            stg(out, o_bands + Int32(8) * B + lq, ers_b + lo)
                            stg(out, o_bands + Int32(9) * B + lq, lds(G_DR, gl) + lo - lsb)
                            stg(out, o_bands + Int32(10) * B + lq, hi - lo)
                else:
                    stg(out, so_pos + b, pos)
                b = b + Int32(NT)

            # ---- phase 5: remote cells in schedule order; a segment start writes its segment
            q = tid
            while q < R:
                ip = Int32(0)  # the last rank-order group whose first remote cell is <= q
                for st_ in cutlass.range_constexpr(LOG_NE):
                    cand = ip + Int32(NE >> (st_ + 1))
                    if cand < E:
                        if lds(RO_A, cand) <= q:
                            ip = cand
                aq = lds(RO_A, ip)
                u = q - aq
                rq = ip // W
                jq = ip - rq * W
                eq = lds(SRT, rq)
                gq = eq * W + jq
                is_start = Int32(0)
                if q == Int32(0):
                    is_start = Int32(1)
                if q == R - Int32(1):
                    is_start = Int32(1)
                kk_ = u
                if aq == Int32(0):
                    kk_ = u - Int32(1)  # the first cell is cut off the first run
                if kk_ >= Int32(0):
                    if kk_ % mgb == Int32(0):
                        is_start = Int32(1)
                if is_start == Int32(1):
                    stq = lds(G_ST, gq)
                    cq = lds(G_C, gq)
                    Lq = ((stq + cq - Int32(1)) >> lg) - (stq >> lg) + Int32(1)
                    nxt = (u // mgb + Int32(1)) * mgb
                    idx = (u + mgb - Int32(1)) // mgb
                    if aq == Int32(0):
                        nxt = Int32(1)
                        idx = Int32(0)
                        if u > Int32(0):
                            nxt = Int32(1) + ((u - Int32(1)) // mgb + Int32(1)) * mgb
                            idx = Int32(1) + (u - Int32(1) + mgb - Int32(1)) // mgb
                    endq = smin(nxt, Lq)
                    lastrel = R - Int32(1) - aq
                    if lastrel > u:
                        endq = smin(endq, lastrel)
                    k0 = stq >> lg
                    kf = k0 + u
                    kl = k0 + endq - Int32(1)
                    lo_f = smax(stq, kf << lg)
                    hi_l = smin(stq + cq, (kl + Int32(1)) << lg)
                    si = lds(RO_SB, ip) + idx
                    if in_cap(si, S) == Int32(1):
                        if cutlass.const_expr(PLAN_OUT):
                            stg(out, o_segs + si, lds(E_RB, eq) + kf)
                            stg(out, o_segs + S + si, kl - kf + Int32(1))
                            stg(out, o_segs + Int32(2) * S + si, group_source(jq, rank, W))
                            stg(out, o_segs + Int32(3) * S + si, lds(E_RS, eq) + lo_f)
                            stg(out, o_segs + Int32(4) * S + si, lds(G_DR, gq) + lo_f - stq)
                            stg(out, o_segs + Int32(5) * S + si, hi_l - lo_f)
                        else:
                            stg(out, so_dr + rank * S + si, lds(G_DR, gq) + lo_f - stq)
                            # every segment's word (0 where it goes to another rank): seg_inc's
                            # valid prefix is num_segments long, nothing past it is written or read
                            inc = Int64(0)
                            if group_source(jq, rank, W) == owner:
                                inc = Int64(hi_l - lo_f)
                            P.st_s64(out + (Int64(so_inc) + Int64(2) * (Int64(rank) * Int64(S)
                                                                        + Int64(si))) * Int64(4),
                                     inc)
                q = q + Int32(NT)
            # segment fields from num_segments up to the remote cells R (one start cell per
            # segment, so R >= num_segments); the tail CTAs fill from R on
            q = nseg + tid
            r_cap = smin(R, S)
            if cutlass.const_expr(senders):
                r_cap = Int32(0)  # nothing reads past nseg
            while q < r_cap:
                for fi in cutlass.range_constexpr(N_SEG_F):
                    stg(out, o_segs + Int32(fi) * S + q, Int32(-1))
                q = q + Int32(NT)
        else:
            # ---- tail CTAs: -1 from each field's valid length to its capacity, in the same
            # launch as the plan. The lengths come from the phases above (the code CTA 0 runs,
            # so the same values) and order-free sums: local cells = sum_e (local band flag)
            # + num_bands - sum_e (remote bands); segments from R (CTA 0 fills below R)
            t_nrb = Int32(0)
            t_f = Int32(0)
            if tid < El:
                t_nrb = lds(E_NRB, tid)
                t_f = lds(E_F, tid)
            t_l = Int32(0)
            if g < E:
                if jg < W - Int32(1):
                    if cg > Int32(0):
                        st_g = lds(G_ST, g)
                        t_l = ((st_g + cg - Int32(1)) >> lg) - (st_g >> lg) + Int32(1)
            _, tails = block_scan([t_nrb, t_f, t_l], SCR, lane, warp)
            # a one-level target: CuTe DSL carries a name out of a runtime `if` only where a
            # plain or one-level tuple target bound it (tests/test_kernel_dsl_scope_cpu.py)
            s_nrb, s_f, r_t = tails
            n_lc = s_f + nb - s_nrb
            if ovf == Int32(1):  # overflow: every field -1 from its start
                nb = Int32(0)
                n_lc = Int32(0)
                r_t = Int32(0)
            tb = bidx - Int32(1)
            step = (nblk - Int32(1)) * Int32(NT)
            for fi in cutlass.range_constexpr(N_BAND_F + N_SEG_F):
                valid = nb  # band fields and the schedule
                cap = B
                base = o_bands + Int32(fi) * B
                if cutlass.const_expr(fi >= 7):
                    valid = n_lc  # local cell fields
                if cutlass.const_expr(fi >= N_BAND_F):
                    valid = smin(r_t, S)
                    cap = S
                    base = o_segs + Int32(fi - N_BAND_F) * S
                i = smin(smax(valid, Int32(0)), cap) + tb * Int32(NT) + tid
                while i < cap:
                    stg(out, base + i, Int32(-1))
                    i = i + step
            if cutlass.const_expr(PLAN_OUT):
                if bidx == Int32(1):
                    # the counts fingerprint: every entry once (P1_LOADS loads per thread in
                    # flight), a CTA sum (mod 2^32: the scan's add.s32 wraps)
                    n_all = W * E
                    acc = Int32(0)
                    xi = tid
                    while xi < n_all:
                        xs = [xi + Int32(NT * u) for u in range(P1_LOADS)]
                        vs = [ldc(counts, smin(x_, n_all - Int32(1))) for x_ in xs]
                        for x_, v in zip(xs, vs):
                            acc = acc + sel_lt(x_, n_all, H.fingerprint_term(x_, v), Int32(0))
                        xi = xi + Int32(NT * P1_LOADS)
                    _, (fp,) = block_scan([acc], SCR, lane, warp)
                    if tid == Int32(0):
                        stg(out, Int32(7), fp)

    @cute.jit
    def launch_plan(counts: Int64, out: Int64, W: Int32, E: Int32, El: Int32, rank: Int32,
                    lg: Int32, mgb: Int32, layout: Int32, B: Int32, S: Int32, grid: Int32,
                    stream: cuda.CUstream):
        if cutlass.const_expr(senders):
            # one planning CTA per rank; no tail CTA (nothing past the valid lengths is read)
            plan_kernel(counts, out, W, E, El, rank, lg, mgb, layout, B, S).launch(
                grid=[1, W, 1], block=[NT, 1, 1], stream=stream)
        else:
            plan_kernel(counts, out, W, E, El, rank, lg, mgb, layout, B, S).launch(
                grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch_plan


def plan_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(0)] + [Int32(1)] * 9 + [Int32(2), cuda.CUstream(0)]


def _plan_buffer(n: int, device) -> torch.Tensor:
    """The plan buffer, uninitialized: the kernel writes every word a view shows (the GPU tests
    replace this with a poisoned buffer to check that)."""
    return torch.empty(n, dtype=torch.int32, device=device)


class PlanKernel:
    """The compiled planner kernel, cached by the host facts that size them (counts dtype, shared
    array length pow2(E), sort length pow2(El)) and the order (a variant each: the expert order
    has no sort, so its sort length is fixed); rank, tile_m, mgb, layout and the capacities are
    runtime arguments."""

    _cache: dict = {}

    @staticmethod
    def can_implement(world_size: int, num_experts: int, counts_dtype, band_capacity: int,
                      segment_capacity: int) -> tuple[bool, str]:
        if num_experts > MAX_GROUPS:
            return False, (f"E={num_experts} groups > {MAX_GROUPS} (one per thread of the "
                           "planning CTA)")
        if counts_dtype not in (torch.int32, torch.int64):
            return False, f"counts dtype {counts_dtype} (int32 / int64 only)"
        El = num_experts // world_size
        total = _Layout(world_size, num_experts, El, band_capacity, segment_capacity).total
        if total >= 2 ** 31:
            return False, f"plan buffer of {total} int32 words exceeds int32 offsets"
        return True, ""

    @staticmethod
    def variant(counts_64: bool, E: int, El: int, order: str = "remote_first") -> tuple:
        """build_plan_kernels' arguments (the compile cache key) for these host facts."""
        if order not in ORDERS:
            raise ValueError(f"order={order!r}; choose from {ORDERS}")
        by_expert = order == "expert"
        return (bool(counts_64), max(32, _pow2(E)), 2 if by_expert else max(2, _pow2(El)),
                by_expert)

    @classmethod
    def compiled(cls, counts_64: bool, E: int, El: int, order: str = "remote_first"):
        key = cls.variant(counts_64, E, El, order)
        if key not in cls._cache:
            import cutlass.cute as cute
            cls._cache[key] = cute.compile(build_plan_kernels(*key), *plan_example_args())
        return cls._cache[key]

    def __call__(self, expert_counts: torch.Tensor, rank: int, tile_m: int, mgb: int,
                 band_capacity: int, layout: str, order: str = "remote_first",
                 stream=None) -> dict[str, torch.Tensor]:
        """The plan tensors by CombinePlan field name (views of one int32 buffer), scheduled in
        `order` ("remote_first" or "expert"). The host checks (plan.py) have run; expert_counts
        is a CUDA [W, E] integer tensor."""
        import cuda.bindings.driver as cuda
        W, E = expert_counts.shape
        El = E // W
        B = band_capacity
        S = B + E
        counts = expert_counts
        if counts.dtype not in (torch.int32, torch.int64):
            counts = counts.to(torch.int32)
        counts = counts.contiguous()
        ok, why = self.can_implement(W, E, counts.dtype, B, S)
        if not ok:
            raise ValueError(f"plan kernel cannot run this plan: {why}")
        lay = _Layout(W, E, El, B, S)
        buf = _plan_buffer(lay.total, counts.device)
        fn_plan = self.compiled(counts.dtype == torch.int64, E, El, order)
        if stream is None:
            stream = torch.cuda.current_stream(counts.device)
        h = cuda.CUstream(stream.cuda_stream)
        tail_ctas = max(1, min(64, -(-max(B, S) // TAIL_WORDS_PER_CTA)))
        fn_plan(counts.data_ptr(), buf.data_ptr(), W, E, El, rank, int(tile_m).bit_length() - 1,
                mgb, _LAYOUT_CODE[layout], B, S, 1 + tail_ctas, h)
        return lay.views(buf, W, E, El, B, S)


_KERNEL = PlanKernel()


def plan_tensors_kernel(expert_counts, rank, tile_m, mgb, band_capacity, layout,
                        order="remote_first"):
    return _KERNEL(expert_counts, rank, tile_m, mgb, band_capacity, layout, order)


def kernel_available() -> bool:
    """CuTe DSL importable (the kernel path of plan_combine(impl="auto"))."""
    try:
        import cutlass  # noqa: F401
        import cutlass.cute  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - any import failure means: use torch
        return False
