"""The fair sequential baseline for benchmarks: the best plain-torch combine.

Same math as `reference.sequential_combine`, but prepared once per routing so the timed call has no
host synchronization: split sizes and permutations are host/device constants (a real MoE layer knows
them from its dispatch), the expert GEMM is `torch._grouped_mm` where it is available and faster
than cuBLAS per expert (checked once), the exchange is one NCCL all_to_all_single, and the weighted
sum is one gather + fused multiply-add-reduce.
"""
from __future__ import annotations

import torch

from ..runtime import collectives
from .reference import source_to_expert_major, world
from ..runtime.device import num_sms


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
    - with one rank (W = 1) no permutation (one source: the compact order is the send order)
      and no exchange (the scale reads the GEMM output), as the overlapped combine there;
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
        self.counts_h = counts_h
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
        if self.W == 1:  # one source: the compact order is the send order (no permutation)
            return y
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
        """The received rows: one all_to_all_single; with one rank, the send buffer itself (no
        copy: the overlapped combine moves nothing there either)."""
        if self.W == 1:
            return send
        if self._recv is None or self._recv.shape[1] != send.shape[1]:
            self._recv = torch.empty(sum(self.out_splits), send.shape[1], dtype=send.dtype,
                                     device=send.device)
        collectives.all_to_all_single(self._recv, send, self.out_splits, self.in_splits,
                                      group=self.group)
        return self._recv

    # ---- stage 3: top-k weighted sum -----------------------------------------------------
    def scale(self, recv: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.scale_kind == "auto":
            self.scale_kind = self._pick("scale", self._scale_variants(recv.is_cuda), recv,
                                         topk_weights)
        return self._scale(self.scale_kind, recv, topk_weights)

    def _scale_variants(self, cuda: bool):
        return ["fp32", "bmm"] + (["compiled"] if cuda else [])

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


class SameScaleBaseline(SequentialBaseline):
    """The headline baseline: differs from the overlapped combine only by the overlap.

    The fastest library GEMM variant on the unpadded rows (`SequentialBaseline`'s `loop`,
    `blocks` or `grouped_mm`, timed once), one NCCL all_to_all_single, then the overlapped path's
    own scale kernel (`moe_overlap.combine.scale.Scale`) on the received rows. Every stage is
    capturable, so it is timed like the overlapped call: CUDA-graph replays
    (`moe_overlap.timing.time_calls`). The arrival counters the kernel waits on are a zero
    tensor (the exchange has completed in stream order), so its wait costs one load. CUDA only.
    """

    def __init__(self, expert_counts: torch.Tensor, topk_ids: torch.Tensor, group=None,
                 gemm: str = "auto", scale_kernel=None):
        super().__init__(expert_counts, topk_ids, group, gemm=gemm, scale="ours")
        if not topk_ids.is_cuda:
            raise ValueError("SameScaleBaseline runs our CuTe DSL scale kernel: CUDA only")
        from .scale import Scale
        dev = topk_ids.device
        self._scale_kernel = scale_kernel or Scale(topk_ids.shape[1])
        self._rows32 = self.rows.to(torch.int32).contiguous()
        self._counters = torch.zeros(max(1, self.W), dtype=torch.int64, device=dev)
        self._expected = torch.zeros_like(self._counters)  # counters >= expected: no wait
        self._err = torch.zeros(8, dtype=torch.int64, device=dev)
        self._epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        self._num_sms = num_sms(dev)

    def scale(self, recv: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        T = self._rows32.shape[0]
        out = torch.empty(T, recv.shape[1], dtype=torch.bfloat16, device=recv.device)
        self._scale_kernel.launch(recv=recv, rows=self._rows32,
                                  weights=topk_weights.to(torch.float32).contiguous(), out=out,
                                  counters=self._counters, expected=self._expected,
                                  rank=self.rank, err=self._err, epoch=self._epoch,
                                  slot_bytes=0, num_sms=self._num_sms)
        return out

    def check_errors(self):
        """Synchronizes; raises RuntimeError if the scale kernel recorded an error."""
        from ..kernels.primitives import describe_error
        torch.cuda.synchronize(self._err.device)
        msg = describe_error(self._err.tolist())
        if msg:
            raise RuntimeError(msg)


def exchange_plan(counts_h, rank: int, experts_per_rank: int):
    """[(peer, send row start, rows, row offset in the peer's receive layout)] of what this rank
    sends to every other rank in the all-to-all: the same bytes NCCL moves between GPUs.
    counts_h[s][e]: assignments rank s sends to expert e (host lists)."""
    W, El = len(counts_h), experts_per_rank
    mine = slice(rank * El, (rank + 1) * El)
    out, start = [], 0
    for d in range(W):  # the send buffer is destination-major: rows back to token owner d
        n = sum(counts_h[d][mine])
        # d receives source-major: the rows of ranks before me come first
        off = sum(sum(counts_h[d][s * El:(s + 1) * El]) for s in range(rank))
        if d != rank and n:
            out.append((d, start, n, off))
        start += n
    return out


def copy_engine_exchange(send: torch.Tensor, peers: dict, pieces) -> None:
    """Peer-to-peer ``copy_`` of every piece of ``exchange_plan`` into the peers' buffers
    (``peers[d]``: rank d's receive buffer mapped here): the transfer floor of the exchange."""
    for d, start, n, off in pieces:
        peers[d][off:off + n].copy_(send[start:start + n])


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
