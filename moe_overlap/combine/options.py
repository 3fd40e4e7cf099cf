"""CombineOptions: every option of the overlapped combine, one default each, checked in one place.

``MoECombine`` and ``OverlapCombine`` take ``options=CombineOptions(...)`` (or the same names as
keyword arguments, which build one) and resolve it once, at construction, with
``options.resolve(CombineFacts(...))``: the result has no ``"auto"`` left, and the layer reads
only the resolved object afterwards.

``"auto"`` has one meaning for every option that accepts it: *the library picks the value for this
layer's shape bucket once, at construction*: the value tuned for the bucket where the tune cache
(``moe_overlap.combine.tuning.TuneCache``) holds one (``ccta``, ``mgb`` and ``order``, written by
``MoECombine.autotune``), else the library's choice for the shape given with each option below.
The one exception is ``layout="auto"``, which depends on the routing rather than the shape: each
plan picks packed where that lays out fewer rows than aligned (``plan_combine``).

Allowed values are checked in ``validate()`` (run by the constructor): ``ValueError`` /
``TypeError`` with the option's name before any CUDA work. Checks that need device facts (the SM
count for ``ccta``) run in ``resolve``.
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import types
from dataclasses import dataclass

AUTO = "auto"
TRANSPORTS = ("nvlink", "nvshmem")
COPIES = ("ldst", "tma")
LAYOUTS = ("auto", "aligned", "packed")  # moe_overlap.combine.plan.LAYOUTS
PRODUCERS = ("auto", "torch", "grouped_gemm")
ERROR_CHECKS = ("async", "off")  # error_check: see CombineOptions
SCALES = ("plain", "ordered")  # scale: see CombineOptions
ORDERS = ("remote_first", "expert")  # moe_overlap.combine.plan.ORDERS
PRODUCER_ENV = "MOE_OVERLAP_PRODUCER"  # default of producer="auto" (tests select the stand-in)


def _int(name: str, v, minimum: int, auto: bool = True, extra: str = ""):
    """v as a plain int >= minimum (numpy ints accepted, bools refused), or "auto" if allowed."""
    if auto and isinstance(v, str) and v == AUTO:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
        what = f"'auto' or an int >= {minimum}" if auto else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}{extra}, got {v!r}")
    return int(v)


@dataclass(frozen=True)
class CombineFacts:
    """What ``CombineOptions.resolve`` needs to know about the layer and the device.

    rows: rows one rank receives per call at full load (max_tokens_per_rank * topk);
    device_name: ``torch.cuda.get_device_name()`` (part of the tune-cache key; "cpu" without
    CUDA); num_sms: the GPU's SM count (None: not known, e.g. on the CPU; ccta is then not
    range-checked)."""
    world_size: int
    hidden_size: int
    out_features: int
    experts_per_rank: int
    tile_m: int
    rows: int
    device_name: str = "cpu"
    num_sms: int | None = None

    @property
    def tune_key(self) -> str:
        from .tuning import shape_key
        return shape_key(self.device_name, self.world_size, self.out_features, self.hidden_size,
                         self.experts_per_rank, self.tile_m, self.rows)


@dataclass(frozen=True)
class CombineOptions:
    """Options of the overlapped combine (DeepEP's ``Config`` is the model: one object, passed
    around, never mutated; make a changed copy with ``replace(**changes)``).

    ccta (int >= 1 and < the GPU's SM count, or "auto"): SMs reserved for the consumer kernel
        that ships finished bands; the producer GEMM runs on the others. auto: tuned, else
        ``tuning.analytic_choice`` for the expected load (never more SMs than pieces of the
        bytes to move). 0: no consumer kernel at all (the producer on every SM, without band
        flags; the scale waits on nothing and reads every row from the producer's output),
        allowed only where the consumer has nothing to move: a group of one rank with
        local_copy=False (``min_ccta``); that is what auto resolves to there.
    mgb (int >= 1 or "auto"): most bands one transfer (segment) of the plan waits for
        (``plan_combine(mgb=)``). auto: tuned, else ``tuning.analytic_choice``.
    transport ("nvlink" | "nvshmem"): how the consumer ships rows: stores to peer-mapped memory,
        or NVSHMEM put-with-signal.
    layout ("auto" | "aligned" | "packed"): the plan's row layout (see ``plan_combine``; auto:
        per plan, packed where it lays out fewer rows).
    local_copy (bool or "auto"; None is read as "auto"): True: the consumer also copies this
        rank's own rows into its receive buffer; False: the owner's scale reads them straight from
        the GEMM output. auto: False with nvlink, True with nvshmem.
    copy ("ldst" | "tma" | "auto"; None is read as "auto"): the consumer's copy: thread
        loads/stores, or bulk copies through a shared-memory ring (nvlink only). auto: "tma"
        with nvlink, "ldst" with nvshmem.
    consumer_threads, consumer_unroll (int >= 1): threads per consumer CTA and 16-byte loads in
        flight per thread (copy="ldst").
    consumer_stages, consumer_chunk (int >= 1 or "auto"): ring stages and bytes per stage of
        copy="tma". auto: ``consumer.DEFAULT_STAGES`` / ``DEFAULT_CHUNK``.
    consumer_piece_rows (int >= 0 or "auto"): rows per piece the consumer's CTAs split segments
        into (0: one piece per segment). auto: about 1 MiB of rows (``DEFAULT_PIECE_BYTES``).
    producer ("auto" | "torch" | "grouped_gemm"): the producer GEMM. auto: $MOE_OVERLAP_PRODUCER
        where set, else the CuTe DSL grouped GEMM where the shape and install allow it
        (``grouped_gemm_fits``), else a torch stand-in (test-only speed).
    timeout_s (float > 0): bound of every device spin-wait, in seconds.
    error_check ("async" | "off"): "async": after each overlapped call the device error word is
        copied to pinned host memory (non-blocking, with an event) and the next call (or
        ``check_errors()``) raises ``OverlapError`` if it is set, with no host sync in the call;
        "off": only an explicit ``check_errors()`` reads it (see README, "Failures and
        recovery").
    scale ("plain" | "ordered"): the owner's scale. "plain": one pass after the last arrival
        (combine/scale.py, on the consumer's stream). "ordered": token tiles in completion
        order, each after a bounded wait for exactly its rows' signals (per-segment arrivals,
        combine/scale_ordered.py), launched on the producer's stream right after the producer,
        on every SM (design A of bench/NOTES.md "Session 11"); bitwise equal to "plain". Needs
        transport="nvlink" and local_copy=False (local_copy="auto" resolves to False); its
        ``prepare`` builds the tile tables on the host (a host sync per routing).
    order ("remote_first" | "expert" | "auto"): the plan's schedule (``plan_combine(order=)``).
        "remote_first": bands holding remote rows first, so the transfers start as early as
        possible. "expert": expert by expert (remote rows first inside each), so the producer
        reads each expert's weights about once where remote_first reads them twice (much of
        each expert's rows local, e.g. W=2; the timings: bench/NOTES.md, the producer in expert
        order); the remote rows come later, so it suits shapes the GEMM bounds, not the
        transfer. "auto": the order ``MoECombine.autotune`` measured faster for this bucket
        (it times both), else ``tuning.analytic_order``: "expert" where the cost model puts the
        GEMM at or above the transfer for the expected load at the resolved ccta, else
        "remote_first" (and at W = 1, where the two plans are the same). Either planner builds
        both (``plan_combine(impl=)``); the overlapped call has not run on two GPUs in either
        order since the first days (the one-GPU multi-rank checks run both).
    gemm_options (dict or None): keyword options of the producer ``GroupedGemm`` (e.g.
        ``cluster_n``, ``band_group``; ``tile_m`` / ``tile_n`` / ``signal`` are the combine's).
    """
    ccta: int | str = AUTO
    mgb: int | str = AUTO
    transport: str = "nvlink"
    layout: str = AUTO
    local_copy: bool | str = AUTO
    copy: str = AUTO
    consumer_threads: int = 512
    consumer_unroll: int = 4
    consumer_stages: int | str = AUTO
    consumer_chunk: int | str = AUTO
    consumer_piece_rows: int | str = AUTO
    producer: str = AUTO
    timeout_s: float = 10.0
    gemm_options: dict | None = None
    error_check: str = "async"
    scale: str = "plain"
    order: str = AUTO

    def __post_init__(self):
        self.validate()

    def _set(self, name, value):
        object.__setattr__(self, name, value)  # normalization inside __post_init__ only

    def validate(self) -> None:
        """Checks every option's type and allowed values (and normalizes: numpy ints -> int,
        None -> "auto", gemm_options -> a read-only copy). Raises ValueError / TypeError."""
        self._set("ccta", _int("ccta", self.ccta, 0))  # 0: see min_ccta (checked in resolve)
        self._set("mgb", _int("mgb", self.mgb, 1))
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport={self.transport!r}; choose 'nvlink' or 'nvshmem'")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout={self.layout!r}; choose from {LAYOUTS}")
        lc = AUTO if self.local_copy is None else self.local_copy
        if not (lc == AUTO or isinstance(lc, bool)):
            raise ValueError(f"local_copy must be True, False or 'auto', got {lc!r}")
        self._set("local_copy", lc)
        if self.scale not in SCALES:
            raise ValueError(f"scale={self.scale!r}; choose from {SCALES}")
        if self.scale == "ordered":
            if self.transport != "nvlink":
                raise ValueError(f"scale='ordered' needs transport='nvlink' (per-segment arrivals "
                                 f"over {self.transport!r} are not validated), got "
                                 f"transport={self.transport!r}")
            if lc is True:
                raise ValueError("scale='ordered' needs local_copy=False (it reads the local "
                                 "rows straight from the GEMM output; with the local copy they "
                                 "would come from this rank's own consumer), got "
                                 "local_copy=True")
        if self.order not in (AUTO,) + ORDERS:
            raise ValueError(f"order={self.order!r}; choose from {(AUTO,) + ORDERS}")
        cp = AUTO if self.copy is None else self.copy
        if cp not in COPIES + (AUTO,) or (cp == "tma" and self.transport != "nvlink"):
            raise ValueError(f"copy={cp!r} with transport={self.transport!r}: use 'ldst', or "
                             "'tma' with nvlink (or 'auto')")
        self._set("copy", cp)
        self._set("consumer_threads", _int("consumer_threads", self.consumer_threads, 1, False))
        self._set("consumer_unroll", _int("consumer_unroll", self.consumer_unroll, 1, False))
        for name in ("consumer_stages", "consumer_chunk"):
            v = getattr(self, name)
            self._set(name, _int(name, AUTO if v is None else v, 1))
        v = AUTO if self.consumer_piece_rows is None else self.consumer_piece_rows
        self._set("consumer_piece_rows", _int("consumer_piece_rows", v, 0,
                                              extra=" (0: one piece per segment)"))
        prod = AUTO if self.producer is None else self.producer
        if prod not in PRODUCERS:
            raise ValueError(f"producer={prod!r}; choose auto, torch or grouped_gemm")
        self._set("producer", prod)
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, numbers.Real) \
                or not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got "
                             f"{self.timeout_s!r}")
        if self.error_check not in ERROR_CHECKS:
            raise ValueError(f"error_check={self.error_check!r}; choose from {ERROR_CHECKS}")
        g = self.gemm_options
        if g is not None and not isinstance(g, (dict, types.MappingProxyType)):
            raise TypeError(f"gemm_options must be a dict, got {type(g).__name__}")
        self._set("gemm_options", types.MappingProxyType(dict(g or {})))

    def replace(self, **changes) -> "CombineOptions":
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_resolved(self) -> bool:
        """No option is "auto" any more (``layout`` excepted: it is resolved per plan)."""
        return all(getattr(self, f.name) != AUTO for f in dataclasses.fields(self)
                   if f.name != "layout")

    def check_gemm_options(self, tile_m: int) -> dict:
        """The producer GEMM's options checked against the GEMM itself (any machine)."""
        import inspect
        from ..kernels import reject_unknown_options
        from .grouped_gemm import GroupedGemm
        options = dict(self.gemm_options)
        allowed = set(inspect.signature(GroupedGemm.__init__).parameters) - {
            "self", "tile_m", "tile_n", "signal"}
        reject_unknown_options("gemm_options", options, allowed)
        GroupedGemm(tile_m=tile_m, **options)  # the GEMM's own value checks
        return options

    def resolve(self, facts: CombineFacts, cache=None) -> "CombineOptions":
        """These options with every "auto" replaced (see the module doc for what auto means);
        cache: the TuneCache to read (default: ``TuneCache()``, read only if ccta, mgb or order is
        auto).
        Raises ValueError if an explicit value does not fit the facts (ccta >= SM count)."""
        from .consumer import DEFAULT_CHUNK, DEFAULT_PIECE_BYTES, DEFAULT_STAGES, check_options
        ch = {}
        ch["local_copy"], ch["copy"] = self.consumer_variant()
        if self.consumer_piece_rows == AUTO:
            ch["consumer_piece_rows"] = max(1, DEFAULT_PIECE_BYTES // (2 * facts.out_features))
        piece_rows = ch.get("consumer_piece_rows", self.consumer_piece_rows)
        if AUTO in (self.ccta, self.mgb, self.order):
            from .tuning import TuneCache, analytic_choice
            cache = TuneCache() if cache is None else cache
            W = facts.world_size
            entry = cache.entry(self.tune_key(facts))
            # rows the consumer moves at full load: the remote ones; at W = 1 with the local
            # copy, this rank's own (none leave it, but the consumer copies them all); at W = 1
            # without it, none: ccta 0, no consumer (tuning.analytic_choice)
            moved = facts.rows if W == 1 and ch["local_copy"] else facts.rows * (W - 1) // W
            # a piece: piece_rows rows, or (0: one piece per segment) one band at least
            piece = (piece_rows or facts.tile_m) * facts.out_features * 2
            choice = (entry["ccta"], entry["mgb"]) if entry else analytic_choice(
                facts.rows, moved, facts.out_features, facts.hidden_size, facts.tile_m,
                piece_bytes=piece)
            if self.ccta == AUTO:
                ch["ccta"] = int(choice[0])
                if facts.num_sms is not None:  # a cached value from a GPU with more SMs
                    ch["ccta"] = min(ch["ccta"], facts.num_sms - 1)
            if self.mgb == AUTO:
                ch["mgb"] = int(choice[1])
            if self.order == AUTO and (entry or {}).get("order") is not None:
                ch["order"] = entry["order"]  # untuned: analytic_order, below
                if ch["order"] not in ORDERS:
                    raise ValueError(f"tune cache {cache.path}: entry {self.tune_key(facts)!r} "
                                     f"has order={ch['order']!r}; expected one of {ORDERS}")
        if self.consumer_stages == AUTO:
            ch["consumer_stages"] = DEFAULT_STAGES
        if self.consumer_chunk == AUTO:
            ch["consumer_chunk"] = DEFAULT_CHUNK
        ch["producer"] = self.resolved_producer(facts)
        out = dataclasses.replace(self, **ch)
        lo = min_ccta(facts.world_size, out.local_copy)
        if out.ccta < lo or (facts.num_sms is not None and out.ccta >= facts.num_sms):
            span = f">= {lo}" if facts.num_sms is None else f"in [{lo}, {facts.num_sms - 1}]"
            raise ValueError(f"ccta={out.ccta!r} must be an int {span}"
                             + (NO_CONSUMER_NOTE if out.ccta == 0 else ""))
        check_options(out.transport, out.copy, out.consumer_stages, out.consumer_chunk,
                      out.consumer_lookahead)
        if out.order == AUTO:  # nothing tuned: the cost model's order at the resolved ccta
            from .tuning import CostModel, analytic_order
            moved = facts.rows * (facts.world_size - 1) // facts.world_size
            out = dataclasses.replace(out, order=analytic_order(
                facts.rows, moved, facts.out_features, facts.hidden_size, facts.tile_m,
                out.ccta, out.mgb, CostModel(num_sms=facts.num_sms) if facts.num_sms else None))
        return out

    def resolved_producer(self, facts: CombineFacts) -> str:
        """The producer GEMM with "auto" resolved ($MOE_OVERLAP_PRODUCER, else the CuTe DSL GEMM
        where it fits)."""
        if self.producer != AUTO:
            return self.producer
        env = os.environ.get(PRODUCER_ENV, AUTO)
        if env not in PRODUCERS:
            raise ValueError(f"{PRODUCER_ENV}={env!r}; choose auto, torch or grouped_gemm")
        return env if env != AUTO else ("grouped_gemm" if grouped_gemm_fits(facts) else "torch")

    def tune_key(self, facts: CombineFacts) -> str:
        """The tune-cache key of (ccta, mgb): the shape bucket (``facts.tune_key``) and every
        option that moves the best pair (transport, scale, layout, order, consumer variant,
        producer), so that a pair tuned for one path is never read for another. Computed from
        the options as requested (``order="auto"`` is its own key: its entry holds the order
        too), not from their resolved copy."""
        local_copy, copy = self.consumer_variant()
        return (f"{facts.tune_key}|{self.transport}|scale={self.scale}|layout={self.layout}"
                f"|order={self.order}|copy={copy}|local_copy={int(local_copy)}"
                f"|{self.resolved_producer(facts)}")

    def consumer_variant(self) -> tuple[bool, str]:
        """(local_copy, copy) with "auto" resolved: the fastest variant validated for the
        transport (nvlink: no local copy, bulk copies; nvshmem: the local copy and its put)."""
        nvlink = self.transport == "nvlink"
        return ((not nvlink) if self.local_copy == AUTO else self.local_copy,
                ("tma" if nvlink else "ldst") if self.copy == AUTO else self.copy)

    @property
    def consumer_lookahead(self) -> int:
        """Chunks the copy="tma" consumer loads ahead (from the resolved stage count)."""
        from .consumer import DEFAULT_LOOKAHEAD, DEFAULT_STAGES
        stages = DEFAULT_STAGES if self.consumer_stages == AUTO else self.consumer_stages
        return min(DEFAULT_LOOKAHEAD, max(1, stages // 2))


NO_CONSUMER_NOTE = (" (0, no consumer, only where no row leaves the rank and none is copied: "
                     "a group of one rank with local_copy=False)")


def min_ccta(world_size: int, local_copy: bool) -> int:
    """The least ccta a layer may run: 0 (no consumer kernel: the producer on every SM, the
    scale reading every row from its output) where the consumer has nothing to move (a group of
    one rank, no local copy), else 1."""
    return 0 if world_size == 1 and not local_copy else 1


def producer_tile_n(out_features: int) -> int | None:
    """The producer GEMM's tile width for output width N: the widest of 256 / 128 / 64 that
    divides N (None: none does; the torch stand-in then)."""
    return next((t for t in (256, 128, 64) if out_features % t == 0), None)


def producer_gemm_options(gemm_options, ccta: int, flags: bool | None = None) -> dict:
    """The keyword options (less tile_m / tile_n) of the producer ``GroupedGemm`` the overlapped
    combine launches beside ``ccta`` consumer SMs (``OverlapCombine._gemm_for``; benches read
    them here to launch it alike). Where gemm_options say nothing of the tile walk (cluster_n,
    cluster_slack, tile_fetch): the GEMM's clusters (2 where N's tiles pair up) with
    tile_fetch="dynamic", beside a consumer and on every SM alike (ccta 0). Clusters of 2 share
    each A tile by multicast (the deep-K tiles are L2-bound with clusters of 1); the shared work
    counter keeps a cluster that starts late (a second wave beside the consumer) or a CTA whose
    tiles cost more (an expert's weights out of L2) from owning a fixed share of the tiles
    (bench/NOTES.md, "Session 26" and "Session 28"). Every cluster size and fetch gives the same
    bits. flags: whether the kernel writes the band flags (default: ccta > 0, a consumer reads
    them; a call with no consumer, ccta 0, builds the kernel without the flag epilogue, same
    bits)."""
    opts = dict(gemm_options or {})
    if not {"cluster_n", "cluster_slack", "tile_fetch"} & opts.keys():
        opts["tile_fetch"] = "dynamic"  # cluster_n left to the GEMM: 2 where N's tiles pair up
    if not (ccta > 0 if flags is None else flags):
        opts["signal"] = False
        opts.pop("flag_warp", None)  # who posts the flags: none to post
    return opts


def grouped_gemm_fits(facts: CombineFacts) -> bool:
    """Whether the CuTe DSL producer GEMM takes this shape and is installed (producer="auto"):
    tile_m 64 or 128, N and K multiples of 64."""
    if facts.tile_m not in (64, 128) or facts.out_features % 64 or facts.hidden_size % 64:
        return False
    try:
        from .grouped_gemm import GroupedGemm  # noqa: F401
    except Exception:  # noqa: BLE001 - CuTe DSL missing or broken: the torch stand-in
        return False
    return True


def options_from_kwargs(options: CombineOptions | None, what: str, **kwargs) -> CombineOptions:
    """The options of a layer built with ``options=`` and/or the legacy keyword arguments:
    keywords given (not None) override the object's fields; both may not name one option
    with different values."""
    if options is not None and not isinstance(options, CombineOptions):
        raise TypeError(f"{what}: options must be a CombineOptions, got "
                        f"{type(options).__name__}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    if options is None:
        return CombineOptions(**given)
    return options.replace(**given) if given else options
