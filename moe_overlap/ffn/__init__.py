"""Tensor-parallel FFN layers: ``FusedFFN`` (dense) and ``ShardedExperts`` (experts split over
the group), with a plain-torch reference backend and a fused backend (compute kernel || band
all-reduce)."""
from .activations import ACT2, ACTIVATIONS, check_activation
from .compute_chained import ChainedFFNCompute
from .layers import (BACKENDS, COMMS, FusedFFN, ShardedExperts, check_compute_options,
                     fused_default_allreduce_band_rows, fused_default_ccta, padded_expert_layout)
from .options import FFNOptions

__all__ = ["ACT2", "ACTIVATIONS", "BACKENDS", "COMMS", "ChainedFFNCompute", "FFNOptions",
           "FusedFFN", "ShardedExperts", "check_activation", "check_compute_options",
           "fused_default_allreduce_band_rows",
           "fused_default_ccta", "padded_expert_layout"]
