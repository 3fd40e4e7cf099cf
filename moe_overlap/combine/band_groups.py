"""The producer's band groups cut at expert boundaries (``GroupedGemm(group_by="expert")``):
per schedule position p, the group [group_first[p], group_first[p] + group_size[p]) of schedule
positions that walk the n tiles together (``kernels.tile_scheduler.BandTileScheduler.walk``).

Why: groups of G fixed schedule positions cut across experts wherever an expert is not a divisor
of G bands long (deepseek-v3 at 16384 tokens: 4-5 bands per expert, a group of 8 spans 2-3
experts), and then the weight slices of 2-3 experts are in flight at once and fall out of L2
(bench/NOTES.md, "A design for that fix"). Here a group holds whole experts, or an equal share
of one:

* a *run* is a maximal stretch of schedule positions whose bands have one expert (a position
  whose schedule entry is outside [0, num_bands) is a run of its own: the producer refuses that
  band, the tables only have to cover it);
* a run longer than G is cut into k = ceil(L / G) pieces of floor or ceil L / k positions (a
  10-band expert at G = 8 is 5 + 5, not 8 + 2: the same two passes over its weights, and no pass
  for two bands only);
* the runs of at most G positions are packed by the aligned windows [w G, (w + 1) G) of the
  schedule: the runs that lie inside one window form one group, a run that crosses a window
  edge forms a group of its own. Where no run crosses a window edge this is exactly the fixed
  groups of G (first = p - p % G, size = min(G, num_bands - first)), so plans of 1-band experts,
  or of 2-, 4-, 8-band experts at aligned starts, keep the order measured today; packing runs of
  different experts shares no weights, so no packing rule reads fewer weight bytes than another,
  and this one is a closed form per position (no pass over the runs in order).

Positions >= num_bands hold -1; num_bands outside [0, capacity] gives -1 everywhere (the producer
then computes no band). ``band_groups_torch`` is the reference (torch ops, no host sync, any
device); ``BandGroupsKernel`` computes the same tensors in one CuTe DSL launch (one CTA of 1024
threads: a max-scan for each position's run start, each run's end written at its start, then the
closed form per position), without a host sync (CUDA-graph capturable). No CuTe DSL import at
module import.
"""

import torch

GROUP_BY = ("position", "expert")  # GroupedGemm(group_by=): fixed groups of G, or these tables
MAX_GROUP = 1 << 16  # band_group bound of group_by="expert" (int32 window arithmetic)
NT = 1024  # threads of the table kernel's one CTA
WORKSPACE_TABLES = 4  # int32 words per band of the kernel's buffer: first, size, 2 scratch
IMPLS = ("auto", "torch", "kernel")


def band_groups_torch(schedule: torch.Tensor, band_expert: torch.Tensor,
                      num_bands: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(group_first, group_size): int32 [capacity] each on the schedule's device, from the plan's
    schedule / band_expert (int [capacity]) and num_bands ([1]); group: G >= 1. Torch ops only,
    no host sync (the reference of ``BandGroupsKernel``; see the module doc for the rule)."""
    cap = schedule.numel()
    dev = schedule.device
    G = int(group)
    p = torch.arange(cap, device=dev)
    nb = num_bands.reshape(-1)[:1].long()
    nb = torch.where((nb >= 0) & (nb <= cap), nb, torch.zeros_like(nb))
    valid = p < nb
    s = schedule.reshape(-1).long()
    ok = valid & (s >= 0) & (s < nb)
    key = band_expert.reshape(-1).long()[s.clamp(0, max(cap - 1, 0))]
    same = torch.zeros(cap, dtype=torch.bool, device=dev)
    same[1:] = ok[1:] & ok[:-1] & (key[1:] == key[:-1])
    start = valid & ~same
    rs = torch.cummax(torch.where(start, p, torch.zeros_like(p)), 0).values  # run start
    last = valid & ~torch.cat([same[1:], same.new_zeros(1)])  # the last position of its run
    re = torch.where(last, p + 1, torch.full_like(p, cap)).flip(0).cummin(0).values.flip(0)
    L = re - rs
    # runs longer than G: k pieces of floor / ceil(L / k) positions
    k = (L + G - 1) // G
    i = (p - rs) * k // L.clamp(min=1)
    piece_first = rs + (i * L + k - 1) // k.clamp(min=1)
    piece_end = rs + ((i + 1) * L + k - 1) // k.clamp(min=1)
    # runs of <= G positions: the runs inside the window [ws, ws + G) of their start
    ws = rs // G * G
    wend = ws + G
    wsc = ws.clamp(max=max(cap - 1, 0))
    left = torch.where(rs[wsc] < ws, re[wsc], ws)
    wl = (torch.minimum(wend, nb) - 1).clamp(0, max(cap - 1, 0))
    right = torch.where(re[wl] > wend, rs[wl], torch.minimum(wend, nb))
    inside = re <= wend
    first = torch.where(L > G, piece_first, torch.where(inside, left, rs))
    end = torch.where(L > G, piece_end, torch.where(inside, right, re))
    neg = torch.full_like(p, -1)
    return (torch.where(valid, first, neg).to(torch.int32),
            torch.where(valid, end - first, neg).to(torch.int32))


def build_band_groups_kernel():
    """The launcher of the table kernel: ``launch(schedule, band_expert, num_bands, out, cap, G,
    stream)`` (addresses as Int64; out: int32 [WORKSPACE_TABLES * cap]: group_first, group_size,
    then each position's run start and, at a run's start, its end). One CTA; positions in rounds
    of NT."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from ..kernels import primitives as P
    from .plan_kernel import simt_helpers

    H = simt_helpers()
    smin, smax, sel_lt, sel_eq = H.smin, H.smax, H.sel_lt, H.sel_eq
    lds, sts_if_eq, shfl_idx = H.lds, H.sts_if_eq, H.shfl_idx

    def ld(base, i):
        return P.ld_s32(base + Int64(i) * Int64(4))

    def st(base, i, v):
        P.st_s32(base + Int64(i) * Int64(4), v)

    def warp_incl_max(v):  # lane i: max over lanes 0..i
        return H.warp_incl_scan(v, "max.s32")

    @cute.kernel
    def groups_kernel(sched: Int64, bexp: Int64, nbp: Int64, out: Int64, cap: Int32, G: Int32):
        tid, _, _ = P.thread_block_grid()
        lane = tid & Int32(31)
        warp = tid >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        scr = alloc.allocate_array(Int32, 32, byte_alignment=16).toint()
        nb = P.ld_s32(nbp)
        nb = sel_lt(nb, Int32(0), Int32(0), nb)
        nb = sel_lt(cap, nb, Int32(0), nb)  # outside [0, cap]: no band
        c64 = Int64(cap) * Int64(4)
        o_size = out + c64
        o_rs = out + Int64(2) * c64
        o_end = out + Int64(3) * c64

        # ---- 1: run start of each position (inclusive max-scan of the starts, carried over
        # the rounds)
        carry = Int32(-1)
        c0 = Int32(0)
        while c0 < nb:
            p1 = c0 + tid
            v = Int32(-1)
            if p1 < nb:
                b1 = ld(sched, p1)
                ok = Int32(0)
                if b1 >= Int32(0):
                    if b1 < nb:
                        ok = Int32(1)
                k1 = ld(bexp, sel_eq(ok, 1, b1, Int32(0)))
                v = p1
                if p1 > Int32(0):
                    bp = ld(sched, p1 - Int32(1))
                    okp = Int32(0)
                    if bp >= Int32(0):
                        if bp < nb:
                            okp = Int32(1)
                    kp = ld(bexp, sel_eq(okp, 1, bp, Int32(0)))
                    if ok == Int32(1):
                        if okp == Int32(1):
                            if k1 == kp:
                                v = Int32(-1)  # same run as p1 - 1
            x = warp_incl_max(v)
            sts_if_eq(lane, 31, scr, warp, x)
            P.block_sync()
            wt = warp_incl_max(lds(scr, lane))  # lane i: max over warps 0..i
            before = sel_eq(warp, 0, Int32(-1), shfl_idx(wt, smax(warp - Int32(1), Int32(0))))
            if p1 < nb:
                st(o_rs, p1, smax(smax(x, before), carry))
            carry = smax(carry, shfl_idx(wt, Int32(31)))
            P.block_sync()  # scr is reused by the next round
            c0 = c0 + Int32(NT)
        P.block_sync()

        # ---- 2: each run's end, written at its start
        p2 = tid
        while p2 < nb:
            is_last = Int32(0)
            if p2 + Int32(1) == nb:
                is_last = Int32(1)
            else:
                if ld(o_rs, p2 + Int32(1)) == p2 + Int32(1):
                    is_last = Int32(1)
            if is_last == Int32(1):
                st(o_end, ld(o_rs, p2), p2 + Int32(1))
            p2 = p2 + Int32(NT)
        P.block_sync()

        # ---- 3: the group of each position (the module doc's rule), -1 past num_bands
        p3 = tid
        while p3 < cap:
            f = Int32(-1)
            sz = Int32(-1)
            if p3 < nb:
                rs = ld(o_rs, p3)
                re = ld(o_end, rs)
                L = re - rs
                if L > G:
                    kk = Int64((L + G - Int32(1)) // G)
                    L64 = Int64(L)
                    i = (Int64(p3 - rs) * kk) // L64
                    f64 = (i * L64 + kk - Int64(1)) // kk
                    e64 = ((i + Int64(1)) * L64 + kk - Int64(1)) // kk
                    f = rs + Int32(f64)
                    sz = Int32(e64 - f64)
                else:
                    ws = (rs // G) * G
                    wend = ws + G
                    f = rs
                    e = re
                    if re <= wend:
                        f = ws
                        rsw = ld(o_rs, ws)
                        if rsw < ws:
                            f = ld(o_end, rsw)
                        e = smin(wend, nb)
                        rsl = ld(o_rs, e - Int32(1))
                        if ld(o_end, rsl) > wend:
                            e = rsl
                    sz = e - f
            st(out, p3, f)
            st(o_size, p3, sz)
            p3 = p3 + Int32(NT)

    @cute.jit
    def launch(sched: Int64, bexp: Int64, nbp: Int64, out: Int64, cap: Int32, G: Int32,
               stream: cuda.CUstream):
        groups_kernel(sched, bexp, nbp, out, cap, G).launch(grid=[1, 1, 1], block=[NT, 1, 1],
                                                            stream=stream)

    return launch


def band_groups_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0)] * 4 + [Int32(1), Int32(8), cuda.CUstream(0)]


def check_group(group) -> int:
    """G of group_by="expert": an int in [1, MAX_GROUP] (ValueError otherwise)."""
    if isinstance(group, bool) or not isinstance(group, int) or not 1 <= group <= MAX_GROUP:
        raise ValueError(f"band_group must be an int in [1, {MAX_GROUP}] with group_by='expert',"
                         f" got {group!r}")
    return group


class BandGroupsKernel:
    """The compiled table kernel (one variant: G and the capacity are runtime values)."""

    _compiled = None

    @classmethod
    def compiled(cls):
        if cls._compiled is None:
            import cutlass.cute as cute
            cls._compiled = cute.compile(build_band_groups_kernel(), *band_groups_example_args())
        return cls._compiled

    def __call__(self, schedule, band_expert, num_bands, group, out, stream=None):
        """Fills out (int32 [>= WORKSPACE_TABLES * capacity], CUDA, contiguous) on ``stream``
        (default: the current one); returns the (group_first, group_size) views. The caller has
        checked the tensors (``band_groups``)."""
        import cuda.bindings.driver as cuda
        cap = schedule.numel()
        if stream is None:
            stream = torch.cuda.current_stream(schedule.device)
        self.compiled()(schedule.data_ptr(), band_expert.data_ptr(), num_bands.data_ptr(),
                        out.data_ptr(), cap, int(group), cuda.CUstream(stream.cuda_stream))
        return out[:cap], out[cap:2 * cap]


_KERNEL = BandGroupsKernel()


def band_groups(schedule, band_expert, num_bands, group, out=None, impl="auto", stream=None):
    """(group_first, group_size) int32 [capacity] for a plan's schedule / band_expert (int32
    [capacity], one device) and num_bands (int32 [1]), G = group: the tables of
    ``GroupedGemm(group_by="expert")``, no host sync. impl: "kernel" (one CuTe DSL launch on
    ``stream``, CUDA; out: an int32 [WORKSPACE_TABLES * capacity] workspace, allocated if None),
    "torch" (``band_groups_torch``; out unused) or "auto" (the kernel for CUDA tensors)."""
    group = check_group(group)
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; choose from {IMPLS}")
    cap = schedule.numel()
    for name, t in (("schedule", schedule), ("band_expert", band_expert),
                    ("num_bands", num_bands)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or not t.is_contiguous() \
                or t.device != schedule.device:
            raise ValueError(f"{name} must be a contiguous int32 tensor on {schedule.device}")
    if schedule.dim() != 1 or band_expert.dim() != 1 or band_expert.numel() != cap \
            or num_bands.numel() != 1:
        raise ValueError(f"schedule and band_expert must be 1-D of one length and num_bands [1]; "
                         f"got {tuple(schedule.shape)}, {tuple(band_expert.shape)}, "
                         f"{tuple(num_bands.shape)}")
    if impl == "auto":
        impl = "kernel" if schedule.is_cuda else "torch"
    if impl == "torch":
        return band_groups_torch(schedule, band_expert, num_bands, group)
    if not schedule.is_cuda:
        raise ValueError("impl='kernel' needs CUDA tensors")
    if WORKSPACE_TABLES * cap >= 2 ** 31:
        raise ValueError(f"capacity {cap} too large for the table kernel's int32 positions")
    if out is None:
        out = torch.empty(WORKSPACE_TABLES * cap, dtype=torch.int32, device=schedule.device)
    elif (out.dtype != torch.int32 or not out.is_contiguous() or out.device != schedule.device
          or out.numel() < WORKSPACE_TABLES * cap):
        raise ValueError(f"out must be a contiguous int32 tensor of >= {WORKSPACE_TABLES * cap} "
                         f"elements on {schedule.device}")
    return _KERNEL(schedule, band_expert, num_bands, group, out, stream)
