"""Choosing `ccta` (SMs reserved for the consumer) and `mgb` (bands per transfer).

First an analytic choice from two measured rates: the grouped GEMM's throughput per SM and the
consumer's copy bandwidth as a function of its SM count. Overlapped time for c consumer SMs is about

    T(c) = max(F / ((S - c) * gemm_per_sm), B_remote / copy_bw(c)) + t_tail(c)

where F is the GEMM's FLOPs, B_remote the bytes that leave the GPU, and t_tail the last segment's
transfer, which cannot overlap (the schedule makes it one band). c is never above what the
transfer needs: at most one consumer SM per piece (``consumer.DEFAULT_PIECE_BYTES``, about 1 MiB)
of B_remote, since the consumer hands out whole pieces and an SM beyond that count ships nothing,
and c = 0 (no consumer: the producer on every SM) where nothing leaves the GPU. Then, where a GPU
and the overlap backend are at hand, `MoECombine.autotune` times the candidates of `coordinate_search` on the real
input (CUDA-graph replays) and caches the winner per shape bucket (device, W, N, K, experts per rank,
tile_m, rows rounded up to a power of two) in a `TuneCache`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from .consumer import DEFAULT_PIECE_BYTES as PIECE_BYTES

CCTA_CHOICES = (4, 8, 12, 16, 20, 24, 32)
MGB_CHOICES = (1, 2, 4)


@dataclass
class CostModel:
    """Rates of one GPU (defaults: H200 measured in this project; see bench/NOTES.md)."""
    num_sms: int = 132
    gemm_tflops: float = 680.0  # our grouped GEMM on all SMs inside the combine
    # (bench/results/archive/combine_sweep_2xh200_v2.json)
    # remote bytes per second the default consumer (no local copy, TMA, 1 MiB pieces) ships
    # alone in the combine (GB/s per direction, both directions busy) at these SM counts: 8/16/24
    # measured (bench/results/combine_split_2xh200_pieces.json, balanced routing, N=8192), 2/4
    # extrapolated from the 8-SM point per SM; linear in between, flat after
    copy_gbps: dict = field(default_factory=lambda: {2: 65.0, 4: 130.0, 8: 261.0, 16: 311.0,
                                                     24: 315.0})
    link_gbps: float = 380.0  # GPU<->GPU copy ceiling
    signal_us: float = 6.0  # per-launch fixed cost of the consumer
    # (bench/results/archive/consumer_run3_fastlaunch.json)

    def copy_bw(self, ccta: int) -> float:
        pts = sorted(self.copy_gbps.items())
        if ccta <= pts[0][0]:
            bw = pts[0][1] * ccta / pts[0][0]
        elif ccta >= pts[-1][0]:
            bw = pts[-1][1]
        else:
            for (c0, b0), (c1, b1) in zip(pts, pts[1:]):
                if c0 <= ccta <= c1:
                    bw = b0 + (b1 - b0) * (ccta - c0) / (c1 - c0)
                    break
        return min(bw, self.link_gbps) * 1e9

    def gemm_s(self, flops: float, ccta: int) -> float:
        per_sm = self.gemm_tflops * 1e12 / self.num_sms
        return flops / ((self.num_sms - ccta) * per_sm)


def predict(model: CostModel, rows: int, remote_rows: int, N: int, K: int, tile_m: int,
            ccta: int, mgb: int, bytes_per_elem: int = 2) -> dict:
    """Predicted times (seconds) of one combine with this (ccta, mgb)."""
    flops = 2.0 * rows * N * K
    remote_bytes = remote_rows * N * bytes_per_elem
    band_bytes = tile_m * N * bytes_per_elem
    t_gemm = model.gemm_s(flops, ccta)
    bw = model.copy_bw(ccta)
    t_comm = remote_bytes / bw + model.signal_us * 1e-6
    t_tail = (min(band_bytes, remote_bytes) / bw) if remote_rows else 0.0
    # a consumer transfer of mgb bands can start only once its last band is done
    t_wait = (mgb - 1) * model.gemm_s(2.0 * tile_m * N * K, ccta) if remote_rows else 0.0
    return {"t_gemm": t_gemm, "t_comm": t_comm,
            "t_overlap": max(t_gemm, t_comm) + t_tail + t_wait}


def ccta_cap(remote_rows: int, N: int, piece_bytes: int = PIECE_BYTES,
             bytes_per_elem: int = 2) -> int:
    """The most consumer SMs a transfer of ``remote_rows`` rows of N elements can use: one per
    piece of ``piece_bytes`` (the consumer gives each CTA whole pieces; see consumer.py), at
    least 1 where any row is remote, 0 where none is."""
    remote_bytes = max(0, remote_rows) * N * bytes_per_elem
    return -(-remote_bytes // max(1, piece_bytes))


def analytic_choice(rows: int, remote_rows: int, N: int, K: int, tile_m: int = 128,
                    model: CostModel | None = None, ccta_choices=CCTA_CHOICES,
                    mgb_choices=MGB_CHOICES, piece_bytes: int = PIECE_BYTES) -> tuple[int, int]:
    """(ccta, mgb) minimizing the predicted overlapped time (ties: fewer SMs, smaller mgb),
    with ccta capped at ``ccta_cap`` (each choice above it is read as the cap): (0, 1) where no
    row is remote (no consumer; mgb cuts only remote segments)."""
    model = model or CostModel()
    cap = ccta_cap(remote_rows, N, piece_bytes)
    if cap == 0:
        return 0, 1
    best = None
    for c in sorted({min(c, cap) for c in ccta_choices}):
        if c >= model.num_sms:
            continue
        for m in mgb_choices:
            t = predict(model, rows, remote_rows, N, K, tile_m, c, m)["t_overlap"]
            if best is None or t < best[0] * (1 - 1e-9):
                best = (t, c, m)
    return best[1], best[2]


def analytic_order(rows: int, remote_rows: int, N: int, K: int, tile_m: int, ccta: int,
                   mgb: int, model: CostModel | None = None) -> str:
    """The plan's schedule where nothing is tuned (``CombineOptions(order="auto")``): "expert"
    where the predicted GEMM time at this (ccta, mgb) is at least the transfer's, else
    "remote_first". Why: remote_first runs every expert's remote bands before any local one, so
    an expert with rows of both kinds has its weights read from DRAM twice (most experts at
    W = 2); expert order reads them about once (its timings: bench/NOTES.md, "the producer in
    expert order" and session 29). Its remote rows finish with the
    GEMM instead of before its local part: where the GEMM bounds the call that costs the last
    segment's transfer, which both orders pay; where the transfer bounds it, remote_first's
    early start is kept. No row remote: "remote_first" (the two plans are the same)."""
    if remote_rows <= 0:
        return "remote_first"
    t = predict(model or CostModel(), rows, remote_rows, N, K, tile_m, ccta, mgb)
    return "expert" if t["t_gemm"] >= t["t_comm"] else "remote_first"


def shape_key(device_name: str, world_size: int, N: int, K: int, experts_per_rank: int,
              tile_m: int, rows: int) -> str:
    bucket = 1 << max(0, math.ceil(math.log2(max(rows, 1))))
    return f"{device_name}|W{world_size}|N{N}|K{K}|E{experts_per_rank}|tm{tile_m}|rows{bucket}"


class TuneCache:
    """JSON file of tuned (ccta, mgb[, order]) per shape key. Default:
    ~/.cache/moe-overlap/tune.json, or $MOE_OVERLAP_TUNE_CACHE."""

    def __init__(self, path: str | None = None):
        self.path = path or os.environ.get(
            "MOE_OVERLAP_TUNE_CACHE", os.path.join(os.path.expanduser("~"), ".cache",
                                                   "moe-overlap", "tune.json"))
        self.entries: dict = {}
        if os.path.exists(self.path):
            with open(self.path) as f:
                self.entries = json.load(f)

    def get(self, key: str):
        e = self.entries.get(key)
        return (e["ccta"], e["mgb"]) if e else None

    def entry(self, key: str) -> dict | None:
        """The whole entry (ccta, mgb, and what autotune recorded beside them: ``order`` where
        it tuned the order, ms, tried), or None."""
        e = self.entries.get(key)
        return dict(e) if e else None

    def put(self, key: str, ccta: int, mgb: int, **info):
        self.entries[key] = {"ccta": ccta, "mgb": mgb, **info}
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.entries, f, indent=1, sort_keys=True)
        os.replace(tmp, self.path)


def coordinate_search(time_fn, first: tuple[int, int], ccta_choices=CCTA_CHOICES,
                      mgb_choices=MGB_CHOICES, num_sms: int = 132):
    """Time `time_fn(ccta, mgb) -> seconds`: every ccta at the first guess's mgb, then every mgb at
    the best ccta. Returns ((ccta, mgb), {(ccta, mgb): seconds}). The ccta axis is searched whole
    because the overlapped time is not convex in it (GEMM and consumer contend for memory)."""
    times = {}
    for c in ccta_choices:
        if c < num_sms:
            times[(c, first[1])] = time_fn(c, first[1])
    c_best = min(times, key=times.get)[0]
    for m in mgb_choices:
        if (c_best, m) not in times:
            times[(c_best, m)] = time_fn(c_best, m)
    return min(times, key=times.get), times


def model_to_json(model: CostModel) -> dict:
    return asdict(model)
