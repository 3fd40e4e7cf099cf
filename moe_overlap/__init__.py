"""moe-overlap: hide MoE combine and tensor-parallel all-reduce communication behind GEMMs, tile by tile."""
from .combine import (CombineOptions, CombinePlan, CommBuffer, MoECombine, MoEDispatch,
                      plan_combine, recv_rows)
from .ffn import FFNOptions, FusedFFN, ShardedExperts
from .moe_layer import MoELayer

__all__ = ["CombineOptions", "CombinePlan", "CommBuffer", "FFNOptions", "FusedFFN", "MoECombine",
           "MoEDispatch", "MoELayer", "ShardedExperts", "plan_combine", "recv_rows"]
__version__ = "0.1.0"
