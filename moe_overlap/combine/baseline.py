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

from .reference import source_to_expert_major, world


def _time_ms(fn, reps=5):
    for _ in range(2):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def _scale_fp32(recv, rows, w):
    T, k = rows.shape
    g = recv.index_select(0, rows.reshape(-1)).view(T, k, recv.shape[1])
    return torch.einsum("tkn,tk->tn", g.float(), w.float()).to(recv.dtype)


def _scale_bmm(recv, rows, w):
    """Gather in bf16, then a batched [1 x k] @ [k x N] product (fp32 accumulation in cuBLAS)."""
    T, k = rows.shape
    g = recv.index_select(0, rows.reshape(-1)).view(T, k, recv.shape[1])
    return torch.bmm(w.to(recv.dtype).unsqueeze(1), g).squeeze(1)


class SequentialBaseline:
    """Prepared for one routing: expert_counts [W, E] (all-gathered) and this rank's topk_ids.

    On CUDA each stage picks its fastest plain-torch variant once (timed on the first call):
    - expert GEMM into the all-to-all's source-major send order: `grouped_mm` or `loop`
      (cuBLAS per expert) followed by one row permutation, or `blocks` (cuBLAS per
      (expert, source) block written straight into the send buffer, no permutation);
    - scale: `fp32` (gather, fp32 einsum), `bmm` (gather, batched GEMM), or `compiled`
      (torch.compile of the fp32 gather + weighted sum: one fused kernel).
    """

    def __init__(self, expert_counts: torch.Tensor, topk_ids: torch.Tensor, group=None,
                 gemm: str = "auto", scale: str = "auto"):
        self.rank, self.W = world(group)
        self.group = group
        E = expert_counts.shape[1]
        El = E // self.W
        counts_h = expert_counts.tolist()
        self.rows_e = [sum(counts_h[s][self.rank * El + e] for s in range(self.W))
                       for e in range(El)]
        dev = topk_ids.device
        perm = torch.tensor(source_to_expert_major(counts_h, self.rank, El), dtype=torch.long,
                            device=dev)
        self.to_source_major = torch.empty_like(perm)
        self.to_source_major[perm] = torch.arange(perm.numel(), device=dev)
        # (compact row start, source-major row start, rows) of every (expert, source) block
        self.blocks = []
        src_off = [0] * self.W
        acc = 0
        for s in range(self.W):
            src_off[s] = acc
            acc += sum(counts_h[s][self.rank * El:(self.rank + 1) * El])
        comp = 0
        for e in range(El):
            for s in range(self.W):
                n = counts_h[s][self.rank * El + e]
                sm = src_off[s] + sum(counts_h[s][self.rank * El:self.rank * El + e])
                if n:
                    self.blocks.append((comp, sm, n, e))
                comp += n
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
        self.gemm, self.scale_kind = gemm, scale
        self.variant_ms = {}  # what auto-selection timed: {"gemm": {...}, "scale": {...}}
        self._recv = None
        self._compiled = None

    # ---- stage 1: expert GEMM, rows in source-major (send) order --------------------------
    def expert_gemm(self, h: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
        if self.gemm == "auto":
            self.gemm = self._pick("gemm", self._gemm_variants(), h, w_down)
        return self._send(self.gemm, h, w_down)

    def _gemm_variants(self):
        out = ["loop", "blocks"]
        fn = getattr(torch, "_grouped_mm", None)
        if fn is not None:
            out.append("grouped_mm")
        return out

    def _send(self, kind, h, w_down):
        N = w_down.shape[2]
        if kind == "blocks":
            send = torch.empty(h.shape[0], N, dtype=h.dtype, device=h.device)
            for comp, sm, n, e in self.blocks:
                torch.matmul(h[comp:comp + n], w_down[e], out=send[sm:sm + n])
            return send
        if kind == "grouped_mm":
            y = torch._grouped_mm(h, w_down, offs=self.offs)
        else:
            y = torch.empty(h.shape[0], N, dtype=h.dtype, device=h.device)
            start = 0
            for e, n in enumerate(self.rows_e):
                if n:
                    torch.matmul(h[start:start + n], w_down[e], out=y[start:start + n])
                start += n
        return y.index_select(0, self.to_source_major)

    def _pick(self, what, variants, *args):
        """The fastest variant that runs (CPU: the first)."""
        if not args[0].is_cuda:
            return variants[0]
        times = {}
        for v in variants:
            try:
                fn = (lambda v=v: self._send(v, *args)) if what == "gemm" else \
                    (lambda v=v: self._scale(v, *args))
                times[v] = _time_ms(fn)
            except Exception as e:  # noqa: BLE001 - a variant this build or layout lacks
                times_failed = self.variant_ms.setdefault(what + "_failed", {})
                times_failed[v] = f"{type(e).__name__}: {str(e)[:120]}"
                continue
        self.variant_ms[what] = times
        return min(times, key=times.get)

    # ---- stage 2: exchange ---------------------------------------------------------------
    def exchange(self, send: torch.Tensor) -> torch.Tensor:
        if self._recv is None or self._recv.shape[1] != send.shape[1]:
            self._recv = torch.empty(sum(self.out_splits), send.shape[1], dtype=send.dtype,
                                     device=send.device)
        if self.W == 1:
            self._recv.copy_(send)
        else:
            dist.all_to_all_single(self._recv, send, self.out_splits, self.in_splits,
                                   group=self.group)
        return self._recv

    # ---- stage 3: top-k weighted sum -----------------------------------------------------
    def scale(self, recv: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.scale_kind == "auto":
            variants = ["fp32", "bmm"]
            if recv.is_cuda:
                variants.append("compiled")
            self.scale_kind = self._pick("scale", variants, recv, topk_weights)
        return self._scale(self.scale_kind, recv, topk_weights)

    def _scale(self, kind, recv, w):
        if kind == "bmm":
            return _scale_bmm(recv, self.rows, w)
        if kind == "compiled":
            if self._compiled is None:
                self._compiled = torch.compile(_scale_fp32, dynamic=False)
            return self._compiled(recv, self.rows, w)
        return _scale_fp32(recv, self.rows, w)

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
