"""moe-overlap: hide MoE combine and tensor-parallel all-reduce communication behind GEMMs, tile by tile."""
from .combine import MoECombine
from .planner import CombinePlan, plan_combine, recv_rows

__all__ = ["CombinePlan", "MoECombine", "plan_combine", "recv_rows"]
__version__ = "0.1.0"
