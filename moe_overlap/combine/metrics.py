"""Derived fields of one combine sweep point, from its measured times (pure: no torch).

Times in ms. bound = max(t_gemm, t_comm): the time a perfect overlap of our GEMM and our
transfer would take. speedup_* = baseline / t_overlap. hidden_fraction: the share of t_comm not
added to t_overlap (clamped to [0, 1]). padding = plan rows / valid rows (>= 1: rows the tile
height adds).
"""
from __future__ import annotations

import math

TIME_FIELDS = ("t_gemm", "t_comm", "t_overlap", "t_seq_same_scale", "t_seq_torch", "t_a2a_nccl",
               "t_a2a_copy_engine", "t_scale")


def _ratio(num, den):
    if num is None or den is None or not math.isfinite(num) or not math.isfinite(den) \
            or den <= 0:
        return float("nan")
    return num / den


def point_fields(*, t_gemm, t_comm, t_overlap, t_seq_same_scale, t_seq_torch, t_a2a_nccl,
                 t_a2a_copy_engine, t_scale, plan_rows, valid_rows) -> dict:
    """The sweep JSON's per-point timing fields (NaN where a time is missing)."""
    times = dict(t_gemm=t_gemm, t_comm=t_comm, t_overlap=t_overlap,
                 t_seq_same_scale=t_seq_same_scale, t_seq_torch=t_seq_torch,
                 t_a2a_nccl=t_a2a_nccl, t_a2a_copy_engine=t_a2a_copy_engine, t_scale=t_scale)
    for k, v in times.items():
        if v is not None and v < 0:
            raise ValueError(f"{k}={v} < 0")
    if plan_rows < valid_rows or valid_rows < 0:
        raise ValueError(f"plan_rows={plan_rows} < valid_rows={valid_rows}")
    bound = max(t_gemm, t_comm) if all(
        v is not None and math.isfinite(v) for v in (t_gemm, t_comm)) else float("nan")
    if math.isfinite(t_comm or float("nan")) and t_comm > 0 and math.isfinite(bound):
        hidden = min(1.0, max(0.0, (t_gemm + t_comm - t_overlap) / t_comm))
    else:
        hidden = float("nan")
    return dict(times, bound=bound,
                speedup_same_scale=_ratio(t_seq_same_scale, t_overlap),
                speedup_torch=_ratio(t_seq_torch, t_overlap),
                overlap_over_bound=_ratio(t_overlap, bound),
                hidden_fraction=hidden,
                comm_over_copy_engine=_ratio(t_comm, t_a2a_copy_engine),
                plan_rows=int(plan_rows), valid_rows=int(valid_rows),
                padding=_ratio(float(plan_rows), float(valid_rows)) if valid_rows else 1.0)
