"""Seeded router modes for tests and benchmarks.

Every mode draws each token's top-k experts without replacement from a popularity distribution
over the E global experts (Gumbel top-k on log-popularity, so expert e is picked with probability
proportional to p_e among those not yet picked), and gate weights from a softmax over the picked
experts' perturbed logits (they sum to 1 per token).

- ``balanced``: p_e uniform. Loads differ only by sampling noise.
- ``moderate_skew``: p_e ∝ (1 + i)^-0.8 over a seeded random permutation of the experts (Zipf, s=0.8).
  With 64 experts and top-8 the busiest expert gets about 3x the mean load.
- ``stress_skew``: p_e ∝ (1 + i)^-2.0, same permutation. A few experts, and the ranks that own them,
  take most of the assignments; many experts receive nothing. Exercises padding and empty groups.

The popularity permutation depends only on ``seed`` (every rank agrees on which experts are hot);
the token draws depend on ``seed`` and ``rank``.
"""
from __future__ import annotations

import torch

ROUTER_MODES = ("balanced", "moderate_skew", "stress_skew")
_ZIPF = {"balanced": 0.0, "moderate_skew": 0.8, "stress_skew": 2.0}


def expert_popularity(mode: str, num_experts: int, seed: int = 0) -> torch.Tensor:
    """Probabilities [E] (float64, sum 1) of the router mode."""
    if mode not in _ZIPF:
        raise ValueError(f"unknown router mode {mode!r}; choose from {ROUTER_MODES}")
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_experts, generator=g)
    w = (1.0 + torch.arange(num_experts, dtype=torch.float64)) ** -_ZIPF[mode]
    p = torch.empty_like(w)
    p[perm] = w
    return p / p.sum()


def route(num_tokens: int, num_experts: int, topk: int, mode: str = "balanced", seed: int = 0,
          rank: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [T, k] (int64) and gate weights [T, k] (float32) for one rank's tokens."""
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk={topk} must be in [1, num_experts={num_experts}]")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    logp = expert_popularity(mode, num_experts, seed).log()
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
    u = torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64).clamp_(1e-12, 1.0)
    scores = logp - torch.log(-torch.log(u))  # Gumbel top-k = sampling without replacement
    top, ids = scores.topk(topk, dim=1)
    weights = torch.softmax(top, dim=1).to(torch.float32)
    return ids.to(device), weights.to(device)


def routing_counts(world_size: int, num_tokens: int, num_experts: int, topk: int,
                   mode: str = "balanced", seed: int = 0) -> torch.Tensor:
    """[W, E] int64: assignments of rank r's routing (``route(..., rank=r)``) to each expert, for
    every rank r of a world of ``world_size``: the all-gathered counts a plan is made from,
    generated in one process (for statistics, benchmarks and projections)."""
    return torch.stack([torch.bincount(route(num_tokens, num_experts, topk, mode, seed=seed,
                                             rank=r)[0].reshape(-1), minlength=num_experts)
                        for r in range(world_size)])
