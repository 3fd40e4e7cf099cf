"""moe-overlap: hide MoE combine and tensor-parallel all-reduce communication behind GEMMs, tile by tile."""
from .combine import (CombineOptions, CombinePlan, CommBuffer, MoECombine, MoEDispatch,
                      plan_combine, recv_rows)
from .ffn import FFNOptions, FusedFFN, ShardedExperts

__all__ = ["CombineOptions", "CombinePlan", "CommBuffer", "FFNOptions", "FusedFFN", "MoECombine",
           "MoEDispatch", "ShardedExperts", "plan_combine", "recv_rows"]
__version__ = "0.1.0"
