"""The fair sequential baseline for benchmarks: the best plain-torch combine.

Same math as `reference.sequential_combine`, but prepared once per routing so the timed call has no
host synchronization: split sizes and permutations are host/device constants (a real MoE layer knows
them from its dispatch), the expert GEMM is `torch._grouped_mm` where it is available and faster
than cuBLAS per expert (checked once), the exchange is one NCCL all_to_all_single, and the weighted
sum is one gather + fused multiply-add-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .reference import _source_to_expert_major, world


def _grouped_mm_fn():
    fn = getattr(torch, "_grouped_mm", None)
    return fn


class SequentialBaseline:
    """Prepared for one routing: expert_counts [W, E] (all-gathered) and this rank's topk_ids."""

    def __init__(self, expert_counts: torch.Tensor, topk_ids: torch.Tensor, group=None,
                 gemm: str = "auto"):
        self.rank, self.W = world(group)
        self.group = group
        E = expert_counts.shape[1]
        El = E // self.W
        counts_h = expert_counts.tolist()
        self.rows_e = [sum(counts_h[s][self.rank * El + e] for s in range(self.W))
                       for e in range(El)]
        dev = topk_ids.device
        perm = torch.tensor(_source_to_expert_major(counts_h, self.rank, El), dtype=torch.long,
                            device=dev)
        self.to_source_major = torch.empty_like(perm)
        self.to_source_major[perm] = torch.arange(perm.numel(), device=dev)
        self.in_splits = [sum(counts_h[s][self.rank * El:(self.rank + 1) * El])
                          for s in range(self.W)]
        self.out_splits = [sum(counts_h[self.rank][r * El:(r + 1) * El]) for r in range(self.W)]
        T, k = topk_ids.shape
        order = torch.argsort(topk_ids.reshape(-1), stable=True)
        rows = torch.empty_like(order)
        rows[order] = torch.arange(order.numel(), device=dev)
        self.rows = rows.view(T, k)
        self.offs = torch.tensor(self.rows_e, device=dev, dtype=torch.int32).cumsum(0).to(
            torch.int32)
        self.gemm = gemm
        self._recv = None

    # ---- parts ---------------------------------------------------------------------------
    def expert_gemm(self, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        if self.gemm == "auto":
            self.gemm = self._pick_gemm(h, w_down)
        if self.gemm == "grouped_mm":
            return _grouped_mm_fn()(h, w_down, offs=self.offs)
        out = torch.empty(h.shape[0], w_down.shape[2], dtype=h.dtype, device=h.device)
        start = 0
        for e, n in enumerate(self.rows_e):
            if n:
                torch.matmul(h[start:start + n], w_down[e], out=out[start:start + n])
            start += n
        return out

    def _pick_gemm(self, h, w_down) -> str:
        """grouped_mm if it runs here and beats the per-expert loop (timed once)."""
        fn = _grouped_mm_fn()
        if fn is None or not h.is_cuda:
            return "loop"
        try:
            fn(h, w_down, offs=self.offs)
        except Exception:  # noqa: BLE001 - unsupported layout/arch: fall back
            return "loop"
        times = {}
        for name in ("grouped_mm", "loop"):
            self.gemm = name
            for _ in range(2):
                self.expert_gemm(h, w_down)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(5):
                self.expert_gemm(h, w_down)
            e.record()
            e.synchronize()
            times[name] = s.elapsed_time(e)
        # every rank must take the same choice only for symmetry of timing; take the local best
        return min(times, key=times.get)

    def exchange(self, y: torch.Tensor) -> torch.Tensor:
        send = y.index_select(0, self.to_source_major)
        if self._recv is None or self._recv.shape[1] != y.shape[1]:
            self._recv = torch.empty(sum(self.out_splits), y.shape[1], dtype=y.dtype,
                                     device=y.device)
        if self.W == 1:
            self._recv.copy_(send)
        else:
            dist.all_to_all_single(self._recv, send, self.out_splits, self.in_splits,
                                   group=self.group)
        return self._recv

    def scale(self, recv: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        T, k = self.rows.shape
        g = recv.index_select(0, self.rows.reshape(-1)).view(T, k, -1)
        return torch.einsum("tkn,tk->tn", g.float(), topk_weights.float()).to(recv.dtype)

    def __call__(self, h_compact: torch.Tensor, w_down: torch.Tensor,
                 topk_weights: torch.Tensor) -> torch.Tensor:
        return self.scale(self.exchange(self.expert_gemm(h_compact, w_down)), topk_weights)


def plan_to_compact_rows(plan, expert_counts: torch.Tensor) -> torch.Tensor:
    """Row indices into the plan layout, in the compact layout's order (expert, source, arrival),
    so that `h_plan[idx]` is the baseline's input with the same data."""
    W, El, rank = plan.world_size, plan.experts_per_rank, plan.rank
    local = expert_counts.to(torch.int64)[:, rank * El:(rank + 1) * El].t()  # [El, W]
    n = local.reshape(-1)
    start = torch.cumsum(n, 0) - n
    blk = torch.repeat_interleave(torch.arange(n.numel(), device=n.device), n)
    j = torch.arange(blk.numel(), device=n.device) - start[blk]
    e, s = blk // W, blk % W
    return (plan.expert_row_start.long()[e] + plan.group_row_start.long()[e, s] + j)
