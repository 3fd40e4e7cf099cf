"""Modelled DRAM read bytes of one chained FFN call per tile order (CPU only, no GPU).

    PYTHONPATH=$PWD python bench/predict_chained_dram.py [--shapes all] [--tokens 8192]
        [--groups auto,4p1,8p4,8p1r16l8s]      # bench_chained_compute's --groups grammar
    PYTHONPATH=$PWD python bench/predict_chained_dram.py --calibrate   # against the ncu files
    PYTHONPATH=$PWD python bench/predict_chained_dram.py --search --shapes all

The model: ``chained_schedule.timeline`` replays the tile list on ``grid`` CTAs as ``simulate``
does (a global counter, tile durations by depth x width), so every tile has a CTA and a [begin,
end). A tile's k slabs are read one after another over that span, two operands each: GEMM1 reads
x[blk rows, k slab] (16 KiB) and the W1 slab of its column tile (32 KiB), GEMM2 the H ring slot's
k slab (16 KiB) and the W2 slab (32 KiB). At its end a GEMM1 tile writes its 64 KiB of H into the
slot, a GEMM2 tile its 64 KiB of out; writes allocate in L2 (whole lines: no DRAM read) and take
capacity like reads. All CTAs' accesses merged by time run through an LRU cache; the modelled
DRAM reads are the bytes of the read misses.

Three physical choices, the last one fitted:
- Units: every operand slab is whole 128-byte lines (x / H: 128 rows of one line, W1 / W2: 64
  rows of 4) read at once by one TMA load, so a slab hits or misses as a unit; a line or sector
  size is no free parameter here.
- Capacity: the H200's 50 MiB in its two partitions: each half of the CTAs (c % 2) fills its
  own LRU of 25 MiB, and a miss there that the other partition holds is copied across, not read
  from DRAM (the Hopper L2 keeps a line in the partition of the SMs that read it, so data both
  halves read is held twice). One LRU of C (``--partitions 1``) fits as well at C ~ 36-40 MiB.
- Spread (``JITTER``): each tile's duration is simulate's times a lognormal factor of this
  relative spread (seeded; the mean of ``SEEDS``). With every tile exactly as long as simulate
  says, the CTAs start tiles on one time grid in large cohorts that read each shared slab at the
  same instant, so sharing looks perfect or absent and the capacity hardly matters; a GPU's
  tiles differ by a few percent, which decides whether a later reader finds a slab still there.

``--calibrate`` fits these to the ncu DRAM reads in bench/results (llama3-70b at 8192 tokens: the
group file's orders 1, 2, 4, 8, 16 and the auto choice of then, 8; the patch file's 8, 8p2, 8p4,
16p2, 16p4, 4p4) and reports the error with either file held out. ``--search`` lists the
orders whose ring fits ``ring_cap_blocks`` by modelled DRAM bytes.
"""
import argparse
import csv
import math
import os
import sys
from collections import OrderedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_chained_compute import make_comp  # noqa: E402
from moe_overlap.ffn.chained_schedule import GEMM1, TILE_K, simulate, timeline  # noqa: E402
from moe_overlap.ffn.shapes import FFN_SHAPES  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
GRID = 132  # the kernel's grid on an H200 (all SMs)
SEEDS = (0, 1)  # the jittered replays averaged per order
# calibrated (``--calibrate``): the nominal capacity in two partitions, and the tiles' spread
CAPACITY, PARTITIONS, JITTER = 50 * 2**20, 2, 0.035

# the measured points: (file, its chained kernel rows in order, as today's --groups entries:
# the group file predates the patch, so its rows ran patch 1; its first row is the auto choice
# of then, group 8, measured again in its fifth row)
NCU_POINTS = (("ncu_chained_70b_groups_8192_ef6ac23.csv", ("8p1", "1", "2p1", "4p1", "8p1",
                                                           "16p1")),
              ("ncu_chained_70b_patch_8192_7df8f19.csv", ("8p1", "8p2", "8p4", "16p2", "16p4",
                                                          "4p4")))
NCU_KERNEL = "kernel_cutlass_kernel_moe_overlapffncomp"


def schedule_of(spec, M, P, hidden, N, grid=GRID):
    """The tile list a bench_chained_compute --groups entry runs (its make_comp, so the same
    grammar and defaults: "auto", G, pC, rR, lL, sK / s)."""
    if not isinstance(spec, str):
        return spec
    return make_comp(int(spec) if spec.isdigit() else spec).schedule(M, P, hidden, N, grid)


def access_stream(s, jitter=0.0, seed=0):
    """The merged stream of one call: (ids int64, bytes int64, is_read bool, cta int64), in time
    order. jitter: the relative spread (standard deviation) of the tiles' durations around
    ``simulate``'s (seeded, so repeatable).

    Address blocks: x (blk, k), W1 (k, col), H (slot, k), W2 (k, col), out (blk, col, quarter);
    H is addressed by ring slot, so block b + ring overwrites block b's lines."""
    scale = None
    if jitter:
        n = s.blocks * (s.h_tiles + s.n_tiles)
        scale = np.exp(np.random.default_rng(seed).normal(0.0, jitter, n)).tolist()
    tl = np.array(timeline(s, scale=scale), dtype=np.float64).reshape(-1, 6)
    kind, blk, col, cta = (tl[:, i].astype(np.int64) for i in range(4))
    begin, end = tl[:, 4], tl[:, 5]
    tm, th, tn = s.tile_m, s.tile_h, s.tile_n
    k1, k2 = s.inputs // TILE_K, s.hidden // TILE_K
    n1, n2, nb = s.h_tiles, s.n_tiles, s.blocks
    slots = min(s.ring, nb)
    x_sz, w1_sz = tm * TILE_K * 2, TILE_K * th * 2
    h_sz, w2_sz = tm * TILE_K * 2, TILE_K * tn * 2
    # id bases of the five regions
    x0 = 0
    w10 = x0 + nb * k1
    h0 = w10 + k1 * n1
    w20 = h0 + slots * k2
    o0 = w20 + k2 * n2
    is1 = kind == GEMM1
    K = np.where(is1, k1, k2)
    t_idx = np.repeat(np.arange(len(kind)), K)  # tile of each slab
    k = np.arange(t_idx.size) - np.repeat(np.cumsum(K) - K, K)  # slab index within its tile
    g1 = is1[t_idx]
    b, c = blk[t_idx], col[t_idx]
    a_id = np.where(g1, x0 + b * k1 + k, h0 + (b % slots) * k2 + k)
    b_id = np.where(g1, w10 + k * n1 + c, w20 + k * n2 + c)
    a_sz = np.where(g1, x_sz, h_sz)
    b_sz = np.where(g1, w1_sz, w2_sz)
    slab_time = begin[t_idx] + (end - begin)[t_idx] * (k / K[t_idx])
    slab_cta = cta[t_idx]
    # writes at the tile's end: GEMM1 -> its 4 H slabs of the slot, GEMM2 -> 4 quarters of out
    q = th // TILE_K
    w_t = np.repeat(np.arange(len(kind)), q)
    wq = np.tile(np.arange(q), len(kind))
    w1k = is1[w_t]
    w_id = np.where(w1k, h0 + (blk[w_t] % slots) * k2 + col[w_t] * q + wq,
                    o0 + (blk[w_t] * n2 + col[w_t]) * q + wq)
    w_sz = np.where(w1k, h_sz, tm * tn * 2 // q)
    w_time = end[w_t]
    # one stream: per slab A then B; sorted by time, then CTA, then A / B / write
    ids = np.concatenate([a_id, b_id, w_id])
    sz = np.concatenate([a_sz, b_sz, w_sz])
    rd = np.concatenate([np.ones(2 * a_id.size, bool), np.zeros(w_id.size, bool)])
    time = np.concatenate([slab_time, slab_time, w_time])
    ctas = np.concatenate([slab_cta, slab_cta, cta[w_t]])
    sub = np.concatenate([np.zeros(a_id.size, np.int8), np.ones(a_id.size, np.int8),
                          np.full(w_id.size, 2, np.int8)])
    order = np.lexsort((sub, ctas, time))
    return ids[order], sz[order], rd[order], ctas[order]


def lru_read_misses(ids, sizes, reads, ctas, capacity, partitions=1):
    """Bytes of the read accesses that miss an LRU of `capacity` bytes (partitions 2: CTA c
    fills partition c % 2, C / 2 each; a line held by the other partition is copied, not read
    from DRAM)."""
    ids, sizes, reads = ids.tolist(), sizes.tolist(), reads.tolist()
    if partitions == 1:
        od, cur, miss = OrderedDict(), 0, 0
        move, pop = od.move_to_end, od.popitem
        for i, z, r in zip(ids, sizes, reads):
            if i in od:
                move(i)
                continue
            if r:
                miss += z
            od[i] = z
            cur += z
            while cur > capacity:
                cur -= pop(False)[1]
        return miss
    if partitions != 2:
        raise ValueError(f"partitions must be 1 or 2, got {partitions!r}")
    cap = capacity / 2
    parts = (OrderedDict(), OrderedDict())
    cur, miss = [0, 0], 0
    for i, z, r, c in zip(ids, sizes, reads, (ctas % 2).tolist()):
        od = parts[c]
        if i in od:
            od.move_to_end(i)
            continue
        if r and i not in parts[1 - c]:
            miss += z
        od[i] = z
        cur[c] += z
        while cur[c] > cap:
            cur[c] -= od.popitem(False)[1]
    return miss


def modelled_dram_bytes(s, capacity, partitions=1, stream=None):
    """Modelled DRAM read bytes of one call of schedule s (``access_stream`` then
    ``lru_read_misses``)."""
    st = access_stream(s) if stream is None else stream
    return lru_read_misses(*st, capacity, partitions)


def measured_points(results=RESULTS):
    """[(spec, measured DRAM read bytes, file)] of the llama3-70b 8192-token ncu files."""
    pts = []
    for fname, specs in NCU_POINTS:
        rows = list(csv.reader(open(os.path.join(results, fname))))
        head = next(i for i, r in enumerate(rows) if r and r[0] == "ID")
        names = rows[head]
        kn, dr = names.index("Kernel Name"), names.index("dram__bytes_read.sum")
        vals = [float(r[dr].replace(",", "")) for r in rows[head + 2:]
                if r and r[kn].startswith(NCU_KERNEL)]
        if len(vals) != len(specs):
            raise ValueError(f"{fname}: {len(vals)} chained kernel rows, expected {len(specs)}")
        pts.extend((sp, v, fname) for sp, v in zip(specs, vals))
    return pts


def point_streams(points, jitter, seeds, shape=("llama3-70b", 8192), world=2):
    """{(spec, seed): access_stream} of the measured points' orders (one build per order)."""
    P, O = FFN_SHAPES[shape[0]]
    out = {}
    for sp, _, _ in points:
        s = schedule_of(sp, shape[1], P, O // world, P)
        for seed in seeds:
            if (sp, seed) not in out:
                out[(sp, seed)] = access_stream(s, jitter, seed)
    return out


def errors(points, streams, capacity, partitions, seeds):
    """[(spec, modelled bytes (mean over seeds), measured bytes, relative error)]."""
    rows = []
    for sp, meas, _ in points:
        m = float(np.mean([lru_read_misses(*streams[(sp, sd)], capacity, partitions)
                           for sd in seeds]))
        rows.append((sp, m, meas, m / meas - 1.0))
    return rows


def rms(rows):
    return math.sqrt(sum(r[3] ** 2 for r in rows) / len(rows))


def calibrate(points, jitters, capacities, partitions=(1, 2), seeds=SEEDS, log=None):
    """Every (partitions, capacity, jitter) of the grid on `points`: [(rms relative error,
    partitions, capacity, jitter, rows)], best first."""
    fits = []
    for j in jitters:
        streams = point_streams(points, j, seeds)
        for parts in partitions:
            for cap in capacities:
                rows = errors(points, streams, cap, parts, seeds)
                fits.append((rms(rows), parts, cap, j, rows))
                if log:
                    log(f"jitter {j:.3f} partitions {parts} C {cap / 2**20:5.1f} MiB: rms "
                        f"{fits[-1][0]:.3f} max {max(abs(r[3]) for r in rows):.3f}")
    return sorted(fits, key=lambda f: f[0])


def show_fit(rows, title):
    print(title)
    for sp, m, meas, e in rows:
        print(f"  {sp:8s} modelled {m / 1e9:6.2f} GB  measured {meas / 1e9:6.2f} GB  {e:+6.1%}")
    print(f"  rms {rms(rows):.1%}, max |error| {max(abs(r[3]) for r in rows):.1%}")


def run_calibration(a):
    pts = measured_points()
    groups_file, patch_file = NCU_POINTS[0][0], NCU_POINTS[1][0]
    caps = [c * 2**20 for c in a.capacities]
    fits = calibrate(pts, a.jitters, caps, a.partitions_grid, log=print)
    best = fits[0]
    show_fit(best[4], f"all {len(pts)} rows: best partitions {best[1]}, C {best[2] / 2**20:.0f} "
                      f"MiB, jitter {best[3]:.3f}")
    for fit_on, held in ((groups_file, patch_file), (patch_file, groups_file)):
        # the fit on one file's rows, the error on the other's (same grid, same streams)
        idx = [i for i, p in enumerate(pts) if p[2] == fit_on]
        hidx = [i for i, p in enumerate(pts) if p[2] == held]
        sub = min(fits, key=lambda f: math.sqrt(sum(f[4][i][3] ** 2 for i in idx) / len(idx)))
        show_fit([sub[4][i] for i in hidx],
                 f"fitted on {fit_on} (partitions {sub[1]}, C {sub[2] / 2**20:.0f} MiB, jitter "
                 f"{sub[3]:.3f}), held out {held}:")


def run_predict(a):
    from moe_overlap.ffn.compute_chained import (activation_bytes, baseline_activation_bytes,
                                                 ring_cap_blocks)
    M = a.tokens
    for name in (list(FFN_SHAPES) if a.shapes == "all" else a.shapes.split(",")):
        P, O = FFN_SHAPES[name]
        hidden, N = O // a.world, P
        cap = ring_cap_blocks(M, hidden, N)
        specs = a.groups.split(",")
        print(f"{name} (M {M}, P {P}, hidden {hidden}, N {N}): ring cap {cap} blocks")
        for sp in specs:
            try:
                s = schedule_of(sp, M, P, hidden, N)
            except ValueError as e:
                print(f"  {sp:12s} invalid: {e}")
                continue
            gb = np.mean([modelled_dram_bytes(s, a.capacity, a.partitions,
                                              access_stream(s, a.jitter, sd))
                          for sd in SEEDS]) / 1e9
            held = min(s.ring, s.blocks)
            act = activation_bytes(M, hidden, N, held * s.tile_m) / \
                baseline_activation_bytes(M, hidden, N)
            split = getattr(getattr(s, "base", s), "split", None)
            print(f"  {sp:12s} DRAM {gb:6.2f} GB  sim {simulate(s).efficiency:.3f}  ring "
                  f"{held:3d}{' > cap' if held > cap else ''}  activation {act:.2f}x"
                  + ("" if split is None else f"  split {split}"), flush=True)


def candidates(M, P, hidden, N, cap):
    """Tile orders whose H ring holds at most `cap` row blocks: the interleaved super-block order
    (groups 2 and 4, patches 1 / 2 / 4, each valid lookahead and ring in whole super-blocks) and
    the phased one (groups 2-16, patches 1 / 2, one or two super-blocks of lookahead and one
    more of ring, the split simulate runs best)."""
    out = []
    for G in (2, 4):
        for ls in (1, 2, 3):
            for rs in range(ls + 1, cap // G + 1):
                for p in (1, 2, 4):
                    out.append(f"{G}p{p}r{rs * G}l{ls * G}")
    for G in range(2, 17):
        for ls, rs in ((1, 2), (1, 3), (2, 3)):
            if rs * G <= cap:
                for p in (1, 2):
                    out.append(f"{G}p{p}r{rs * G}l{ls * G}s")
    return out


def run_search(a):
    from moe_overlap.ffn.compute_chained import ring_cap_blocks
    M = a.tokens
    for name in (list(FFN_SHAPES) if a.shapes == "all" else a.shapes.split(",")):
        P, O = FFN_SHAPES[name]
        hidden, N = O // a.world, P
        cap = ring_cap_blocks(M, hidden, N)
        rows = []
        for sp in candidates(M, P, hidden, N, cap) + a.reference.split(","):
            try:
                s = schedule_of(sp, M, P, hidden, N)
            except ValueError:
                continue
            eff = simulate(s).efficiency
            ref = sp in a.reference.split(",")
            if eff < a.min_efficiency and not ref:
                continue
            gb = np.mean([modelled_dram_bytes(s, a.capacity, a.partitions,
                                              access_stream(s, a.jitter, sd))
                          for sd in SEEDS]) / 1e9
            split = getattr(getattr(s, "base", s), "split", None)
            rows.append((gb, sp, eff, min(s.ring, s.blocks), split, ref))
            print(f"  {name} {sp:14s} DRAM {gb:6.2f} GB sim {eff:.3f} ring {rows[-1][3]}"
                  + ("" if split is None else f" split {split}"), flush=True)
        print(f"{name}: ring cap {cap}; best {a.top} under the cap with sim >= "
              f"{a.min_efficiency}, then the references")
        best = sorted(r for r in rows if not r[5] and r[3] <= cap)[:a.top]
        for gb, sp, eff, ring, split, ref in best + [r for r in rows if r[5]]:
            print(f"  {sp:14s} {gb:6.2f} GB  sim {eff:.3f}  ring {ring:3d}"
                  + ("" if split is None else f"  split {split}")
                  + ("  (reference)" if ref else ""), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="llama3-70b", help="FFN_SHAPES names, or all")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--world", type=int, default=2, help="G: the hidden slice is O / G")
    ap.add_argument("--groups", default="auto,1,2p1,4p1,8p1,16p1,8p4,16p4",
                    help="tile orders: bench_chained_compute --groups entries (its grammar and "
                         "defaults: without p the patch is auto_patch of the group)")
    ap.add_argument("--capacity-mb", type=float, default=CAPACITY / 2**20)
    ap.add_argument("--partitions", type=int, default=PARTITIONS)
    ap.add_argument("--jitter", type=float, default=JITTER)
    ap.add_argument("--calibrate", action="store_true",
                    help="fit (partitions, capacity, jitter) on the grid below to the ncu files")
    ap.add_argument("--jitters", default="0.01,0.02,0.025,0.03,0.035,0.04,0.05")
    ap.add_argument("--capacities-mb", default="50")
    ap.add_argument("--partitions-grid", default="2")
    ap.add_argument("--search", action="store_true",
                    help="the orders of `candidates` under the ring cap (ring_cap_blocks), "
                         "best modelled DRAM first among those simulate runs at "
                         "--min-efficiency or better, then --reference")
    ap.add_argument("--min-efficiency", type=float, default=0.97)
    ap.add_argument("--reference", default="auto,8p4,16p4")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args(argv)
    a.capacity = a.capacity_mb * 2**20
    a.jitters = [float(v) for v in a.jitters.split(",")]
    a.capacities = [float(v) for v in a.capacities_mb.split(",")]
    a.partitions_grid = [int(v) for v in a.partitions_grid.split(",")]
    if a.calibrate:
        run_calibration(a)
    elif a.search:
        run_search(a)
    else:
        run_predict(a)


if __name__ == "__main__":
    main()
