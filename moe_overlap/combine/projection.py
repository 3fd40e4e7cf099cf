"""Scale-out projection of the overlapped combine (W = 2..64) from measured rates.

The machines here stop at 2 GPUs, so larger world sizes are projected, not measured:

    T_overlap = max(T_gemm_ours, T_comm_ours) + T_tail + T_scale
    T_seq     = T_gemm_lib + T_all_to_all + T_scale              (the same-scale baseline)

- T_gemm_ours: our GEMM on the plan's rows (padding included) on num_sms - ccta SMs at the rate of
  `CostModel.gemm_tflops`; T_gemm_lib: the library on the valid rows on every SM at that rate
  (one rate for both: on packed plans our producer runs close to the library per valid row,
  bench/results/packed_gemm_*.json).
- Bytes: the rows this rank computed for other ranks, N * 2 bytes each; peers of the same node
  (`gpus_per_node`) over NVLink, the others over InfiniBand.
- T_comm_ours: max(NVLink bytes / the consumer's rate on ccta SMs (capped at the link), IB bytes /
  IB bandwidth) + the consumer's fixed cost + IB latency; T_tail: the last band's transfer.
- T_all_to_all: max(NVLink bytes / NCCL's measured all-to-all rate, IB bytes / IB bandwidth) +
  IB latency.
- T_scale: our scale kernel reads topk rows and writes one per token at its measured rate.
- Padding: the planner's own (plan_combine on routed counts of all W ranks, rank 0's plan).

Rates (`input_sources` names each with its file, card, GPUs, date, commit and freshness): the
GEMM rates per model from `PRODUCER_FILE` (one GPU, the producer as `MoECombine` launches it on
the model's plans at W = 8, and the library on the same rows unpadded: `ProducerRates`), at the
measured token count nearest the projected one; the consumer's, the links' and the scale's from
the last 2-GPU runs and the scale bench (`CostModel` / `Fabric` defaults; the NCCL all-to-all
rate has no result file); IB stated. Without a checkout (no bench/results/ beside the package)
`CostModel`'s one GEMM rate stands for both.

Two checks, on data the rates were not fitted on:
- `check_producer`: the GEMM rates of one measured token count predict the producer's and the
  library's times at the other (current one-GPU data; `HELD_OUT_PRODUCER_TOKENS`).
- `check_against_sweep`: the whole model with the rates of the sweep's era (`CostModel()`:
  GEMM rate fitted on sweep v2, consumer rates on combine_split_2xh200_pieces.json) on measured
  2-GPU sweep points, every rank's rows rebuilt from the sweep's routing (`sweep_ranks`): the
  slowest rank against the times the sweep took as the maximum over ranks. `HELD_OUT_SWEEP`
  names the points no rate was fitted on.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace

import torch

from .plan import plan_combine
from .shapes import MODELS
from .tuning import CCTA_CHOICES, CostModel
from ..provenance import Git, result_source, source_text
from ..routing import routing_counts

# bench/results/ files the rates come from (relative to it)
PRODUCER_FILE = "producer_models_h100_fffb23c_grid.json"  # the producer row's H100 headline
# the points of PRODUCER_FILE the rates come from: one per model@tokens, rank 0's plan at W = 8
# of a skewed routing (the slower of the grid's two routings for the combine: its rank 0 holds
# more rows than the mean)
PRODUCER_POINT = dict(world_size=8, routing="skewed")
CONSUMER_FILE = "combine_split_2xh200_pieces.json"
LINK_FILE = "consumer_run5_large_2xh200.json"
SCALE_FILE = "scale_bench_h200.json"
GEMM_FIT_FILE = "archive/combine_sweep_2xh200_v2.json"
SIGNAL_FILE = "archive/consumer_run3_fastlaunch.json"
SWEEP_FILES = ("combine_sweep_2xh200_v7.json", "combine_sweep_2xh200_v7_k14336.json")
# the sweep points no rate of CostModel() was fitted on (file -> ccta, None: every ccta): the
# GEMM rate comes from sweep v2 at K 1024 / 2048, N 8192 on every SM; the consumer's from the
# pieces file at 8 / 16 / 24 SMs, N 8192, balanced. Held out: the K 14336, N 4096 sweep (another
# shape for both; ccta 4 below every measured SM count) and sweep v7's 12-SM points (between the
# measured SM counts), every router mode.
HELD_OUT_SWEEP = {"combine_sweep_2xh200_v7_k14336.json": None, "combine_sweep_2xh200_v7.json": 12}


@dataclass
class Fabric:
    """Links and the rates that do not depend on ccta (GB/s per GPU and direction)."""
    gpus_per_node: int = 8
    nvlink_gbps: float = 380.0  # copy-engine GPU-to-GPU rate measured here
    nccl_a2a_gbps: float = 281.0  # NCCL all_to_all_single at 256 MiB, measured here (2 GPUs)
    ib_gbps: float = 50.0  # per GPU between nodes (stated, e.g. 400 Gb/s NICs)
    ib_latency_us: float = 10.0  # stated
    scale_tbps: float = 4.0  # our scale kernel's effective rate (bench/results/scale_bench_h200.json)

    def describe(self) -> str:
        return (f"{self.gpus_per_node} GPUs per node; NVLink: consumer rate by ccta (CostModel), "
                f"cap {self.nvlink_gbps:.0f} GB/s, NCCL a2a {self.nccl_a2a_gbps:.0f} GB/s; "
                f"IB {self.ib_gbps:.0f} GB/s per GPU (stated), latency {self.ib_latency_us:.0f} us; "
                f"scale at {self.scale_tbps:.1f} TB/s")


def _nearest(table: dict, model: str, tokens: int):
    """table[model@T] at the measured T nearest tokens in log scale, None where model has none."""
    pts = {int(k.split("@")[1]): v for k, v in table.items() if k.split("@")[0] == model}
    if not pts:
        return None
    return pts[min(pts, key=lambda t: abs(math.log(t / max(tokens, 1))))]


def _producer_points(doc: dict) -> list:
    """The points of a producer file the rates come from (`PRODUCER_POINT`), at most one per
    model@tokens."""
    pts = [p for p in doc["points"] if all(p.get(k) == v for k, v in PRODUCER_POINT.items())]
    keys = [f"{p['model']}@{p['tokens']}" for p in pts]
    if len(set(keys)) != len(keys):
        raise ValueError(f"two {PRODUCER_POINT} points of one model@tokens in the producer file")
    return pts


@dataclass
class ProducerRates:
    """The GEMM rates per model@tokens (TFLOP/s) from the producer bench's points of
    `PRODUCER_POINT` (the combine's case: ccta SMs left to the consumer): ours on the plan's
    rows (padding included) per SM of its grid, times num_sms (CostModel.gemm_tflops' unit), and
    the library (the faster of torch._grouped_mm and a per-expert mm loop) on the valid rows on
    every SM. The bench's routing is skewed; the projection's may not be."""
    producer_tflops: dict = field(default_factory=dict)
    library_tflops: dict = field(default_factory=dict)
    world_size: int = 8  # the W of the points read
    num_sms: int = 132

    @classmethod
    def from_doc(cls, doc: dict, tokens=None) -> "ProducerRates":
        """Rates of the `PRODUCER_POINT` points of a bench_producer_models result (its
        "ours_variant"); tokens: only these token counts (None: all)."""
        ours = doc.get("ours_variant", "default")
        pts = [p for p in _producer_points(doc) if tokens is None or p["tokens"] in tokens]
        if not pts:
            raise ValueError(f"no {PRODUCER_POINT} point in the producer file")
        Ws = {p["world_size"] for p in pts}
        prod, lib = {}, {}
        for p in pts:
            v = p["variants"][ours]
            key = f"{p['model']}@{p['tokens']}"
            flops = 2.0 * v["plan_rows"] * p["K"] * p["N"]
            prod[key] = flops / (v["ms"] * 1e-3) / v["grid"] * p["num_sms"] / 1e12
            lib[key] = p["gflop"] / (p["base_ms"] * 1e-3) / 1e3
        return cls(prod, lib, world_size=max(Ws), num_sms=pts[0]["num_sms"])

    def cost_models(self, model: str, tokens: int, cost: CostModel):
        """(ours, library): cost with gemm_tflops set to this model's rates (cost's own where
        the file has no point of the model)."""
        a, b = _nearest(self.producer_tflops, model, tokens), _nearest(self.library_tflops,
                                                                      model, tokens)
        return (replace(cost, gemm_tflops=a) if a else cost,
                replace(cost, gemm_tflops=b) if b else cost)


def check_producer(doc: dict) -> dict:
    """The GEMM rates of one measured token count predicting the other: per `PRODUCER_POINT`
    point of the producer file, the producer's and the library's time and their ratio from the
    rates of the same model at the nearest other token count (predicted / measured - 1). Summary:
    mean and max |error| of "producer_ms", "library_ms" and "ratio" (ours / library, the GEMM
    part of the speedup), and the points."""
    ours = doc.get("ours_variant", "default")
    pts = _producer_points(doc)
    per = []
    for p in pts:
        other = sorted({q["tokens"] for q in pts if q["model"] == p["model"]} - {p["tokens"]})
        if not other:
            continue
        fit = ProducerRates.from_doc(doc, tokens=other)
        v = p["variants"][ours]
        key_rate = _nearest(fit.producer_tflops, p["model"], p["tokens"])
        lib_rate = _nearest(fit.library_tflops, p["model"], p["tokens"])
        t_ours = 2.0 * v["plan_rows"] * p["K"] * p["N"] / (
            key_rate * 1e12 * v["grid"] / p["num_sms"]) * 1e3
        t_lib = p["gflop"] / (lib_rate * 1e3) * 1e3
        per.append(dict(label=p["label"], fitted_on_tokens=other, ccta=v["ccta"],
                        producer_ms=v["ms"], model_producer_ms=t_ours,
                        library_ms=p["base_ms"], model_library_ms=t_lib,
                        err_producer_ms=t_ours / v["ms"] - 1, err_library_ms=t_lib / p["base_ms"] - 1,
                        err_ratio=(t_ours / t_lib) / (v["ms"] / p["base_ms"]) - 1))
    summary = {k: dict(mean=sum(x[f"err_{k}"] for x in per) / len(per),
                       max_abs=max(abs(x[f"err_{k}"]) for x in per), n=len(per))
               for k in ("producer_ms", "library_ms", "ratio")} if per else {}
    return dict(summary=summary, points=per)


def consumer_rates(doc: dict, piece_bytes: int = 1 << 20) -> dict:
    """{ccta: GB/s} the consumer shipped in a bench_combine_split pieces run: its points with
    pieces of piece_bytes at the first shape (CostModel.copy_gbps' measured entries)."""
    first = doc["points"][0]["shape"]
    return {p["ccta"]: p["remote_GBs_ship"] for p in doc["points"]
            if p["shape"] == first and p["piece_rows"] * 2 * first["N"] == piece_bytes}


def input_sources(root: str | None, cost: CostModel, fabric: Fabric,
                  producer: ProducerRates | None, git: Git | None = None) -> dict:
    """Every input of the projection and the check: its value, unit and source (file, card,
    GPUs, date, commit and freshness: moe_overlap.provenance.result_source), or "stated" where no
    result file holds it. root: the checkout whose bench/results/ the rates come from (None: no
    checkout, CostModel's defaults stand)."""
    def src(name, area, gpus, field):
        if root is None:
            return dict(file=None, stated=f"built-in default, read from {name} when it was "
                        "written (no checkout here to check it against)")
        return result_source(root, name, area, gpus=gpus, git=git, field=field)

    def entry(value, unit, what, source):
        return dict(value=value, unit=unit, what=what, source=source)

    git = git or (Git(root) if root else None)
    out = {}
    if producer is not None:
        s = src(PRODUCER_FILE, "producer", 1, "points[W 8, skewed]: "
                "variants[ours_variant].plan_rows, .ms, .grid; base_ms, gflop")
        out["producer_tflops"] = entry(producer.producer_tflops, "TFLOP/s (per SM of its grid x num_sms)",
                                       "our producer as MoECombine launches it at W = "
                                       f"{producer.world_size}, on the plan's rows, per model@tokens",
                                       s)
        out["library_tflops"] = entry(producer.library_tflops, "TFLOP/s",
                                      "the library GEMM on the valid rows, every SM, per "
                                      "model@tokens (the same-scale baseline's GEMM)", s)
    else:
        out["gemm_tflops"] = entry(cost.gemm_tflops, "TFLOP/s",
                                   "one GEMM rate for ours and the library's (CostModel)",
                                   src(GEMM_FIT_FILE, "combine", 2, "points[].gemm_tflops"))
    out["copy_gbps"] = entry(cost.copy_gbps, "GB/s by ccta",
                             "the consumer's shipping rate on ccta SMs (8 / 16 / 24 measured, "
                             "2 / 4 extrapolated per SM), N 8192, balanced",
                             src(CONSUMER_FILE, "combine", 2, "points[piece_rows = 1 MiB]."
                                 "remote_GBs_ship"))
    out["signal_us"] = entry(cost.signal_us, "us", "the consumer's fixed cost per launch",
                             src(SIGNAL_FILE, "consumer", 2, "results (fast launch)"))
    link = src(LINK_FILE, "consumer", 2, "results[variant = copy_engine].gbps (387 at 128 MiB)")
    out["nvlink_gbps"] = entry(fabric.nvlink_gbps, "GB/s",
                               "NVLink cap of the consumer (380: the brief's copy rate; the copy "
                               "engine measured 387 at 128 MiB)", link)
    out["link_gbps"] = entry(cost.link_gbps, "GB/s", "the consumer's rate cap in CostModel (the "
                             "same NVLink copy rate)", link)
    out["num_sms"] = entry(cost.num_sms, "SMs", "SMs of the card (the GEMM's grid is num_sms - "
                           "ccta)", src(PRODUCER_FILE, "producer", 1, "num_sms")
                           if producer is not None else src(GEMM_FIT_FILE, "combine", 2, ""))
    out["nccl_a2a_gbps"] = entry(
        fabric.nccl_a2a_gbps, "GB/s", "NCCL all_to_all_single over NVLink (the baseline)",
        dict(file=None, stated="no result file: NCCL all_to_all_single at 256 MiB on 2x H200, "
             "2026-12-01, commit 01e8704 (bench/NOTES.md, session 9: the scale-out projection)"))
    out["scale_tbps"] = entry(fabric.scale_tbps, "TB/s", "our scale kernel's effective rate",
                              src(SCALE_FILE, "scale", 1, "variants[].TBs (the fastest)"))
    out["ib_gbps"] = entry(fabric.ib_gbps, "GB/s per GPU", "InfiniBand between nodes",
                           dict(file=None, stated="stated (--ib-gbps), not measured"))
    out["ib_latency_us"] = entry(fabric.ib_latency_us, "us", "InfiniBand latency",
                                 dict(file=None, stated="stated (--ib-latency-us), not measured"))
    out["gpus_per_node"] = entry(fabric.gpus_per_node, "GPUs", "NVLink domain",
                                 dict(file=None, stated="stated (--gpus-per-node)"))
    out["padding"] = entry("plan_combine", "", "rows per rank, by layout",
                           dict(file=None, stated="computed: the planner of this tree "
                                "(moe_overlap/combine/plan.py) on routing_counts of every rank"))
    return out


def format_sources(inputs: dict) -> str:
    """One line per input: name = value unit: its source."""
    lines = []
    for k, e in inputs.items():
        v = e["value"]
        if isinstance(v, dict):
            v = ", ".join(f"{a}: {b:.0f}" for a, b in v.items())
        lines.append(f"  {k} = {v} {e['unit']}".rstrip() + f": {source_text(e['source'])}")
    return "\n".join(lines)


def predict_call(rows: int, valid_rows: int, nvlink_rows: int, ib_rows: int, tokens: int,
                 topk: int, K: int, N: int, tile_m: int, ccta: int, mgb: int,
                 cost: CostModel, fabric: Fabric, lib_cost: CostModel | None = None) -> dict:
    """Projected times (seconds) of one combine on one rank and of its same-scale baseline.
    lib_cost: the library GEMM's rate (None: cost's, the same rate for both)."""
    row_bytes = 2 * N
    t_gemm = cost.gemm_s(2.0 * rows * K * N, ccta)
    t_gemm_lib = (lib_cost or cost).gemm_s(2.0 * valid_rows * K * N, 0)
    nv_bytes, ib_bytes = nvlink_rows * row_bytes, ib_rows * row_bytes
    nv_bw = min(cost.copy_bw(ccta), fabric.nvlink_gbps * 1e9)
    ib_bw = fabric.ib_gbps * 1e9
    lat = fabric.ib_latency_us * 1e-6 if ib_rows else 0.0
    t_comm = max(nv_bytes / nv_bw, ib_bytes / ib_bw) + cost.signal_us * 1e-6 + lat
    remote = nvlink_rows + ib_rows
    band_bw = ib_bw if ib_rows else nv_bw
    t_tail = min(tile_m, remote) * row_bytes / band_bw if remote else 0.0
    t_wait = (mgb - 1) * cost.gemm_s(2.0 * tile_m * N * K, ccta) if remote else 0.0
    t_scale = tokens * (topk + 1) * row_bytes / (fabric.scale_tbps * 1e12)
    t_a2a = max(nv_bytes / (fabric.nccl_a2a_gbps * 1e9), ib_bytes / ib_bw) + lat
    t_overlap = max(t_gemm, t_comm) + t_tail + t_wait + t_scale
    t_seq = t_gemm_lib + t_a2a + t_scale
    return dict(t_gemm=t_gemm, t_gemm_lib=t_gemm_lib, t_comm=t_comm, t_a2a=t_a2a,
                t_scale=t_scale, t_overlap=t_overlap, t_seq_same_scale=t_seq,
                speedup_same_scale=t_seq / t_overlap)


def plan_rows(model: str, W: int, layout: str, mode: str, tokens: int, tile_m: int = 128,
              seed: int = 0, fabric: Fabric | None = None) -> dict:
    """The planner's rows for rank 0 of W: laid out, valid, and the remote ones by link."""
    fabric = fabric or Fabric()
    E, topk, _, _ = MODELS[model]
    counts = routing_counts(W, tokens, E, topk, mode, seed)
    plan = plan_combine(counts, 0, tile_m=tile_m, layout=layout)
    El = E // W
    from_src = counts[:, :El].sum(1)  # rows rank 0 computes for each source
    node = torch.arange(W) // fabric.gpus_per_node
    nv = int(from_src[(node == 0) & (torch.arange(W) != 0)].sum())
    ib = int(from_src[node != 0].sum())
    return dict(rows=int(plan.total_rows), valid_rows=int(plan.valid_rows), nvlink_rows=nv,
                ib_rows=ib, tokens=tokens, packed=bool(int(plan.packed)))


def project(models=("deepseek-v3", "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x7b"),
            worlds=(2, 4, 8, 16, 32, 64), layouts=("aligned", "packed"), mode="balanced",
            tokens=4096, tile_m=128, mgb=2, cost: CostModel | None = None,
            fabric: Fabric | None = None, progress=None,
            producer: ProducerRates | None = None) -> list[dict]:
    """One row per (model, W, layout): the planner's padding, the best ccta's projected times.
    producer: the GEMM rates per model (None: cost's one rate for ours and the library's)."""
    cost, fabric = cost or CostModel(), fabric or Fabric()
    out = []
    for model in models:
        E, topk, K, N = MODELS[model]
        ours, lib = producer.cost_models(model, tokens, cost) if producer else (cost, None)
        for W in worlds:
            if E % W:
                continue
            for layout in layouts:
                if progress:
                    progress(f"{model} W={W} {layout}")
                pr = plan_rows(model, W, layout, mode, tokens, tile_m, fabric=fabric)
                best = min((predict_call(pr["rows"], pr["valid_rows"], pr["nvlink_rows"],
                                         pr["ib_rows"], tokens, topk, K, N, tile_m, c, mgb,
                                         ours, fabric, lib) | {"ccta": c}
                            for c in CCTA_CHOICES if c < cost.num_sms),
                           key=lambda r: r["t_overlap"])
                out.append(dict(model=model, world_size=W, layout=layout, mode=mode,
                                tokens_per_rank=tokens, gemm_tflops=ours.gemm_tflops,
                                library_tflops=(lib or ours).gemm_tflops, padding=pr["rows"] / max(pr["valid_rows"], 1),
                                **pr, **{k: (v * 1e3 if k.startswith("t_") else v)
                                         for k, v in best.items()}))
    return out


def sweep_ranks(points: list[dict], world_size: int = 2, tile_m: int = 128,
                file_points: list[dict] | None = None) -> list:
    """Every rank's rows of each sweep point, rebuilt from its routing: the sweep routes with
    seed 1000 * (shape index) + (router-mode index) in the order of its arguments, which is the
    order its file's points first list them (moe_overlap/combine/sweep.py), and records rank 0's
    plan. file_points: all points of the file `points` come from (None: `points` are). Per point
    a list of {rows, valid_rows, remote_rows} per rank, or None where rank 0's rebuilt plan
    differs from the recorded one (the routing is not the one rebuilt)."""
    shapes, modes = [], []
    for p in file_points or points:
        key = json.dumps(p["shape"], sort_keys=True)
        if key not in shapes:
            shapes.append(key)
        if p["mode"] not in modes:
            modes.append(p["mode"])
    cache, out = {}, []
    for p in points:
        sh = p["shape"]
        si, mi = shapes.index(json.dumps(sh, sort_keys=True)), modes.index(p["mode"])
        key = (si, mi, p["mgb"])
        if key not in cache:
            counts = routing_counts(world_size, sh["tokens"], sh["experts"], sh["topk"],
                                    p["mode"], seed=1000 * si + mi)
            El = sh["experts"] // world_size
            ranks = []
            for r in range(world_size):
                plan = plan_combine(counts, r, tile_m=tile_m, mgb=p["mgb"], layout="aligned",
                                    impl="torch")
                ranks.append(dict(rows=int(plan.total_rows),
                                  valid_rows=int(counts[:, r * El:(r + 1) * El].sum()),
                                  remote_rows=int(plan.stats()["remote_rows"])))
            cache[key] = ranks
        ranks = cache[key]
        rec = dict(rows=p["rows"], valid_rows=p["valid_rows"], remote_rows=p["remote_rows"])
        out.append(ranks if ranks[0] == rec else None)
    return out


def sweep_errors(points: list[dict], cost: CostModel | None = None,
                 fabric: Fabric | None = None, tile_m: int = 128, ranks=None) -> list[dict]:
    """Per sweep point, predicted / measured - 1 of t_gemm (the GEMM alone on every SM: the
    sweep times it at ccta 0), t_comm and t_overlap (at the point's ccta and mgb), each the
    maximum over ranks as the sweep takes it. ranks: `sweep_ranks(points)` (None: rank 0's
    recorded rows stand for every rank)."""
    cost, fabric = cost or CostModel(), fabric or Fabric()
    out = []
    for i, p in enumerate(points):
        sh = p["shape"]
        rk = ranks[i] if ranks is not None and ranks[i] is not None else [
            dict(rows=p["rows"], valid_rows=p["valid_rows"], remote_rows=p["remote_rows"])]
        pred = {"t_gemm": 0.0, "t_comm": 0.0, "t_overlap": 0.0}
        for r in rk:
            one = predict_call(r["rows"], r["valid_rows"], r["remote_rows"], 0, sh["tokens"],
                               sh["topk"], sh["K"], sh["N"], tile_m, p["ccta"], p["mgb"], cost,
                               fabric)
            one["t_gemm"] = cost.gemm_s(2.0 * r["rows"] * sh["K"] * sh["N"], 0)
            pred = {k: max(v, one[k]) for k, v in pred.items()}
        out.append(dict(K=sh["K"], N=sh["N"], mode=p["mode"], ccta=p["ccta"], mgb=p["mgb"],
                        ranks=len(rk), **{f"{k}_ms": p[f"{k}_ms"] for k in pred},
                        **{f"model_{k}_ms": v * 1e3 for k, v in pred.items()},
                        **{f"err_{k}": v * 1e3 / p[f"{k}_ms"] - 1.0 for k, v in pred.items()}))
    return out


def summarize(errors: list[dict]) -> dict:
    """{t_gemm | t_comm | t_overlap: {mean, max_abs, n}} of `sweep_errors`' points."""
    return {k: dict(mean=sum(e[f"err_{k}"] for e in errors) / len(errors),
                    max_abs=max(abs(e[f"err_{k}"]) for e in errors), n=len(errors))
            for k in ("t_gemm", "t_comm", "t_overlap")} if errors else {}


def check_against_sweep(points: list[dict], cost: CostModel | None = None,
                        fabric: Fabric | None = None, tile_m: int = 128,
                        all_ranks: bool = True, file_points: list[dict] | None = None) -> dict:
    """The model on measured 2-GPU sweep points of one file (their rows, ccta and mgb): relative
    errors of t_gemm, t_comm and t_overlap (predicted / measured - 1; `sweep_errors`),
    summarized. all_ranks: every rank's rows rebuilt from the routing (`sweep_ranks`; points
    whose routing does not rebuild keep rank 0's), else rank 0's for every rank."""
    ranks = sweep_ranks(points, tile_m=tile_m, file_points=file_points) if all_ranks else None
    return summarize(sweep_errors(points, cost, fabric, tile_m, ranks))


def check_sweep_files(docs: dict, cost: CostModel | None = None,
                      fabric: Fabric | None = None, tile_m: int = 128) -> dict:
    """`sweep_errors` on every point of each sweep file (docs: name -> its JSON), every rank's
    rows rebuilt per file: {t_gemm | t_comm | t_overlap: summary of every point, "held_out":
    summary of the HELD_OUT_SWEEP points, "points": [per point, with its file and whether held
    out], "files": [names]}."""
    errs = []
    for name, doc in docs.items():
        pts = doc["points"]
        ho = {id(p) for p in held_out(name, pts)}
        for p, e in zip(pts, sweep_errors(pts, cost, fabric, tile_m,
                                          sweep_ranks(pts, tile_m=tile_m))):
            errs.append(dict(e, file=name, held_out=id(p) in ho))
    return dict(summarize(errs), held_out=summarize([e for e in errs if e["held_out"]]),
                points=errs, files=list(docs))


def held_out(name: str, points: list[dict]) -> list[dict]:
    """The points of sweep file `name` in HELD_OUT_SWEEP (none where the file is not there)."""
    if name not in HELD_OUT_SWEEP:
        return []
    ccta = HELD_OUT_SWEEP[name]
    return [p for p in points if ccta is None or p["ccta"] == ccta]


def _short_src(src: dict) -> str:
    """file (card, date, commit, freshness word) or the stated text's first clause."""
    if not src.get("file"):
        return src.get("stated", "stated").split(":")[0]
    f = src["freshness"]["state"]
    return (f"{src['file'].replace('bench/results/', '')}: {src['card']} x{src['gpus']}, "
            f"{src['date'] or '?'}, {src['commit'] or '?'}, {f}")


def assumptions_text(fabric: Fabric, inputs: dict | None = None, check: dict | None = None,
                     producer_check: dict | None = None) -> str:
    """What the plot states: a projection, the rates with their sources and dates, the errors of
    the checks."""
    parts = ["Projection, not a measurement."]
    if inputs:
        if "producer_tflops" in inputs:
            parts.append("GEMM rates per model (ours and the library's): "
                         + _short_src(inputs["producer_tflops"]["source"])
                         + " (skewed routing, W = 8; applied to every W and routing).")
        else:
            parts.append("GEMM rate: " + _short_src(inputs["gemm_tflops"]["source"]) + ".")
        cg = inputs["copy_gbps"]["value"]
        parts.append(
            f"Link rates (last 2-GPU runs): consumer {min(cg.values()):.0f}-{max(cg.values()):.0f}"
            f" GB/s by ccta ({_short_src(inputs['copy_gbps']['source'])}), NVLink cap "
            f"{fabric.nvlink_gbps:.0f} GB/s ({_short_src(inputs['nvlink_gbps']['source'])}), NCCL "
            f"a2a {fabric.nccl_a2a_gbps:.0f} GB/s (no result file: 2x H200, 2026-12-01, 01e8704)"
            f"; scale {fabric.scale_tbps:.1f} TB/s ({_short_src(inputs['scale_tbps']['source'])}).")
        parts.append(f"Stated: IB {fabric.ib_gbps:.0f} GB/s per GPU, {fabric.ib_latency_us:.0f} us;"
                     f" {fabric.gpus_per_node} GPUs per node.")
    else:
        parts.append(fabric.describe() + ".")
    if producer_check and producer_check.get("summary"):
        ps = producer_check["summary"]
        parts.append(f"GEMM rates held out across token counts: ours/library error max "
                     f"|{100 * ps['ratio']['max_abs']:.0f}| %, producer time max "
                     f"|{100 * ps['producer_ms']['max_abs']:.0f}| %.")
    if check:
        c = check.get("held_out") or check
        which = "held-out" if check.get("held_out") else "(none held out: in-sample)"
        if "t_overlap" in c:
            parts.append(f"Model on {which} 2-GPU sweep points (their era's rates): "
                         f"t_overlap error mean {100 * c['t_overlap']['mean']:+.0f} %, max "
                         f"|{100 * c['t_overlap']['max_abs']:.0f}| % (n = {c['t_overlap']['n']}).")
    return " ".join(parts)


def plot(rows: list[dict], path: str, fabric: Fabric, check: dict | None = None,
         inputs: dict | None = None, producer_check: dict | None = None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 4.2), sharey=True,
                             squeeze=False)
    for ax, m in zip(axes[0], models):
        for layout, style in (("aligned", "--o"), ("packed", "-s")):
            pts = sorted((r["world_size"], r["speedup_same_scale"]) for r in rows
                         if r["model"] == m and r["layout"] == layout)
            if pts:
                ax.plot(*zip(*pts), style, label=layout)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(m)
        ax.set_xlabel("GPUs (W)")
        ax.legend()
    axes[0][0].set_ylabel("projected speedup over the same-scale baseline")
    import textwrap
    width = 4.2 * len(models)
    note = textwrap.fill(assumptions_text(fabric, inputs, check, producer_check),
                         int(16 * width))
    fig.set_figheight(4.2 + 0.13 * (note.count("\n") + 1))
    fig.text(0.01, 0.005, note, fontsize=7)
    fig.tight_layout(rect=(0, (0.13 * (note.count("\n") + 1) + 0.1) / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_table(rows: list[dict]) -> str:
    hdr = (f"{'model':<16}{'W':>4} {'layout':<8}{'pad':>6}{'ccta':>5}{'gemm':>8}{'comm':>8}"
           f"{'a2a':>8}{'overlap':>9}{'seq':>8}{'speedup':>8}")
    lines = [hdr, "-" * len(hdr)]
    for r in rows:
        lines.append(f"{r['model']:<16}{r['world_size']:>4} {r['layout']:<8}{r['padding']:>6.2f}"
                     f"{r['ccta']:>5}{r['t_gemm']:>8.3f}{r['t_comm']:>8.3f}{r['t_a2a']:>8.3f}"
                     f"{r['t_overlap']:>9.3f}{r['t_seq_same_scale']:>8.3f}"
                     f"{r['speedup_same_scale']:>8.2f}")
    return "\n".join(lines)


def write(rows, path_json, fabric, cost, check, meta, inputs=None, producer_check=None,
          check_inputs=None):
    """The projection's JSON: meta, every input with its source (inputs), the checks (check:
    the sweep's, with the inputs of its era in check_inputs; producer_check), the assumptions'
    text and the rows."""
    doc = dict(meta=meta, inputs=inputs, fabric=asdict(fabric), cost_model=asdict(cost),
               assumptions=assumptions_text(fabric, inputs, check, producer_check),
               check=check, check_inputs=check_inputs, producer_check=producer_check, rows=rows)
    with open(path_json, "w") as f:
        json.dump(doc, f, indent=1)
    return doc
