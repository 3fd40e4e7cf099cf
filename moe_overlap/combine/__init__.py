"""The MoE combine: plan, dispatch into the plan layout, the layer, and its overlapped backend.

    routing -> exchange_counts -> plan_combine -> dispatch_to_plan (or MoEDispatch: each token
    once per destination rank) -> expert up-projection
    -> MoECombine.forward: producer grouped GEMM || consumer (bands to their owners) -> scale
"""
from .checks import AgreementTimeoutError, PeerInputError, RankMismatchError
from .comm_buffer import CommBuffer, heap_report
from .dispatch import dispatch_to_plan, exchange_counts
from .dispatch_dedup import MoEDispatch, dispatch_wire_bytes
from .layer import MoECombine, overlap_available
from .options import CombineOptions
from .plan import CombinePlan, plan_combine, recv_rows
from .reference import grouped_matmul

__all__ = ["AgreementTimeoutError", "CombineOptions", "CombinePlan", "CommBuffer", "MoECombine",
           "MoEDispatch", "PeerInputError", "RankMismatchError", "dispatch_to_plan",
           "dispatch_wire_bytes", "exchange_counts", "grouped_matmul", "heap_report",
           "overlap_available", "plan_combine", "recv_rows"]
