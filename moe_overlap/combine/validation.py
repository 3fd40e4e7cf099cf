"""End-to-end check of one MoE layer: router -> dispatch -> up-projection + activation -> combine,
against the sequential baseline written without the plan. Used by the CLI, the tests and benches."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .layer import MoECombine
from .dispatch import dispatch_to_plan, exchange_counts
from .reference import grouped_matmul, sequential_combine, sequential_dispatch
from ..launch import rank_device
from ..routing import route

ACTIVATIONS = {"relu": torch.relu, "gelu": torch.nn.functional.gelu, "silu": torch.nn.functional.silu}


@dataclass
class LayerCase:
    mode: str = "balanced"
    tokens: int = 96  # per rank
    num_experts: int = 12
    topk: int = 2
    model_dim: int = 32  # D: x is [tokens, D], w_up [El, D, K]
    hidden: int = 48  # K
    out_features: int = 40  # N
    tile_m: int = 64
    mgb: int = 2
    seed: int = 0
    activation: str = "silu"
    dtype: str = "float32"
    backend: str = "reference"
    ccta: object = "auto"
    layout: str = "auto"


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 8e-3


def run_layer(rank: int, world_size: int, case: LayerCase, group=None, device="cpu") -> dict:
    """Run one layer on this rank; returns errors and plan statistics (rank-local)."""
    dtype = getattr(torch, case.dtype)
    E, El = case.num_experts, case.num_experts // world_size
    ids, gates = route(case.tokens, E, case.topk, case.mode, seed=case.seed, rank=rank,
                       device=device)
    x = make_tokens(case, rank).to(device, dtype)
    w_up, w_down = (w.to(device, dtype) for w in make_expert_weights(case, rank, world_size))
    act = ACTIVATIONS[case.activation]

    counts = exchange_counts(ids, E, group)
    comb = MoECombine(E, case.hidden, case.out_features, case.topk, case.tokens, group=group,
                      tile_m=case.tile_m, backend=case.backend, ccta=case.ccta, mgb=case.mgb,
                      layout=case.layout)
    plan = comb.plan(counts.to(device))
    x_plan = dispatch_to_plan(x, ids, plan, counts, group)
    h_plan = act(grouped_matmul(x_plan, w_up, plan.expert_rows.tolist()))
    out = comb(h_plan, w_down, plan, ids, gates)

    x_c, counts_c = sequential_dispatch(x, ids, E, group)
    rows_e = counts_c[:, rank * El:(rank + 1) * El].sum(0).tolist()
    ref = sequential_combine(act(grouped_matmul(x_c, w_up, rows_e)), w_down, counts_c, ids, gates,
                             group)
    truth = float64_truth(case, rank, world_size, dtype)
    return {"rank": rank, "rel_err": rel_err(out, ref), "rel_err_f64": rel_err(out, truth),
            "finite": bool(torch.isfinite(out).all()), "tol": tolerance(dtype),
            "tol_f64": 1e-5 if dtype == torch.float32 else 2e-2, "stats": plan.stats(),
            "case": asdict(case)}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_tokens(case: LayerCase, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed * 7919 + rank)
    return torch.randn(case.tokens, case.model_dim, generator=g)


def make_expert_weights(case: LayerCase, owner: int, world_size: int):
    """(w_up [El, D, K], w_down [El, K, N]) of the experts hosted by `owner`; any rank can rebuild
    them, which is what lets every rank compute a float64 truth without communication."""
    El = case.num_experts // world_size
    g = torch.Generator().manual_seed(case.seed * 104729 + owner + 17)
    w_up = torch.randn(El, case.model_dim, case.hidden, generator=g) / case.model_dim ** 0.5
    w_down = torch.randn(El, case.hidden, case.out_features, generator=g) / case.hidden ** 0.5
    return w_up, w_down


def float64_truth(case: LayerCase, rank: int, world_size: int, dtype) -> torch.Tensor:
    """This rank's layer output in float64 from the dtype-rounded inputs, no plan, no messages."""
    El = case.num_experts // world_size
    x = make_tokens(case, rank).to(dtype).double()
    ids, gates = route(case.tokens, case.num_experts, case.topk, case.mode, seed=case.seed,
                       rank=rank)
    ws = [tuple(w.to(dtype).double() for w in make_expert_weights(case, r, world_size))
          for r in range(world_size)]
    act = ACTIVATIONS[case.activation]
    out = torch.zeros(case.tokens, case.out_features, dtype=torch.float64)
    for t in range(case.tokens):
        for j in range(case.topk):
            g = int(ids[t, j])
            w_up, w_down = ws[g // El]
            out[t] += gates[t, j].double() * (act(x[t] @ w_up[g % El]) @ w_down[g % El])
    return out


def _spawned(rank, world_size, cases, device):
    dev = str(rank_device()) if device == "cuda" else device
    return [run_layer(rank, world_size, c, group=None, device=dev) for c in cases]


def check_layers(world_size: int, cases: list[LayerCase], device: str = "cpu") -> list[list[dict]]:
    """Run the cases on world_size processes (one process group for all of them: gloo on CPU,
    NCCL with one GPU per rank on CUDA); returns, per case, one result per rank."""
    from ..launch import spawn
    per_rank = spawn(_spawned, world_size, list(cases), device,
                     backend="cuda" if device == "cuda" else "gloo")
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


def check_layer(world_size: int, case: LayerCase, device: str = "cpu") -> list[dict]:
    return check_layers(world_size, [case], device)[0]


def passed(results: list[dict]) -> bool:
    return all(r["finite"] and r["rel_err"] <= r["tol"] and r["rel_err_f64"] <= r["tol_f64"]
               for r in results)
