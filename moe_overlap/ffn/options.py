"""FFNOptions: the fused backend's options of ``FusedFFN`` / ``ShardedExperts``, one default each,
checked in one place.

The layers take ``options=FFNOptions(...)`` (or the same names as keyword arguments, which build
one) and, with ``backend="fused"``, resolve it once at construction with
``options.resolve(FFNFacts(...))``; the result has no ``"auto"`` left. The reference backend
takes none of these options: it refuses options other than the defaults.

``"auto"`` means what it means for the combine (moe_overlap/combine/options.py): *the library
picks the value for this layer's shape once, at construction*: the tuned value for the shape
bucket where a tune cache holds one, else the library's choice for the shape, given with each
option below. The FFN has no tuner yet, so today "auto" is always that choice.
"""
from __future__ import annotations

import dataclasses
import numbers
import types
from dataclasses import dataclass

from .band_allreduce import check_symmetric, resolve_symmetric

AUTO = "auto"
ERROR_CHECKS = ("async", "off")  # FFNOptions.error_check
COMMS = ("unicast", "switch")
TILE_MS = (64, 128)
COMPUTES = ("reduce", "chained")  # FFNOptions.compute
DEFAULT_COMPUTE = "reduce"  # "chained" becomes the default once its 2-GPU tests have run


# ---- the library's choices for the shape ("auto") and the compute kernel's option check -------
def fused_default_ccta(local_hidden: int) -> int:
    """SMs of the communication blocks (band all-reduce) in the fused backend for ccta="auto".
    The all-reduce's bytes per row are N fp32 whatever the hidden size, the compute's FLOPs per
    row grow with O/G: small hidden slices leave the all-reduce exposed, so they get more SMs.
    The thresholds are where 16 / 24 / 32 SMs change places on 2x H200 (bench/NOTES.md)."""
    if local_hidden <= 2048:
        return 32
    return 24 if local_hidden <= 4096 else 16


def fused_default_allreduce_band_rows(local_hidden: int, tile_m: int) -> int:
    """Rows per band of the fused backend's all-reduce for allreduce_band_rows="auto". A
    compute m-tile is all-reduced by tile_m / band rows CTAs at once: fine bands shorten the
    tail after the compute kernel ends, coarse ones cost fewer cross-GPU handshakes, which
    matters where the all-reduce is longer than the compute (small hidden slices). Timings on
    2x H200: bench/NOTES.md."""
    return min(64 if local_hidden <= 2048 else 32, tile_m)


def fused_tile_o(local_hidden: int) -> int:
    """Hidden columns per compute unit of the fused backend: 256 where they divide O/G (half the
    fp32 reduce-add traffic of 128), else 128."""
    return 256 if local_hidden % 256 == 0 else 128


COMPUTE_OPTIONS = ("stages", "epi_n", "epi_stages", "cluster_m", "h_pair")
# compute="chained": keyword options of ffn.compute_chained.ChainedFFNCompute (tile sizes are
# the kernel's fixed 128 x 256 x 256)
CHAINED_COMPUTE_OPTIONS = ("stages", "epi_n", "epi_stages", "group", "patch", "split")


def check_chained_compute_options(options) -> dict:
    """Validated copy of ``compute_options`` for compute="chained" (``CHAINED_COMPUTE_OPTIONS``,
    checked by ``ChainedFFNCompute.check_options``; group, patch: "auto" or an int >= 1; split:
    None, "auto" or an int >= 0). Raises ValueError / TypeError on any machine, before CUDA is
    touched."""
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise TypeError(f"compute_options must be a dict, got {type(options).__name__}")
    from ..kernels import reject_unknown_options
    reject_unknown_options("compute_options (compute='chained')", options,
                           CHAINED_COMPUTE_OPTIONS)
    options = dict(options)
    for name in ("group", "patch"):
        g = options.get(name, "auto")
        if g != "auto" and (isinstance(g, bool) or not isinstance(g, numbers.Integral)
                            or g < 1):
            raise ValueError(f"compute_options: {name}={g!r} must be 'auto' or an int >= 1")
    sp = options.get("split")
    if sp is not None and sp != "auto" and (isinstance(sp, bool)
                                            or not isinstance(sp, numbers.Integral) or sp < 0):
        raise ValueError(f"compute_options: split={sp!r} must be None, 'auto' or an int >= 0")
    from .compute_chained import ChainedFFNCompute
    ChainedFFNCompute.check_options(**{k: v for k, v in options.items()
                                       if k not in ("group", "patch", "split")})
    return options


def check_compute_options(options, local_hidden: int, tile_m: int, tile_o: int,
                          grouped: bool) -> dict:
    """Validated copy of the fused layers' ``compute_options`` (keyword options of
    ``ffn.compute_reduce.FusedFFNCompute``; tile sizes and band rows are the layer's) with the
    layer's default filled in: ``h_pair`` wherever the hidden tiles pair up (local_hidden a
    multiple of 2 * tile_o). Raises ValueError / TypeError on any machine,
    before CUDA is touched."""
    options = {} if options is None else options
    if not isinstance(options, dict):
        raise TypeError(f"compute_options must be a dict, got {type(options).__name__}")
    from ..kernels import reject_unknown_options
    reject_unknown_options("compute_options", options, COMPUTE_OPTIONS)
    options = dict(options)
    if grouped and options.get("cluster_m", 1) != 1:
        raise ValueError("compute_options: cluster_m=2 applies to FusedFFN only (the grouped "
                         "expert call keeps one expert per m-tile, not per cluster)")
    if options.get("h_pair") and local_hidden % (2 * tile_o):
        raise ValueError(f"compute_options: h_pair needs hidden_features / world_size "
                         f"({local_hidden}) to be a multiple of 2 * {tile_o}")
    if "h_pair" not in options:
        # default: two hidden tiles per unit wherever they pair up (half the fp32 reduce-adds;
        # timings in bench/NOTES.md)
        options["h_pair"] = local_hidden % (2 * tile_o) == 0
    from .compute_reduce import FusedFFNCompute
    FusedFFNCompute.check_options(tile_m=tile_m, tile_o=tile_o, **options)  # the kernel's checks
    return options


@dataclass(frozen=True)
class FFNFacts:
    """What ``FFNOptions.resolve`` needs: local_hidden = hidden_features / world size (the
    hidden slice of this rank), grouped (ShardedExperts: the grouped compute launch), num_sms
    (the GPU's SM count; None: not range-checked), ranks_share_device (two ranks of the group
    run on one GPU: ``runtime.device.ranks_share_device``, the same on every rank)."""
    local_hidden: int
    grouped: bool = False
    num_sms: int | None = None
    ranks_share_device: bool = False


def _auto_or_int(name: str, v, extra: str = ""):
    if isinstance(v, str) and v == AUTO:
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ValueError(f"{name}={v!r} must be 'auto' or a positive int{extra}")
    return int(v)


@dataclass(frozen=True)
class FFNOptions:
    """Options of the fused tensor-parallel FFN layers (fused backend only).

    comm ("unicast" | "switch"): how the band all-reduce moves data: peer loads/stores over
        NVLink, or NVLink multicast (refused unless multicast is explicitly allowed and
        available, see ``runtime.multicast.require_multicast``).
    ccta (int >= 1 and < the GPU's SM count, or "auto"): SMs of the communication blocks (band
        all-reduce); the compute blocks take the others. auto: ``fused_default_ccta(O/G)``
        (16 to 32: more SMs where the hidden slice is small and the all-reduce is exposed).
    max_tokens (int >= 1 or None): rows the symmetric accumulator is first sized for (None: the
        first call's; it grows, collectively, when a call brings more).
    tile_m (64 | 128): compute m-tile, one ready flag per m-tile.
    allreduce_band_rows (a divisor of tile_m, or "auto"): rows per band of the all-reduce, so a
        finished m-tile is shared by tile_m / allreduce_band_rows communication CTAs. auto:
        ``fused_default_allreduce_band_rows(O/G, tile_m)`` (32, or 64 at O/G <= 2048).
    compute_options (dict or None): keyword options of the compute kernel (``COMPUTE_OPTIONS``;
        tile sizes and band rows are the layer's); resolved with the layer's defaults filled in
        (``check_compute_options``: ``h_pair`` where the hidden tiles pair up).
    error_check ("async" | "off"): "async": after each fused call the band all-reduce's error
        word is copied to pinned host memory (non-blocking, with an event) and the next call
        (or ``check_errors()``) raises if it is set, with no host sync in the call; "off": only
        an explicit ``check_errors()`` reads it (README, "Failures and recovery").
    compute ("reduce" | "chained"): the compute kernel. "reduce" (default): the seed's kernel
        (ffn/compute_reduce.py), fp32 reduce-adds into the symmetric fp32 accumulator, fp32
        band all-reduce. "chained": ffn/compute_chained.py (GEMM1 -> bf16 H ring ->
        full-depth GEMM2, final bf16 partial tiles) into a symmetric bf16 buffer and the band
        all-reduce's bf16-partial mode (half the bytes). ShardedExperts runs its grouped form
        (``ChainedFFNCompute.grouped``, b_out added per row block by the all-reduce's
        ``b2_per_band`` variant). Needs tile_m = 128, (O/G) % 256 == 0, N % 256 == 0;
        compute_options are then ``CHAINED_COMPUTE_OPTIONS``.
    symmetric ("auto" | "torch" | "nvshmem"): who allocates the band all-reduce's symmetric
        buffer (``band_allreduce.resolve_symmetric``): torch symmetric memory (one rank per GPU;
        the only one with comm="switch") or the process's NVSHMEM runtime (also ranks sharing a
        GPU, which torch refuses). auto: nvshmem where ranks of the group share a GPU, else
        torch. comm="switch" with "nvshmem" is refused.
    """
    comm: str = "unicast"
    ccta: int | str = AUTO
    max_tokens: int | None = None
    tile_m: int = 128
    allreduce_band_rows: int | str = AUTO
    compute_options: dict | None = None
    error_check: str = "async"
    compute: str = DEFAULT_COMPUTE
    symmetric: str = AUTO

    def __post_init__(self):
        self.validate()

    def _set(self, name, value):
        object.__setattr__(self, name, value)  # normalization inside __post_init__ only

    def validate(self) -> None:
        """Checks every option's type and allowed values (numpy ints -> int, None -> "auto" for
        ccta / allreduce_band_rows, compute_options -> a read-only copy). ValueError /
        TypeError naming the option."""
        if self.comm not in COMMS:
            raise ValueError(f"comm={self.comm!r}: choose from {COMMS}")
        if self.compute not in COMPUTES:
            raise ValueError(f"compute={self.compute!r}: choose from {COMPUTES}")
        check_symmetric(self.symmetric, self.comm)
        chained = self.compute == "chained"
        self._set("ccta", _auto_or_int("ccta", AUTO if self.ccta is None else self.ccta,
                                       " (SMs of the communication blocks)"))
        if self.max_tokens is not None:
            self._set("max_tokens", _auto_or_int("max_tokens", self.max_tokens))
            if self.max_tokens == AUTO:
                raise ValueError("max_tokens must be a positive int or None")
        tm = self.tile_m
        if isinstance(tm, bool) or not isinstance(tm, numbers.Integral) or tm not in TILE_MS:
            raise ValueError(f"tile_m={tm!r} must be 64 or 128")
        self._set("tile_m", int(tm))
        if chained and tm != 128:
            raise ValueError(f"tile_m={tm!r}: compute='chained' runs 128-row blocks (tile_m=128)")
        ar = AUTO if self.allreduce_band_rows is None else self.allreduce_band_rows
        ar = _auto_or_int("allreduce_band_rows", ar, f" dividing tile_m={self.tile_m}")
        if ar != AUTO and self.tile_m % ar:
            raise ValueError(f"allreduce_band_rows={ar!r} must be a positive divisor of "
                             f"tile_m={self.tile_m}")
        self._set("allreduce_band_rows", ar)
        if self.error_check not in ERROR_CHECKS:
            raise ValueError(f"error_check={self.error_check!r}; choose from {ERROR_CHECKS}")
        co = self.compute_options
        if co is not None:
            if not isinstance(co, (dict, types.MappingProxyType)):
                raise TypeError(f"compute_options must be a dict, got {type(co).__name__}")
            from ..kernels import reject_unknown_options
            if chained:
                reject_unknown_options("compute_options (compute='chained')", co,
                                       CHAINED_COMPUTE_OPTIONS)
            else:
                reject_unknown_options("compute_options", co, COMPUTE_OPTIONS)
            self._set("compute_options", types.MappingProxyType(dict(co)))

    def replace(self, **changes) -> "FFNOptions":
        """A copy with some options changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def is_default(self) -> bool:
        return self == FFNOptions()

    @property
    def is_resolved(self) -> bool:
        return AUTO not in (self.ccta, self.allreduce_band_rows, self.symmetric) \
            and self.compute_options is not None

    def resolve(self, facts: FFNFacts) -> "FFNOptions":
        """These options with every "auto" replaced and the compute options checked against the
        kernel (see the module doc). ValueError if a value does not fit the facts."""
        O = facts.local_hidden
        chained = self.compute == "chained"
        if chained and O % 256:
            raise ValueError(f"compute='chained' needs hidden_features / world_size ({O}) to be "
                             f"a multiple of 256 (the kernel's hidden tile)")
        # the bf16 all-reduce moves half the fp32 bytes, so it may need fewer SMs; the same
        # defaults until it is measured (bench/NOTES.md)
        ccta = fused_default_ccta(O) if self.ccta == AUTO else self.ccta
        if facts.num_sms is not None and not 1 <= ccta < facts.num_sms:
            raise ValueError(f"ccta={ccta!r} must be an int in [1, {facts.num_sms - 1}] (SMs of "
                             f"the communication blocks; the rest compute)")
        ar = fused_default_allreduce_band_rows(O, self.tile_m) \
            if self.allreduce_band_rows == AUTO else self.allreduce_band_rows
        given = None if self.compute_options is None else dict(self.compute_options)
        if chained:
            co = check_chained_compute_options(given)
        else:
            co = check_compute_options(given, O, self.tile_m, fused_tile_o(O),
                                       grouped=facts.grouped)
        sym = resolve_symmetric(self.symmetric, self.comm, facts.ranks_share_device)
        return dataclasses.replace(self, ccta=ccta, allreduce_band_rows=ar, compute_options=co,
                                   symmetric=sym)


def ffn_options_from_kwargs(options: FFNOptions | None, what: str, **kwargs) -> FFNOptions:
    """The options of a layer built with ``options=`` and/or the keyword arguments: keywords
    given (not None) override the object's fields."""
    if options is not None and not isinstance(options, FFNOptions):
        raise TypeError(f"{what}: options must be an FFNOptions, got {type(options).__name__}")
    given = {k: v for k, v in kwargs.items() if v is not None}
    if options is None:
        return FFNOptions(**given)
    return options.replace(**given) if given else options
