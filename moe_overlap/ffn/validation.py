"""Multi-rank check of the FFN layers against the float64 truth (tests and CLI)."""
from __future__ import annotations

import math

import torch

from .layers import FusedFFN, ShardedExperts
from .reference import experts_truth, ffn_truth, rel_err, tolerance


def _case_inputs(case: dict):
    g = torch.Generator().manual_seed(case.get("seed", 0))
    P, O, N, T = case["P"], case["O"], case["N"], case["T"]
    dt = getattr(torch, case.get("dtype", "bfloat16"))
    s1, s2 = 1 / math.sqrt(P), 1 / math.sqrt(O)
    if case.get("experts"):
        E = case["E"]
        rows = case["rows"]
        x = torch.randn(T, P, generator=g).to(dt)
        w_in = (torch.randn(E, P, O, generator=g) * s1).to(dt)
        w_out = (torch.randn(E, O, N, generator=g) * s2).to(dt)
        b_in = (torch.randn(E, O, generator=g) * 0.1).to(dt) if case.get("bias") else None
        b_out = (torch.randn(E, N, generator=g) * 0.1).to(dt) if case.get("bias") else None
        return x, rows, w_in, w_out, b_in, b_out
    x = torch.randn(T, P, generator=g).to(dt)
    w1 = (torch.randn(P, O, generator=g) * s1).to(dt)
    b1 = (torch.randn(O, generator=g) * 0.1).to(dt) if case.get("bias", True) else None
    w2 = (torch.randn(O, N, generator=g) * s2).to(dt)
    b2 = (torch.randn(N, generator=g) * 0.1).to(dt) if case.get("bias", True) else None
    return x, w1, b1, w2, b2


def check_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Run each case on this rank (process group already set up by ``launch.spawn`` or absent for
    world 1) with the reference backend (on ``cuda:rank`` when the case says ``device="cuda"``); returns per-case errors against the float64 truth and the
    max difference between this rank's output and rank 0's (all ranks must agree)."""
    import torch.distributed as dist


    group = dist.group.WORLD if dist.is_initialized() else None
    results = []
    for case in cases:
        dev = torch.device(f"cuda:{rank}") if case.get("device") == "cuda" else torch.device("cpu")
        if case.get("experts"):
            x, rows, w_in, w_out, b_in, b_out = (
                t.to(dev) if isinstance(t, torch.Tensor) else t for t in _case_inputs(case))
            mod = ShardedExperts.from_full_weights(w_in, w_out, b_in, b_out, group=group,
                                                   activation=case["act1"])
            y = mod(x, rows)
            truth = experts_truth(x, rows, w_in, w_out, b_in, b_out, case["act1"])
        else:
            x, w1, b1, w2, b2 = (t.to(dev) if t is not None else None
                                 for t in _case_inputs(case))
            mod = FusedFFN.from_full_weights(w1, b1, w2, b2, group=group, act1=case["act1"],
                                             act2=case.get("act2"))
            y = mod(x)
            truth = ffn_truth(x, w1, b1, w2, b2, case["act1"], case.get("act2") or "none")
        y0 = y.clone()
        if world > 1:
            dist.broadcast(y0, 0, group=group)
        results.append(dict(rel_err=rel_err(y, truth), shape=tuple(y.shape),
                            dtype=str(y.dtype), rank_diff=(y.float() - y0.float()).abs().max()
                            .item() if y.numel() else 0.0,
                            tol=tolerance(y.dtype, case["O"])))
    return results
