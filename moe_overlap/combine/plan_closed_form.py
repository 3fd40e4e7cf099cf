"""The planner kernel's algorithm in plain Python: every plan field from closed forms and prefix
sums, no sort (see moe_overlap/combine/plan_kernel.py, which computes the same thing phase by
phase on one CTA). It exists so the closed forms can be checked against the torch planner
(`plan_combine`) on any machine, field by field, and so a GPU mismatch can be replayed on the
host: `closed_form_plan(...)` returns the plan tensors by name, each equal to the torch planner's.

Phases (the kernel's, in order):
 1. per source s: total rows it receives back, and the receive row of its first assignment to
    each local expert (prefix sums of counts[s]).
 2. per group (e, j) (j: group order, remote sources ascending, local last): aligned and packed
    starts (scans inside the expert); per expert: aligned / packed rows; the layout (auto: packed
    iff it lays out fewer rows); expert rows, starts; remote bands nrb_e = ceil(local start /
    tile_m) (both layouts: rows before the local group's start are remote rows, aligned padding
    of remote groups included).
 3. experts ranked by (-nrb_e, e); scans in rank order: remote-band base, local-band base, and the
    base of the local cells that sit in a remote band (packed: the band holding the end of the
    remote rows and the start of the local group). order="expert": no ranking (the rank order
    is the expert order, the schedule the band order); an expert's first band sits at its band
    base, its first local cell after the local cells of the experts before it.
 4. per band b (expert e by binary search over band bases, k its index inside e): band fields
    from the group that holds row k * tile_m (its first cell), schedule position, and the local
    cell of the band if it holds local rows.
 5. per remote cell q (schedule order = experts in rank order, then group, then band): its group
    by binary search over the groups' first remote-cell index; segment starts by the torch
    planner's rule (the first remote cell alone, then cuts every mgb cells counted from the
    second cell in the first run and from the run start in the others, and the last remote cell
    alone); a start writes its segment from its first and last cell.
"""
from __future__ import annotations

import torch

# the plan buffer's field order (plan_kernel.py lays the buffer out in it)
BAND_FIELDS = ("band_expert", "band_row", "band_src_row", "band_dest", "band_valid",
               "band_dest_row", "schedule", "local_cell_band", "local_cell_src_row",
               "local_cell_dest_row", "local_cell_rows")  # length band_capacity
SEGMENT_FIELDS = ("segment_start", "segment_bands", "segment_dest", "segment_src_row",
                  "segment_dest_row", "segment_rows")  # length segment_capacity

# The counts fingerprint (CombinePlan.counts_fingerprint, the call's identity in the epoch tags):
# fp = sum over the flat index i = s * E + e of fmix32(counts[s, e] ^ (i * FP_KEY)) mod 2^32,
# each entry as a 32-bit word (the low word of an int64). fmix32 (MurmurHash3's finalizer:
# xor-shifts and odd multipliers, each step invertible) is a bijection of 32-bit words, and so is
# v -> v ^ k, so for each index the term is a bijection of the entry: two count matrices that
# differ in exactly one entry always have different fingerprints. Several entries changed: no
# guarantee (a collision needs the changed terms to cancel mod 2^32). A sum is order-free, so
# the kernel adds the terms in any order (plan_kernel.py); plan.py has the torch version.
FP_KEY, FP_MUL1, FP_MUL2 = 0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35


def _cdiv(a, b):
    return -(-a // b)


def _as_int32(u: int) -> int:
    """The int32 of an unsigned 32-bit value's bits."""
    return u - (1 << 32) if u & 0x80000000 else u


def fmix32(x: int) -> int:
    """MurmurHash3's 32-bit finalizer (a bijection of 32-bit words)."""
    x ^= x >> 16
    x = x * FP_MUL1 & 0xFFFFFFFF
    x ^= x >> 13
    x = x * FP_MUL2 & 0xFFFFFFFF
    return x ^ (x >> 16)


def counts_fingerprint(counts) -> int:
    """The counts fingerprint (FP_KEY above) as an unsigned 32-bit int, in plain Python."""
    flat = [int(v) & 0xFFFFFFFF for row in torch.as_tensor(counts).tolist() for v in row]
    return sum(fmix32(v ^ (i * FP_KEY & 0xFFFFFFFF)) for i, v in enumerate(flat)) & 0xFFFFFFFF


def group_source(j: int, rank: int, W: int) -> int:
    """Source rank of group j (remote ranks ascending, the local rank last)."""
    if j == W - 1:
        return rank
    return j if j < rank else j + 1


def _layout_fields(cnt, rank, st, erows, erstart, sum_c, packed):
    """The plan's layout fields (no band, cell or segment) from phases 1 and 2."""
    W, E = len(cnt), len(cnt[0])
    El = E // W
    grs = [[0] * W for _ in range(El)]
    for e in range(El):
        for j in range(W):
            grs[e][group_source(j, rank, W)] = st[e * W + j]
    return dict(packed=[packed], group_row_start=grs, expert_rows=erows,
                expert_row_start=erstart, recv_rows_per_rank=[sum(r) for r in cnt],
                routed_counts=cnt[rank], total_rows=[sum(erows)], valid_rows=[sum(sum_c)],
                counts_fingerprint=[_as_int32(counts_fingerprint(cnt))])


def _overflow_plan(cnt, rank, st, erows, erstart, sum_c, packed, B, S, num_bands):
    """The plan of counts its capacities cannot hold: the layout fields, num_bands (outside
    [0, B]), no band, cell or segment (counts 0, every capacity field -1)."""
    out = _layout_fields(cnt, rank, st, erows, erstart, sum_c, packed)
    out.update({k: [-1] * B for k in BAND_FIELDS})
    out.update({k: [-1] * S for k in SEGMENT_FIELDS})
    out.update(num_bands=[num_bands], num_remote_bands=[0], num_segments=[0],
               num_local_cells=[0])
    return {k: torch.tensor(v, dtype=torch.int32) for k, v in out.items()}


def closed_form_plan(counts, rank: int, tile_m: int, mgb: int, band_capacity: int,
                     layout: str, order: str = "remote_first") -> dict[str, torch.Tensor]:
    """Plan tensors (int32, by CombinePlan field name) from the closed forms; `order` is
    plan_combine's ("remote_first" or "expert")."""
    if order not in ("remote_first", "expert"):
        raise ValueError(f"order={order!r}; choose from ('remote_first', 'expert')")
    by_expert = order == "expert"
    cnt = [[int(v) for v in row] for row in torch.as_tensor(counts).tolist()]
    W, E = len(cnt), len(cnt[0])
    El, t = E // W, tile_m
    B = band_capacity
    S = B + E
    # ---- phase 1: per source (its row total: _layout_fields)
    before = [sum(cnt[s][:rank * El]) for s in range(W)]
    # ---- phase 2: per group (index e * W + j)
    c = [cnt[group_source(j, rank, W)][rank * El + e] for e in range(El) for j in range(W)]
    dr = []  # receive row (at the source) of the group's first row
    for e in range(El):
        for j in range(W):
            s = group_source(j, rank, W)
            dr.append(before[s] + sum(cnt[s][rank * El:rank * El + e]))
    a = [_cdiv(x, t) * t for x in c]
    st_al, st_pk, rows_al, sum_c = [], [], [], []
    for e in range(El):
        g = slice(e * W, (e + 1) * W)
        ga, gc = a[g], c[g]
        st_al += [sum(ga[:j]) for j in range(W)]
        st_pk += [sum(gc[:j]) for j in range(W)]
        rows_al.append(sum(ga))
        sum_c.append(sum(gc))
    rows_pk = [_cdiv(x, t) * t for x in sum_c]
    if layout == "auto":
        packed = int(sum(rows_pk) < sum(rows_al))
    else:
        packed = int(layout == "packed")
    st = st_pk if packed else st_al
    erows = rows_pk if packed else rows_al
    erstart = [sum(erows[:e]) for e in range(El)]
    ebands = [x // t for x in erows]
    bbase = [x // t for x in erstart]
    nb = sum(ebands)
    # overflow (validate=False counts the capacities cannot hold): no band, cell or segment,
    # num_bands the bands needed (> B) or -1 (negative counts); the kernel's int32 sums add
    # "the rows' total is negative" (past int32), which Python ints never are
    if any(x < 0 or x // t > B for x in c) or nb > B:
        return _overflow_plan(cnt, rank, st, erows, erstart, sum_c, packed, B, S,
                              nb if nb > B else -1)
    ls = [st[e * W + W - 1] for e in range(El)]  # local group's start
    lc = [c[e * W + W - 1] for e in range(El)]
    nrb = [_cdiv(x, t) for x in ls]
    # local cell in a remote band: the local group starts inside a band (packed only)
    f = [int(lc[e] > 0 and ls[e] % t != 0) for e in range(El)]
    ncell = [((st[g] + c[g] - 1) // t - st[g] // t + 1) if c[g] > 0 else 0 for g in range(E)]
    # ---- phase 3: ranks and rank-order scans
    rbase, lbase, fbase = [0] * El, [0] * El, [0] * El
    if by_expert:
        # schedule = band order: expert e's first band at its band base; its local cells
        # (f_e in its last remote band, then one per local band) after the earlier experts'
        srt = list(range(El))
        acc = 0
        for e in srt:
            rbase[e], fbase[e] = bbase[e], acc
            acc += f[e] + ebands[e] - nrb[e]
        num_remote, num_local = sum(nrb), acc
    else:
        srt = sorted(range(El), key=lambda e: (-nrb[e], e))  # expert at each rank
        acc_r = acc_l = acc_f = 0
        for e in srt:
            rbase[e], lbase[e], fbase[e] = acc_r, acc_l, acc_f
            acc_r += nrb[e]
            acc_l += ebands[e] - nrb[e]
            acc_f += f[e]
        num_remote, num_fcells = acc_r, acc_f
        num_local = acc_f + acc_l
    # ---- phase 4: per band
    m1 = lambda n: [-1] * n  # noqa: E731
    out = {k: m1(B) for k in BAND_FIELDS}
    for b in range(nb):
        e = max(i for i in range(El) if bbase[i] <= b and ebands[i] > 0)  # binary search
        k = b - bbase[e]
        kt = k * t
        # the group holding row kt: the last j with st <= kt (binary search)
        j = max(j for j in range(W) if st[e * W + j] <= kt)
        g = e * W + j
        out["band_expert"][b] = e
        out["band_row"][b] = kt
        out["band_src_row"][b] = erstart[e] + kt
        out["band_dest"][b] = group_source(j, rank, W)
        out["band_dest_row"][b] = dr[g] + kt - st[g]
        out["band_valid"][b] = min(t, (sum_c[e] if packed else st[g] + c[g]) - kt)
        if by_expert:
            pos = b
        else:
            pos = rbase[e] + k if k < nrb[e] else num_remote + lbase[e] + k - nrb[e]
        out["schedule"][pos] = b
        gl = e * W + W - 1
        lo, hi = max(ls[e], kt), min(ls[e] + lc[e], kt + t)
        if hi > lo:  # the band holds local rows: one local cell
            if by_expert:  # the local group's bands from the one holding its first row
                q = fbase[e] + k - ls[e] // t
            else:
                q = fbase[e] if k < nrb[e] else num_fcells + lbase[e] + k - nrb[e]
            out["local_cell_band"][q] = b
            out["local_cell_src_row"][q] = erstart[e] + lo
            out["local_cell_dest_row"][q] = dr[gl] + lo - ls[e]
            out["local_cell_rows"][q] = hi - lo
    # ---- phase 5: remote cells in schedule order, groups in rank order (index r * W + j)
    ro_g = [srt[r] * W + j for r in range(El) for j in range(W)]
    ro_L = [ncell[g] if g % W != W - 1 else 0 for g in ro_g]
    ro_a = [sum(ro_L[:i]) for i in range(E)]  # first remote-cell index of the group
    R = sum(ro_L)

    def nstarts(i):  # segment starts of rank-order group i (before the last-cell rule)
        L, a0 = ro_L[i], ro_a[i]
        if L == 0:
            return 0
        if a0 == 0:
            n = 1 + _cdiv(L - 1, mgb)
            extra = a0 + L == R and not (L - 1 == 0 or (L - 2) % mgb == 0)
        else:
            n = _cdiv(L, mgb)
            extra = a0 + L == R and (L - 1) % mgb != 0
        return n + int(extra)

    ns_g = [nstarts(i) for i in range(E)]
    sbase = [sum(ns_g[:i]) for i in range(E)]
    NS = sum(ns_g)
    for k_ in SEGMENT_FIELDS:
        out[k_] = m1(S)
    for q in range(R):
        i = max(i for i in range(E) if ro_a[i] <= q and ro_L[i] > 0)  # binary search
        u = q - ro_a[i]
        first_run = ro_a[i] == 0
        kk = u - 1 if first_run else u
        if not (q == 0 or q == R - 1 or (kk >= 0 and kk % mgb == 0)):
            continue
        L = ro_L[i]
        # end (exclusive, inside the run) of the segment starting at u
        if first_run:
            nxt = 1 if u == 0 else 1 + ((u - 1) // mgb + 1) * mgb
            idx = 0 if u == 0 else 1 + _cdiv(u - 1, mgb)
        else:
            nxt = (u // mgb + 1) * mgb
            idx = _cdiv(u, mgb)
        end = min(nxt, L)
        if R - 1 - ro_a[i] > u:
            end = min(end, R - 1 - ro_a[i])
        g = ro_g[i]
        e, j = divmod(g, W)
        k0 = st[g] // t
        kf, kl = k0 + u, k0 + end - 1
        lo_f = max(st[g], kf * t)
        hi_l = min(st[g] + c[g], (kl + 1) * t)
        sidx = sbase[i] + idx
        out["segment_start"][sidx] = rbase[e] + kf
        out["segment_bands"][sidx] = kl - kf + 1
        out["segment_dest"][sidx] = group_source(j, rank, W)
        out["segment_src_row"][sidx] = erstart[e] + lo_f
        out["segment_dest_row"][sidx] = dr[g] + lo_f - st[g]
        out["segment_rows"][sidx] = hi_l - lo_f
    out.update(_layout_fields(cnt, rank, st, erows, erstart, sum_c, packed))
    out.update(num_bands=[nb], num_remote_bands=[num_remote], num_segments=[NS],
               num_local_cells=[num_local])
    return {k: torch.tensor(v, dtype=torch.int32) for k, v in out.items()}
