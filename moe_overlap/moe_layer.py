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

from dataclasses import dataclass, replace

import torch

from .combine import (CombineOptions, MoECombine, MoEDispatch, dispatch_to_plan, exchange_counts,
                      grouped_matmul)
from .combine.checks import agree_on_call, as_int, error_of, world
from .combine.dispatch_expand import DEFAULT_CTAS_PER_SM
from .combine.dispatch_index import ARRIVAL_ORDERS, arrival_schedule
from .combine.grouped_gemm import (TILE_FETCH, GroupedGemm, deinterleave_gate_up,
                                   interleave_gate_up, split_gate_up)
from .combine.options import TRANSPORTS
from .kernels.host_checks import require_tensors

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
BACKENDS = ("auto", "reference", "overlap")
# "auto" picks the overlapped dispatch + arrival-gated up-projection only once they have run on a
# GPU (tests/test_moe_layer_overlap_gpu.py; bench/NOTES.md); until then "auto" keeps the layer's
# dispatch and up-projection on torch ops and leaves the combine's own "auto" to MoECombine.
AUTO_PICKS_OVERLAP = False
UP_STREAMS = ("side", "same")
EXPAND_WAITS = ("per_source", "all")  # MoEDispatch(expand_wait=), the layer's default first
WEIGHT_LAYOUTS = ("auto", "halves", "interleaved")
COUNTS_EXCHANGES = ("auto", "device", "host")
UP_TILE_M = (64, 128)  # the up-projection GEMM's band heights (GroupedGemm)
TILE_K = 64  # the GEMMs' K tile (bf16): D and K must be multiples of it


@dataclass(frozen=True)
class MoELayerOptions:
    """The layer's own knobs (the combine's are ``CombineOptions``), resolved once by
    ``resolve_layer`` at construction (``MoELayer.options``: no "auto" left).

    send_ctas: CTAs of the overlapped dispatch's send kernel (the same on every rank).
    dispatch_timeout_s: the dispatch's bounded wait for every source's tokens.
    arrival_timeout_s: the up-projection's bounded wait for a band's arrival flag.
    up_tile_n: the SwiGLU GEMM's N tile (64, 128, 256): gate and up halves of up_tile_n / 2
        output columns each, the weights interleaved in blocks of that (``interleave_gate_up``).
    up_stream: where the arrival-gated up-projection runs. "side": a second stream forked after
        the dispatch's epoch is advanced and before its send is launched, so the GEMM runs
        beside the send, wait and expand, each band starting when its flag comes (its grid
        leaves up_ccta SMs to the dispatch's kernels: the wait and expand must get SMs while
        the persistent GEMM spins, or it waits until its timeout). "same": on the layer's
        stream after the expand (every flag already raised: no overlap; the comparison path).
        The same stream before the wait is not offered: the wait + expand would queue behind a
        GEMM waiting for them.
    up_ccta: "auto" or an int >= 1: SMs the side-stream GEMM leaves free ("auto": send_ctas,
        the send kernel's CTAs, whose SMs the wait and expand take over); 0 with "same".
    expand_wait: the dispatch's expand (``MoEDispatch(expand_wait=)``). "per_source": each
        (expert, source) item waits for its own source, this rank's first, and a band's flag
        comes once the sources with rows in it have landed, so the up-projection (walking
        ``arrival_schedule``: local bands first, then by rank distance) starts on the local
        rows while the peers' sends are in flight; its grid is at most 2 CTAs per SM of the
        up_ccta SMs the side-stream GEMM leaves (its waiting items then hold only those: the
        send, which precedes it on the stream, has finished there). "all": the wait kernel
        for every source, then the expand (flags only once every source has landed).
    weight_layout: "halves" (w_gate_up's gate half first), "interleaved" (the SwiGLU kernel's
        layout, blocks of up_tile_n / 2) or "auto" (interleaved on the overlap backend, halves
        on the reference). The parameter is stored once in this layout; the reference path reads
        the same tensor (``split_gate_up``).
    counts_exchange: how the step's routing counts are all-gathered. "device" (the overlap
        backend's "auto"): through the layer's CommBuffer by its post + gather kernels
        (combine/counts_exchange.py, bounded by dispatch_timeout_s), so that with
        validate=False the step holds no host collective and a CUDA graph captures it on any
        process group (gloo, ranks sharing one GPU); "host": the process group's all-gather
        (the reference, also the reference backend's resolved value: it has no CommBuffer).
        Both give the same counts, bitwise; validate=True keeps its host checks either way.
    up_order: the up-projection's band order (``arrival_schedule(order=)``). "arrival": as the
        expand raises the flags (local bands first, then by rank distance), so the GEMM starts
        on what has landed; "expert": every band of an expert side by side, each weight slice
        read once per band group, the first tiles waiting for every source of the first expert.
        Same output bits.
    up_tile_fetch: how the up-projection's persistent CTAs find their next tile
        (``GroupedGemm(tile_fetch=)``). "dynamic": each next pair of tiles from a shared work
        counter, so CTAs that waited on an arrival or started late do not own a fixed share of
        the tiles (its measurements: bench/NOTES.md, "Session 27"); "static": CTA i takes
        tiles i, i + G, ... Same output bits.
    """
    send_ctas: int = 8
    dispatch_timeout_s: float = 10.0
    arrival_timeout_s: float = 10.0
    up_tile_n: int = 256
    up_stream: str = "side"
    up_ccta: int | str = "auto"
    weight_layout: str = "auto"
    expand_wait: str = "per_source"
    counts_exchange: str = "auto"
    up_order: str = "arrival"
    up_tile_fetch: str = "dynamic"

    def validate(self) -> None:
        """ValueError / TypeError for a value no backend accepts (host only)."""
        as_int("send_ctas", self.send_ctas, minimum=1)
        for name in ("dispatch_timeout_s", "arrival_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e6:
                raise ValueError(f"{name} must be a number of seconds in (0, 1e6), got {v!r}")
        if self.up_tile_n not in (64, 128, 256):
            raise ValueError(f"up_tile_n must be 64, 128 or 256, got {self.up_tile_n!r}")
        if self.up_stream not in UP_STREAMS:
            raise ValueError(f"up_stream={self.up_stream!r}; choose from {UP_STREAMS}")
        if self.up_ccta != "auto":
            as_int("up_ccta", self.up_ccta, minimum=0)
        if self.expand_wait not in EXPAND_WAITS:
            raise ValueError(f"expand_wait={self.expand_wait!r}; choose from {EXPAND_WAITS}")
        if self.counts_exchange not in COUNTS_EXCHANGES:
            raise ValueError(f"counts_exchange={self.counts_exchange!r}; choose from "
                             f"{COUNTS_EXCHANGES}")
        if self.up_order not in ARRIVAL_ORDERS:
            raise ValueError(f"up_order={self.up_order!r}; choose from {ARRIVAL_ORDERS}")
        if self.up_tile_fetch not in TILE_FETCH:
            raise ValueError(f"up_tile_fetch={self.up_tile_fetch!r}; choose from {TILE_FETCH}")
        if self.weight_layout not in WEIGHT_LAYOUTS:
            raise ValueError(f"weight_layout={self.weight_layout!r}; choose from "
                             f"{WEIGHT_LAYOUTS}")


def _overlap_refusal(world_size, dtype, hidden_size, intermediate_size, tile_m, options,
                     custom_dispatch) -> tuple[type, str] | None:
    """Why the overlap layer cannot run these sizes (exception type, text), or None."""
    D, K = hidden_size, intermediate_size
    if dtype != torch.bfloat16:
        return TypeError, f"the overlap backend needs dtype=torch.bfloat16, got {dtype}"
    if D % TILE_K:
        return ValueError, (f"hidden_size={D} must be a multiple of {TILE_K} (the "
                            "up-projection's K tile)")
    if K % TILE_K:
        return ValueError, (f"intermediate_size={K} must be a multiple of {TILE_K} (the "
                            "down-projection's K tile)")
    if (2 * K) % options.up_tile_n:
        return ValueError, (f"intermediate_size={K} must be a multiple of up_tile_n / 2 = "
                            f"{options.up_tile_n // 2} (one SwiGLU N tile holds that many gate "
                            "and up columns)")
    if tile_m not in UP_TILE_M:
        return ValueError, f"tile_m={tile_m}: the up-projection GEMM takes {UP_TILE_M}"
    if options.weight_layout == "halves":
        return ValueError, ("weight_layout='halves' on the overlap backend: the SwiGLU kernel "
                            "reads the interleaved layout")
    if custom_dispatch:
        return ValueError, ("a dispatch= seam on the overlap backend: the layer's overlapped "
                            "dispatch raises the flags its up-projection waits for")
    return None


def resolve_layer(backend: str, options: MoELayerOptions | None, *, world_size: int,
                  dtype: torch.dtype, hidden_size: int, intermediate_size: int, tile_m: int,
                  transport: str, overlap_ok: tuple[bool, str], custom_dispatch: bool = False
                  ) -> tuple[str, MoELayerOptions]:
    """The layer's backend and options, resolved once (pure: the device facts come in as
    ``overlap_ok`` = ``combine.overlap_available(device)``). "auto" is "overlap" where it can
    run (overlap_ok, W > 1, the sizes and dtype it takes), else "reference"; "overlap" asked
    where it cannot run raises (RuntimeError without the device, TypeError for the dtype,
    ValueError for sizes and options). W = 1 with "overlap" runs it (the dispatch stores into
    this rank's own slot; every band's flag comes from this rank's expand). ``transport``, the
    combine's, may be either: the dispatch sends over the buffer they share. While
    ``AUTO_PICKS_OVERLAP`` is False "auto" is "reference" (the combine keeps its own "auto")."""
    options = MoELayerOptions() if options is None else options
    if not isinstance(options, MoELayerOptions):
        raise TypeError(f"layer_options must be a MoELayerOptions, got {type(options).__name__}")
    options.validate()
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; choose from {BACKENDS}")
    if transport not in TRANSPORTS:  # either one: the dispatch shares the combine's buffer
        raise ValueError(f"transport={transport!r}; choose from {TRANSPORTS}")
    why = _overlap_refusal(world_size, dtype, hidden_size, intermediate_size, tile_m, options,
                           custom_dispatch)
    if backend == "overlap":
        if not overlap_ok[0]:
            raise RuntimeError(f"backend 'overlap' cannot run: {overlap_ok[1]}")
        if why is not None:
            raise why[0](why[1])
    elif backend == "auto":
        backend = ("overlap" if AUTO_PICKS_OVERLAP and overlap_ok[0] and world_size > 1
                   and why is None else "reference")
    if backend == "reference":
        layout = "halves" if options.weight_layout == "auto" else options.weight_layout
        if layout == "interleaved" and (2 * intermediate_size) % options.up_tile_n:
            raise ValueError(f"weight_layout='interleaved' needs intermediate_size="
                             f"{intermediate_size} a multiple of up_tile_n / 2 = "
                             f"{options.up_tile_n // 2}")
        return backend, replace(options, weight_layout=layout, up_ccta=0,
                                counts_exchange="host")
    ccta = options.send_ctas if options.up_ccta == "auto" else int(options.up_ccta)
    if options.up_stream == "same":
        ccta = 0
    elif ccta < 1:
        raise ValueError("up_ccta=0 with up_stream='side': the dispatch's wait and expand need "
                         "an SM beside the persistent up-projection")
    counts = "device" if options.counts_exchange == "auto" else options.counts_exchange
    return backend, replace(options, weight_layout="interleaved", up_ccta=ccta,
                            counts_exchange=counts)


def expand_ctas(options: MoELayerOptions) -> int | None:
    """The per-source expand's grid bound: 2 CTAs (its ctas_per_sm) on each of the up_ccta
    SMs the side-stream GEMM leaves; None (every SM) where no GEMM runs beside it."""
    if options.expand_wait != "per_source" or options.up_ccta == 0:
        return None
    return DEFAULT_CTAS_PER_SM * int(options.up_ccta)


def up_projection_gemm(options: MoELayerOptions, tile_m: int, **overrides) -> GroupedGemm:
    """The overlap layer's up-projection kernel object (not compiled): SwiGLU, waiting for the
    dispatch's per-band arrival flags, no flags of its own. ``overrides``: GroupedGemm keywords
    replacing the layer's (benches' variants of the same launch; the layer passes none)."""
    kw = dict(tile_m=tile_m, tile_n=options.up_tile_n, signal=False, wait_arrival=True,
              arrival_scope="gpu", arrival_timeout_ns=int(options.arrival_timeout_s * 1e9),
              swiglu=True, tile_fetch=options.up_tile_fetch)
    return GroupedGemm(**dict(kw, **overrides))


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
        tile_m, validate, options, comm_buffer: the combine's (``MoECombine``).
            ``validate=True``: every step's input is checked and the ranks agree on it (a few
            small all-reduces) before data moves; False: no host reads beyond the reference
            backend's own, the caller vouches (see ``MoECombine``).
        backend: "reference" (torch ops and process-group exchanges, any device and float
            dtype), "overlap" (CUDA, bf16: ``MoEDispatch(backend="overlap",
            signal_arrival=True)`` || the arrival-gated SwiGLU ``GroupedGemm`` -> the
            overlapped ``MoECombine``; inference only) or "auto": "overlap" where it can run
            (Hopper, W > 1, bf16, the sizes ``resolve_layer`` lists), else "reference".
            Resolved once here (``self.backend``).
        layer_options: ``MoELayerOptions`` (send_ctas, timeouts, the up-projection's tile,
            stream and SMs, the weight layout), resolved once (``self.options``).
        comm_buffer (overlap): the one ``CommBuffer`` the layer's dispatch and combine share
            (default: ``CommBuffer.shared(group, options.transport)``, shared with the
            process's other layers as ``MoECombine``'s default); ``self.comm_buffer``.
        dispatch: the dispatch seam (see the module doc; reference backend); default
            ``MoEDispatch``.

    Parameters (this rank's; the math convention ``x @ w``):
        router: ``[D, E]``, every rank the same (replicated: its gradient on a rank is that
            rank's tokens' share; sum it over the ranks as for any data-parallel weight).
        w_gate_up: ``[E // W, D, 2 * K]``, this rank's experts, in ``self.options.
            weight_layout``: "halves" (the gate half first, ``h = silu(x @ w_gate_up[e][:, :K])
            * (x @ w_gate_up[e][:, K:])``) or "interleaved" (``interleave_gate_up`` of that in
            blocks of up_tile_n / 2: what the SwiGLU kernel reads). ``gate_up_halves()`` gives
            the first layout either way; a state dict moves between layers of one layout.
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
                 options: CombineOptions | None = None, comm_buffer=None, dispatch=None,
                 layer_options: MoELayerOptions | None = None):
        super().__init__()
        D, K = as_int("hidden_size", hidden_size, 1), as_int("intermediate_size",
                                                             intermediate_size, 1)
        E, k = as_int("num_experts", num_experts, 1), as_int("topk", topk, 1)
        if not isinstance(norm_topk_prob, bool):
            raise TypeError(f"norm_topk_prob must be a bool, got {norm_topk_prob!r}")
        if dtype not in _FLOAT:
            raise TypeError(f"dtype must be one of {_FLOAT}, got {dtype!r}")
        from .combine.layer import overlap_available
        dev = torch.empty(0, device=device).device
        W = world(group)[1]
        self.requested_backend = backend
        self.backend, self.options = resolve_layer(
            backend, layer_options, world_size=W, dtype=dtype, hidden_size=D,
            intermediate_size=K, tile_m=tile_m,
            transport=(options or CombineOptions()).transport,
            overlap_ok=((False, "backend='reference' asked") if backend == "reference" else
                        overlap_available(dev)), custom_dispatch=dispatch is not None)
        overlap = self.backend == "overlap"
        # a layer left on torch ops by "auto" keeps the combine's own choice (its overlap
        # kernels where they run); "reference" asked means the reference everywhere
        combine_backend = "auto" if backend == "auto" and not overlap else self.backend
        if overlap and comm_buffer is None:  # the combine's transport: the dispatch shares it
            from .combine.comm_buffer import CommBuffer
            comm_buffer = CommBuffer.shared(group, (options or CombineOptions()).transport,
                                            torch.bfloat16)
        # the combine checks E % W, topk <= E, the capacity, tile_m and its options
        self.combine = MoECombine(num_experts=E, intermediate_size=K, out_features=D, topk=k,
                                  max_tokens_per_rank=max_tokens_per_rank, group=group,
                                  tile_m=tile_m, backend=combine_backend, validate=validate,
                                  options=options, comm_buffer=comm_buffer)
        self.comm_buffer = self.combine.comm_buffer
        self.group, (self.rank, self.world_size) = group, world(group)
        self.hidden_size, self.intermediate_size = D, K
        self.num_experts, self.topk = E, k
        self.experts_per_rank = E // self.world_size
        self.max_tokens_per_rank = self.combine.max_tokens_per_rank
        self.norm_topk_prob, self.validate, self.dtype = norm_topk_prob, validate, dtype
        o = self.options
        if overlap:  # collective: attaches to (allocates) the buffer the combine reserved on
            dispatch = MoEDispatch(E, D, k, self.max_tokens_per_rank, group, backend="overlap",
                                   validate=validate, comm_buffer=self.comm_buffer,
                                   send_ctas=o.send_ctas, timeout_s=o.dispatch_timeout_s,
                                   signal_arrival=True, expand_wait=o.expand_wait,
                                   expand_ctas=expand_ctas(o))
            self.up_gemm = up_projection_gemm(o, tile_m)
        elif dispatch is None:
            dispatch = MoEDispatch(E, D, k, self.max_tokens_per_rank, group, backend="reference",
                                   validate=validate)
        self.dispatch = dispatch
        self._side_stream = self._band_ready = None  # overlap: made at the first call
        # the weights' column blocks (None: the gate half first)
        self.gate_up_tile_n = o.up_tile_n if o.weight_layout == "interleaved" else None
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
            self.w_gate_up[i].copy_(self._gate_up_layout(normal((1, D, 2 * K), seed + 1 + e,
                                                                D))[0])
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
        require_tensors(dict(router=router, w_gate=w_gate, w_up=w_up, w_down=w_down))
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
            layer.w_gate_up.copy_(layer._gate_up_layout(torch.cat([w_gate[mine], w_up[mine]],
                                                                  dim=2)))
            layer.w_down.copy_(w_down[mine])
        return layer

    def _gate_up_layout(self, halves: torch.Tensor) -> torch.Tensor:
        """[n, D, 2K] with the gate half first -> the parameter's layout."""
        if self.gate_up_tile_n is None:
            return halves
        return interleave_gate_up(halves, self.gate_up_tile_n)

    def gate_up_halves(self) -> torch.Tensor:
        """w_gate_up with the gate half first ([E // W, D, 2K]; the parameter itself where it
        is stored so, else a copy)."""
        if self.gate_up_tile_n is None:
            return self.w_gate_up
        return deinterleave_gate_up(self.w_gate_up, self.gate_up_tile_n)

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
        gate, up = split_gate_up(y, self.gate_up_tile_n)  # the parameter's column order
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
        if self.backend == "overlap" and torch.is_grad_enabled() and (
                x.requires_grad or any(p.requires_grad for p in self.parameters())):
            raise RuntimeError("MoELayer(backend='overlap') is inference-only (its kernels have "
                               "no backward): call it under torch.no_grad() / "
                               "torch.inference_mode(), or train with backend='reference'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]; collective (see the class doc)."""
        if self.validate:  # a bad x on one rank raises on every rank, before any exchange
            err = error_of(self._check, x)
            agree_on_call("MoELayer.forward", None if err else {
                "hidden_size (D)": self.hidden_size, "intermediate_size (K)":
                    self.intermediate_size, "num_experts": self.num_experts, "topk": self.topk,
                "norm_topk_prob": self.norm_topk_prob, "dtype": x.dtype,
                "device type": x.device.type, "backend": self.backend,
                "layer options": repr(self.options)}, err, self.group)
        else:
            self._check(x)
        tokens = x.reshape(-1, self.hidden_size)
        if self.backend == "overlap":
            return self._forward_overlap(tokens).reshape(x.shape)
        topk_weights, topk_ids = self.route(tokens)
        counts = exchange_counts(topk_ids, self.num_experts, self.group,
                                 validate=self.validate)  # [W, E]
        plan = self.combine.plan(counts)
        routes = self.combine.prepare(plan, topk_ids)
        x_plan = self.dispatch(tokens, topk_ids, plan, counts)  # [rows, D], the plan layout
        h = self.up_projection(x_plan, plan)  # [rows, K]
        out = self.combine(h, self.w_down, plan, topk_ids, topk_weights, routes=routes)
        return out.reshape(x.shape)

    def _forward_overlap(self, tokens: torch.Tensor) -> torch.Tensor:
        """router -> top-k -> counts -> plan + prepare -> dispatch (send, wait, expand raising
        band flags) || the arrival-gated SwiGLU GEMM -> the overlapped combine. Device-only with
        validate=False (capturable: the side stream forks from and joins the layer's stream)."""
        o = self.options
        topk_weights, topk_ids = self.route(tokens)
        counts = self.dispatch.exchange_counts(  # [W, E]; "device": no host collective
            topk_ids, device=o.counts_exchange == "device")
        plan = self.combine.plan(counts)
        routes = self.combine.prepare(plan, topk_ids)
        dev = tokens.device
        main = torch.cuda.current_stream(dev)
        plan_rows = plan.row_capacity
        h = torch.empty(plan_rows, self.intermediate_size, dtype=torch.bfloat16, device=dev)
        if self._band_ready is None or self._band_ready.numel() != plan.band_capacity:
            self._band_ready = torch.zeros(plan.band_capacity, dtype=torch.int32, device=dev)
        side = None
        if o.up_stream == "side":
            if self._side_stream is None:
                self._side_stream = torch.cuda.Stream(dev)
            side = self._side_stream

        w_gate_up = self.w_gate_up.detach()  # inference only: the kernel takes no autograd
        schedule = arrival_schedule(plan, counts, o.up_order)

        def up(x_plan, stream, ccta):
            self.up_gemm(x_plan, w_gate_up, h, plan.band_expert, plan.band_src_row,
                         schedule, plan.num_bands, self._band_ready,
                         self.comm_buffer.epoch, ccta=ccta, stream=stream,
                         err=self.comm_buffer.err, rank=self.rank,
                         band_arrived=self.dispatch.band_arrived)

        def fork(x_plan):  # the dispatch's epoch is advanced on `main`; its send comes next
            side.wait_stream(main)
            with torch.cuda.stream(side):
                up(x_plan, side, o.up_ccta)

        x_plan = self.dispatch(tokens, topk_ids, plan, counts, rows=plan_rows,
                               consumer=fork if side is not None else None)
        if side is None:
            up(x_plan, main, 0)
        else:
            main.wait_stream(side)  # before the combine advances the epoch the GEMM read
            if not torch.cuda.is_current_stream_capturing():
                x_plan.record_stream(side)
                h.record_stream(side)
        return self.combine(h, self.w_down.detach(), plan, topk_ids, topk_weights,
                            routes=routes)

    def check_errors(self) -> None:
        """Synchronize; ``OverlapError`` if a device wait of any call on this layer's
        communication buffer (its dispatch, up-projection or combine, or another layer sharing
        it) timed out or recorded an error since construction or the last ``reset()``, naming
        the rank and what it waited for. Nothing to check on the reference backend."""
        self.combine.check_errors()

    def reset(self) -> None:
        """Collective (every rank, between calls, not under capture): usable again after a
        device error. Clears the communication buffer the dispatch and the combine share
        (error word, counters, epoch tags, epoch, the attached layers' band and arrival flags;
        ``CommBuffer.reset``); on the reference backend a barrier."""
        self.combine.reset()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, intermediate_size={self.intermediate_size}, "
                f"num_experts={self.num_experts}, topk={self.topk}, "
                f"experts_per_rank={self.experts_per_rank}, norm_topk_prob={self.norm_topk_prob}, "
                f"backend={self.backend!r}")
