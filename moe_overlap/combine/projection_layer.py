"""Projection of the whole MoE layer (issue 39, goal 4) for W = 2..64 from measured and stated rates.

One rank's call (rank 0 of a balanced routing unless told otherwise), three ways:

- ``layer``: the layer as MoELayer with MoEDispatch's overlap backend is designed to run it:
  dispatch || up-projection, then down-projection || combine.
- ``seq`` (baseline a): NCCL all-to-all of every (token, k) assignment, the library's grouped
  GEMMs on the valid rows with a separate SwiGLU pass, NCCL all-to-all back, our scale; all
  sequential.
- ``combine_only`` (baseline b, today's layer): the same per-assignment all-to-all dispatch and
  placement into the plan layout, the library up-projection + SwiGLU on the plan's rows, then
  the overlapped combine.

Stages (seconds; ``predict_layer``):

- Bytes: every rank's routing is drawn (``moe_overlap.routing.route``, as `routing_counts` and
  bench/bench_dispatch_bytes.py draw it), so the dispatch bytes are `dispatch_wire_bytes`'
  (each token once per destination rank + its int32 top-k ids; per assignment for the
  baselines) and the combine's rows are the planner's (`plan_combine` on the counts). Each
  exchange takes, per link class, the larger of what this rank sends and receives; peers of its
  node (`Fabric.gpus_per_node`) over NVLink, the others over InfiniBand.
- Dispatch || up-projection (``t_dispatch_up``), band by band: arrivals per source (local at
  plan + prepare; the NVLink peers one after another over once-bytes / the send rate on
  ``dctas`` reserved SMs, a staggered all-to-all; the IB peers likewise at the IB rate after
  its latency); the expand (received tokens read, plan rows written) on the same reserved SMs,
  source after source in arrival order, expert by expert within one; a band of the plan's
  rows is ready when every (expert, source) group it holds is expanded (`band_ready`, on the
  plan's own layout: remote groups in source order, local last); the arrival-gated
  up-projection on num_sms - dctas SMs takes ready bands in ready order (`gemm_finish`).
  ``arrival="built"`` is what today's kernels do (the wait kernel waits for every source, the
  expand then raises each expert's bands); "designed" takes the better of the two orders for
  the shape (a static choice the layer can make). ``up_goal``: the up-projection at the
  issue's goal (>= 0.95x the library, SM-scaled) where the measured producer is slower.
- Down-projection || combine: `projection.predict_call` (the combine projection's model: our
  GEMM on num_sms - ccta SMs, the consumer's rate, last band, scale), its same-scale baseline for
  ``seq``.
- The baselines' memory passes at ``LayerRates.hbm_tbps``: the gather of every assignment row
  into the all-to-all's send order, the placement of the received rows (compact for ``seq``,
  the plan's rows for ``combine_only``), the SwiGLU pass (reads [rows, 2K], writes [rows, K]).

What is measured and what is assumed (``input_sources`` names each with file, card, GPUs, date
and commit; ``ASSUMPTIONS`` says what each assumption assumes): the GEMM rates are the one-GPU
producer bench's (H100) of the model's down-projection shape, applied to the up-projection's
[rows, D] x [D, 2K] too (no up-projection shape was measured); the overlapped dispatch has never
run on a GPU: its send rate is assumed to be the consumer's measured NVLink rate at the same SM
count, its IB transport (NVSHMEM put, not built) the stated IB rate, its expand the scale
kernel's measured HBM rate per SM. A projection, not a measurement.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace

import torch

from ..provenance import Git, result_source
from ..routing import route
from .dispatch_dedup import IDS_DTYPE
from .plan import plan_combine
from .projection import (SCALE_FILE, Fabric, ProducerRates, _short_src,
                         input_sources as combine_inputs, predict_call)
from .shapes import MODELS
from .tuning import CCTA_CHOICES, CostModel

PLAN_FILE = "plan_kernel2_h200_1622057.json"
BYTES_FILE = "dispatch_bytes_1bbb111.json"
UPPROJ_FILE = "upproj_models_h100_486caa4.json"  # the up-projection's measured rates
# more points of the same code and options (where both measured a point, the headline's is kept);
# none since the headline holds the full grid
UPPROJ_EXTRA = ()
# bench/lab_upproj_window.py runs, one file per window of source distances (none measured yet):
# project_layer's "up_window" takes the best window per row at that window's measured rate
UPPROJ_WINDOW_FILES = ()
ARRIVALS = ("designed", "built")
UP_GOAL = 0.95  # issue 39: the arrival-gated up-projection >= 0.95x the library (SM-scaled)
CLASSES = ("local", "nvlink", "ib")

ASSUMPTIONS = {
    "up_gemm_rate": "the up-projection [rows, D] x [D, 2K] (SwiGLU in our epilogue) runs at the "
                    "TFLOP/s the producer bench measured for the same model's down-projection "
                    "[rows, K] x [K, N] on the same plans (ours) and valid rows (library); no "
                    "up-projection shape has been timed",
    "arrival_gating_free": "waiting on arrival flags costs the up-projection nothing once the "
                           "band has arrived (goal >= 0.95x the library, not measured)",
    "dispatch_send_nvlink": "the dispatch's send kernel (SIMT peer stores, never run on a GPU) "
                            "ships at the consumer's measured rate for the same number of SMs, "
                            "capped at the NVLink rate",
    "dispatch_send_ib": "an inter-node transport for the dispatch (NVSHMEM put: not built) moves "
                        "the once-per-rank bytes at the stated IB rate with its latency, "
                        "without holding the reserved SMs",
    "expand_rate": "the owner's expand copies at the scale kernel's measured HBM rate per SM "
                   "(its rate / 132) on the dctas reserved SMs, beside the send (different "
                   "resources: NVLink stores vs local HBM)",
    "staggered_sources": "the sources of a link class land one after another (each at the "
                         "class's full rate, a staggered all-to-all), NVLink and IB classes in "
                         "parallel; a band goes once every source of its rows is expanded",
    "rank0": "rank 0 stands for every rank (balanced routing: the ranks differ by sampling "
             "noise; skewed routings would need the slowest rank)",
    "up_rate_nearest": "up_measured: the up-projection (ours and the library's GEMM) at a model's "
                       "W, tokens and routing not measured runs at the rate of the nearest "
                       "measured point of that model (the routing first, then W, then tokens, "
                       "then the larger W of two equally near)",
    "nccl_rate_any_w": "NCCL's all-to-all over NVLink keeps its 2-GPU rate at every W in a node",
    "baseline_passes": "the baselines' gather, placement and SwiGLU are one pass each at the "
                       "HBM rate (torch's silu(g) * u is two)",
}


@dataclass
class LayerRates:
    """Rates of the layer's stages beyond the combine's (`CostModel`, `Fabric`)."""
    plan_prepare_us: float = 28.7  # plan + prepare kernels, most of W = 2..64 (PLAN_FILE)
    expand_gbps_per_sm: float = 4000.0 / 132  # scale kernel's HBM rate per SM (SCALE_FILE)
    hbm_tbps: float = 4.0  # memory passes of the baselines (SCALE_FILE, H200)

    @classmethod
    def from_results(cls, root: str | None) -> "LayerRates":
        """The plan + prepare time from PLAN_FILE (the largest plan_us + prepare_us) where root
        holds it; the rest as defaults (they are Fabric.scale_tbps' source)."""
        if root is None:
            return cls()
        with open(os.path.join(root, "bench", "results", PLAN_FILE)) as f:
            rows = json.load(f)["rows"]
        return cls(plan_prepare_us=max(r["plan_us"] + r["prepare_us"] for r in rows))


@dataclass
class UpRates:
    """The arrival-gated SwiGLU up-projection's rates as bench/bench_upproj.py measures them
    (the layer's options and band order, every band arrived), per measured point (model,
    tokens, W, routing) with W > 1: ours in TFLOP/s on the plan's rows per SM of its grid times
    num_sms (CostModel.gemm_tflops' unit, as `ProducerRates`), and the library's GEMM alone (the
    faster of grouped_mm and a per-expert loop, without the SwiGLU pass the baselines add) on
    the valid rows on every SM."""
    points: dict = field(default_factory=dict)  # (model, T, W, routing) -> (ours, lib, label)
    source: dict = field(default_factory=dict)  # the same keys -> the file it was read from
    files: tuple = ()  # the files read (`from_files`), in their order of precedence
    window: int = 1  # the band order's window of source distances (1: the layer's arrival order)

    @staticmethod
    def window_of(*docs: dict) -> int:
        """The docs' window (``lab_window`` of bench/lab_upproj_window.py; 1 where absent: the
        layer's arrival order); docs of two windows raise."""
        ws = {int(d.get("lab_window", 1)) for d in docs}
        if len(ws) != 1:
            raise ValueError(f"up-projection runs of different band windows: {sorted(ws)}")
        return ws.pop()

    @classmethod
    def from_doc(cls, *docs: dict) -> "UpRates":
        """The points of every doc; where two measured the same point, the later doc's."""
        window = cls.window_of(*docs) if docs else 1
        pts = {}
        for p in (p for doc in docs for p in doc["points"]):
            if p["world_size"] < 2 or not p.get("correct"):
                continue
            flops_row = 2.0 * p["D"] * p["two_k"]
            ours = flops_row * p["plan_rows"] / (p["ms"] * 1e-3) / p["grid"] * p["num_sms"]
            lib = flops_row * p["valid_rows"] / (p["base_gemm_alone_ms"] * 1e-3)
            pts[(p["model"], p["tokens"], p["world_size"], p["routing"])] = (
                ours / 1e12, lib / 1e12, p["label"])
        return cls(pts, window=window)

    @classmethod
    def from_files(cls, root: str, names=(UPPROJ_FILE,) + UPPROJ_EXTRA) -> "UpRates":
        """The points of these bench/results files; where two measured the same point, the
        earlier file's."""
        docs = {}
        for name in names:
            with open(os.path.join(root, "bench", "results", name)) as f:
                docs[name] = json.load(f)
        up = cls(files=tuple(names), window=cls.window_of(*docs.values()))
        for name in reversed(names):
            pts = cls.from_doc(docs[name]).points
            up.points.update(pts)
            up.source.update(dict.fromkeys(pts, name))
        return up

    def nearest(self, model: str, tokens: int, W: int, mode: str):
        """(ours, library, label) of the measured point of this model nearest the asked one:
        the same routing mode first, then W, then tokens nearest in log scale, then (W between
        two measured, e.g. 4 between 2 and 8) the larger W: more sources leave fewer bands per
        (expert, source) group, so the arrival order's weight traffic only grows with W. None
        where the model has none."""
        cands = [k for k in self.points if k[0] == model]
        if not cands:
            return None
        k = min(cands, key=lambda k: (k[3] != mode, abs(math.log(k[2] / W)),
                                      abs(math.log(k[1] / tokens)), -k[2]))
        return self.points[k]


def draw_ids(model: str, W: int, tokens: int, mode: str = "balanced", seed: int = 0) -> list:
    """Every rank's top-k ids [tokens, k] as `routing_counts` / bench_dispatch_bytes draw them."""
    E, k, _, _ = MODELS[model]
    return [route(tokens, E, k, mode, seed=seed, rank=r)[0] for r in range(W)]


def band_ready(group_start, group_rows, group_ready, rows: int, tile_m: int,
               floor: float = 0.0) -> torch.Tensor:
    """[bands] the time each band of the plan's rows can go: the latest ready time of the
    (expert, source) groups whose rows it holds (padding needs none: floor where it holds no
    group's row). group_start / group_rows / group_ready: [El, W]."""
    nb = -(-rows // tile_m)
    ready = torch.full((nb,), float(floor), dtype=torch.float64)
    gs, gr = torch.as_tensor(group_start).reshape(-1), torch.as_tensor(group_rows).reshape(-1)
    t = torch.as_tensor(group_ready, dtype=torch.float64).reshape(-1)
    m = gr > 0
    gs, gr, t = gs[m], gr[m], t[m]
    first, last = gs // tile_m, (gs + gr - 1) // tile_m
    for f, l, v in zip(first.tolist(), last.tolist(), t.tolist()):
        ready[f:l + 1] = torch.clamp(ready[f:l + 1], min=v)
    return ready


def gemm_finish(ready: torch.Tensor, t_band: float, order: torch.Tensor | None = None) -> float:
    """When a GEMM at t_band per band (the whole grid's throughput) that takes each band once
    it is ready ends: in ready order (order None), max over i of ready_sorted[i] + (bands from
    i on) x t_band; in a static order (the kernel's schedule: a band waits for every band
    before it), the same over the running maximum of the ready times in that order."""
    if not ready.numel():
        return 0.0
    r = ready.sort().values if order is None else torch.cummax(ready[order], 0).values
    left = torch.arange(r.numel(), 0, -1, dtype=torch.float64)
    return float((r + left * t_band).max())


def window_order(group_start, group_rows, rank: int, rows: int, tile_m: int,
                 window: int) -> torch.Tensor:
    """[bands] the up-projection's static band order in windows of ``window`` rank distances
    (bench/lab_upproj_window.py's order): by the window of the band's farthest source's
    distance (s - rank) mod W, then its first expert, then that distance, then band id.
    group_start / group_rows: [El, W] as `band_ready` takes them."""
    if window < 1:
        raise ValueError(f"window={window}: at least 1")
    g_rows = torch.as_tensor(group_rows)
    El, W = g_rows.shape
    nb = -(-rows // tile_m)
    dist = ((torch.arange(W) - rank) % W).to(torch.float64).expand(El, W)
    far = band_ready(group_start, g_rows, dist, rows, tile_m).long()
    # the band's first (lowest) expert: the largest of -e, where a band holds no group's row El
    neg_e = -torch.arange(El, dtype=torch.float64)[:, None].expand(El, W)
    first_e = -band_ready(group_start, g_rows, neg_e, rows, tile_m, floor=-El).long()
    b = torch.arange(nb)
    key = ((far // window) * (El + 1) + first_e) * (W * nb) + far * nb + b
    return torch.argsort(key)


def layer_rows(model: str, W: int, tokens: int, mode: str = "balanced", seed: int = 0,
               tile_m: int = 128, layout: str = "packed", fabric: Fabric | None = None,
               rank: int = 0, ids=None) -> dict:
    """Rank `rank`'s rows and bytes of one layer call: the plan's rows, the dispatch's tokens
    and assignments by link class (sent and received), the combine's rows by link class, and
    the rows of its local experts by source class. ids: every rank's topk ids (None: drawn)."""
    fabric = fabric or Fabric()
    E, k, K, D = MODELS[model]
    ids = ids if ids is not None else draw_ids(model, W, tokens, mode, seed)
    El = E // W
    counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for i in ids])
    plan = plan_combine(counts, rank, tile_m=tile_m, layout=layout)
    assign = counts.view(W, W, El).sum(2)  # [source, owner]: (token, k) rows
    pairs = torch.stack([torch.zeros(i.shape[0], W, dtype=torch.bool).scatter_(
        1, i // El, True).sum(0) for i in ids])  # [source, owner]: tokens, once per owner
    node = torch.arange(W) // fabric.gpus_per_node
    cls = torch.where(torch.arange(W) == rank, 0, torch.where(node == node[rank], 1, 2))
    out = dict(rows=int(plan.total_rows), valid_rows=int(plan.valid_rows), tokens=tokens,
               packed=bool(int(plan.packed)), world_size=W)
    for c, name in enumerate(CLASSES):
        m = cls == c
        out[f"once_sent_{name}"] = int(pairs[rank][m].sum())  # tokens this rank sends there
        out[f"once_recv_{name}"] = int(pairs[:, rank][m].sum())  # tokens it receives
        out[f"assign_sent_{name}"] = int(assign[rank][m].sum())
        out[f"assign_recv_{name}"] = int(assign[:, rank][m].sum())
    out["peers"] = {n: int((cls == c).sum()) for c, n in enumerate(CLASSES)}
    # the layout, for the band-level arrival model: per local expert and source, its group's
    # rows and where they start; the sources' classes and the tokens each sends here
    out["group_rows"] = counts[:, rank * El:(rank + 1) * El].T.tolist()  # [El, W]
    out["group_start"] = (plan.expert_row_start[:, None] + plan.group_row_start).tolist()
    out["source_class"] = cls.tolist()
    out["once_recv_by_source"] = pairs[:, rank].tolist()
    return out


def _link(sent: int, recv: int, row_bytes: int) -> int:
    return max(sent, recv) * row_bytes


def predict_layer(lr: dict, model: str, ours: CostModel, lib: CostModel, fabric: Fabric,
                  rates: LayerRates, tile_m: int = 128, mgb: int = 2, dctas: int = 16,
                  ccta: int = 16, arrival: str = "designed", up_goal: float | None = None,
                  up_rates: tuple | None = None, window: int | None = None) -> dict:
    """Stage times (seconds) of one call of rank lr's layer and of both baselines (module
    docstring). ours / lib: CostModels with our and the library's GEMM rate. up_goal: the
    up-projection at least at this fraction of the library's speed on the valid rows, scaled
    by its SMs (issue 39's goal 0.95), where the producer's measured rate is below it.
    up_rates: (ours, library) TFLOP/s of the up-projection (`UpRates`) in place of ours' and
    lib's GEMM rates for that GEMM, ours' and the baselines' alike.
    window: the up-projection walks its bands in `window_order` (static: each band after the
    ones before it) over the per-source expand's ready times, in place of "designed"'s choice
    (give up_rates measured in that order)."""
    if arrival not in ARRIVALS:
        raise ValueError(f"arrival={arrival!r}: one of {ARRIVALS}")
    if window is not None and arrival != "designed":
        raise ValueError("window walks the per-source expand: arrival='designed'")
    E, k, K, D = MODELS[model]
    rows, valid, T = lr["rows"], lr["valid_rows"], lr["tokens"]
    tok_b, idx_b = 2 * D, k * IDS_DTYPE.itemsize  # a token row, its ids
    ib_bw, hbm = fabric.ib_gbps * 1e9, rates.hbm_tbps * 1e12
    ib_lat = fabric.ib_latency_us * 1e-6
    # ----------------------------------------------------------- dispatch || up-projection
    once = {c: _link(lr[f"once_sent_{c}"], lr[f"once_recv_{c}"], tok_b + idx_b)
            for c in CLASSES[1:]}
    send_bw = min(ours.copy_bw(dctas), fabric.nvlink_gbps * 1e9)
    lat_of = {"nvlink": ours.signal_us * 1e-6, "ib": ib_lat + ours.signal_us * 1e-6}
    arrive = {"local": rates.plan_prepare_us * 1e-6,
              "nvlink": once["nvlink"] / send_bw + ours.signal_us * 1e-6 if once["nvlink"] else 0.0,
              "ib": once["ib"] / ib_bw + ib_lat + ours.signal_us * 1e-6 if once["ib"] else 0.0}
    x_bw = min(rates.expand_gbps_per_sm * 1e9 * dctas, hbm)
    cls = lr["source_class"]
    W = len(cls)
    g_rows = torch.tensor(lr["group_rows"])  # [El, W]
    recv = lr["once_recv_by_source"]
    # arrivals: each class's sources one after another (a staggered all-to-all), source s
    # landing when the bytes of the class's sources up to it have
    a_s = [0.0] * W
    for c, name in enumerate(CLASSES):
        srcs = [s for s in range(W) if cls[s] == c]
        tot = sum(recv[s] for s in srcs)
        done = 0
        for s in srcs:
            done += recv[s]
            a_s[s] = (arrive["local"] if c == 0 else
                      arrive[name] - (1.0 - done / tot) * (arrive[name] - lat_of[name])
                      if tot else arrive[name])
    # the expand: one source's items after another, in arrival order (padding zeroed with the
    # last); time of its received tokens read and its rows written
    x_s = [recv[s] * (tok_b + idx_b) / x_bw
           + int(g_rows[:, s].sum()) * tok_b / x_bw for s in range(W)]
    order = sorted(range(W), key=lambda s: (a_s[s], s))
    x_s[order[-1]] += (rows - valid) * tok_b / x_bw
    t_expand = sum(x_s)
    up_flops_row = 2.0 * D * 2 * K
    up, up_lib = ours, lib
    if up_rates is not None:
        up, up_lib = (replace(ours, gemm_tflops=up_rates[0]),
                      replace(lib, gemm_tflops=up_rates[1]))
    if up_goal is not None:
        up = replace(up, gemm_tflops=max(
            up.gemm_tflops, up_goal * up_lib.gemm_tflops * valid / max(rows, 1)))
    t_band = up.gemm_s(up_flops_row * tile_m, dctas)
    t_up = up.gemm_s(up_flops_row * rows, dctas)
    El = g_rows.shape[0]
    frac = torch.arange(1, El + 1, dtype=torch.float64)[:, None] / El  # [El, 1]
    # as built: every source first, then the expand expert by expert (per-expert flags)
    t_all = max(a_s)
    built = gemm_finish(band_ready(lr["group_start"], g_rows, (t_all + t_expand * frac).expand(
        El, W), rows, tile_m, floor=arrive["local"]), t_band)
    t_dispatch_up, expand_order = built, "all sources, then by expert"
    if arrival == "designed":  # each source's items once it lands, expert by expert
        x_end, start = 0.0, torch.zeros(W, dtype=torch.float64)
        dur = torch.tensor(x_s, dtype=torch.float64)
        for s in order:
            start[s] = max(a_s[s], x_end)
            x_end = float(start[s]) + x_s[s]
        ready = band_ready(lr["group_start"], g_rows, start + dur * frac, rows, tile_m,
                           floor=arrive["local"])
        if window is not None:
            walk = window_order(lr["group_start"], g_rows, cls.index(0), rows, tile_m, window)
            t_dispatch_up = gemm_finish(ready, t_band, walk)
            expand_order = f"each source as it lands, bands in windows of {window}"
        else:
            by_source = gemm_finish(ready, t_band)
            if by_source < built:  # the layer takes the better order for the shape (static)
                t_dispatch_up, expand_order = by_source, "each source as it lands"
    t_send = max(arrive.values())
    # ----------------------------------------------------------- down-projection || combine
    comb = predict_call(rows, valid, lr["assign_recv_nvlink"], lr["assign_recv_ib"], T, k, K, D,
                        tile_m, ccta, mgb, ours, fabric, lib)
    # the combine's return all-to-all: the larger of the rows sent back and received
    # (predict_call takes the rows sent; the balanced routing makes them alike)
    # ----------------------------------------------------------- baselines
    pa = {c: _link(lr[f"assign_sent_{c}"], lr[f"assign_recv_{c}"], tok_b) for c in CLASSES[1:]}
    lat = ib_lat if pa["ib"] else 0.0
    t_a2a_dispatch = max(pa["nvlink"] / (fabric.nccl_a2a_gbps * 1e9), pa["ib"] / ib_bw) + lat
    sent_rows = T * k  # every assignment row, gathered into the send order
    t_gather = 2 * sent_rows * tok_b / hbm
    t_place_compact = 2 * valid * tok_b / hbm
    t_place_plan = (valid + rows) * tok_b / hbm
    t_act = lambda r: r * 3 * K * 2 / hbm  # noqa: E731  reads [r, 2K], writes [r, K]
    t_up_lib = up_lib.gemm_s(up_flops_row * valid, 0)
    t_up_lib_plan = up_lib.gemm_s(up_flops_row * rows, 0)
    t_seq = (t_gather + t_a2a_dispatch + t_place_compact + t_up_lib + t_act(valid)
             + comb["t_seq_same_scale"])
    t_combine_only = (t_gather + t_a2a_dispatch + t_place_plan + t_up_lib_plan + t_act(rows)
                      + comb["t_overlap"])
    t_layer = t_dispatch_up + comb["t_overlap"]
    return dict(
        t_arrive_nvlink=arrive["nvlink"], t_arrive_ib=arrive["ib"], t_send=t_send,
        t_expand=t_expand, t_up=t_up, t_dispatch_up=t_dispatch_up, expand_order=expand_order,
        t_down=comb["t_gemm"], t_comm=comb["t_comm"], t_scale=comb["t_scale"],
        t_combine=comb["t_overlap"], t_layer=t_layer,
        t_a2a_dispatch=t_a2a_dispatch, t_gather=t_gather, t_place_compact=t_place_compact,
        t_place_plan=t_place_plan, t_up_lib=t_up_lib, t_up_lib_plan=t_up_lib_plan,
        t_act=t_act(valid), t_down_lib=comb["t_gemm_lib"], t_a2a_combine=comb["t_a2a"],
        t_seq_combine=comb["t_seq_same_scale"], t_seq=t_seq, t_combine_only=t_combine_only,
        speedup_vs_seq=t_seq / t_layer, speedup_vs_combine_only=t_combine_only / t_layer,
        once_bytes=once, per_assignment_bytes=pa)


def best_layer(lr: dict, model: str, ours: CostModel, lib: CostModel, fabric: Fabric,
               rates: LayerRates, tile_m: int = 128, mgb: int = 2,
               arrival: str = "designed", up_goal: float | None = None,
               up_rates: tuple | None = None, window: int | None = None) -> dict:
    """predict_layer at the best dctas (dispatch || up) and the best ccta (combine) of
    CCTA_CHOICES, each chosen for its own half; the combine-only baseline takes its best ccta
    too (the same as ours: the combine half is the same model)."""
    choices = [c for c in CCTA_CHOICES if c < ours.num_sms]
    kw = dict(tile_m=tile_m, mgb=mgb, arrival=arrival, up_goal=up_goal, up_rates=up_rates,
              window=window)
    d = min(choices, key=lambda c: predict_layer(lr, model, ours, lib, fabric, rates, dctas=c,
                                                 ccta=choices[0], **kw)["t_dispatch_up"])
    c = min(choices, key=lambda c: predict_layer(lr, model, ours, lib, fabric, rates, dctas=d,
                                                 ccta=c, **kw)["t_combine"])
    return dict(predict_layer(lr, model, ours, lib, fabric, rates, dctas=d, ccta=c, **kw),
                dctas=d, ccta=c)


def project_layer(models=("deepseek-v3", "qwen3-235b-a22b"), worlds=(2, 4, 8, 16, 32, 64),
                  tokens=(4096, 16384), mode="balanced", tile_m=128, mgb=2, layout="packed",
                  cost: CostModel | None = None, fabric: Fabric | None = None,
                  rates: LayerRates | None = None, producer: ProducerRates | None = None,
                  up: UpRates | None = None, up_windows=(), seed: int = 0,
                  progress=None) -> list[dict]:
    """One row per (model, tokens, W) the experts divide: the rows and bytes (`layer_rows`), the
    layer as designed and as built and both baselines at their best SM splits, times in ms;
    with up, also "up_measured": the same with the up-projection's measured rates (ours' and
    the library's, the nearest measured point) in place of the down-projection's; with
    up_windows (UpRates of windowed band orders, one window each), also "up_window": the layer
    with its bands walked in each window (`predict_layer(window=)`) at that window's measured
    rate, the fastest of them and every window's speedup against combine-only."""
    cost, fabric, rates = cost or CostModel(), fabric or Fabric(), rates or LayerRates()
    out = []
    for model in models:
        E = MODELS[model][0]
        for T in tokens:
            ours, lib = producer.cost_models(model, T, cost) if producer else (cost, cost)
            for W in worlds:
                if E % W:
                    continue
                if progress:
                    progress(f"{model}@{T} W={W}")
                lr = layer_rows(model, W, T, mode, seed, tile_m, layout, fabric)
                r = best_layer(lr, model, ours, lib, fabric, rates, tile_m, mgb, "designed")
                b = best_layer(lr, model, ours, lib, fabric, rates, tile_m, mgb, "built")
                g = best_layer(lr, model, ours, lib, fabric, rates, tile_m, mgb, "designed",
                               up_goal=UP_GOAL)
                ms = {k: v * 1e3 for k, v in r.items() if k.startswith("t_")}
                out.append(dict(
                    model=model, tokens_per_rank=T, world_size=W, mode=mode, layout=layout,
                    seed=seed, up_tflops=ours.gemm_tflops, library_tflops=lib.gemm_tflops,
                    padding=lr["rows"] / max(lr["valid_rows"], 1),
                    rows={k: v for k, v in lr.items() if not isinstance(v, list)},
                    dctas=r["dctas"], ccta=r["ccta"], expand_order=r["expand_order"], **ms,
                    once_bytes=r["once_bytes"], per_assignment_bytes=r["per_assignment_bytes"],
                    speedup_vs_seq=r["speedup_vs_seq"],
                    speedup_vs_combine_only=r["speedup_vs_combine_only"],
                    built=dict(t_dispatch_up=b["t_dispatch_up"] * 1e3, t_layer=b["t_layer"] * 1e3,
                               dctas=b["dctas"], speedup_vs_seq=b["speedup_vs_seq"],
                               speedup_vs_combine_only=b["speedup_vs_combine_only"]),
                    up_at_goal=dict(t_up=g["t_up"] * 1e3, t_dispatch_up=g["t_dispatch_up"] * 1e3,
                                    t_layer=g["t_layer"] * 1e3, dctas=g["dctas"],
                                    speedup_vs_seq=g["speedup_vs_seq"],
                                    speedup_vs_combine_only=g["speedup_vs_combine_only"])))
                near = up.nearest(model, T, W, mode) if up is not None else None
                if near is not None:
                    u = best_layer(lr, model, ours, lib, fabric, rates, tile_m, mgb, "designed",
                                   up_rates=near[:2])
                    out[-1]["up_measured"] = dict(
                        point=near[2], up_tflops=near[0], library_up_tflops=near[1],
                        t_up=u["t_up"] * 1e3, t_dispatch_up=u["t_dispatch_up"] * 1e3,
                        t_layer=u["t_layer"] * 1e3, t_seq=u["t_seq"] * 1e3,
                        t_combine_only=u["t_combine_only"] * 1e3, dctas=u["dctas"],
                        speedup_vs_seq=u["speedup_vs_seq"],
                        speedup_vs_combine_only=u["speedup_vs_combine_only"])
                tried = []
                for uw in up_windows:
                    nw = uw.nearest(model, T, W, mode)
                    if nw is not None:
                        tried.append((uw.window, nw, best_layer(
                            lr, model, ours, lib, fabric, rates, tile_m, mgb, "designed",
                            up_rates=nw[:2], window=uw.window)))
                if tried:
                    w, nw, v = min(tried, key=lambda t: (t[2]["t_layer"], t[0]))
                    out[-1]["up_window"] = dict(
                        window=w, point=nw[2], up_tflops=nw[0], library_up_tflops=nw[1],
                        t_up=v["t_up"] * 1e3, t_dispatch_up=v["t_dispatch_up"] * 1e3,
                        t_layer=v["t_layer"] * 1e3, dctas=v["dctas"],
                        speedup_vs_seq=v["speedup_vs_seq"],
                        speedup_vs_combine_only=v["speedup_vs_combine_only"],
                        by_window={str(t[0]): round(t[2]["speedup_vs_combine_only"], 4)
                                   for t in tried})
    return out


def check_bytes(rows: list[dict], doc: dict) -> dict:
    """The projection's rank-0 dispatch bytes against the counted file (bench_dispatch_bytes:
    per_rank[0] once / per_assignment) at the points both have (same model, W, mode, tokens,
    seed): {points, equal: all equal, mismatches}."""
    rec = {(p["model"], p["world_size"], p["mode"], p["tokens_per_rank"], p["seed"]):
           p["per_rank"][0] for p in doc["rows"]}
    pts, bad = [], []
    for r in rows:
        key = (r["model"], r["world_size"], r["mode"], r["tokens_per_rank"], r["seed"])
        if key not in rec:
            continue
        D = MODELS[r["model"]][3]
        got = dict(once=2 * D * (r["rows"]["once_sent_nvlink"] + r["rows"]["once_sent_ib"]),
                   per_assignment=2 * D * (r["rows"]["assign_sent_nvlink"]
                                           + r["rows"]["assign_sent_ib"]))
        want = dict(once=rec[key]["once"], per_assignment=rec[key]["per_assignment"])
        pts.append(dict(key=list(key), got=got, recorded=want))
        if got != want:
            bad.append(key)
    return dict(points=len(pts), equal=not bad and bool(pts), mismatches=[list(b) for b in bad])


def input_sources(root: str | None, cost: CostModel, fabric: Fabric, rates: LayerRates,
                  producer: ProducerRates | None, git: Git | None = None,
                  up: UpRates | None = None, up_windows=()) -> dict:
    """The combine projection's inputs (`projection.input_sources`) and the layer's own: the
    up-projection's rates (the producer file, an assumption), the plan + prepare time, the
    expand's and the baselines' HBM rates, the dispatch's send rate (an assumption)."""
    git = git or (Git(root) if root else None)
    out = combine_inputs(root, cost, fabric, producer, git)

    def src(name, area, gpus, field):
        if root is None:
            return dict(file=None, stated=f"built-in default, read from {name} when it was "
                        "written (no checkout here to check it against)")
        return result_source(root, name, area, gpus=gpus, git=git, field=field)

    def entry(value, unit, what, source, assumption=None):
        e = dict(value=value, unit=unit, what=what, source=source)
        if assumption:
            e["assumption"] = ASSUMPTIONS[assumption]
        return e

    if producer is not None:
        out["up_tflops"] = entry(producer.producer_tflops, "TFLOP/s", "the up-projection's rate, "
                                 "ours (per model@tokens, nearest measured T)",
                                 out["producer_tflops"]["source"], "up_gemm_rate")
        out["up_library_tflops"] = entry(producer.library_tflops, "TFLOP/s",
                                         "the baselines' up-projection rate (library)",
                                         out["library_tflops"]["source"], "up_gemm_rate")
    def measured(u: UpRates, prefix: str, what_of: str):
        """One entry per file of u and rate (ours, the library's): the points read from that
        file, it as their source."""
        for i, name in enumerate(u.files):
            own = {k: v for k, v in u.points.items() if u.source[k] == name}
            sfx = f"_{i}" if i else ""
            for key, j, what in ((f"{prefix}_tflops", 0, "ours"),
                                 (f"{prefix}_library_tflops", 1, "the library's GEMM alone")):
                out[key + sfx] = entry(
                    {f"{m}@{t}/W{w}/{r}": v[j] for (m, t, w, r), v in own.items()}, "TFLOP/s",
                    what_of.format(what=what),
                    src(name, "upproj", 1, "points[]: plan_rows, ms, grid (ours); valid_rows, "
                        "base_gemm_alone_ms (library)"), "up_rate_nearest")

    if up is not None:
        measured(up, "up_measured",
                 "up_measured: the up-projection's measured rate, {what}, per point")
    for uw in up_windows:  # lab runs (no README row): the file's own commit and date
        measured(uw, f"up_window_{uw.window}",
                 "up_window: the up-projection's measured rate, {what}, bands in windows of "
                 f"{uw.window} source distances (bench/lab_upproj_window.py)")
    out["plan_prepare_us"] = entry(rates.plan_prepare_us, "us", "plan + prepare kernels before "
                                   "the first expand (the largest of W = 2..64)",
                                   src(PLAN_FILE, "plan", 1, "rows[].plan_us + prepare_us (max)"))
    scale = src(SCALE_FILE, "scale", 1, "variants[].TBs (the fastest) / 132 SMs")
    out["expand_gbps_per_sm"] = entry(rates.expand_gbps_per_sm, "GB/s per SM", "the dispatch "
                                      "expand's copy rate on each reserved SM", scale,
                                      "expand_rate")
    out["hbm_tbps"] = entry(rates.hbm_tbps, "TB/s", "the baselines' gather, placement and "
                            "SwiGLU passes", src(SCALE_FILE, "scale", 1, "variants[].TBs"),
                            "baseline_passes")
    out["dispatch_send_gbps"] = entry(cost.copy_gbps, "GB/s by dctas", "the dispatch's NVLink "
                                      "send rate on dctas SMs: the consumer's (copy_gbps)",
                                      out["copy_gbps"]["source"], "dispatch_send_nvlink")
    out["dispatch_ib"] = entry(fabric.ib_gbps, "GB/s per GPU", "the dispatch's IB transport",
                               dict(file=None, stated="stated (--ib-gbps); the transport is "
                                    "not built"), "dispatch_send_ib")
    out["dispatch_bytes"] = entry("dispatch_wire_bytes", "", "tokens once per destination rank "
                                  "+ int32 top-k ids; per assignment for the baselines",
                                  dict(file=None, stated="computed from every rank's routing "
                                       "(moe_overlap.routing.route), checked against "
                                       f"bench/results/{BYTES_FILE} where both have the point"))
    return out


def assumptions_text(fabric: Fabric, rates: LayerRates, inputs: dict | None = None,
                     bytes_check: dict | None = None) -> str:
    """The plot's and the JSON's statement of what is measured, what stated, what assumed."""
    parts = ["Projection, not a measurement; rank 0 of a balanced routing."]
    if inputs and "up_tflops" in inputs:
        parts.append("GEMM rates (ours, library; up-projection assumed at the down-projection's "
                     "rate): " + _short_src(inputs["up_tflops"]["source"]) + ".")
    measured = [e["source"] for k, e in (inputs or {}).items()
                if k.startswith("up_measured_tflops")]
    if measured:
        parts.append("Dashed: the up-projection at its measured rate in the layer's band order "
                     "(ours and the library's GEMM, nearest measured point): "
                     + "; ".join(_short_src(m) for m in measured) + ".")
    parts.append(f"Dispatch never run on a GPU: send at the consumer's rate by SMs (2-GPU "
                 f"H200), IB transport not built (stated {fabric.ib_gbps:.0f} GB/s, "
                 f"{fabric.ib_latency_us:.0f} us), expand at {rates.expand_gbps_per_sm:.0f} GB/s "
                 f"per SM; plan + prepare {rates.plan_prepare_us:.0f} us; NCCL a2a "
                 f"{fabric.nccl_a2a_gbps:.0f} GB/s (2x H200); {fabric.gpus_per_node} GPUs per "
                 "node.")
    if bytes_check:
        parts.append(f"Dispatch bytes equal the counted file at {bytes_check['points']} points: "
                     f"{bytes_check['equal']}.")
    return " ".join(parts)


def format_table(rows: list[dict]) -> str:
    hdr = (f"{'model':<16}{'T':>6}{'W':>4}{'dcta':>5}{'ccta':>5}{'send':>7}{'up':>7}"
           f"{'disp||up':>9}{'combine':>8}{'layer':>8}{'built':>8}{'seq(a)':>8}{'comb(b)':>8}"
           f"{'x(a)':>6}{'x(b)':>6}{'up meas':>8}{'x(a)m':>6}{'x(b)m':>6}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(
            f"{r['model']:<16}{r['tokens_per_rank']:>6}{r['world_size']:>4}{r['dctas']:>5}"
            f"{r['ccta']:>5}{r['t_send']:>7.2f}{r['t_up']:>7.2f}{r['t_dispatch_up']:>9.2f}"
            f"{r['t_combine']:>8.2f}{r['t_layer']:>8.2f}{r['built']['t_layer']:>8.2f}"
            f"{r['t_seq']:>8.2f}{r['t_combine_only']:>8.2f}{r['speedup_vs_seq']:>6.2f}"
            f"{r['speedup_vs_combine_only']:>6.2f}"
            + (f"{r['up_measured']['t_up']:>8.2f}{r['up_measured']['speedup_vs_seq']:>6.2f}"
               f"{r['up_measured']['speedup_vs_combine_only']:>6.2f}" if "up_measured" in r
               else f"{'-':>8}{'-':>6}{'-':>6}")
            + (f"{r['up_window']['window']:>4}{r['up_window']['speedup_vs_combine_only']:>6.2f}"
               if "up_window" in r else ""))
    if any("up_window" in r for r in rows):
        lines[0] += f"{'win':>4}{'x(b)w':>6}"
        lines[1] = "-" * len(lines[0])
    return "\n".join(lines)


def plot(rows: list[dict], path: str, fabric: Fabric, rates: LayerRates,
         inputs: dict | None = None, bytes_check: dict | None = None):
    import textwrap

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = list(dict.fromkeys((r["model"], r["tokens_per_rank"]) for r in rows))
    fig, axes = plt.subplots(1, len(keys), figsize=(4.0 * len(keys), 4.2), sharey=True,
                             squeeze=False)
    for ax, (m, T) in zip(axes[0], keys):
        pts = sorted((r["world_size"], r) for r in rows
                     if r["model"] == m and r["tokens_per_rank"] == T)
        Ws = [w for w, _ in pts]
        ax.plot(Ws, [r["speedup_vs_seq"] for _, r in pts], "-o", label="vs (a) all sequential")
        ax.plot(Ws, [r["speedup_vs_combine_only"] for _, r in pts], "-s",
                label="vs (b) combine-only overlap")
        ax.plot(Ws, [r["built"]["speedup_vs_combine_only"] for _, r in pts], ":^",
                label="as built vs (b)")
        if all("up_measured" in r for _, r in pts):
            ax.plot(Ws, [r["up_measured"]["speedup_vs_combine_only"] for _, r in pts], "--v",
                    label="vs (b), up-projection at its measured rate")
        if all("up_window" in r for _, r in pts):
            ax.plot(Ws, [r["up_window"]["speedup_vs_combine_only"] for _, r in pts], "-.D",
                    label="vs (b), the best measured band window")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{m} @ {T}")
        ax.set_xlabel("GPUs (W)")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("projected layer speedup")
    note = textwrap.fill(assumptions_text(fabric, rates, inputs, bytes_check),
                         int(16 * 4.0 * len(keys)))
    n = note.count("\n") + 1
    fig.set_figheight(4.2 + 0.13 * n)
    fig.text(0.01, 0.005, note, fontsize=7)
    fig.tight_layout(rect=(0, (0.13 * n + 0.1) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(rows, path_json, fabric, cost, rates, meta, inputs=None, bytes_check=None,
          producer_check=None):
    """The projection's JSON: meta, every input with its source, the assumptions, the checks
    and the rows."""
    doc = dict(meta=meta, inputs=inputs, fabric=asdict(fabric), cost_model=asdict(cost),
               rates=asdict(rates), assumptions=ASSUMPTIONS,
               assumptions_text=assumptions_text(fabric, rates, inputs, bytes_check),
               bytes_check=bytes_check, producer_check=producer_check, rows=rows)
    with open(path_json, "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def summary(rows: list[dict]) -> dict:
    """Per model@tokens: the W at which the layer is projected faster than each baseline, and
    the speedups by W (the prediction NOTES states); with the up-projection's measured rates
    too where the rows have them."""
    out = {}
    for r in rows:
        s = out.setdefault(f"{r['model']}@{r['tokens_per_rank']}", dict(vs_seq={}, vs_combine_only={}))
        s["vs_seq"][r["world_size"]] = round(r["speedup_vs_seq"], 3)
        s["vs_combine_only"][r["world_size"]] = round(r["speedup_vs_combine_only"], 3)
        for col in ("up_measured", "up_window"):
            if col in r:
                m = s.setdefault(col, dict(vs_seq={}, vs_combine_only={}))
                m["vs_seq"][r["world_size"]] = round(r[col]["speedup_vs_seq"], 3)
                m["vs_combine_only"][r["world_size"]] = round(r[col]["speedup_vs_combine_only"],
                                                              3)
    return out


__all__ = ["ASSUMPTIONS", "UPPROJ_EXTRA", "UPPROJ_FILE", "UPPROJ_WINDOW_FILES", "band_ready",
           "best_layer", "check_bytes", "draw_ids", "format_table", "gemm_finish", "input_sources", "layer_rows", "LayerRates",
           "plot", "predict_layer", "project_layer", "summary", "UpRates", "window_order", "write"]
