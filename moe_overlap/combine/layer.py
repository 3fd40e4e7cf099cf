"""MoECombine: the combine step of an MoE layer (down-projection + return all-to-all + top-k sum).

For each local token t: out[t] = sum_k w[t, k] * (h_row(t, k) @ w_down[e(t, k)]), where h is the
stacked expert input in the plan layout on the expert's owner. Backends:
- ``reference``: executes the plan with torch ops and one process-group exchange (CPU and GPU).
- ``overlap``: the persistent grouped GEMM || consumer kernels (CUDA, NVSHMEM, CuTe DSL).
- ``auto``: ``overlap`` where it can run, else ``reference``.
"""
from __future__ import annotations

import importlib.util
import numbers
import warnings

import torch

from ..kernels.host_checks import require_tensors
from .checks import (agree_on_call, as_int, backward_agreement, check_routing_matches,
                     error_of)
from .options import ORDERS, CombineFacts, CombineOptions, options_from_kwargs
from .plan import SUPPORTED_TILE_M, CombinePlan, count_assignments, plan_combine
from .reference import reference_combine, world
from ..runtime.device import num_sms

BACKENDS = ("auto", "reference", "overlap")
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # reference backend


def overlap_available(device: torch.device | None = None) -> tuple[bool, str]:
    """Whether the overlap backend can run here, and why not."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    if device is not None and device.type != "cuda":
        return False, f"tensors are on {device}, not CUDA"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return False, "needs a Hopper (sm_90) GPU"
    for mod in ("cutlass", "nvshmem.core"):
        try:
            if importlib.util.find_spec(mod) is None:
                return False, f"{mod} is not installed (pip install moe-overlap[gpu])"
        except ModuleNotFoundError:
            return False, f"{mod} is not installed (pip install moe-overlap[gpu])"
    return True, ""


class MoECombine(torch.nn.Module):
    """Combine for one MoE layer; construct once per layer, call `plan` then `forward` per step.

    num_experts: global experts E (E // world_size per rank); intermediate_size K: the experts'
    intermediate width, columns of h and rows of w_down (HF ``moe_intermediate_size``, not the
    model's ``hidden_size``; ``self.hidden_size`` keeps it under the old name, and the keyword
    ``hidden_size=`` still works with a DeprecationWarning); out_features N: columns of w_down, the
    layer's output width (the model's hidden size); topk: experts per token;
    max_tokens_per_rank: the most tokens any rank routes in one call (sizes plans and
    communication buffers); tile_m: rows per band (64, 128 or 256); backend: see the module doc.

    Options (``options=CombineOptions(...)``, or the same names as keyword arguments: ccta, mgb,
    transport, local_copy, copy, layout; a keyword given overrides the object's field): see
    moe_overlap/combine/options.py for each option, its allowed values and the one meaning of
    "auto". They are validated and resolved once here (``self.options``: no "auto" left but the
    per-plan layout); ``autotune`` replaces them with the tuned ccta and mgb (and the order, for
    ``order="auto"``).

    validate=True: `plan` and `forward` check their input, including its values (expert ids in
    range, topk_ids matching the counts the plan was made from, capacities), which reads data on
    the host, and agree on the outcome over the group (one small all-reduce), so bad input on one
    rank raises on every rank, naming that rank, instead of leaving the others waiting in the
    exchange. The same all-reduce compares what the ranks are about to do (`checks.agree_on_call`):
    the call and its sequence number (a rank that skipped a call, or the backward, is named),
    the layer's sizes and options, the dtype, and the whole counts matrix the plan was made from
    against every rank's topk_ids (a plan of an earlier step reused on one rank); a difference
    raises RankMismatchError on every rank, naming the ranks and the field. validate=False
    (CUDA graphs): no host reads and no extra collective; only the host facts (shapes, dtypes,
    devices) are checked, locally. The caller then vouches, on every rank,
    that expert ids are in [0, num_experts), that each plan was made from the all-gathered counts
    of the very routing passed to `forward` (`exchange_counts(topk_ids)` of this step), that no
    rank routes more than max_tokens_per_rank tokens, that h holds the plan's rows
    (plan.total_rows) and that every rank passes the same kind of input; otherwise the output is
    silently wrong or a rank waits until a timeout.

    Memory (overlap backend): the communication state (symmetric receive slots, counters,
    epoch tags, epoch, expected counts, error word) is a ``CommBuffer``
    (moe_overlap/combine/comm_buffer.py). ``comm_buffer=None`` (default): the process-wide buffer
    of (group, transport, bf16), shared by every such layer and sized for the largest
    (``max_tokens_per_rank * topk * N * 2`` bytes per slot, two slots), reserved here at
    construction and allocated by the first call; ``comm_buffer=CommBuffer(...)``: that one (a
    new object: this layer's own). Layers sharing a buffer must run one at a time (no call of
    one in flight while another's is launched on another stream), and share its errors and
    ``reset()``. The heap a model needs: ``moe-overlap heap``.

    Autograd: the ``reference`` backend is differentiable in h, w_down and topk_weights across
    ranks (its exchange's backward is the reverse exchange; backward is collective, run it on
    every rank). The ``overlap`` backend is inference-only: it raises if grad mode is on and an
    input requires grad.
    """

    def __init__(self, num_experts: int, intermediate_size: int | None = None,
                 out_features: int | None = None, topk: int | None = None,
                 max_tokens_per_rank: int | None = None, group=None, tile_m: int = 128,
                 backend: str = "auto",
                 ccta=None, mgb=None, transport: str | None = None, validate: bool = True,
                 local_copy: bool | None = None, copy: str | None = None,
                 layout: str | None = None, error_check: str | None = None,
                 options: CombineOptions | None = None, comm_buffer=None,
                 scale: str | None = None, hidden_size: int | None = None):
        super().__init__()
        if hidden_size is not None:  # the old name: not the model's hidden size (out_features)
            if intermediate_size is not None:
                raise TypeError("give intermediate_size only (hidden_size is its old name)")
            warnings.warn("MoECombine(hidden_size=) is deprecated: it is the experts' "
                          "intermediate width (rows of w_down), now intermediate_size=; the "
                          "model's hidden size is out_features", DeprecationWarning, stacklevel=2)
            intermediate_size = hidden_size
        hidden_size = intermediate_size
        from .comm_buffer import CommBuffer
        if comm_buffer is not None and not isinstance(comm_buffer, CommBuffer):
            raise TypeError(f"comm_buffer must be a CommBuffer, got {type(comm_buffer).__name__}")
        rank, W = world(group)
        ints = {}
        for name, v in (("num_experts", num_experts), ("intermediate_size", hidden_size),
                        ("out_features", out_features), ("topk", topk),
                        ("max_tokens_per_rank", max_tokens_per_rank)):
            try:
                ints[name] = as_int(name, v, minimum=1)
            except ValueError:
                raise ValueError(f"{name} must be a positive int, got {v!r}") from None
        num_experts, hidden_size, out_features = (ints["num_experts"], ints["intermediate_size"],
                                                  ints["out_features"])
        topk, max_tokens_per_rank = ints["topk"], ints["max_tokens_per_rank"]
        if isinstance(tile_m, numbers.Integral) and not isinstance(tile_m, bool):
            tile_m = int(tile_m)
        if num_experts % W:
            raise ValueError(f"num_experts={num_experts} is not divisible by the world size {W}")
        if topk > num_experts:
            raise ValueError(f"topk={topk} exceeds num_experts={num_experts}")
        if tile_m not in SUPPORTED_TILE_M:
            raise ValueError(f"tile_m={tile_m!r} not supported; use one of {SUPPORTED_TILE_M}")
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; choose from {BACKENDS}")
        # every option checked in one place (CombineOptions.validate), resolved once below
        options = options_from_kwargs(options, "MoECombine", ccta=ccta, mgb=mgb,
                                      transport=transport, local_copy=local_copy, copy=copy,
                                      layout=layout, error_check=error_check, scale=scale)
        self.group, self.rank, self.world_size = group, rank, W
        self.num_experts, self.experts_per_rank = num_experts, num_experts // W
        self.hidden_size, self.out_features, self.topk = hidden_size, out_features, topk
        self.intermediate_size = hidden_size
        self.max_tokens_per_rank, self.tile_m, self.validate = max_tokens_per_rank, tile_m, validate
        self.requested_backend = backend
        cuda = torch.cuda.is_available()
        self.facts = CombineFacts(
            world_size=W, hidden_size=hidden_size, out_features=out_features,
            experts_per_rank=num_experts // W, tile_m=tile_m, rows=max_tokens_per_rank * topk,
            device_name=torch.cuda.get_device_name() if cuda else "cpu",
            num_sms=num_sms(torch.cuda.current_device()) if cuda else None)
        self._requested = options  # as asked ("auto" kept): what the tune-cache key is made of
        self.options = options.resolve(self.facts)
        if self.options.gemm_options:  # checked now, not when the overlap backend starts
            self.options.check_gemm_options(tile_m)
        self.comm_buffer = None
        if backend != "reference":
            if comm_buffer is None:
                comm_buffer = CommBuffer.shared(group, self.options.transport, torch.bfloat16)
            elif comm_buffer.group is not group or comm_buffer.dtype != torch.bfloat16 or \
                    comm_buffer.transport != self.options.transport:
                raise ValueError(f"comm_buffer is for transport={comm_buffer.transport!r}, "
                                 f"{comm_buffer.dtype} rows (or another process group); this "
                                 "layer needs one of its group, bfloat16 rows and "
                                 f"transport={self.options.transport!r}")
            # host only: the memory is allocated (collectively) by the first overlapped call
            # (an N the overlap backend cannot run is refused there, not here: "auto" falls back)
            if out_features % 8 == 0:
                comm_buffer.reserve(max_tokens_per_rank * topk, out_features * 2)
            self.comm_buffer = comm_buffer
        self._impl = None  # overlap backend object, built lazily on the first CUDA call
        self._calls = 0  # validated calls entered (plan, forward): named in the agreement

    # the most rows one rank can receive: every token of every rank routed to its experts
    @property
    def max_rows(self) -> int:
        return self.world_size * self.max_tokens_per_rank * self.topk

    # the resolved options under their historical attribute names (read-only: the layer's
    # options change only through autotune, which replaces self.options)
    ccta = property(lambda self: self.options.ccta, doc="Consumer SMs (resolved option).")
    mgb = property(lambda self: self.options.mgb, doc="Bands per transfer (resolved option).")
    transport = property(lambda self: self.options.transport)
    layout = property(lambda self: self.options.layout)
    local_copy = property(lambda self: self.options.local_copy)
    copy = property(lambda self: self.options.copy)
    tune_key = property(lambda self: self._requested.tune_key(self.facts),
                        doc="The tune-cache key of this layer's shape bucket and path.")

    def plan(self, expert_counts: torch.Tensor, validate: bool | None = None) -> CombinePlan:
        """The plan of this rank for all-gathered counts [W, E], sized for max_tokens_per_rank.

        validate (default: the layer's): check the counts' values; collective then (every rank
        raises if any rank's counts are bad). False: no host read, no collective."""
        validate = self.validate if validate is None else validate
        result = {}

        def make():
            if not isinstance(expert_counts, torch.Tensor):
                raise TypeError(f"expert_counts must be a torch.Tensor, got "
                                f"{type(expert_counts).__name__}")
            if tuple(expert_counts.shape) != (self.world_size, self.num_experts):
                raise ValueError(f"expert_counts has shape {tuple(expert_counts.shape)}, expected "
                                 f"[world_size={self.world_size}, "
                                 f"num_experts={self.num_experts}]")
            result["plan"] = plan_combine(expert_counts, self.rank, tile_m=self.tile_m,
                                          mgb=self.mgb, max_rows=self.max_rows,
                                          validate=validate, layout=self.layout,
                                          order=self.options.order)

        if not validate:
            make()
        else:
            self._calls += 1
            err = error_of(make)
            agree_on_call("MoECombine.plan", None if err else self._fields(
                num_experts=self.num_experts, mgb=self.mgb, layout=self.layout,
                order=self.options.order, expert_counts=expert_counts), err, self.group,
                where=f"layer call #{self._calls}")
        # scale="ordered" needs every rank's counts with the plan (prepare / forward)
        self._last_plan_counts = (result["plan"], expert_counts)
        return result["plan"]

    def _fields(self, **more) -> dict:
        """What every rank's layer must have alike (the agreement's fields), and `more`."""
        return {"hidden_size (K)": self.hidden_size, "out_features (N)": self.out_features,
                "topk": self.topk, "max_tokens_per_rank": self.max_tokens_per_rank,
                "tile_m": self.tile_m, **more}

    def _forward_fields(self, h, w_down, plan) -> dict:
        backend = self.backend_for(h.device)
        fields = self._fields(num_experts=self.num_experts, backend=backend,
                              **{"h and w_down dtype": h.dtype,
                                 "device type": h.device.type, "plan mgb": plan.mgb,
                                 "plan layout": plan.layout, "plan order": plan.order})
        if backend == "overlap":  # what the ranks' kernels exchange and wait for
            fields.update(transport=self.options.transport, scale=self.options.scale,
                          local_copy=self.options.local_copy, copy=self.options.copy)
        else:  # the reference exchange's backward is collective
            fields["autograd (backward is collective)"] = torch.is_grad_enabled() and (
                h.requires_grad or w_down.requires_grad)
        return fields

    def _counts_of(self, plan, expert_counts):
        """The all-gathered counts of ``plan``: as given, else those of the last ``plan()``."""
        if expert_counts is not None:
            return expert_counts
        last = getattr(self, "_last_plan_counts", None)
        return last[1] if last is not None and last[0] is plan else None

    def backend_for(self, device: torch.device) -> str:
        if self.requested_backend != "auto":
            return self.requested_backend
        ok, _ = overlap_available(device)
        return "overlap" if ok and self.world_size > 1 else "reference"

    def check_inputs(self, h, w_down, plan, topk_ids, topk_weights):
        """Clear errors for bad input, before any work. Returns this rank's assignments per
        expert ([E], from topk_ids) where the layer validates, else None."""
        require_tensors(dict(h=h, w_down=w_down, topk_ids=topk_ids, topk_weights=topk_weights))
        if not isinstance(plan, CombinePlan):
            raise TypeError(f"plan must be a CombinePlan, got {type(plan).__name__}")
        if h.dim() != 2 or h.shape[1] != self.hidden_size:
            raise ValueError(f"h must be [rows, hidden_size={self.hidden_size}], got "
                             f"{tuple(h.shape)}")
        El, K, N = self.experts_per_rank, self.hidden_size, self.out_features
        if tuple(w_down.shape) != (El, K, N):
            raise ValueError(f"w_down must be [experts_per_rank={El}, K={K}, N={N}], got "
                             f"{tuple(w_down.shape)}")
        if h.dtype not in _FLOAT or w_down.dtype != h.dtype:
            raise TypeError(f"h and w_down must have the same dtype, one of "
                            f"{', '.join(str(d).removeprefix('torch.') for d in _FLOAT)} "
                            f"(bfloat16 on the overlap backend); got {h.dtype} and "
                            f"{w_down.dtype}")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.topk:
            raise ValueError(f"topk_ids must be [tokens, topk={self.topk}], got "
                             f"{tuple(topk_ids.shape)}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape "
                             f"{tuple(topk_ids.shape)}")
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        if topk_ids.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"capacity exceeded: {topk_ids.shape[0]} tokens > "
                             f"max_tokens_per_rank={self.max_tokens_per_rank}")
        devs = {t.device for t in (h, w_down, topk_ids, topk_weights)} | {plan.device}
        if len(devs) != 1:
            raise ValueError(f"h, w_down, plan, topk_ids and topk_weights must be on one device, "
                             f"got {sorted(map(str, devs))}")
        if plan.world_size != self.world_size or plan.rank != self.rank:
            raise ValueError(f"plan is for rank {plan.rank} of world size {plan.world_size}; this "
                             f"process group is rank {self.rank} of {self.world_size}")
        if plan.num_experts != self.num_experts:
            raise ValueError(f"plan has {plan.num_experts} experts, this layer {self.num_experts}")
        if plan.tile_m != self.tile_m:
            raise ValueError(f"plan has tile_m={plan.tile_m}, this layer {self.tile_m}")
        if self.backend_for(h.device) == "overlap":
            if torch.is_grad_enabled() and any(
                    t.requires_grad for t in (h, w_down, topk_weights)):
                raise RuntimeError(
                    "backend 'overlap' is inference-only (its kernels have no backward), but an "
                    "input requires grad: use backend='reference' to train through the combine, "
                    "or call it under torch.no_grad() / torch.inference_mode()")
            ok, why = overlap_available(h.device)
            if not ok:
                raise RuntimeError(f"backend 'overlap' cannot run: {why}")
            if h.dtype != torch.bfloat16:
                raise TypeError(f"backend 'overlap' needs bfloat16 h and w_down, got {h.dtype}")
            if not h.is_contiguous():
                raise ValueError("backend 'overlap' needs a contiguous h")
        if self.validate:  # reads data (a host sync on CUDA); validate=False for CUDA graphs
            mine = count_assignments(topk_ids, self.num_experts)  # also checks the ids' range
            check_routing_matches(
                mine, plan.routed_counts, "the plan",
                "a plan of another routing? plan each step from exchange_counts(topk_ids) of "
                "that step")
            need = int(plan.total_rows.item())
            if h.shape[0] < need:
                raise ValueError(f"h has {h.shape[0]} rows but the plan lays out {need}")
            return mine
        return None

    def prepare(self, plan: CombinePlan, topk_ids: torch.Tensor, expert_counts=None):
        """Per routing (once per step, right after `plan`, e.g. while the dispatch or the first
        expert GEMM runs): what `forward` needs from the routing, computed on the device without
        a host sync (overlap backend: each assignment's row for the owner's scale and the
        expected arrival counts; the reference backend needs nothing and gets None). Pass it to
        `forward(..., routes=...)` to keep this work out of the combine's critical path.
        expert_counts: the [W, E] counts the plan was made from; default: those of the last
        `plan()` call if it made this plan (only scale="ordered" reads them; with the layer's
        validate=True they are checked against topk_ids and the plan, a host sync)."""
        if not isinstance(plan, CombinePlan):
            raise TypeError(f"plan must be a CombinePlan, got {type(plan).__name__}")
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 \
                or topk_ids.shape[1] != self.topk:
            raise ValueError(f"topk_ids must be a [tokens, topk={self.topk}] tensor")
        if self.backend_for(topk_ids.device) == "reference":
            return None
        impl = self._overlap_impl(topk_ids.device)
        if not getattr(impl, "ordered", False):  # only the ordered scale reads the counts
            return impl.prepare(plan, topk_ids)
        return impl.prepare(plan, topk_ids, self._counts_of(plan, expert_counts),
                            validate=self.validate)

    def forward(self, h: torch.Tensor, w_down: torch.Tensor, plan: CombinePlan,
                topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                routes=None) -> torch.Tensor:
        """Combine one step: [T_local, N]. Collective (every rank calls it, also with 0 tokens).
        Overlap backend: a device error of an earlier call (read back asynchronously after each
        call, ``CombineOptions.error_check``) raises ``OverlapError`` here, before any work.

        plan: `plan(exchange_counts(topk_ids))` of this very routing; h: [>= plan.total_rows, K]
        expert inputs in the plan layout; topk_ids / topk_weights: [T_local, topk] of this rank.
        routes: `prepare(plan, topk_ids)` of this step (optional; computed in the call if None).
        With validate=True the checks (see the class doc) run on every rank and are agreed on
        before any communication; with validate=False see the class doc for what the caller
        vouches for."""
        backward_check = None
        if self.validate:
            self._calls += 1
            where = f"layer call #{self._calls}"
            result = {}

            def check():
                result["row"] = self.check_inputs(h, w_down, plan, topk_ids, topk_weights)
                result["fields"] = self._forward_fields(h, w_down, plan)

            err = error_of(check)
            agree_on_call("MoECombine.forward", result.get("fields"), err, self.group,
                          routing=None if err else (result["row"], plan.source_counts,
                                                    "the counts the plan was made from"),
                          where=where)
            backward_check = backward_agreement("backward of MoECombine.forward", self.group,
                                                where=where)
        else:
            self.check_inputs(h, w_down, plan, topk_ids, topk_weights)
        backend = self.backend_for(h.device)
        if backend == "reference":
            return reference_combine(h, w_down, plan, topk_ids, topk_weights, self.group,
                                     backward_check=backward_check)
        impl = self._overlap_impl(h.device)
        if routes is None and getattr(impl, "ordered", False):
            routes = impl.prepare(plan, topk_ids, self._counts_of(plan, None))
        return impl.forward(h, w_down, plan, topk_ids, topk_weights, routes=routes,
                            ccta=self.ccta)

    def check_errors(self):
        """Overlap backend: synchronize and raise if a device wait timed out in an earlier call
        (``OverlapError`` with the device's error record) of any layer on this layer's
        communication buffer. Nothing to check otherwise."""
        if self._impl is not None:
            self._impl.check_errors()
        elif self.comm_buffer is not None:  # other layers' calls on the shared buffer
            self.comm_buffer.check_errors()

    synchronize = check_errors

    def reset(self):
        """Collective (every rank, between calls): make the overlap backend usable again after
        a device error (a timeout, ranks out of step): error word, arrival counters, epoch tags,
        expected counts, epoch and band flags cleared on every rank between two barriers (see
        ``OverlapCombine.reset``), for every layer sharing its communication buffer. The
        reference backend keeps no device state: a barrier."""
        if self._impl is not None:
            self._impl.reset()
        elif self.comm_buffer is not None and self.comm_buffer.allocated:
            self.comm_buffer.reset()  # allocated by other layers (collectively: every rank)
        elif self.world_size > 1:
            import torch.distributed as dist
            dist.barrier(group=self.group)

    def _overlap_impl(self, device):
        ok, why = overlap_available(device)
        if not ok:
            raise RuntimeError(f"backend 'overlap' cannot run: {why}")
        if self._impl is None:
            from .overlap import OverlapCombine
            self._impl = OverlapCombine(
                group=self.group, num_experts=self.num_experts, hidden_size=self.hidden_size,
                out_features=self.out_features, topk=self.topk,
                max_tokens_per_rank=self.max_tokens_per_rank, tile_m=self.tile_m,
                options=self.options, comm_buffer=self.comm_buffer)
        return self._impl

    def autotune(self, h, w_down, expert_counts, topk_ids, topk_weights, candidates=None,
                 reps: int = 5, cache=None) -> tuple[int, int]:
        """Time (ccta, mgb) candidates (default: `tuning.coordinate_search` from the current
        choice) on this input with the overlap backend (CUDA-graph replays), keep the fastest
        (the slowest rank counts), cache it for this shape bucket (rank 0 writes) and use it from
        now on (``self.options`` becomes a copy with the chosen ccta and mgb). With
        ``order="auto"`` both orders are searched so, each with its own plans, and the fastest
        (order, ccta, mgb) is kept and cached. Each candidate is passed to the calls it times
        (``forward(..., ccta=)`` and a plan made with its mgb and order); no attribute is written
        while timing. Collective: call on every rank. A bucket every rank finds cached is not
        timed. Returns (ccta, mgb); the order is ``self.options.order``."""
        import torch.distributed as dist

        from ..runtime import collectives
        from ..timing import time_calls
        from .tuning import TuneCache, coordinate_search
        self.check_inputs(h, w_down, self.plan(expert_counts), topk_ids, topk_weights)
        impl = self._overlap_impl(h.device)
        cache = cache or TuneCache()
        dev = h.device
        orders = ORDERS if self._requested.order == "auto" else (self.options.order,)

        def agree(x: float, op) -> float:
            t = torch.tensor([x], dtype=torch.float64, device=dev)
            if self.world_size > 1:
                collectives.all_reduce(t, op=op, group=self.group)
            return float(t.item())

        def barrier():
            if self.world_size > 1:
                dist.barrier(group=self.group)

        hit = cache.entry(self.tune_key)
        if hit is not None:  # read as a layer's construction reads it (options.resolve)
            order = (hit.get("order") or self.options.order) if len(orders) > 1 else orders[0]
            if order not in ORDERS:
                raise ValueError(f"tune cache {cache.path}: entry {self.tune_key!r} has "
                                 f"order={order!r}; expected one of {ORDERS}")
            choice = (min(int(hit["ccta"]), impl.num_sms - 1), int(hit["mgb"]))
        if agree(0.0 if hit is None else 1.0, dist.ReduceOp.MIN) != 1.0:
            def measure(c, m, order):
                plan = plan_combine(expert_counts, self.rank, tile_m=self.tile_m, mgb=m,
                                    max_rows=self.max_rows, validate=False, layout=self.layout,
                                    order=order)
                routes = impl.prepare(plan, topk_ids, expert_counts) if getattr(
                    impl, "ordered", False) else impl.prepare(plan, topk_ids)
                ms = time_calls(lambda: impl.forward(h, w_down, plan, topk_ids, topk_weights,
                                                     routes=routes, ccta=c),
                                reps=reps, replays=5, barrier=barrier)[0]
                impl.check_errors()
                return agree(ms, dist.ReduceOp.MAX)

            times = {}
            for o in orders:
                if candidates:
                    for cm in candidates:
                        times[(*cm, o)] = measure(*cm, o)
                else:
                    _, t = coordinate_search(lambda c, m, o=o: measure(c, m, o),
                                             (self.ccta, self.mgb), num_sms=impl.num_sms)
                    times.update({(c, m, o): v for (c, m), v in t.items()})
            best = min(times, key=times.get)
            choice, order = best[:2], best[2]
            if self.rank == 0:
                extra = {"order": order} if len(orders) > 1 else {}
                cache.put(self.tune_key, choice[0], choice[1], ms=times[best], **extra,
                          tried={(f"{c},{m}" if len(orders) == 1 else f"{c},{m},{o}"): t
                                 for (c, m, o), t in times.items()})
        # every rank runs rank 0's choice (each read its own cache file, which may differ, e.g.
        # one per node), and no rank goes on to build a layer from the file before rank 0 wrote
        if self.world_size > 1:
            t = torch.tensor([choice[0], choice[1], ORDERS.index(order)], dtype=torch.int64,
                             device=dev)
            collectives.broadcast(t, src=dist.get_global_rank(self.group or dist.group.WORLD,
                                                              0), group=self.group)
            choice, order = (int(t[0]), int(t[1])), ORDERS[int(t[2])]
        barrier()
        self.options = self.options.replace(ccta=int(choice[0]), mgb=int(choice[1]),
                                            order=order)
        return self.ccta, self.mgb
