"""Multi-rank check of the FFN layers against the float64 truth (tests and CLI)."""
from __future__ import annotations

import math

import torch

from ..runtime import collectives
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
    world 1) with the reference backend (on the rank's current CUDA device when the case says
    ``device="cuda"``); returns per-case errors against the float64 truth and the max difference
    between this rank's output and rank 0's (all ranks must agree)."""
    import torch.distributed as dist


    group = dist.group.WORLD if dist.is_initialized() else None
    results = []
    for case in cases:
        # the device launch.spawn made current for this rank (ranks may share a GPU)
        dev = (torch.device("cuda", torch.cuda.current_device()) if case.get("device") == "cuda"
               else torch.device("cpu"))
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
            collectives.broadcast(y0, dist.get_global_rank(group or dist.group.WORLD, 0),
                                  group=group)
        results.append(dict(rel_err=rel_err(y, truth), shape=tuple(y.shape),
                            dtype=str(y.dtype), rank_diff=(y.float() - y0.float()).abs().max()
                            .item() if y.numel() else 0.0,
                            tol=tolerance(y.dtype, case["O"])))
    return results


def _grad_err(got, truth) -> float:
    """rel_err of a gradient; inf where the layer produced none (the parameter was cut from the
    graph) and the truth is not all zero."""
    if got is None:
        return 0.0 if truth is None or not truth.any() else math.inf
    if truth is None:
        return 0.0 if not got.any() else math.inf
    return rel_err(got, truth)


def _loss(y, seed: int):
    """A loss computed from Y the same way on every rank (Y itself is the same on every rank), so
    the upstream gradient dY is the same everywhere, as the layers' backward assumes. Nonlinear,
    so dY depends on Y."""
    c = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    return (y * c.to(y.device)).sum() + 0.5 * (y * y).sum()


def check_grad_cases(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Backward of the reference backend on this rank against single-process autograd of the
    unsplit layer, both in float64 (cases as for ``check_cases``; ``dtype`` is ignored).
    ``x_grad=False`` in a case leaves X out of autograd (then only the weights get gradients).
    Returns per case the relative errors of the output, of x.grad (full on every rank) and of
    each parameter's gradient against the matching slice of the full gradient, the all-reduce
    calls made in forward and in backward, and the warnings raised meanwhile."""
    import warnings

    import torch.distributed as dist

    group = dist.group.WORLD if dist.is_initialized() else None
    results = []
    for case in cases:
        case = dict(case, dtype="float64")
        x_grad = case.get("x_grad", True)
        inputs = _case_inputs(case)
        if case.get("experts"):
            x, rows, *weights = inputs
        else:
            x, *weights = inputs
        leaves = [t.clone().requires_grad_() if t is not None else None for t in weights]
        xt = x.clone().requires_grad_(x_grad)
        if case.get("experts"):
            w_in, w_out, b_in, b_out = leaves
            truth = experts_truth(xt, rows, w_in, w_out, b_in, b_out, case["act1"])
        else:
            w1, b1, w2, b2 = leaves
            truth = ffn_truth(xt, w1, b1, w2, b2, case["act1"], case.get("act2") or "none")
        wrt = [t for t in [xt] + leaves if t is not None and t.requires_grad]
        gl = torch.autograd.grad(_loss(truth, case.get("seed", 0)), wrt, allow_unused=True)
        gl = iter(gl)
        gx = next(gl) if x_grad else None
        full = [next(gl) if t is not None else None for t in leaves]

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if case.get("experts"):
                mod = ShardedExperts.from_full_weights(*weights, group=group,
                                                       activation=case["act1"])
                params = dict(w_in=mod.w_in, w_out=mod.w_out, b_in=mod.b_in, b_out=mod.b_out)
            else:
                mod = FusedFFN.from_full_weights(*weights, group=group, act1=case["act1"],
                                                 act2=case.get("act2"))
                params = dict(w1=mod.w1, b1=mod.b1, w2=mod.w2, b2=mod.b2)
            xm = x.clone().requires_grad_(x_grad)
            calls = _count_all_reduce()
            with calls:
                y = mod(xm, rows) if case.get("experts") else mod(xm)
                fwd_calls = calls.n
                _loss(y, case.get("seed", 0)).backward()
                bwd_calls = calls.n - fwd_calls
        s = mod.local_slice()
        if case.get("experts"):
            want = dict(w_in=full[0][:, :, s] if full[0] is not None else None,
                        w_out=full[1][:, s, :] if full[1] is not None else None,
                        b_in=full[2][:, s] if full[2] is not None else None, b_out=full[3])
        else:
            want = dict(w1=full[0][:, s], b1=full[1][s] if full[1] is not None else None,
                        w2=full[2][s, :], b2=full[3])
        errs = dict(y=rel_err(y, truth),
                    x=_grad_err(xm.grad, gx) if x_grad else (0.0 if xm.grad is None else math.inf))
        for k, p in params.items():
            if p is not None:
                errs[k] = _grad_err(p.grad, want[k])
        results.append(dict(errs=errs, fwd_all_reduce=fwd_calls, bwd_all_reduce=bwd_calls,
                            warnings=[f"{w.category.__name__}: {w.message}" for w in caught]))
    return results


class _count_all_reduce:
    """Counts torch.distributed.all_reduce calls inside the ``with`` block (in this process)."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        import torch.distributed as dist
        self._orig = orig = dist.all_reduce

        def counted(*a, **k):
            self.n += 1
            return orig(*a, **k)
        dist.all_reduce = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        dist.all_reduce = self._orig
        return False
