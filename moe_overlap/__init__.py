"""moe-overlap: hide MoE combine and tensor-parallel all-reduce communication behind GEMMs, tile by tile."""
from .combine import CombinePlan, MoECombine, plan_combine, recv_rows
from .ffn import FusedFFN, ShardedExperts

__all__ = ["CombinePlan", "FusedFFN", "MoECombine", "ShardedExperts", "plan_combine", "recv_rows"]
__version__ = "0.1.0"
