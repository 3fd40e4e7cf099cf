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

`check_against_sweep` replays the model on measured 2-GPU sweep points and reports its error.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from .plan import plan_combine
from .shapes import MODELS
from .tuning import CCTA_CHOICES, CostModel
from ..routing import routing_counts


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


def predict_call(rows: int, valid_rows: int, nvlink_rows: int, ib_rows: int, tokens: int,
                 topk: int, K: int, N: int, tile_m: int, ccta: int, mgb: int,
                 cost: CostModel, fabric: Fabric) -> dict:
    """Projected times (seconds) of one combine on one rank and of its same-scale baseline."""
    row_bytes = 2 * N
    t_gemm = cost.gemm_s(2.0 * rows * K * N, ccta)
    t_gemm_lib = cost.gemm_s(2.0 * valid_rows * K * N, 0)
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
            fabric: Fabric | None = None, progress=None) -> list[dict]:
    """One row per (model, W, layout): the planner's padding, the best ccta's projected times."""
    cost, fabric = cost or CostModel(), fabric or Fabric()
    out = []
    for model in models:
        E, topk, K, N = MODELS[model]
        for W in worlds:
            if E % W:
                continue
            for layout in layouts:
                if progress:
                    progress(f"{model} W={W} {layout}")
                pr = plan_rows(model, W, layout, mode, tokens, tile_m, fabric=fabric)
                best = min((predict_call(pr["rows"], pr["valid_rows"], pr["nvlink_rows"],
                                         pr["ib_rows"], tokens, topk, K, N, tile_m, c, mgb,
                                         cost, fabric) | {"ccta": c}
                            for c in CCTA_CHOICES if c < cost.num_sms),
                           key=lambda r: r["t_overlap"])
                out.append(dict(model=model, world_size=W, layout=layout, mode=mode,
                                tokens_per_rank=tokens, padding=pr["rows"] / max(pr["valid_rows"], 1),
                                **pr, **{k: (v * 1e3 if k.startswith("t_") else v)
                                         for k, v in best.items()}))
    return out


def check_against_sweep(points: list[dict], cost: CostModel | None = None,
                        fabric: Fabric | None = None, tile_m: int = 128) -> dict:
    """The model on measured 2-GPU sweep points (their rows, ccta and mgb): relative errors of
    t_gemm, t_comm and t_overlap (predicted / measured - 1)."""
    cost, fabric = cost or CostModel(), fabric or Fabric()
    errs = {"t_gemm": [], "t_comm": [], "t_overlap": []}
    for p in points:
        sh = p["shape"]
        pred = predict_call(p["rows"], p["valid_rows"], p["remote_rows"], 0, sh["tokens"],
                            sh["topk"], sh["K"], sh["N"], tile_m, p["ccta"], p["mgb"], cost,
                            fabric)
        for k in errs:
            errs[k].append(pred[k] * 1e3 / p[f"{k}_ms"] - 1.0)
    return {k: dict(mean=sum(v) / len(v), max_abs=max(abs(x) for x in v), n=len(v))
            for k, v in errs.items() if v}


def plot(rows: list[dict], path: str, fabric: Fabric, check: dict | None = None):
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
    note = "Projection, not a measurement. " + fabric.describe()
    if check:
        note += (f". Check on 2-GPU sweep points: t_overlap error mean "
                 f"{100 * check['t_overlap']['mean']:+.0f} %, max |{100 * check['t_overlap']['max_abs']:.0f}| %")
    fig.text(0.01, 0.005, note, fontsize=7, wrap=True)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
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


def write(rows, path_json, fabric, cost, check, meta):
    with open(path_json, "w") as f:
        json.dump(dict(meta=meta, fabric=asdict(fabric), cost_model=asdict(cost), check=check,
                       rows=rows), f, indent=1)

