"""OverlapCombine: producer GEMM || consumer (ship bands) || owner's scale, no host sync.

One call of ``forward(h, w_down, plan, topk_ids, topk_weights)`` on the current stream ``s0``:

    s0: epoch += 1; expected_cum[s] += rows from s + 1; rows(t, k); weights -> fp32
    cs (high priority) waits s0 (this point: not the producer below)
    s0: producer: y[bands] = h[bands] @ w_down[band_expert], band_ready[b] = epoch (release, gpu)
    cs: consumer (ccta CTAs, spins on band flags; launched after the producer, so it never
        waits on a kernel not launched yet)
    cs: scale (waits on arrival counters, then out = sum_k w * recv[row])
    s0 waits cs; starts the asynchronous read-back of the error word (ErrorWatch); returns out
The next call raises OverlapError first if that read-back found an error; ``reset()`` (collective)
clears the device state after one.

Communication state: a ``CommBuffer`` (moe_overlap/combine/comm_buffer.py: the receive slots,
counters, epoch tags, the epoch, the expected counts and the error word), this layer's own unless
``comm_buffer=`` names one shared with other layers (``MoECombine`` shares one per (group,
transport, dtype) by default). Receive buffer: symmetric, two slots used by epoch parity, each of
the buffer's ``slot_bytes`` (at least ``max_tokens_per_rank * topk * N * 2``; this layer's rows
start each slot, ``recv`` is its ``[2, max_tokens_per_rank * topk, N]`` view). The epoch counts
calls on the buffer, whatever layer makes them, so all that follows holds for layers sharing it
as long as they run one at a time.
Why two slots: a peer may start shipping call i+1 while this rank's scale still reads call i. It
cannot ship call i+2 before this rank's scale of call i is done: every consumer adds a call marker
(+1) to every owner's counter[rank] when it starts, each rank's consumer of call i+1 starts after
its scale of call i (same stream), and the peer's scale of call i+1 (before its consumer of i+2)
waits for that marker.

Everything per call lives on the device (epoch, expected counts, flags), so the call is capturable
in a CUDA graph and replays with new data in the same input tensors.

ccta 0 (``options.min_ccta``: a group of one rank with local_copy=False, what ccta="auto"
resolves to there): no row leaves the rank and none is copied, so the call is the producer on
every SM (no band flags) and the scale reading y, on s0 alone (``_forward_alone``): no consumer,
no call marker, no wait. Bitwise equal to the call with a consumer.

Options: ``moe_overlap.combine.options.CombineOptions`` (one default each, resolved once at
construction). The consumer variants they select:
- ``local_copy=False`` (the default with nvlink): the consumer ships remote segments only.
  ``prepare(plan, ...)`` builds, on the device, each (t, k) assignment's source row: the
  receive-slot row r (remote experts) or, for this rank's own experts, y row =
  expert_row_start[e] + group_row_start[e, rank] + (r - first receive row of expert g), encoded
  as -(y row) - 1; expected[rank] only advances by the call marker. The scale is ordered after
  the producer on the stream (cs waits s0 after the producer launch), not on the band flags.
  Memory ordering: the producer's y stores (TMA, async proxy) are complete and visible to later
  work at its kernel boundary; the cs -> s0 event wait orders the scale launch after that boundary
  (no flag needed). Why not spin on band_ready in the scale instead: the scale's 2 x SMs CTAs could
  take the SMs (registers) the persistent producer still needs and deadlock it until the timeout;
  ordered after the producer they never spin on local work. Remote rows keep the sys-scope
  counter release/acquire. y is rewritten only by the next call's producer, which s0 orders after
  this call's scale (s0 waits cs at the end of the call).
- ``local_copy=True`` (the default with nvshmem): the consumer also copies this rank's own rows
  into its receive buffer (its local cells) and counts them; the scale reads every assignment
  from the receive buffer.
- ``copy="tma"`` (nvlink only; the default there): the consumer moves segments with bulk
  copies through a shared memory ring (see moe_overlap/combine/consumer.py);
  ``consumer_stages`` / ``consumer_chunk`` size the ring.

- ``scale="ordered"`` (nvlink, local_copy=False): the consumer adds each piece's rows to the
  owner's per-segment arrival word (``arrival="segment"``; the counters then carry only the call
  markers), ``begin_call`` advances the cumulative per-segment expectation (``CommBuffer.
  seg_tables``) by the routing's ``seg_inc`` (each sender's valid prefix only,
  ``ordered_routes.add_seg_inc``) and zeroes the tile queue, and the ordered scale
  (combine/scale_ordered.py) runs on s0 right after the producer, on every SM (design A of
  bench/NOTES.md "Session 11"): after the kernel boundary every local row is final (no band
  wait), each tile waits for its own segments. Why no deadlock and why the slots stay safe:
  docs/CONTRACTS.md "Ordered scale" (the launch on s0 e ends before this rank's consumer e+1,
  which waits s0 after begin_call e+1). ``prepare(plan, topk_ids, expert_counts)`` needs every
  rank's counts (the plan holds only this rank's) and builds the tile tables on the device, no
  host sync (combine/ordered_routes.py; ``ordered_impl="host"``: the host reference).

Producer: ``moe_overlap.combine.grouped_gemm.GroupedGemm`` (the dynamic tile fetch beside the
consumer, see ``_gemm_for``); without CuTe DSL (or with ``producer="torch"``) a torch stand-in:
all-expert matmul + gather by band expert, then one torch op that sets the flags of all valid
bands (no host sync; test-only speed).
"""
from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from ..diagnostics import CombineDebug, debug_scope
from .comm_buffer import (CommBuffer, OverlapError,  # noqa: F401  (OverlapError: its old home)
                          ordered_segment_capacity)
from .options import (TRANSPORTS, CombineFacts, CombineOptions, min_ccta,  # noqa: F401
                      options_from_kwargs, producer_gemm_options, producer_tile_n)
from ..runtime.device import num_sms


# test only (MOE_OVERLAP_TEST_BROKEN_ORDER=flags_before_stores): GPU cycles between the early
# flags and the stores (~1 ms)
_BROKEN_ORDER_STORE_DELAY_CYCLES = 2_000_000


def check_gemm_options(options, tile_m):
    """Validated copy of OverlapCombine's ``gemm_options`` (ValueError / TypeError otherwise)."""
    return CombineOptions(gemm_options=options).check_gemm_options(tile_m)


def consumer_for(options: CombineOptions):
    """The ``Consumer`` the overlapped combine launches for resolved ``options`` (its variant,
    threads, ring, timeout; per-segment arrivals with scale="ordered"). Host only, nothing
    compiled yet; the producer bench builds its loopback consumer here too."""
    from .consumer import Consumer
    if not options.is_resolved:
        raise ValueError("consumer_for needs resolved options (CombineOptions.resolve)")
    return Consumer(options.transport, options.consumer_threads, options.consumer_unroll,
                    int(options.timeout_s * 1e9), local_copy=options.local_copy,
                    copy=options.copy, stages=options.consumer_stages,
                    chunk_bytes=options.consumer_chunk, lookahead=options.consumer_lookahead,
                    **({"arrival": "segment"} if options.scale == "ordered" else {}))


class CombineRoutes:
    """A routing's per-call inputs of the overlapped combine (``OverlapCombine.prepare``)."""

    def __init__(self, rows, expected_inc, plan, num_tokens, ordered=None):
        self.rows, self.expected_inc = rows, expected_inc
        self.plan, self.num_tokens = plan, num_tokens
        # scale="ordered": {"tables": the tile tables (int32; the dependency arrays padded to
        # T * topk, combine/ordered_routes.py), "seg_inc": int64 [W, Sc] valid up to
        # "seg_count": int32 [W] per row (``OrderedRoutes``)} on the device
        self.ordered = ordered


class OverlapCombine:
    """The overlapped combine of one layer on this rank (see the module doc for one call).

    Sizes: num_experts, hidden_size (K), out_features (N), topk, max_tokens_per_rank, tile_m.
    Options: ``options=CombineOptions(...)`` and/or the same names as keyword arguments (a
    keyword given overrides the object's field); resolved once here (``self.options``, no
    "auto" left; see moe_overlap/combine/options.py for every option and what "auto" means).
    ``mgb`` is accepted for compatibility only: bands per transfer are the plan's
    (``plan_combine(mgb=)`` / ``MoECombine``), this object never reads it.
    Per call, ``forward(..., ccta=)`` / ``ship(..., ccta=, piece_rows=)`` /
    ``produce(..., ccta=)`` override the resolved ccta / piece rows for that call only (the
    tuner and the sweep time candidates this way).
    ``comm_buffer``: the ``CommBuffer`` holding the communication state (receive slots,
    counters, epoch tags, epoch, expected counts, error word); default: one of this object's
    own. Layers given the same buffer share its memory (sized for the largest), its epoch, its
    errors and its ``reset()``; they must run one at a time (see comm_buffer.py)."""

    # scale="ordered" state (set in __init__; the class values are the default scale's)
    ordered, seg_cap, oscale, queue = False, 0, None, None
    _test_consumer_delay_cycles = 0  # test only: see __init__

    def __init__(self, group=None, num_experts: int = 8, hidden_size: int = 1024,
                 out_features: int = 1024, topk: int = 2, max_tokens_per_rank: int = 1024,
                 tile_m: int = 128, ccta=None, mgb=None, transport: str | None = None,
                 producer: str | None = None, timeout_s: float | None = None,
                 consumer_threads: int | None = None, consumer_unroll: int | None = None,
                 local_copy: bool | None = None, copy: str | None = None,
                 consumer_stages: int | None = None, consumer_chunk: int | None = None,
                 consumer_piece_rows: int | None = None,
                 gemm_options: dict | None = None, error_check: str | None = None,
                 options: CombineOptions | None = None, comm_buffer: CommBuffer | None = None,
                 scale: str | None = None):
        if comm_buffer is not None and not isinstance(comm_buffer, CommBuffer):
            raise TypeError(f"comm_buffer must be a CommBuffer, got {type(comm_buffer).__name__}")
        if mgb is not None and mgb != "auto":
            warnings.warn("OverlapCombine(mgb=...) is ignored: bands per transfer are the "
                          "plan's (plan_combine(mgb=...) or MoECombine(mgb=...))",
                          DeprecationWarning, stacklevel=2)
        # every option checked here, on any machine, before CUDA is touched
        opts = options_from_kwargs(
            options, "OverlapCombine", ccta=ccta, transport=transport, producer=producer,
            timeout_s=timeout_s, consumer_threads=consumer_threads,
            consumer_unroll=consumer_unroll, local_copy=local_copy, copy=copy,
            consumer_stages=consumer_stages, consumer_chunk=consumer_chunk,
            consumer_piece_rows=consumer_piece_rows, gemm_options=gemm_options,
            error_check=error_check, scale=scale)
        self.gemm_options = opts.check_gemm_options(tile_m)
        if not torch.cuda.is_available():
            raise OverlapError("OverlapCombine needs CUDA")
        if out_features % 8:
            raise ValueError(f"out_features={out_features} must be a multiple of 8 (16-byte rows)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = W = dist.get_world_size(group)
        if num_experts % W:
            raise ValueError(f"num_experts={num_experts} not divisible by world size {W}")
        self.num_experts, self.experts_per_rank = num_experts, num_experts // W
        self.hidden_size, self.out_features, self.topk = hidden_size, out_features, topk
        self.max_tokens_per_rank, self.tile_m = max_tokens_per_rank, tile_m
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_sms = num_sms(self.device)
        self.facts = CombineFacts(
            world_size=W, hidden_size=hidden_size, out_features=out_features,
            experts_per_rank=self.experts_per_rank, tile_m=tile_m,
            rows=max_tokens_per_rank * topk, device_name=torch.cuda.get_device_name(self.device),
            num_sms=self.num_sms)
        self.options = opts = opts.resolve(self.facts)
        self.timeout_ns = int(opts.timeout_s * 1e9)
        if os.environ.get("CUDA_MODULE_LOADING", "") != "EAGER":
            warnings.warn("CUDA_MODULE_LOADING is not EAGER: a spinning kernel plus a lazily "
                          "loaded module can deadlock; OverlapCombine warms every kernel up, "
                          "but set CUDA_MODULE_LOADING=EAGER before CUDA starts", RuntimeWarning)

        from .scale import Scale
        if comm_buffer is None:
            comm_buffer = CommBuffer(group, opts.transport)
        if comm_buffer.dtype != torch.bfloat16:
            raise ValueError(f"comm_buffer holds {comm_buffer.dtype} rows; the overlap combine "
                             "moves bfloat16 rows")
        if comm_buffer.group is not group or comm_buffer.transport != opts.transport:
            raise ValueError(
                f"comm_buffer is for transport={comm_buffer.transport!r}"
                f"{'' if comm_buffer.group is group else ' of another process group'}; this "
                f"layer needs one of its own group and transport={opts.transport!r}")
        self.comm = comm_buffer
        self.max_recv_rows = max_tokens_per_rank * topk
        self._band_ready = None
        self.ordered = opts.scale == "ordered"
        self.seg_cap = 0
        if self.ordered:
            # the segment capacity of a plan at the layer's maximum rows (MoECombine.plan): the
            # row stride of seg_arrivals, which the senders' consumers and this rank's scale
            # must share, so it must be equal on every rank (checked here, collectively)
            self.seg_cap = ordered_segment_capacity(W, max_tokens_per_rank, topk,
                                                    self.experts_per_rank, tile_m)
            caps = [None] * W
            dist.all_gather_object(caps, self.seg_cap, group=group)
            if len(set(caps)) != 1:
                raise ValueError(f"scale='ordered' needs the same segment capacity on every "
                                 f"rank (the shapes differ between ranks?): {caps}")
        # collective (same construction order on every rank): allocates, or grows, the memory
        comm_buffer.attach(self, self.max_recv_rows, out_features * 2,
                           seg_words=W * self.seg_cap)
        self.rt = comm_buffer.runtime
        if opts.transport == "nvlink":
            self.buffers.require_p2p()  # stores to the peers' memory: they must be mapped
        dev = self.device
        # reported by default: read back after every call, raised by the next (ErrorWatch of
        # the buffer: an error of any layer on it raises in the next call of any of them)
        self._async_errors = opts.error_check == "async"
        self._y = None
        self.cs = torch.cuda.Stream(device=dev, priority=-1)
        self.consumer = consumer_for(opts)
        self.scale = Scale(topk, timeout_ns=self.timeout_ns, y_src=not opts.local_copy)
        self.oscale = self.queue = None
        if self.ordered:
            from .scale_ordered import OrderedScale
            self.oscale = OrderedScale(topk, timeout_ns=self.timeout_ns)
            self.queue = torch.zeros(1, dtype=torch.int32, device=dev)
        self.producer_kind = self._pick_producer(opts.producer)
        self._gemms = {}  # per producer_gemm_options: see _gemm_for
        self._warm = False  # scale (and the consumer where ccta > 0) loaded (warmup())
        self._consumer_warm = False  # the consumer loaded (a layer of ccta 0 runs none)
        self._prod_warm = False  # producer compiled and run once alone
        # diagnostics (benchmarks; eager calls only, never under capture; never in a compile
        # key): see ``diagnostics``
        self._debug = CombineDebug()
        # test only (moe_overlap.combine.race_check): a deliberately broken ordering, read once
        # here. "flags_before_stores": the torch stand-in producer raises every band flag about
        # a millisecond before the band's rows are computed and stored, so the consumer ships
        # stale (poisoned) rows; the validation must catch it. Refused with the real producer
        # (its kernel has no such mode).
        self._test_broken_order = os.environ.get("MOE_OVERLAP_TEST_BROKEN_ORDER", "")
        # "seg_expected_frozen" (scale="ordered" only): begin_call does not advance the
        # per-segment expectation, so the ordered scale may read rows before they arrive.
        if self._test_broken_order not in ("", "flags_before_stores", "seg_expected_frozen"):
            raise ValueError(f"MOE_OVERLAP_TEST_BROKEN_ORDER={self._test_broken_order!r}; "
                             "only 'flags_before_stores' and 'seg_expected_frozen' exist")
        if self._test_broken_order == "flags_before_stores" and self.producer_kind != "torch":
            raise ValueError("MOE_OVERLAP_TEST_BROKEN_ORDER needs producer='torch'")
        if self._test_broken_order == "seg_expected_frozen" and not self.ordered:
            raise ValueError("MOE_OVERLAP_TEST_BROKEN_ORDER=seg_expected_frozen needs "
                             "scale='ordered'")
        # test only: GPU cycles cs sleeps before each consumer launch (late arrivals)
        self._test_consumer_delay_cycles = 0

    # the communication state lives in the CommBuffer (shared with the layers sharing it)
    buffers = property(lambda self: self.comm.buffers, doc="runtime.nvshmem.CombineBuffers")
    counters = property(lambda self: self.comm.buffers.counters)
    epoch = property(lambda self: self.comm.epoch, doc="int32 [1]: calls on the buffer")
    expected = property(lambda self: self.comm.expected)
    err = property(lambda self: self.comm.err)
    _watch = property(lambda self: self.comm.watch)
    slot_bytes = property(lambda self: self.comm.slot_bytes,
                          doc="Bytes between the two receive slots (the buffer's slot).")

    @property
    def recv(self) -> torch.Tensor:
        """This layer's view of the receive slots: bf16 [2, max_recv_rows, N] (slot stride
        ``slot_bytes``)."""
        return self.comm.slots(self.max_recv_rows, self.out_features)

    def _clear_band_flags(self):
        if self._band_ready is not None:  # flags hold old epochs: a match after the epoch reset
            self._band_ready.zero_()

    # resolved options under their historical attribute names (read-only)
    ccta = property(lambda self: self.options.ccta, doc="Consumer SMs (resolved option).")
    transport = property(lambda self: self.options.transport)
    local_copy = property(lambda self: self.options.local_copy)
    copy = property(lambda self: self.options.copy)
    scale_kind = property(lambda self: self.options.scale, doc="'plain' or 'ordered'.")
    piece_rows = property(lambda self: self.options.consumer_piece_rows)

    def diagnostics(self, timeline: list | None = None, skip_scale: bool = False):
        """Context manager for benchmarks (eager calls only): inside it every ``forward``
        appends to ``timeline`` (a list) a dict of CUDA timing events (start, begun, shipped,
        produced, scaled), and ``skip_scale=True`` leaves the scale out (its output is then
        garbage: times producer || consumer alone). Not part of any compile key."""
        return debug_scope(self, CombineDebug(timeline=timeline, skip_scale=bool(skip_scale)))

    # ---- producer ----------------------------------------------------------------------------
    def _pick_producer(self, producer: str) -> str:
        self._tile_n = producer_tile_n(self.out_features)
        if producer == "torch":
            return "torch"
        if self._tile_n is None or self.tile_m not in (64, 128) or self.hidden_size % 64:
            if producer == "grouped_gemm":
                raise ValueError("GroupedGemm needs tile_m in (64, 128), N % 64 == 0, K % 64 == 0")
            return "torch"
        try:
            from .grouped_gemm import GroupedGemm  # noqa: F401
            return "grouped_gemm"
        except Exception:
            if producer == "grouped_gemm":
                raise
            return "torch"

    def buffers_for(self, h, plan):
        """The producer's outputs for this input, owned by this object and reused across calls:
        ``(y, band_ready)`` with y bf16 ``[h.shape[0] + 1, N]`` (the last row absorbs the
        stores of invalid bands; the GEMM output is ``y[:h.shape[0]]``) and band_ready int32
        ``[plan.band_capacity]`` (persistent flags, never reset: see docs/CONTRACTS.md). Benches
        and the validation use them to time or poison the producer's buffers."""
        rows = h.shape[0]
        if self._y is None or self._y.shape[0] != rows + 1:
            self._y = torch.zeros(rows + 1, self.out_features, dtype=torch.bfloat16,
                                  device=self.device)  # last row: scratch for invalid bands
        if self._band_ready is None or self._band_ready.numel() != plan.band_capacity:
            # never reset during use: a fresh tensor starts at 0 < every epoch
            self._band_ready = torch.zeros(plan.band_capacity, dtype=torch.int32,
                                           device=self.device)
        return self._y, self._band_ready

    def _torch_producer(self, h, w_down, plan, y, band_ready, epoch):
        """Stand-in producer (torch ops, no host sync): every band = h[band rows] @ w[expert]."""
        tm, cap = plan.tile_m, plan.band_capacity
        R = h.shape[0]
        ar = torch.arange(tm, device=h.device)
        bidx = torch.arange(cap, device=h.device)
        valid = bidx < plan.num_bands.to(bidx.dtype)
        src = plan.band_src_row.long().clamp(min=0)[:, None] + ar  # [cap, tm]
        src_in = src.clamp(max=R - 1)
        expert = plan.band_expert.long().clamp(min=0)
        if self._test_broken_order == "flags_before_stores":  # test only: see __init__
            band_ready.copy_(torch.where(valid, epoch.expand(cap), band_ready))
            # the stores come late, so the consumer finds the flags up before them every call
            # (without it the small test GEMMs often finish before the consumer starts)
            torch.cuda._sleep(_BROKEN_ORDER_STORE_DELAY_CYCLES)
        y_all = torch.matmul(h.unsqueeze(0), w_down)  # [El, R, N] (test sizes only)
        vals = y_all[expert[:, None].expand(-1, tm), src_in]  # [cap, tm, N]
        dst = torch.where(valid[:, None] & (src < R), src, torch.full_like(src, y.shape[0] - 1))
        # y here is the (rows + 1)-row buffer: the last row absorbs invalid bands
        y.index_copy_(0, dst.reshape(-1), vals.reshape(-1, y.shape[1]).to(y.dtype))
        band_ready.copy_(torch.where(valid, epoch.expand(cap), band_ready))

    def _gemm_for(self, ccta: int, flags: bool = True):
        """The producer GEMM for a launch beside ``ccta`` consumer SMs (0: alone, every SM):
        its options are ``options.producer_gemm_options`` (the dynamic tile fetch unless
        gemm_options set the tile walk; flags=False: the build without band flags)."""
        opts = producer_gemm_options(self.gemm_options, ccta, flags)
        key = tuple(sorted(opts.items()))
        gemm = self._gemms.get(key)
        if gemm is None:
            from .grouped_gemm import GroupedGemm
            gemm = self._gemms[key] = GroupedGemm(tile_m=self.tile_m, tile_n=self._tile_n,
                                                  **opts)
        return gemm

    def produce(self, h, w_down, plan, y_ext, band_ready, ccta=None, flags: bool = True):
        """Launch the producer alone on the current stream: y = y_ext[:rows] = h[bands] @
        w_down[band expert], then band_ready[b] = epoch for every valid band (the current epoch:
        no epoch change). y_ext: ``[rows + 1, N]`` (``buffers_for``); ccta: SMs left out of the
        producer's grid (default: the resolved option; 0: every SM); flags=False: the GEMM
        built without band flags (band_ready is not written; the call without a consumer)."""
        ccta = self.ccta if ccta is None else ccta
        if h.shape[0] == 0:
            # this rank receives no rows (the plan has no bands): the GEMM still launches, on
            # the order of the stream every rank keeps, but its TMA descriptors need a row, so
            # it gets one zero row of h and y's scratch row (y_ext has rows + 1 = 1 row)
            h = h.new_zeros(1, h.shape[1])
        if self.producer_kind == "torch":
            self._torch_producer(h, w_down, plan, y_ext, band_ready, self.epoch)
        else:
            gemm = self._gemm_for(ccta, flags)
            gemm(h, w_down, y_ext[:h.shape[0]], plan.band_expert, plan.band_src_row,
                 plan.schedule, plan.num_bands, band_ready, self.epoch, ccta=ccta, err=self.err,
                 rank=self.rank, band_valid=plan.band_valid if gemm.skip_padding else None)

    # ---- checks ------------------------------------------------------------------------------
    def check_inputs(self, h, w_down, plan, topk_ids, topk_weights):
        El, K, N = self.experts_per_rank, self.hidden_size, self.out_features
        if torch.is_grad_enabled() and any(t.requires_grad for t in (h, w_down, topk_weights)):
            raise OverlapError("the overlap combine is inference-only (its kernels have no "
                               "backward), but an input requires grad: use MoECombine("
                               "backend='reference') to train through the combine, or call it "
                               "under torch.no_grad() / torch.inference_mode()")
        if h.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16:
            raise TypeError(f"overlap backend needs bf16 h and w_down, got {h.dtype}, "
                            f"{w_down.dtype}")
        if h.dim() != 2 or h.shape[1] != K or not h.is_contiguous():
            raise ValueError(f"h must be contiguous [rows, {K}], got {tuple(h.shape)}")
        if tuple(w_down.shape) != (El, K, N):
            raise ValueError(f"w_down must be [{El}, {K}, {N}], got {tuple(w_down.shape)}")
        if topk_ids.dim() != 2 or topk_ids.shape[1] != self.topk:
            raise ValueError(f"topk_ids must be [T, {self.topk}], got {tuple(topk_ids.shape)}")
        if topk_ids.shape[0] > self.max_tokens_per_rank:
            raise ValueError(f"capacity exceeded: {topk_ids.shape[0]} tokens > "
                             f"max_tokens_per_rank={self.max_tokens_per_rank}")
        if tuple(topk_weights.shape) != tuple(topk_ids.shape):
            raise ValueError("topk_weights must have topk_ids' shape")
        if plan.tile_m != self.tile_m or plan.world_size != self.world_size \
                or plan.rank != self.rank or plan.num_experts != self.num_experts:
            raise ValueError("plan does not match this layer (tile_m / world / rank / experts)")
        for t in (h, w_down, topk_ids, topk_weights):
            if t.device != self.device:
                raise ValueError(f"tensors must be on {self.device}, got {t.device}")

    def check_ccta(self, ccta) -> int:
        """A per-call ccta checked against this GPU and group (ValueError otherwise): 0 (no
        consumer) only where ``min_ccta`` allows it."""
        lo = min_ccta(self.world_size, self.local_copy)
        if isinstance(ccta, bool) or not isinstance(ccta, int) or not lo <= ccta < self.num_sms:
            from .options import NO_CONSUMER_NOTE
            raise ValueError(f"ccta={ccta!r} must be an int in [{lo}, {self.num_sms - 1}]"
                             + (NO_CONSUMER_NOTE if ccta == 0 else ""))
        return ccta

    def check_errors(self):
        """Synchronizes; raises OverlapError with the device error record (describe_error text)
        if any kernel recorded an error (a timeout, ranks out of step, an entry out of bounds)
        since construction or the last ``reset()``. Also the way to check after CUDA-graph
        replays (the per-call read-back only raises on a later eager call)."""
        self._watch.check()

    synchronize = check_errors

    def reset(self):
        """Collective (every rank, between calls): make the combine usable again after a device
        error. Synchronizes, barrier (no kernel of any rank runs past it), then zeroes this
        rank's error word, arrival counters, epoch tags (the whole communication block: only
        peers' consumers write it, and none runs now), expected counts, epoch and band flags,
        and forgets the host read-back; barrier again so no rank ships before every rank has
        cleared. The state is then the constructed one: every rank restarts at epoch 0 (a rank
        that made more calls than the others is back in step too). Not capturable.
        A reset of the communication buffer: with a shared ``comm_buffer`` it clears it for
        every layer on it (``CommBuffer.reset``)."""
        self.comm.reset()

    # ---- warm-up -----------------------------------------------------------------------------
    def warmup(self):
        """Load and run every kernel once alone (empty work) before any overlapped launch: the
        scale(s), and the consumer where this layer launches one (ccta > 0; a call given a
        ccta > 0 on a layer of ccta 0 loads it then, ``_warmup_consumer``)."""
        if self._warm:
            return
        if self.ccta > 0:
            self._warmup_consumer()
        dev = self.device
        z = torch.zeros(1, dtype=torch.int32, device=dev)
        yb = torch.zeros(1, self.out_features, dtype=torch.bfloat16, device=dev)
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.empty(0, self.out_features, dtype=torch.bfloat16, device=dev)
        zi = torch.zeros(1, dtype=torch.int32, device=dev)
        zf = torch.zeros(1, dtype=torch.float32, device=dev)
        self.scale.launch(recv=self.buffers.recv, rows=zi, weights=zf, out=out,
                          counters=self.counters[:0], expected=self.expected, rank=self.rank,
                          err=self.err, epoch=z, slot_bytes=0, num_sms=self.num_sms, y=yb)
        if self.ordered:  # no tile, no tag check: loads the module
            arr, exp = self.comm.seg_tables(self.seg_cap)
            tables = {n: torch.zeros(1 if n in ("tile_start", "dep_start") else 0,
                                     dtype=torch.int32, device=dev)
                      for n in ("order", "tile_start", "dep_start", "dep_kind", "dep_source",
                                "dep_index")}
            self.oscale.launch(recv=self.buffers.recv, rows=zi[:0].view(0, self.topk),
                               weights=zf[:0].view(0, self.topk), out=out, y=yb, tables=tables,
                               band_ready=flags, seg_arrivals=arr, seg_expected=exp,
                               queue=self.queue, counters=self.counters, expected=self.expected,
                               rank=self.rank, err=self.err, epoch=z, slot_bytes=0, grid=1,
                               wait_bands=False, check_tags=False)
        torch.cuda.synchronize(dev)
        self._warm = True

    def _warmup_consumer(self):
        """Load and run the consumer once alone on an empty plan."""
        dev = self.device
        z = torch.zeros(1, dtype=torch.int32, device=dev)
        from types import SimpleNamespace
        empty = SimpleNamespace(rank=self.rank, world_size=0, **{n: z for n in (
            "num_segments", "segment_start", "segment_bands", "segment_dest", "segment_src_row",
            "segment_dest_row", "segment_rows", "schedule", "num_local_cells", "local_cell_band",
            "local_cell_src_row", "local_cell_rows", "local_cell_dest_row",
            "counts_fingerprint")})
        yb = torch.zeros(1, self.out_features, dtype=torch.bfloat16, device=dev)
        flags = torch.zeros(1, dtype=torch.int32, device=dev)
        self.consumer.launch(y=yb, plan=empty, band_ready=flags, epoch=z,
                             recv_peers=self.buffers.recv_peers, ctr_peers=self.buffers.ctr_peers,
                             recv_sym=self.buffers.recv.data_ptr(),
                             ctr_sym=self.counters.data_ptr(),
                             err=self.err, ccta=max(1, self.ccta), slot_bytes=0)
        torch.cuda.synchronize(dev)
        self._consumer_warm = True

    def prepare(self, plan, topk_ids, expert_counts=None, ordered_impl: str = "device",
                validate: bool = False) -> CombineRoutes:
        """What a call needs from the routing, computed once per routing and off the call's
        critical path (device only, no host sync): each (t, k) assignment's row for the scale and
        the per-source increment of the expected arrival counts. The sequential baseline prepares
        its permutations the same way (a MoE layer knows its routing from the dispatch); computed
        inside the call it would delay the GEMM (bench/bench_combine_split.py times it).

        rows: int32 [T, topk]: receive rows, or with local_copy=False and a plan, source rows (see
        source_rows). Without a plan (consumer-only use) plain receive rows.
        expected_inc: int64 [W]: my assignments to rank s's experts + 1 (s's call marker); with
        local_copy=False the own rank's rows are not counted (they are read from y).
        scale="ordered": ``expert_counts`` [W, E] (the all-gathered counts the plans of every
        rank were made from) is required; the counters carry only the call markers (expected_inc
        = 1 per source) and ``ordered`` holds the tile tables and the per-segment increment
        (``_prepare_ordered``). ``ordered_impl``: "device" (``ordered_routes.
        ordered_routes_device``: on the device, no host sync, capturable, the caller vouching
        for the inputs; with ``validate=True`` it also runs the reference's checks, a host sync)
        or "host" (``ordered_scale.ordered_routes``: the reference, on the host, a host sync; it
        raises ValueError for inconsistent inputs)."""
        from .routes import prepare_routes  # two CuTe DSL kernels on CUDA, torch reference
        ordered, rows = None, None
        if self.ordered:
            # the tables' kernels compute prepare's rows themselves (the senders' plans on a
            # side stream under them) and hand them back; other paths leave them to us
            ordered = self._prepare_ordered(plan, topk_ids, expert_counts, impl=ordered_impl,
                                            validate=validate)
            rows = ordered.pop("rows")
        if rows is None:
            rows, inc = prepare_routes(topk_ids, self.num_experts, self.world_size, self.rank,
                                       self.local_copy, plan)
        if self.ordered:
            inc = torch.ones(self.world_size, dtype=torch.int64, device=rows.device)
        return CombineRoutes(rows=rows, expected_inc=inc, plan=plan, num_tokens=topk_ids.shape[0],
                             ordered=ordered)

    def _prepare_ordered(self, plan, topk_ids, expert_counts, impl="device", validate=False):
        """{"tables": the ordered scale's tile tables (int32), "seg_inc": int64 [W, Sc],
        "seg_count": int32 [W] (seg_inc's valid prefix per sender), "rows":
        prepare_routes' rows where the tables' kernels made them, else None} on this layer's
        device for one routing. plan: this rank's plan of ``expert_counts`` (int [W, E]);
        topk_ids: int [T, topk]; impl: see ``prepare``'s ordered_impl."""
        from .ordered_routes import ORDERED_IMPLS
        if impl not in ORDERED_IMPLS:
            raise ValueError(f"ordered_impl={impl!r}; choose from {ORDERED_IMPLS}")
        W, E = self.world_size, self.num_experts
        if expert_counts is None:
            raise ValueError("scale='ordered' needs every rank's counts: prepare(plan, topk_ids, "
                             "expert_counts) with the [W, E] counts the plans were made from "
                             "(exchange_counts(topk_ids))")
        if not isinstance(expert_counts, torch.Tensor) or tuple(expert_counts.shape) != (W, E):
            raise ValueError(f"expert_counts must be a [{W}, {E}] tensor")
        if plan.segment_capacity != self.seg_cap:
            raise ValueError(f"scale='ordered' needs plans made with max_rows = world_size x "
                             f"max_tokens_per_rank x topk (MoECombine.plan): their segment "
                             f"capacity {self.seg_cap} is the arrival table's row stride on "
                             f"every rank; this plan has {plan.segment_capacity}")
        if impl == "device":
            from .ordered_routes import ordered_routes_device
            o = ordered_routes_device(topk_ids.to(self.device), expert_counts.to(self.device),
                                      plan, validate=validate)
            return {"tables": o.tables, "seg_inc": o.seg_inc, "seg_count": o.seg_count,
                    "rows": o.rows}
        from .ordered_scale import ordered_routes
        o = ordered_routes(topk_ids, expert_counts, self.rank, plan.tile_m, plan.mgb,
                           plan.layout, self.seg_cap, order=plan.order)
        return {"tables": {n: t.to(self.device) for n, t in o.tables.items()},
                "seg_inc": o.seg_inc.to(self.device), "seg_count": o.seg_count.to(self.device),
                "rows": None}

    def begin_call(self, topk_ids, topk_weights, plan=None, routes=None):
        """Per-call device bookkeeping on the current stream (no host ints): epoch += 1,
        expected_cum += routes.expected_inc (routes: from ``prepare``, computed here if None).
        Returns (rows int32 [T, topk], weights fp32 [T, topk]) for the scale."""
        if routes is None:
            if self.ordered:
                raise ValueError("scale='ordered': pass routes=prepare(plan, topk_ids, "
                                 "expert_counts) (it needs every rank's counts)")
            routes = self.prepare(plan, topk_ids)
        if self.ordered and routes.ordered is None:
            raise ValueError("routes were prepared without the ordered scale's tables")
        self.comm.note_call()
        self.epoch.add_(1)  # the buffer's epoch: slot parity and tags count calls on the buffer
        self.expected.add_(routes.expected_inc)
        if self.ordered:
            if self._test_broken_order != "seg_expected_frozen":  # test only: see __init__
                from .ordered_routes import add_seg_inc
                _, seg_expected = self.comm.seg_tables(self.seg_cap)
                add_seg_inc(seg_expected, routes.ordered["seg_inc"], routes.ordered["seg_count"])
            # the previous call's ordered scale has ended (s0 order); this call's claims start
            # after this point on s0
            self.queue.zero_()
        return routes.rows, topk_weights.to(torch.float32).contiguous()

    def source_rows(self, topk_ids, recv_rows, plan):
        """Device-only (no sync): the scale's source of each (t, k): the receive row r for remote
        experts; for local expert e (global g): -(y row) - 1 with y row = expert_row_start[e] +
        group_row_start[e, rank] + r - (first receive row of g)."""
        from .routes import source_rows_torch
        return source_rows_torch(topk_ids, recv_rows, plan, self.num_experts,
                                 self.experts_per_rank, self.rank)

    def ship(self, y, plan, band_ready, ccta=None, slot_bytes=None, stream=None,
             piece_rows=None):
        """Launch the consumer alone (for tests and benchmarks): it ships the plan's segments of
        y once their bands' flags equal the current epoch. ccta / piece_rows: this launch's
        CTAs and rows per piece (default: the resolved options)."""
        self.consumer.launch(y=y, plan=plan, band_ready=band_ready, epoch=self.epoch,
                             recv_peers=self.buffers.recv_peers,
                             ctr_peers=self.buffers.ctr_peers,
                             recv_sym=self.buffers.recv.data_ptr(),
                             ctr_sym=self.counters.data_ptr(), err=self.err,
                             ccta=self.ccta if ccta is None else ccta,
                             slot_bytes=self.slot_bytes if slot_bytes is None else slot_bytes,
                             piece_rows=self.piece_rows if piece_rows is None else piece_rows,
                             stream=stream)

    # ---- the call ------------------------------------------------------------------------------
    def forward(self, h, w_down, plan, topk_ids, topk_weights, check: bool = False,
                overlap: bool = True, routes: CombineRoutes | None = None, out=None,
                ccta: int | None = None, piece_rows: int | None = None):
        """One combine call (collective): bf16 [T, N].
        overlap=False: our own non-overlapped path (the same GEMM on every SM, then the
        consumer, then the scale), the bitwise reference of the overlapped call (at ccta 0
        both are the call without a consumer, ``_forward_alone``).
        routes: ``prepare(plan, topk_ids)`` of this routing (computed in the call if None).
        out: optional bf16 [T, N] tensor the result is written to (default: a new one).
        ccta / piece_rows: this call's consumer SMs and rows per piece (default: the resolved
        options; every rank must pass the same). check: synchronize and raise on a device
        error."""
        self.check_inputs(h, w_down, plan, topk_ids, topk_weights)
        ccta = self.ccta if ccta is None else self.check_ccta(ccta)
        if piece_rows is not None:
            CombineOptions(consumer_piece_rows=piece_rows)  # the option's own check
        T = topk_ids.shape[0]
        if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (
                T, self.out_features) or not out.is_contiguous() or out.device != self.device):
            raise ValueError(f"out must be a contiguous bf16 [{T}, {self.out_features}] tensor "
                             f"on {self.device}")
        if routes is not None:
            if routes.plan is not plan:
                raise ValueError("routes were prepared for another plan: call prepare(plan, "
                                 "topk_ids) for this one")
            if routes.num_tokens != topk_ids.shape[0] or tuple(routes.rows.shape) != \
                    tuple(topk_ids.shape):
                raise ValueError(f"routes are for {routes.num_tokens} tokens x "
                                 f"{routes.rows.shape[1]}, topk_ids is {tuple(topk_ids.shape)}")
        if self.ordered and (routes is None or routes.ordered is None):
            raise ValueError("scale='ordered': pass routes=prepare(plan, topk_ids, "
                             "expert_counts) (it needs every rank's counts)")
        if self._async_errors:  # an earlier call's device error raises here, before any launch
            self._watch.poll()
        if ccta == 0:  # nothing leaves this rank and nothing is copied (min_ccta): no consumer
            return self._forward_alone(h, w_down, plan, topk_ids, topk_weights, routes, out,
                                       check)
        if not self._warm:
            self.warmup()
        if self.ccta == 0 and not self._consumer_warm:  # a per-call ccta on a layer of none
            self._warmup_consumer()
        if not self._prod_warm:
            # solo producer pass on scratch flags: compiles and loads its module while nothing
            # spins (loading a module next to a spinning kernel can stall until the spin ends)
            y, _ = self.buffers_for(h, plan)
            scratch = torch.zeros(plan.band_capacity, dtype=torch.int32, device=self.device)
            self.produce(h, w_down, plan, y, scratch, ccta=ccta)
            torch.cuda.synchronize(self.device)
            # every rank has compiled and loaded every kernel before any rank's first
            # cross-rank wait starts its timeout clock (ranks compile at different speeds)
            self.rt.barrier("the combine's first call (its warm-up barrier: every rank makes "
                            "that call)")
            self._prod_warm = True
        y, band_ready = self.buffers_for(h, plan)
        s0 = torch.cuda.current_stream(self.device)
        marks = None
        debug = self._debug
        if debug.timeline is not None:
            marks = {n: torch.cuda.Event(enable_timing=True)
                     for n in ("start", "begun", "shipped", "produced", "scaled")}
            marks["start"].record(s0)
        rows, weights = self.begin_call(topk_ids, topk_weights, plan, routes)
        if marks:
            marks["begun"].record(s0)
        if out is None:
            out = torch.empty(T, self.out_features, dtype=torch.bfloat16, device=self.device)
        cs = self.cs
        if not overlap:  # all bands final before the consumer starts
            self.produce(h, w_down, plan, y, band_ready, ccta=0)
        # cs depends on s0 up to here (begin_call), not on the producer: the producer is then
        # launched first, so the consumer that spins on its flags never waits on a kernel that
        # is not launched yet (with CUDA_LAUNCH_BLOCKING=1 the producer runs to completion and
        # the consumer finds every flag set)
        cs.wait_stream(s0)
        if overlap:
            self.produce(h, w_down, plan, y, band_ready, ccta=ccta)
        if marks:
            marks["produced"].record(s0)
        with torch.cuda.stream(cs):
            if self._test_consumer_delay_cycles:  # test only: see __init__
                torch.cuda._sleep(int(self._test_consumer_delay_cycles))
            self.ship(y, plan, band_ready, ccta=ccta, stream=cs, piece_rows=piece_rows)
            if marks:
                marks["shipped"].record(cs)
        if self.ordered:
            self._launch_ordered_scale(routes, rows, weights, out, y, band_ready, s0, marks,
                                       plan)
        else:
            if not self.local_copy:
                # the scale reads local rows straight from y: order it after the producer
                # (kernel boundary = y final and visible; see the module doc for why not a
                # flag spin)
                cs.wait_stream(s0)
            with torch.cuda.stream(cs):
                if not debug.skip_scale:
                    self.scale.launch(recv=self.buffers.recv, rows=rows, weights=weights,
                                      out=out, counters=self.counters, expected=self.expected,
                                      rank=self.rank, err=self.err, epoch=self.epoch,
                                      slot_bytes=self.slot_bytes, num_sms=self.num_sms,
                                      stream=cs, y=y, epoch_tags=True,
                                      err_peers=self.comm.err_peers,
                                      fingerprint=plan.counts_fingerprint)
                if marks:
                    marks["scaled"].record(cs)
                    debug.timeline.append(marks)
        s0.wait_stream(cs)
        if not torch.cuda.is_current_stream_capturing():
            for t in (rows, weights, out, y):
                t.record_stream(cs)
        if self._async_errors:
            self._watch.after_call(s0)
        if check:
            self.check_errors()
        return out

    def _forward_alone(self, h, w_down, plan, topk_ids, topk_weights, routes, out, check):
        """The call of ccta 0 (a group of one rank, local_copy=False: no row leaves the rank and
        none is copied): on the current stream, the producer on every SM (its clusters at ccta
        0) built without band flags, then the plain scale reading every row from the producer's
        output, with no arrival to wait for. No consumer launch, no call marker, no side
        stream; the counters, expected counts and (scale="ordered") per-segment expectations
        are left as they are (a later call with a consumer finds them in step), the epoch
        still counts the call. Bitwise equal to the call with a consumer: the same GEMM
        tiles (the flags change no stored value) and the same scale on the same rows (the
        ordered scale is bitwise equal to the plain one)."""
        if not self._warm:
            self.warmup()
        if routes is None:
            routes = self.prepare(plan, topk_ids)
        y, band_ready = self.buffers_for(h, plan)
        s0 = torch.cuda.current_stream(self.device)
        debug = self._debug
        marks = None
        if debug.timeline is not None:
            marks = {n: torch.cuda.Event(enable_timing=True)
                     for n in ("start", "begun", "shipped", "produced", "scaled")}
            marks["start"].record(s0)
        self.comm.note_call()
        self.epoch.add_(1)
        weights = topk_weights.to(torch.float32).contiguous()
        if out is None:
            out = torch.empty(topk_ids.shape[0], self.out_features, dtype=torch.bfloat16,
                              device=self.device)
        if marks:
            marks["begun"].record(s0)
        self.produce(h, w_down, plan, y, band_ready, ccta=0, flags=False)
        if marks:
            marks["produced"].record(s0)
            marks["shipped"].record(s0)
        if not debug.skip_scale:
            # no counter to wait on (0 words: the arrival wait does nothing)
            self.scale.launch(recv=self.buffers.recv, rows=routes.rows, weights=weights,
                              out=out, counters=self.counters[:0], expected=self.expected,
                              rank=self.rank, err=self.err, epoch=self.epoch,
                              slot_bytes=self.slot_bytes, num_sms=self.num_sms, stream=s0, y=y)
        if marks:
            marks["scaled"].record(s0)
            debug.timeline.append(marks)
        if self._async_errors:
            self._watch.after_call(s0)
        if check:
            self.check_errors()
        return out

    def _launch_ordered_scale(self, routes, rows, weights, out, y, band_ready, s0, marks, plan):
        """scale="ordered": on s0 right after the producer's kernel boundary (every local row
        final: no band wait), every SM; each tile waits for its own segments, the kernel for
        every source's call marker and epoch tag."""
        if not self._debug.skip_scale:
            arr, exp = self.comm.seg_tables(self.seg_cap)
            self.oscale.launch(recv=self.buffers.recv, rows=rows, weights=weights, out=out, y=y,
                               tables=routes.ordered["tables"], band_ready=band_ready,
                               seg_arrivals=arr, seg_expected=exp, queue=self.queue,
                               counters=self.counters, expected=self.expected, rank=self.rank,
                               err=self.err, epoch=self.epoch, slot_bytes=self.slot_bytes,
                               grid=self.num_sms * self.oscale.ctas_per_sm, wait_bands=False,
                               check_tags=True, stream=s0, err_peers=self.comm.err_peers,
                               fingerprint=plan.counts_fingerprint)
        if marks:
            marks["scaled"].record(s0)
            self._debug.timeline.append(marks)

    __call__ = forward

    def recv_slot(self, epoch: int | None = None) -> torch.Tensor:
        """The receive slot of an epoch (default: the last call's), a [max_recv_rows, N] view."""
        e = int(self.epoch.item()) if epoch is None else epoch
        return self.recv[e & 1]
