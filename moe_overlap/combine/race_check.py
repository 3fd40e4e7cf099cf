"""Validation of the overlapped combine that fails on an ordering race.

A race in the overlapped path (a band shipped before its rows are stored, the scale reading a row
before it arrived) reads stale memory. If that memory already holds the right answer (the same
inputs as the last call) the race is invisible; so every checked call here
- gets fresh random ``h`` (and, every ``routing_every`` calls, a fresh routing and plan);
- fills the receive buffers (both slots), the GEMM output ``y`` and ``out`` with NaN first;
- is compared bitwise with our non-overlapped path (``OverlapCombine.forward(overlap=False)``) on
  the same inputs, and within ``tol`` relative error of the independent fp32 baseline
  (``SequentialBaseline``: torch matmul per expert, NCCL all_to_all_single, fp32 weighted sum).
``validate_calls`` runs eager calls; ``soak`` replays one captured CUDA graph with new data
written into its captured tensors, poisoned before every replay, and reports memory before and
after. Both are collective (every rank calls them with the same arguments).

Zero-token ranks: ``empty_ranks`` (validate_calls) names ranks that route no token in every
call (their ``out`` is [0, N]; they still own experts, compute and ship the other ranks' rows).
The soak passes (``soak_passed``) only with every checked replay correct and the allocated device
memory flat after warm-up: what it holds at the end exceeds what it held after the capture by no
more than one routing's worth of host-prepared tensors (``memory_slack_bytes``).

``poison_``, ``compare``, ``summarize``, ``rank_tokens``, ``memory_slack_bytes`` and
``soak_passed`` are plain Python / torch and run on the CPU too.
"""
from __future__ import annotations

import torch

TOL = 8e-3


def poison_(*tensors) -> None:
    """Fill every floating-point tensor given with NaN (None and integer tensors are skipped)."""
    for t in tensors:
        if t is not None and t.is_floating_point():
            t.fill_(float("nan"))


def compare(out: torch.Tensor, out_ref: torch.Tensor, ref32: torch.Tensor,
            tol: float = TOL) -> dict:
    """One call's verdict: bitwise equal to the non-overlapped output, every value finite, and
    relative error (Frobenius) against the fp32 baseline <= tol."""
    bitwise = bool(out.shape == out_ref.shape and out.dtype == out_ref.dtype
                   and torch.equal(out.view(torch.int16) if out.dtype == torch.bfloat16 else out,
                                   out_ref.view(torch.int16)
                                   if out_ref.dtype == torch.bfloat16 else out_ref))
    o = out.float()
    finite = bool(torch.isfinite(o).all())
    r = ref32.float()
    err = float((o - r).norm() / r.norm().clamp_min(1e-30)) if finite else float("inf")
    return dict(bitwise=bitwise, finite=finite, rel_err=err,
                ok=bool(bitwise and finite and err <= tol))


def rank_tokens(tokens: int, rank: int, empty_ranks=()) -> int:
    """This rank's tokens per call: 0 for the ranks in ``empty_ranks``, else ``tokens``."""
    return 0 if rank in tuple(empty_ranks) else tokens


def memory_slack_bytes(world_size: int, tokens: int, topk: int) -> int:
    """How much more device memory a soak may hold at its end than after its capture without a
    leak: the routing it holds then (replaced every few replays) may differ from the first one
    in the sizes that follow the routing (the baseline's row permutation and the plan's compact
    rows: int64, at most every rank's tokens x topk rows each), plus 64 KiB of allocator
    rounding. A leak of one 512-byte block per replay exceeds it within a few hundred replays
    at the grid's sizes."""
    return 2 * 8 * world_size * tokens * topk + (64 << 10)


def soak_passed(s: dict) -> tuple[bool, str]:
    """(passed, why not) of a soak record (``soak``'s dict): every requested replay ran, every
    checked one passed, and the memory stayed flat (``memory_slack_bytes``)."""
    why = []
    if s.get("failures", 1) or not s.get("calls"):
        why.append(f"{s.get('failures')} failed of {s.get('calls')} checked replays")
    expect = -(-int(s.get("replays", 0)) // max(1, int(s.get("check_every", 1))))
    if s.get("calls", 0) < expect:
        why.append(f"stopped after {s.get('calls')} of {expect} checked replays")
    before, after = s.get("memory_allocated_before"), s.get("memory_allocated_after")
    slack = s.get("memory_slack_bytes")
    if before is None or after is None or slack is None:
        why.append("memory not recorded")
    elif after - before > slack:
        why.append(f"device memory grew {after - before} B (> {slack} B allowed) over the "
                   "replays")
    return not why, "; ".join(why)


def summarize(records: list[dict]) -> dict:
    """calls, failures, max relative error, and whether every call was bitwise equal."""
    errs = [r["rel_err"] for r in records]
    return dict(calls=len(records), failures=sum(not r["ok"] for r in records),
                max_rel_err=max(errs) if errs else float("nan"),
                all_bitwise=all(r["bitwise"] for r in records))


# ---- GPU (collective) ---------------------------------------------------------------------------
def _agree_ok(ok: bool, device, group) -> bool:
    """True on every rank only if every rank's call passed."""
    from ..timing import max_over_ranks
    return max_over_ranks(0.0 if ok else 1.0, device, group) == 0.0


class _Routing:
    """One routing of the case: ids, gates, counts, plan, the fp32 baseline, compact rows."""

    def __init__(self, ov, tokens, mode, seed, mgb, layout="auto", order="remote_first",
                 empty_ranks=()):
        from .baseline import SequentialBaseline, plan_to_compact_rows
        from .dispatch import exchange_counts
        from .plan import plan_combine
        from ..routing import route
        # tokens: every rank's capacity (the plans' max_rows); a rank in empty_ranks routes none
        self.ids, self.gates = route(rank_tokens(tokens, ov.rank, empty_ranks), ov.num_experts,
                                     ov.topk, mode, seed=seed, rank=ov.rank, device=ov.device)
        self.counts = exchange_counts(self.ids, ov.num_experts, ov.group)
        self.plan = plan_combine(self.counts, ov.rank, tile_m=ov.tile_m, mgb=mgb,
                                 max_rows=ov.world_size * tokens * ov.topk, validate=False,
                                 layout=layout, order=order)
        self.base = SequentialBaseline(self.counts, self.ids, group=ov.group, gemm="loop",
                                       scale="fp32")
        self.compact = plan_to_compact_rows(self.plan, self.counts)

    def ref32(self, h, w_down):
        return self.base(h[self.compact].float(), w_down.float(), self.gates.float())


def _poison_call_buffers(ov, h, plan, out):
    """NaN into both receive slots, y and out, with every rank out of its previous call first
    (a peer's consumer writes into this rank's receive buffer during a call)."""
    torch.cuda.synchronize(ov.device)
    ov.rt.barrier()
    y, _ = ov.buffers_for(h, plan)
    poison_(ov.recv, y, out)
    torch.cuda.synchronize(ov.device)
    ov.rt.barrier()


def validate_calls(ov, tokens: int, mode: str, calls: int = 8, routing_every: int = 3,
                   seed: int = 0, mgb: int = 2, tol: float = TOL, ccta: int | None = None,
                   layout: str = "auto", order: str = "remote_first",
                   empty_ranks=()) -> dict:
    """``calls`` eager overlapped calls, each with fresh h, poisoned buffers and both checks
    (ccta: the overlapped calls' consumer SMs; default: ov's resolved option; layout, order:
    the plans'; empty_ranks: ranks that route no token).
    Returns summarize(...) plus the per-call records; every rank returns the same verdicts."""
    from .overlap import OverlapError
    dev, K, N = ov.device, ov.hidden_size, ov.out_features
    g = torch.Generator(device=dev).manual_seed(1_000_003 * seed + 7919 * ov.rank + 1)
    w_down = (torch.randn(ov.experts_per_rank, K, N, device=dev, generator=g)
              / K ** 0.5).to(torch.bfloat16)
    records, r = [], None
    for i in range(calls):
        if i % routing_every == 0:
            r = _Routing(ov, tokens, mode, seed * 1000 + i, mgb, layout, order, empty_ranks)
        rows = int(r.plan.total_rows.item())
        h = torch.randn(rows, K, device=dev, generator=g).to(torch.bfloat16)
        out = torch.empty(r.ids.shape[0], N, dtype=torch.bfloat16, device=dev)
        _poison_call_buffers(ov, h, r.plan, out)
        try:
            out_ref = ov.forward(h, w_down, r.plan, r.ids, r.gates, overlap=False,
                                 check=True).clone()
            _poison_call_buffers(ov, h, r.plan, out)
            ov.forward(h, w_down, r.plan, r.ids, r.gates, out=out, check=True, ccta=ccta)
        except OverlapError as e:  # a timed-out wait: this call failed, the layer is unusable
            records.append(dict(call=i, bitwise=False, finite=False, rel_err=float("inf"),
                                ok=False, error=str(e)))
            break
        rec = compare(out, out_ref, r.ref32(h, w_down), tol)
        rec["ok"] = _agree_ok(rec["ok"], dev, ov.group)
        records.append(dict(rec, call=i))
    return dict(summarize(records), records=records, tokens=tokens, mode=mode,
                routing_every=routing_every, empty_ranks=sorted(empty_ranks))


def soak(ov, tokens: int, mode: str, calls: int = 1000, routing_every: int = 10,
         seed: int = 0, mgb: int = 2, tol: float = TOL, check_every: int = 1,
         ccta: int | None = None, layout: str = "auto", order: str = "remote_first") -> dict:
    """``calls`` replays of one captured overlapped call. Before each replay: new h (and every
    ``routing_every`` replays a new routing: its plan tensors copied into the captured plan's)
    written into the captured tensors, receive buffers / y / out poisoned; after it, the output
    is compared with the non-overlapped path on the same data (eager) and the fp32 baseline
    (every ``check_every``-th replay; 1: all). ccta: the captured call's consumer SMs (default:
    ov's resolved option); layout, order: the plans'. Reports calls, failures, max error and
    memory: allocated after the capture, after the first replay cycle (the warm-up: the flat
    level ``soak_passed`` holds the end to), at every routing change (``memory_samples``) and
    at the end, and the slack ``soak_passed`` allows."""
    from .overlap import OverlapError
    dev, K, N = ov.device, ov.hidden_size, ov.out_features
    g = torch.Generator(device=dev).manual_seed(1_000_003 * seed + 7919 * ov.rank + 2)
    w_down = (torch.randn(ov.experts_per_rank, K, N, device=dev, generator=g)
              / K ** 0.5).to(torch.bfloat16)
    r = _Routing(ov, tokens, mode, seed * 1000, mgb, layout, order)
    plan, ids, gates = r.plan, r.ids.clone(), r.gates.clone()
    h = torch.randn(plan.row_capacity, K, device=dev, generator=g).to(torch.bfloat16)
    out = torch.empty(tokens, N, dtype=torch.bfloat16, device=dev)
    ov.forward(h, w_down, plan, ids, gates, out=out, check=True, ccta=ccta)  # eager warm-up
    torch.cuda.synchronize(dev)
    ov.rt.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ov.forward(h, w_down, plan, ids, gates, out=out, ccta=ccta)
    torch.cuda.synchronize(dev)
    ov.rt.barrier()
    mem_capture = torch.cuda.memory_allocated(dev)
    mem_before = free_before = None
    records, samples = [], []
    for i in range(calls):
        if i == 1:
            # warm-up = the capture and the first replay cycle: the eager non-overlapped call
            # and the checks allocate their buffers once there
            torch.cuda.synchronize(dev)
            mem_before = torch.cuda.memory_allocated(dev)
            free_before = torch.cuda.mem_get_info(dev)[0]
        if i and i % routing_every == 0:
            samples.append(torch.cuda.memory_allocated(dev))
            r = _Routing(ov, tokens, mode, seed * 1000 + i, mgb, layout, order)
            for name, t in r.plan.tensors().items():
                getattr(plan, name).copy_(t)
            ids.copy_(r.ids)
            gates.copy_(r.gates)
        h.copy_(torch.randn(h.shape, device=dev, generator=g).to(torch.bfloat16))
        checked = i % check_every == 0
        try:
            if checked:
                out_ref = ov.forward(h, w_down, plan, ids, gates, overlap=False,
                                     check=True).clone()
            _poison_call_buffers(ov, h, plan, out)
            graph.replay()
            ov.check_errors()
        except OverlapError as e:
            records.append(dict(call=i, bitwise=False, finite=False, rel_err=float("inf"),
                                ok=False, error=str(e)))
            break
        if checked:
            rec = compare(out, out_ref, r.ref32(h, w_down), tol)
            rec["ok"] = _agree_ok(rec["ok"], dev, ov.group)
            records.append(dict(rec, call=i))
            del out_ref
    torch.cuda.synchronize(dev)
    mem_after = torch.cuda.memory_allocated(dev)
    free_after = torch.cuda.mem_get_info(dev)[0]
    del graph
    bad = [x for x in records if not x["ok"]]
    return dict(summarize(records), replays=calls, tokens=tokens, mode=mode,
                routing_every=routing_every, check_every=check_every,
                memory_allocated_after_capture=mem_capture,
                memory_allocated_before=mem_capture if mem_before is None else mem_before,
                memory_allocated_after=mem_after,
                memory_samples=samples,
                memory_slack_bytes=memory_slack_bytes(ov.world_size, tokens, ov.topk),
                device_free_before=free_before, device_free_after=free_after,
                first_failures=bad[:5], layout=layout, order=order)
