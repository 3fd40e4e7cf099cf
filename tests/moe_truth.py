"""An MoE layer written plainly, in one process, from the full weights: the truth the MoELayer
tests compare against. It shares no code with the library (no plan, no exchange, no
grouped_matmul, not even torch.topk): per token, the softmax of its router logits, its top-k
experts by a sort of the probabilities, then the SwiGLU expert and the weighted sum, in float64
torch ops so that autograd gives the gradients of every input and weight."""
from __future__ import annotations

import torch


def silu(v: torch.Tensor) -> torch.Tensor:
    return v * torch.sigmoid(v)


def plain_moe(x, router, w_gate, w_up, w_down, topk: int, norm_topk_prob: bool):
    """x [T, D]; router [D, E]; w_gate, w_up [E, D, K]; w_down [E, K, D] (x @ w).
    Returns (out [T, D], chosen: per token the list of its top-k expert ids)."""
    E = router.shape[1]
    probs = torch.softmax(x @ router, dim=-1)
    rows, chosen = [], []
    for t in range(x.shape[0]):
        p = probs[t]
        ids = sorted(range(E), key=lambda e: -float(p[e].detach()))[:topk]
        total = sum(p[e] for e in ids) if norm_topk_prob else 1.0
        acc = torch.zeros(w_down.shape[2], dtype=x.dtype)
        for e in ids:
            hidden = silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            acc = acc + (p[e] / total) * (hidden @ w_down[e])
        rows.append(acc)
        chosen.append(ids)
    out = torch.stack(rows) if rows else x.new_zeros(0, w_down.shape[2])
    return out, chosen


def plain_moe_grads(xs, cots, weights: dict, topk: int, norm_topk_prob: bool):
    """Single-process autograd of sum_r <plain_moe(x_r), cot_r> over the ranks' tokens xs
    (list of [T_r, D]) in float64. Returns (outs per rank, grads of xs per rank, {name: grad}
    of router, w_gate, w_up, w_down, chosen expert ids per rank)."""
    f64 = torch.float64
    w = {n: t.detach().to(f64).clone().requires_grad_() for n, t in weights.items()}
    leaves = [x.detach().to(f64).clone().requires_grad_() for x in xs]
    x_all = torch.cat(leaves)
    out, chosen = plain_moe(x_all, w["router"], w["w_gate"], w["w_up"], w["w_down"], topk,
                            norm_topk_prob)
    if out.shape[0]:
        (out * torch.cat(cots).to(f64)).sum().backward()
    else:  # no token anywhere: every gradient is zero
        for t in leaves + list(w.values()):
            t.grad = torch.zeros_like(t)
    sizes = [x.shape[0] for x in xs]
    outs = list(out.detach().split(sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return (outs, [x.grad for x in leaves], {n: t.grad for n, t in w.items()},
            [chosen[s:s + n] for s, n in zip(starts, sizes)])
