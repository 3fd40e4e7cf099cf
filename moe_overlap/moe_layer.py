"""MoELayer: one whole MoE layer (router -> dispatch -> SwiGLU experts -> combine) as one module.

    x [T, D] -> router logits [T, E] -> softmax -> top-k (ids, weights) -> exchange_counts
    -> MoECombine.plan + prepare -> dispatch (tokens into the plan layout)
    -> up-projection: silu(x W_gate) * (x W_up), per local expert -> MoECombine.forward
    (down-projection, return exchange, top-k weighted sum) -> out [T, D]

The pieces stay public (moe_overlap.combine) for users who own their layer; this module only
composes them. The dispatch is one seam (``MoELayer.dispatch``): any object called as
``dispatch(tokens, topk_ids, plan, expert_counts)`` that returns the tokens' (token, k) rows in
the plan layout ([rows, D]). The default is ``MoEDispatch`` (each token sent once per rank that
owns any of its experts); ``AllToAllDispatch`` is the per-assignment all-to-all it replaces
(the same result, bitwise).
"""
from __future__ import annotations

import torch

from .combine import (CombineOptions, MoECombine, MoEDispatch, dispatch_to_plan, exchange_counts,
                      grouped_matmul)
from .combine.checks import agree_on_call, as_int, error_of, world

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class AllToAllDispatch:
    """Today's dispatch (``dispatch_to_plan``): one all_to_all_single of every (token, k)
    assignment, its split sizes read on the host, the received rows placed in the plan layout.
    Differentiable in the tokens (backward: the reverse exchange, collective).

    Called as ``dispatch(tokens [T, D], topk_ids [T, k] int, plan, expert_counts [W, E])`` ->
    ``[plan.total_rows, D]`` in the tokens' dtype, padding rows zero."""

    def __init__(self, group=None, validate: bool = True):
        self.group, self.validate = group, validate

    def __call__(self, tokens, topk_ids, plan, expert_counts):
        return dispatch_to_plan(tokens, topk_ids, plan, expert_counts, self.group,
                                validate=self.validate)


class MoELayer(torch.nn.Module):
    """One MoE layer with SwiGLU experts, expert-parallel over ``group`` (rank r owns experts
    r * E / W ... (r + 1) * E / W - 1). Construct once per layer on every rank; call it on every
    rank every step (it is collective, also on a rank with 0 tokens).

    Arguments:
        hidden_size: ``int``, D, the model width: the tokens' width and the output's (HF
            ``hidden_size``).
        intermediate_size: ``int``, K, each expert's intermediate width (HF
            ``moe_intermediate_size``).
        num_experts: ``int``, E, global experts, a multiple of the world size W.
        topk: ``int``, experts per token (HF ``num_experts_per_tok``), at most E.
        max_tokens_per_rank: ``int``, the most tokens any rank passes in one call (sizes the
            plans and the combine's communication buffer).
        group: the process group (default: the world); W = its size.
        norm_topk_prob: ``bool``, divide the top-k softmax weights by their sum (Qwen3-MoE's
            ``norm_topk_prob``); False: the softmax probabilities over all E experts as they are.
        dtype: ``torch.dtype`` of the parameters and of the input: float32, float64, bfloat16 or
            float16 on the reference backend, bfloat16 for the overlap combine.
        device: where the parameters live (default: the current default device).
        seed: ``int``, the initial weights: the router from ``seed``, global expert e's weights
            from ``seed + 1 + e``, so that the same seed gives the same global layer at any W.
            ``from_full_weights`` sets given weights instead.
        tile_m, backend, validate, options, comm_buffer: the combine's (``MoECombine``);
            ``backend`` picks the combine's backend ("auto": the overlap kernels on Hopper GPUs
            with W > 1, else "reference"); the router, the dispatch and the up-projection are
            torch ops on every backend. ``validate=True``: every step's input is checked and the
            ranks agree on it (a few small all-reduces) before data moves; False: no host reads
            beyond the reference backend's own, the caller vouches (see ``MoECombine``).
        dispatch: the dispatch seam (see the module doc); default ``MoEDispatch``.

    Parameters (this rank's; the math convention ``x @ w``):
        router: ``[D, E]``, every rank the same (replicated: its gradient on a rank is that
            rank's tokens' share; sum it over the ranks as for any data-parallel weight).
        w_gate_up: ``[E // W, D, 2 * K]``, this rank's experts, the gate half first:
            ``h = silu(x @ w_gate_up[e][:, :K]) * (x @ w_gate_up[e][:, K:])``.
        w_down: ``[E // W, K, D]``, this rank's experts.

    Forward: ``x`` ``[..., D]`` (e.g. [T, D] or [batch, seq, D]; at most max_tokens_per_rank
    tokens, 0 allowed) in ``dtype`` -> ``[..., D]`` in ``dtype``:
    ``out[t] = sum_j w[t, j] * (silu(x_t W_gate[e]) * (x_t W_up[e])) @ W_down[e]``, e = the
    token's j-th expert, w its softmax weight (renormalised over the top-k with
    ``norm_topk_prob``). The routing weights are computed in float32 (float64 for float64
    input) and applied in that precision by the combine.

    Autograd (reference backend): differentiable in x and every parameter across ranks; the
    backward is collective (run it on every rank). The overlap combine is inference-only.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, topk: int,
                 max_tokens_per_rank: int, group=None, norm_topk_prob: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, seed: int = 0,
                 tile_m: int = 128, backend: str = "auto", validate: bool = True,
                 options: CombineOptions | None = None, comm_buffer=None, dispatch=None):
        super().__init__()
        D, K = as_int("hidden_size", hidden_size, 1), as_int("intermediate_size",
                                                             intermediate_size, 1)
        E, k = as_int("num_experts", num_experts, 1), as_int("topk", topk, 1)
        if not isinstance(norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
        if dtype not in _FLOAT:
            raise TypeError(f"dtype must be one of {_FLOAT}, got {dtype!r}")
        # the combine checks E % W, topk <= E, the capacity, tile_m, backend and its options
        self.combine = MoECombine(num_experts=E, intermediate_size=K, out_features=D, topk=k,
                                  max_tokens_per_rank=max_tokens_per_rank, group=group,
                                  tile_m=tile_m, backend=backend, validate=validate,
                                  options=options, comm_buffer=comm_buffer)
        self.group, (self.rank, self.world_size) = group, world(group)
        self.hidden_size, self.intermediate_size = D, K
        self.num_experts, self.topk = E, k
        self.experts_per_rank = E // self.world_size
        self.max_tokens_per_rank = self.combine.max_tokens_per_rank
        self.norm_topk_prob, self.validate, self.dtype = norm_topk_prob, validate, dtype
        if dispatch is None:
            dispatch = MoEDispatch(E, D, k, self.max_tokens_per_rank, group, backend="reference",
                                   validate=validate)
        self.dispatch = dispatch
        El = self.experts_per_rank
        fw = dict(dtype=dtype, device=device)
        self.router = torch.nn.Parameter(torch.empty(D, E, **fw))
        self.w_gate_up = torch.nn.Parameter(torch.empty(El, D, 2 * K, **fw))
        self.w_down = torch.nn.Parameter(torch.empty(El, K, D, **fw))
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Normal weights scaled by 1 / sqrt(fan in), drawn per global expert (see ``seed``)."""
        D, K, El = self.hidden_size, self.intermediate_size, self.experts_per_rank

        def normal(shape, s, fan_in):
            g = torch.Generator().manual_seed(s)
            return torch.randn(shape, generator=g, dtype=torch.float64) / fan_in ** 0.5

        self.router.copy_(normal((D, self.num_experts), seed, D))
        for i in range(El):
            e = self.rank * El + i
            self.w_gate_up[i].copy_(normal((D, 2 * K), seed + 1 + e, D))
            self.w_down[i].copy_(normal((K, D), seed + 1 + self.num_experts + e, K))

    @classmethod
    def from_full_weights(cls, router: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                          w_down: torch.Tensor, topk: int, max_tokens_per_rank: int, group=None,
                          **kwargs) -> "MoELayer":
        """The layer of this rank from the weights of all E experts (the same on every rank):
        router ``[D, E]``, w_gate and w_up ``[E, D, K]``, w_down ``[E, K, D]`` (``x @ w``; an HF
        ``nn.Linear`` weight is the transpose). Rank r keeps experts r * E / W ... (r + 1) * E /
        W - 1 (copies: the layer's parameters share no memory with the arguments). dtype and
        device default to router's; other keywords go to the constructor."""
        for name, t in (("router", router), ("w_gate", w_gate), ("w_up", w_up),
                        ("w_down", w_down)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if router.dim() != 2:
            raise ValueError(f"router must be [D, E], got {tuple(router.shape)}")
        D, E = router.shape
        if w_gate.dim() != 3 or w_gate.shape[:2] != (E, D):
            raise ValueError(f"w_gate must be [E={E}, D={D}, K], got {tuple(w_gate.shape)}")
        K = w_gate.shape[2]
        if tuple(w_up.shape) != (E, D, K):
            raise ValueError(f"w_up must be [E={E}, D={D}, K={K}], got {tuple(w_up.shape)}")
        if tuple(w_down.shape) != (E, K, D):
            raise ValueError(f"w_down must be [E={E}, K={K}, D={D}], got {tuple(w_down.shape)}")
        kwargs.setdefault("dtype", router.dtype)
        kwargs.setdefault("device", router.device)
        layer = cls(D, K, E, topk, max_tokens_per_rank, group=group, **kwargs)
        El, r = layer.experts_per_rank, layer.rank
        mine = slice(r * El, (r + 1) * El)
        with torch.no_grad():
            layer.router.copy_(router)
            layer.w_gate_up.copy_(torch.cat([w_gate[mine], w_up[mine]], dim=2))
            layer.w_down.copy_(w_down[mine])
        return layer

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T, D] -> (topk_weights [T, k] float32 (float64 for float64 tokens), topk_ids
        [T, k] int64): the softmax of the router logits over all E experts, its top k, divided
        by their sum with ``norm_topk_prob``. Local (no communication)."""
        logits = tokens @ self.router  # [T, E]
        probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype,
                                                                          torch.float32))
        topk_weights, topk_ids = probs.topk(self.topk, dim=-1)
        if self.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_ids

    def up_projection(self, x_plan: torch.Tensor, plan) -> torch.Tensor:
        """SwiGLU of the plan-layout rows [rows, D] with this rank's experts -> [rows, K]
        (padding rows stay zero: silu(0) * 0)."""
        y = grouped_matmul(x_plan, self.w_gate_up, plan.expert_rows.tolist())  # [rows, 2K]
        gate, up = y.split(self.intermediate_size, dim=1)
        return torch.nn.functional.silu(gate) * up

    def _check(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x must be [..., hidden_size={self.hidden_size}], got "
                             f"{tuple(x.shape)}")
        if x.dtype != self.router.dtype:
            raise TypeError(f"x has dtype {x.dtype}, the layer's parameters {self.router.dtype}")
        if x.device != self.router.device:
            raise ValueError(f"x is on {x.device}, the layer's parameters on "
                             f"{self.router.device}")
        T = x.numel() // self.hidden_size
        if T > self.max_tokens_per_rank:
            raise ValueError(f"capacity exceeded: {T} tokens > max_tokens_per_rank="
                             f"{self.max_tokens_per_rank}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]; collective (see the class doc)."""
        if self.validate:  # a bad x on one rank raises on every rank, before any exchange
            err = error_of(self._check, x)
            agree_on_call("MoELayer.forward", None if err else {
                "hidden_size (D)": self.hidden_size, "intermediate_size (K)":
                    self.intermediate_size, "num_experts": self.num_experts, "topk": self.topk,
                "norm_topk_prob": self.norm_topk_prob, "dtype": x.dtype,
                "device type": x.device.type}, err, self.group)
        else:
            self._check(x)
        tokens = x.reshape(-1, self.hidden_size)
        topk_weights, topk_ids = self.route(tokens)
        counts = exchange_counts(topk_ids, self.num_experts, self.group,
                                 validate=self.validate)  # [W, E]
        plan = self.combine.plan(counts)
        routes = self.combine.prepare(plan, topk_ids)
        x_plan = self.dispatch(tokens, topk_ids, plan, counts)  # [rows, D], the plan layout
        h = self.up_projection(x_plan, plan)  # [rows, K]
        out = self.combine(h, self.w_down, plan, topk_ids, topk_weights, routes=routes)
        return out.reshape(x.shape)

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, "
                f"experts_per_rank={self.experts_per_rank}, norm_topk_prob={self.norm_topk_prob}, "
                f"backend={self.combine.requested_backend!r}")
