"""Tensor-parallel FFN layers: ``FusedFFN`` and ``ShardedExperts``.

``FusedFFN``: ``Y = act2(sum_g act1(X W1_g + b1_g) W2_g + b2)`` over the G ranks of ``group``.
Rank g holds the column slice ``W1[:, g O/G : (g+1) O/G]`` / ``b1[...]``, the matching row slice of
W2, and the full b2; ``forward(X)`` returns the full ``[T, N]`` output on every rank. Math layout:
``W1 [P, O]`` (``X @ W1``), ``W2 [O, N]``.

``ShardedExperts``: E experts, each split over all G ranks the same way (1/G of every ``W_in[e]``'s
columns, the matching rows of ``W_out[e]``); ``forward(x, rows_per_expert)`` takes the rows of all
experts stacked expert-major and returns the all-reduced ``[rows, N]`` output on every rank.

Autograd contract: the reference backend differentiates correctly across ranks (every rank gets
the full gradient of X and of the replicated b2 / b_out and the exact gradient of its own weight
slices), assuming the upstream gradient dY is the same on every rank, as Megatron does (the loss
is computed from the replicated Y identically everywhere); see ``moe_overlap.ffn.parallel``. The
fused backend is inference-only: a forward that autograd would record (grad mode on and the input
or a parameter requiring grad) raises RuntimeError before any kernel or communication; call it
under ``torch.no_grad()`` / ``torch.inference_mode()``.

Backends:
- ``reference``: plain torch (``moe_overlap.ffn.reference``): addmm with the bias fused, in-place
  activation, mm (+b2 fused on rank 0), one in-place ``all_reduce`` (gloo on CPU, NCCL on CUDA),
  act2 in place. This is also the fair baseline of ``bench/bench_ffn.py``. While autograd
  records: out-of-place activations, the all-reduce through ``reduce_from_group``, X through
  ``copy_to_group`` (all-reduce of dX in backward), b2 added after the reduce on every rank.
- ``fused`` (CUDA Hopper GPUs, CuTe DSL, bf16, inference): two persistent CuTe DSL kernels
  running at the same time on one GPU: the compute blocks
  (``moe_overlap.ffn.compute_reduce.FusedFFNCompute``: act1(X W1_g + b1_g) tiles on chip, times W2_g,
  TMA reduce-add into the fp32 symmetric accumulator, per-band ready flags) on the current stream
  and SMs - ``ccta`` SMs, and the communication blocks (``moe_overlap.ffn.band_allreduce.BandAllReduce``,
  ``producer=True``: band all-reduce across the group, + b2, act2, bf16 out, accumulator zeroed for
  the next call) on a high-priority stream and ``ccta`` SMs. Where CUDA / CuTe DSL are missing the
  constructor raises ``NotImplementedError`` (a ``RuntimeError``) saying why.
  ``ShardedExperts(backend="fused")`` runs the same kernel grouped over the experts (each
  expert's rows padded to tile_m, one launch; b_out seeds rank 0's accumulator); with
  ``compute="chained"`` the chained kernel's grouped form (``ChainedFFNCompute.grouped``) and the
  bf16 all-reduce adding ``b_out`` of each row block's expert (``b2_per_band``).
  Its speed against the reference backend, and why: bench/NOTES.md.
  ``comm="unicast"`` (peer loads/stores over NVLink) or ``comm="switch"`` (NVLink multicast;
  refused unless multicast is explicitly allowed and available, see ``require_multicast``).
- ``auto``: ``fused`` only where it is measured faster (an FFN tune-cache entry) or modelled at
  least 5 % faster (``moe_overlap.ffn.projection``), else ``reference``; decided once at
  construction (``moe_overlap.ffn.tuning.choose_backend``), the choice in ``backend`` and why in
  ``backend_reason`` (and ``repr``). With today's measured rates it is the reference on every
  seed shape. The fused options may be given; they are validated and apply only if fused is
  chosen. The default backend stays ``reference``.

All argument checks raise ``TypeError`` / ``ValueError`` before any work is done.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..diagnostics import FFNDebug, debug_scope
from ..runtime.error_watch import ErrorWatch
from .activations import ACT2, ACTIVATIONS, check_activation  # noqa: F401 (re-exported)
from .options import (CHAINED_COMPUTE_OPTIONS, COMPUTE_OPTIONS,  # noqa: F401 (re-exported)
                      COMPUTES, FFNFacts, FFNOptions,
                      check_compute_options, ffn_options_from_kwargs,
                      fused_default_allreduce_band_rows, fused_default_ccta, fused_tile_o)
from .reference import experts_tp_reference, ffn_tp_reference
from ..runtime.device import num_sms, ranks_share_device

BACKENDS = ("reference", "fused", "auto")
COMMS = ("unicast", "switch")
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # float64: reference only

def _group_world(group) -> tuple[int, int]:
    if group is None:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialized")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of `group`")
    return rank, dist.get_world_size(group)


def _pos_int(name, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")
    return v


def _check_dtype(dtype, backend):
    if dtype not in DTYPES:
        raise TypeError(f"dtype={dtype} is not supported: choose from {DTYPES}")
    # float64 is there for gradient checks against a float64 truth; the fused kernels are bf16
    # ("auto" takes the reference for other dtypes)
    if backend == "fused" and dtype != torch.bfloat16:
        raise TypeError(f"backend='fused' computes in bfloat16, got dtype={dtype}")


def _check_backend(backend, comm):
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose from {BACKENDS}")
    if comm is not None and comm not in COMMS:
        raise ValueError(f"comm={comm!r}: choose from {COMMS}")
    if backend == "reference" and comm is not None:
        raise ValueError(f"comm={comm!r} applies to backend='fused' only (the reference backend "
                         f"all-reduces with torch.distributed)")
    return comm or "unicast"


def _check_device_vs_group(device: torch.device, group, world: int):
    if world == 1:
        return
    # CUDA weights on a gloo group are allowed: several ranks sharing one GPU cannot use NCCL,
    # and runtime.collectives stages their CUDA tensors through host memory
    be = dist.get_backend(group)
    if device.type == "cpu" and str(be) == "nccl":
        raise ValueError("weights are on the CPU but the process group uses nccl; use gloo "
                         "(or move the module to the rank's GPU)")


def _fused_missing(comm: str, device: torch.device) -> str | None:
    """The first missing requirement of the fused backend on this machine (multicast for
    comm='switch', CUDA, a CUDA device, a Hopper GPU, CuTe DSL), or None."""
    if comm == "switch":
        from ..runtime.multicast import require_multicast
        try:
            require_multicast()  # raises a clear RuntimeError on our machines
        except RuntimeError as e:
            return str(e)
    if not torch.cuda.is_available():
        return "no CUDA GPU is available"
    if device.type != "cuda":
        return f"the module's device is {device}, not a CUDA GPU"
    major, _ = torch.cuda.get_device_capability(device)
    if major != 9:
        return f"{torch.cuda.get_device_name(device)} is not a Hopper (sm_90) GPU"
    try:
        import cutlass.cute  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError or a broken install
        return f"CuTe DSL (nvidia-cutlass-dsl) is not importable ({e})"
    return None


def _fused_requirements(comm: str, device: torch.device, what: str = "FusedFFN"):
    """Raises NotImplementedError (a RuntimeError) naming the first missing requirement of the
    fused backend on this machine (``_fused_missing``); comm='switch' without multicast raises
    require_multicast's RuntimeError."""
    if comm == "switch":
        from ..runtime.multicast import require_multicast
        require_multicast()
    why = _fused_missing(comm, device)
    if why is not None:
        raise NotImplementedError(
            f"{what}(backend='fused', comm={comm!r}) cannot run here: the fused compute kernel "
            f"(moe_overlap/ffn/compute_reduce.py) and the band all-reduce need CUDA Hopper GPUs "
            f"and CuTe DSL; {why}. Use backend='reference'.")


def _fused_shape_problem(P: int, local_hidden: int, N: int) -> str | None:
    """What the fused kernels cannot take in these dimensions (the checks of ``_init_fused``)."""
    if P % 64:
        return f"backend='fused' needs in_features % 64 == 0, got {P}"
    if local_hidden % 128:
        return (f"backend='fused' needs hidden_features / world_size % 128 == 0, got "
                f"{local_hidden}")
    if N % 128:
        return f"backend='fused' needs out_features % 128 == 0, got {N}"
    return None


def _resolve_backend(what: str, backend: str, P: int, O: int, N: int, G: int, dtype, device,
                     grouped: bool, options, fused_kw: dict) -> tuple[str, str]:
    """(backend, reason): an explicit backend as given; "auto" decided once here
    (``moe_overlap.ffn.tuning.choose_backend``: tune cache, else the projection model, the
    reference wherever the fused backend cannot run). The fused options are validated first,
    and their ccta / max_tokens enter the decision."""
    if backend != "auto":
        return backend, f"requested backend={backend!r}"
    from .tuning import choose_backend
    opts = ffn_options_from_kwargs(options, what, **fused_kw)
    why = None if dtype == torch.bfloat16 else f"dtype {dtype}: the fused kernels are bfloat16"
    why = why or _fused_shape_problem(P, O // G, N) or _fused_missing(opts.comm, device)
    name = torch.cuda.get_device_name(device) if why is None else device.type
    return choose_backend(P, O, N, G, grouped=grouped, tokens=opts.max_tokens,
                          ccta=None if opts.ccta == "auto" else opts.ccta, device_name=name,
                          cannot_run=why, compute=opts.compute)


def _check_layer(in_features, hidden_features, out_features, bias, dtype, backend, comm, group,
                 device, world_name):
    """Checks shared by FusedFFN and ShardedExperts; returns (P, O, N, comm, rank, G, device) with
    comm resolved and the device made explicit (cuda -> cuda:current)."""
    P = _pos_int("in_features", in_features)
    O = _pos_int("hidden_features", hidden_features)
    N = _pos_int("out_features", P if out_features is None else out_features)
    if not isinstance(bias, bool):
        raise TypeError(f"bias={bias!r} must be a bool")
    comm = _check_backend(backend, comm)
    _check_dtype(dtype, backend)
    rank, G = _group_world(group)
    if O % G:
        raise ValueError(f"hidden_features={O} is not divisible by {world_name} {G}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _check_device_vs_group(device, group, G)
    return P, O, N, comm, rank, G, device


def _check_tensor(name, t, shape, dtype, device, allow_none=False):
    if t is None:
        if allow_none:
            return None
        raise TypeError(f"{name} is required")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if not (t.is_floating_point()):
        raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}, expected {dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    return t


def check_fused_inference(what: str, tensors: dict) -> None:
    """The fused backend's autograd contract, checked before any kernel or communication: its
    kernels have no backward, so a forward that autograd would record (grad mode on and any of
    ``tensors``, name -> tensor or None, requiring grad) raises RuntimeError naming the tensors
    and ``backend='reference'`` instead of returning an output cut from the graph."""
    if not torch.is_grad_enabled():
        return
    names = [k for k, t in tensors.items() if isinstance(t, torch.Tensor) and t.requires_grad]
    if names:
        raise RuntimeError(
            f"{what}(backend='fused') is inference-only (its kernels have no backward), but "
            f"{', '.join(names)} require{'s' if len(names) == 1 else ''} grad with grad mode on. "
            f"Use backend='reference' to train (correct gradients across ranks), or call the "
            f"fused layer under torch.no_grad() / torch.inference_mode() (or with "
            f"requires_grad_(False) on its parameters and inputs).")


def padded_expert_layout(rows, tile_m: int, device):
    """Where the fused ShardedExperts puts each expert's rows: expert-major, every group padded to
    a multiple of tile_m (so an m-tile belongs to one expert). ``rows`` are host ints. Returns
    ``(dst, tile_expert, row_expert, padded_rows)``: ``dst [sum(rows)]`` int64, the padded row of
    each input row; ``tile_expert [padded_rows / tile_m]`` int32 and ``row_expert [padded_rows]``
    int64, the expert of each m-tile / padded row. Built with device ops (no per-row Python, no
    host sync: the sizes come from the host ints)."""
    E = len(rows)
    padded = [-(-n // tile_m) * tile_m for n in rows]
    total, R_pad = sum(rows), sum(padded)
    cnt = torch.tensor(rows + padded, dtype=torch.int64).to(device, non_blocking=True)
    cnt, pcnt = cnt[:E], cnt[E:]
    experts = torch.arange(E, device=device)
    start = torch.cumsum(cnt, 0) - cnt
    pstart = torch.cumsum(pcnt, 0) - pcnt
    e_of_row = torch.repeat_interleave(experts, cnt, output_size=total)
    dst = torch.arange(total, device=device) - start[e_of_row] + pstart[e_of_row]
    row_expert = torch.repeat_interleave(experts, pcnt, output_size=R_pad)
    tile_expert = row_expert[::tile_m].to(torch.int32)
    return dst, tile_expert, row_expert, R_pad


class _FusedBackend:
    """The fused backend's plumbing shared by FusedFFN and ShardedExperts: the compute-kernel
    object, the BandAllReduce (symmetric fp32 accumulator, made on the first forward and grown
    collectively), the high-priority communication stream, the warm-up, and one overlapped call.
    The host class provides ``in_features``, ``out_features``, ``local_hidden``, ``group``,
    ``comm`` and the hooks ``_fused_device``, ``_fused_act2``, ``_fused_b2``,
    ``_fused_b1_param`` (the first bias parameter or None) and
    ``_run_compute(x, acc, band_ready, epoch, m_tile_expert, stream, ccta=None, b1=None)``.

    ``compute="chained"``: the compute object is ``ChainedFFNCompute`` (ShardedExperts: its
    ``grouped`` call), the
    all-reduce runs ``partial="bf16"`` on its symmetric bf16 ``partial`` buffer (the compute
    kernel's ``out``), the compute kernel's own error word is watched beside the all-reduce's,
    and its H ring is one layer-owned buffer allocated before the launches."""
    _chained = False  # compute="chained" (set by _init_fused)
    _cwatch = None  # ErrorWatch of the chained compute kernel's error word
    _ring_buf = None  # chained: the H ring's storage (grows, never per call)
    _b2_per_band = False  # chained: b2 one row per row block (ShardedExperts' b_out)

    def _decide_backend(self, backend, P, O, N, G, dtype, device, options, **fused_kw) -> str:
        """The backend this layer runs (``backend``, or what "auto" decides: ``_resolve_backend``
        on the fused keyword options, ``compute`` among them); keeps ``requested_backend`` and
        ``backend_reason``."""
        self.requested_backend = backend
        backend, self.backend_reason = _resolve_backend(
            type(self).__name__, backend, P, O, N, G, dtype, device, self._grouped_compute,
            options, fused_kw)
        return backend

    def _init_backend(self, backend, device, options, comm, ccta, max_tokens, tile_m,
                      compute_options, allreduce_band_rows, error_check=None, compute=None,
                      requested=None, symmetric=None):
        """Builds the layer's FFNOptions from ``options`` and the keyword arguments (refused for
        the reference backend when it was asked for: it takes no fused option; kept unused where
        "auto" chose it), checks them, and sets up the fused backend with the resolved
        options."""
        self._debug = FFNDebug()  # benchmarks: see diagnostics()
        if backend != "fused" and requested != "auto":
            if (ccta is not None or max_tokens is not None or tile_m is not None
                    or compute_options is not None or allreduce_band_rows is not None):
                raise ValueError("ccta / max_tokens / tile_m / compute_options / "
                                 "allreduce_band_rows apply to backend='fused' only")
            if error_check is not None:  # the reference backend has no device error word
                raise ValueError("error_check applies to backend='fused' only")
            if compute is not None:
                raise ValueError("compute applies to backend='fused' only (the reference "
                                 "backend computes with torch)")
            if symmetric is not None:
                raise ValueError("symmetric applies to backend='fused' only (the reference "
                                 "backend has no symmetric buffer)")
            if isinstance(options, FFNOptions) and options != FFNOptions():
                raise ValueError(f"options={options!r} apply to backend='fused' only (the "
                                 "reference backend takes the defaults)")
        self.options = ffn_options_from_kwargs(
            options, type(self).__name__, comm=comm, ccta=ccta, max_tokens=max_tokens,
            tile_m=tile_m, compute_options=compute_options,
            allreduce_band_rows=allreduce_band_rows, error_check=error_check, compute=compute,
            symmetric=symmetric)
        self.comm = self.options.comm
        if backend == "fused":
            self._init_fused(device)

    def _backend_repr(self) -> str:
        if self.requested_backend != "auto":
            return f"backend={self.backend}"
        return f"backend={self.backend} ({self.backend_reason})"

    def diagnostics(self, timeline: list | None = None):
        """Context manager for benchmarks (fused backend, eager calls): inside it every call
        appends ``[start, compute end, all-reduce end]`` CUDA timing events to ``timeline``.
        Not part of any compile key."""
        return debug_scope(self, FFNDebug(timeline=timeline))

    def _init_fused(self, device):
        """Checks (before any allocation or launch), the options resolved once, and the
        compute-kernel object."""
        _fused_requirements(self.comm, device, type(self).__name__)
        from .compute_reduce import FusedFFNCompute
        P, O, N = self.in_features, self.local_hidden, self.out_features
        bad = _fused_shape_problem(P, O, N)
        if bad is not None:
            raise ValueError(bad)
        sms = num_sms(device)
        # collective where it must be asked (every rank builds the layer): the symmetric
        # allocator follows whether ranks share a GPU
        shared = (self.options.symmetric == "auto" and self.world_size > 1
                  and ranks_share_device(self.group, device))
        self.options = opts = self.options.resolve(
            FFNFacts(local_hidden=O, grouped=self._grouped_compute, num_sms=sms,
                     ranks_share_device=shared))
        self.ccta, self.max_tokens, self.tile_m = opts.ccta, opts.max_tokens, opts.tile_m
        self.allreduce_band_rows = opts.allreduce_band_rows
        self.tile_o = fused_tile_o(O)
        self.compute_options = dict(opts.compute_options)
        self._chained = opts.compute == "chained"
        if self._chained:
            from .compute_chained import ChainedFFNCompute
            try:
                ChainedFFNCompute.check_shapes(P, O, N, self._fused_act1)
            except ValueError as e:
                raise ValueError(f"compute='chained': {e} (compute='reduce' needs only "
                                 f"(O/G) % 128 == 0 and N % 128 == 0)") from None
            self._compute = ChainedFFNCompute(tile_m=self.tile_m, **self.compute_options)
        else:
            self._compute = FusedFFNCompute(tile_m=self.tile_m, tile_o=self.tile_o,
                                            band_rows=self.tile_m, **self.compute_options)
        self._allreduce = None
        self._comm_stream = None
        self._warm = False
        self._watch = None  # ErrorWatch of the all-reduce's error word (made with it)
        self._b1_cache = None  # (key, fp32 b1): converted once per weight version, not per call

    def allreduce_for(self, M: int):
        """The layer's BandAllReduce (symmetric fp32 accumulator ``acc``, or with
        compute="chained" the bf16 ``partial``; ``band_ready``, ``epoch``) sized for at least M
        rows. Collective on first use and on growth: every rank
        calls it (or forward) with the same M. Benchmarks time it alone through it."""
        return self._fused_allreduce(M)

    def run_compute(self, x, acc, band_ready, epoch, ccta: int = 0, m_tile_expert=None,
                    stream=None):
        """Launch the layer's compute kernel alone with its own weights (benchmarks, tests):
        reduce-adds act1(x W1_g + b1_g) W2_g into ``acc`` and sets band_ready[b] = epoch[0] per
        finished band, on ``stream`` (default: the current one), leaving ``ccta`` SMs free (0:
        every SM). ShardedExperts: x in the padded expert layout, ``m_tile_expert`` the expert of
        each m-tile (``padded_expert_layout``). No communication, no epoch change."""
        if self.backend != "fused":
            raise RuntimeError("run_compute needs backend='fused'")
        if stream is None:
            stream = torch.cuda.current_stream(self._fused_device)
        if m_tile_expert is None:
            m_tile_expert = torch.zeros(1, dtype=torch.int32, device=self._fused_device)
        self._run_compute(x, acc, band_ready, epoch, m_tile_expert, stream, ccta=ccta)

    def _fused_allreduce(self, M: int):
        """The BandAllReduce for M rows (collective on first use / growth: every rank calls
        forward with the same M)."""
        from .band_allreduce import BandAllReduce
        ar = self._allreduce
        if ar is None or ar.max_rows < M:
            rows = max(M, self.max_tokens or 0, ar.max_rows * 2 if ar is not None else 0)
            rows = -(-rows // self.tile_m) * self.tile_m
            if self._watch is not None:  # the old buffers' error would be lost with them
                self._watch.check()
            if ar is not None:  # collective, like the growth (NVSHMEM: freed now, not by GC)
                ar.release()
            # ready_rows == tile_m: one ready flag per compute m-tile
            self._allreduce = ar = BandAllReduce(
                rows, self.out_features, self.group, backend=self.comm, act2=self._fused_act2,
                band_rows=self.allreduce_band_rows, ready_rows=self.tile_m, ccta=self.ccta,
                partial="bf16" if self._chained else "fp32",
                b2_per_band=self._chained and self._b2_per_band,
                symmetric=self.options.symmetric)
            self._warm = False
            from .band_allreduce import describe_error
            self._watch = ErrorWatch(ar.err, describe_error,
                                     f"{type(self).__name__} (rank {self.rank})",
                                     enabled=self.options.error_check == "async")
            if self._chained and self._cwatch is None:  # one word for the object's lifetime
                from .compute_chained import describe_chained_error
                self._cwatch = ErrorWatch(self._compute.error_word(self._fused_device),
                                          describe_chained_error,
                                          f"{type(self).__name__} compute (rank {self.rank})",
                                          enabled=self.options.error_check == "async")
        if self._comm_stream is None:  # high priority: its CTAs go first when SMs free up
            try:
                lo, hi = torch.cuda.Stream.priority_range()
                prio = min(lo, hi)  # lower number = higher priority
            except Exception:  # noqa: BLE001 - older torch: -1 is "high" everywhere
                prio = -1
            self._comm_stream = torch.cuda.Stream(device=self._fused_device, priority=prio)
        return ar

    def _fused_warmup(self, ar):
        """Loads and runs every kernel once, alone, before the first overlapped launch (a spinning
        kernel next to a lazily loaded one deadlocks): the compute kernel on scratch buffers,
        then a standalone (producer=False) all-reduce of a zero band (collective)."""
        dev = self._fused_device
        tm = self.tile_m
        x = torch.zeros(tm, self.in_features, dtype=torch.bfloat16, device=dev)
        acc = torch.zeros(tm, self.out_features,
                          dtype=torch.bfloat16 if self._chained else torch.float32, device=dev)
        ready = torch.zeros(1, dtype=torch.int32, device=dev)
        epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        mte = torch.zeros(1, dtype=torch.int32, device=dev)
        if self._chained:
            self._prepare_chained(tm)
        self._run_compute(x, acc, ready, epoch, mte, torch.cuda.current_stream(dev))
        ar.compile()
        torch.cuda.synchronize(dev)
        # every rank has compiled both kernels before the first cross-rank wait (the warm-up
        # all-reduce) starts its timeout clock: ranks compile at different speeds
        self._barrier()
        # acc (partial) is zero: writes zeros, leaves it zero; no epoch change
        ar(min(tm, ar.max_rows))
        torch.cuda.synchronize(dev)
        ar.check()
        if self._chained:
            self._compute.check(dev)
        self._warm = True

    def _prepare_chained(self, M: int):
        """compute="chained", before the launches of a call on M rows: the compute object's
        table and scratch, and the H ring's storage (grown here, never inside the call)."""
        dev = self._fused_device
        rows = self._compute.prepare(M, self.in_features, self.local_hidden, self.out_features,
                                     dev, ccta=self.ccta, has_b1=self._fused_b1_param() is not None,
                                     grouped=self._grouped_compute)
        need = rows * self.local_hidden
        if self._ring_buf is None or self._ring_buf.numel() < need:
            self._ring_buf = torch.empty(need, dtype=torch.bfloat16, device=dev)
        return self._ring_buf[:need].view(rows, self.local_hidden)

    def _b1_for_compute(self):
        """The first-layer bias as the compute kernel reads it (None without bias): the chained
        kernel reads a contiguous bf16 bias as it is (``compute_chained.b1_read_dtype``), so the
        parameter itself, with no copy; otherwise a contiguous fp32 copy, converted once per
        weight version (``_version`` moves with every in-place update, e.g.
        ``load_full_weights``), so that no call converts it."""
        b1 = self._fused_b1_param()
        if b1 is None:
            return None
        if self._chained and b1.dtype == torch.bfloat16 and b1.is_contiguous():
            return b1.detach()
        key = (b1.data_ptr(), b1._version, b1.dtype)
        if self._b1_cache is None or self._b1_cache[0] != key:
            self._b1_cache = (key, b1.detach().float().contiguous().clone())
        return self._b1_cache[1]

    def _streams(self, device):
        """(compute stream = the current one, communication stream)."""
        return torch.cuda.current_stream(device), self._comm_stream

    @staticmethod
    def _keep_for(t, stream):
        t.record_stream(stream)

    def _fused_call(self, x2: torch.Tensor, mte=None, acc_init=None, b2=None) -> torch.Tensor:
        """One overlapped layer call on M = x2.shape[0] rows: compute blocks (current stream)
        || band all-reduce (comm stream) -> bf16 [M, N]. acc_init(acc) may write the
        accumulator's starting value (zero otherwise) in the compute stream's order. b2: the
        all-reduce's b2 in place of ``_fused_b2()`` (made by the caller before the call, e.g.
        one row per row block with ``b2_per_band``).

        Host order: every allocation and conversion (output, b1 as the kernel reads it, the
        compute kernel's scratch counter) is done before the first launch; the compute (the
        producer of the ready flags) is launched before the all-reduce that waits on them, so
        that the waiting kernel never waits on one not launched yet (with
        CUDA_LAUNCH_BLOCKING=1 the compute runs to completion first). An earlier call's device
        error raises here, before any work."""
        M = x2.shape[0]
        out = torch.empty(M, self.out_features, dtype=torch.bfloat16, device=x2.device)
        if M == 0:
            return out
        if self._watch is not None:
            self._watch.poll()
        if self._cwatch is not None:  # compute="chained": the compute kernel's own word
            self._cwatch.poll()
        x2 = x2.contiguous()
        if x2.data_ptr() % 16:  # TMA needs 16-byte aligned rows
            x2 = x2.clone()
        ar = self._fused_allreduce(M)
        if not self._warm:
            self._fused_warmup(ar)
        cur, comm = self._streams(x2.device)
        b1f = self._b1_for_compute()
        if self._chained:
            ring = self._prepare_chained(M)  # allocated before any launch
            data = ar.partial[:M]  # the compute kernel's out: stored, not added into
        else:
            ring = None
            self._compute.counter_for(ar.band_ready)  # allocated (once) before any launch
            data = ar.acc[:M]
        b2 = self._fused_b2() if b2 is None else b2
        if acc_init is not None:
            if self._chained:
                raise NotImplementedError("acc_init needs compute='reduce' (the chained kernel "
                                          "stores its partial, it does not add into a seed)")
            acc_init(data)
        # one epoch per call, advanced in the compute stream's order: the compute kernel (same
        # stream) and the all-reduce (comm stream, which waits on this point) read the same value
        ar.epoch.add_(1)
        comm.wait_stream(cur)  # x, weights, the zeroed accumulator, the epoch; not the compute
        ev = self._debug.timeline
        if ev is not None:  # benchmarks: when each kernel ends, relative to the call's start
            ev.append([torch.cuda.Event(enable_timing=True) for _ in range(3)])
            ev[-1][0].record(cur)
        if self._chained:
            self._run_compute(x2, data, ar.band_ready, ar.epoch, mte, cur, b1=b1f, h_ring=ring)
        else:
            self._run_compute(x2, data, ar.band_ready, ar.epoch, mte, cur, b1=b1f)
        ar(M, b2=b2, out=out, producer=True, bump_epoch=False, stream=comm)
        if ev is not None:
            ev[-1][1].record(cur)
            ev[-1][2].record(comm)
        self._keep_for(out, comm)
        cur.wait_stream(comm)  # join: out is final, acc zeroed / partial free for the next call
        self._watch.after_call(cur)
        if self._cwatch is not None:
            self._cwatch.after_call(cur)
        return out

    def check_errors(self):
        """Fused backend: synchronize and raise (``runtime.error_watch.DeviceError``, a
        RuntimeError, with the all-reduce's error record and this rank) if a device wait timed
        out since construction or the last ``reset()``; also the way to check after CUDA-graph replays. Nothing to
        check on the reference backend."""
        if getattr(self, "_watch", None) is not None:
            self._watch.check()
        if self._cwatch is not None:
            self._cwatch.check()

    def check_fused(self):
        """Old name of ``check_errors`` (kept for compatibility)."""
        self.check_errors()

    synchronize = check_errors

    def _barrier(self):
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def reset(self):
        """Collective (every rank of the group, between calls): make the layer usable again
        after a device error (e.g. a timeout). Synchronizes, barrier (no kernel of any rank runs
        past it), then zeroes this rank's error word, fp32 accumulator (partial sums of a failed
        call), arrive / done / expected counts, ready flags, epoch and the compute kernel's
        scratch band counter, forgets the host read-back, and barriers again so that no rank
        signals before every rank has cleared. The reference backend: a barrier only."""
        ar = getattr(self, "_allreduce", None)
        dev = self._fused_device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self._barrier()
        if ar is not None:
            for t in (ar.err, getattr(ar, "acc", None), getattr(ar, "partial", None),
                      ar.arrive, ar.done, ar.expected, ar.band_ready, ar.epoch):
                if t is not None:  # acc (fp32 mode) or partial (bf16 mode)
                    t.zero_()
            if self._chained:
                self._compute.error_word(dev).zero_()
                if self._cwatch is not None:
                    self._cwatch.clear()
            else:
                self._compute.counter_for(ar.band_ready).zero_()
            self._watch.clear()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self._barrier()


class FusedFFN(_FusedBackend, torch.nn.Module):
    """Tensor-parallel FFN ``Y = act2(act1(X W1 + b1) W2 + b2)``, this rank's slices only.

    Args: ``in_features`` P, ``hidden_features`` O (divisible by G), ``out_features`` N (default
    P); ``act1`` in ``ACTIVATIONS`` (relu, gelu, gelu_tanh, silu), ``act2`` in ``ACT2`` (None or
    "none" for no activation); ``bias``: keep b1 and b2; ``group``: the TP process group (None: the
    default group if initialized, else a single process); ``dtype`` / ``device`` of the
    parameters; ``backend`` "reference" | "fused" | "auto" (module docstring: resolved once, the
    choice in ``self.backend``, why in ``self.backend_reason``); ``comm`` "unicast" | "switch"
    (fused only).
    Fused only (``options=FFNOptions(...)`` or the same names as keywords, a keyword given
    overriding the object's field; validated at construction and resolved once into
    ``self.options``, see moe_overlap/ffn/options.py; the reference backend refuses them):
    ``comm``, ``ccta`` (SMs of the communication blocks, default ``fused_default_ccta(O/G)``:
    16 to 32; the compute blocks take the others), ``max_tokens`` (rows the symmetric
    accumulator is first sized for; it grows, collectively, when a call brings more), ``tile_m``
    (64 or 128: compute m-tile = one ready flag); needs P % 64 == 0, (O/G) % 128 == 0,
    N % 128 == 0, bf16, Hopper GPUs, CuTe DSL. The fused forward is collective (every rank of the
    group calls it with the same token count). ``compute_options``: keyword options of the compute kernel
    (``COMPUTE_OPTIONS``: ring ``stages``, ``epi_n`` / ``epi_stages``, ``cluster_m``,
    ``h_pair``; see ffn/compute_reduce.py), checked at construction;
    ``h_pair`` defaults to True where O/G is a multiple of 2 * tile_o.
    ``allreduce_band_rows`` (a divisor of tile_m; default ``fused_default_allreduce_band_rows``:
    32, or 64 at O/G <= 2048): rows per band of the all-reduce, so a finished m-tile is shared by
    tile_m / allreduce_band_rows communication CTAs.
    ``compute`` ("reduce", the default, or "chained"): the compute kernel and the all-reduce's
    partial dtype (see ``FFNOptions.compute``): "chained" runs ffn/compute_chained.py, whose
    final bf16 partial tiles go to a symmetric bf16 buffer that the band all-reduce sums in
    fp32 in rank order (half the fp32 path's bytes); it needs (O/G) % 256 == 0 and
    N % 256 == 0, tile_m = 128, and takes ``CHAINED_COMPUTE_OPTIONS`` as compute_options.
    ``symmetric`` ("auto", "torch" or "nvshmem"; ``FFNOptions.symmetric``): who allocates the
    band all-reduce's symmetric buffer; "auto" asks the group once, at construction (every rank
    builds the layer), whether ranks share a GPU, and takes NVSHMEM there (torch symmetric memory
    refuses such ranks), torch symmetric memory elsewhere.
    Parameters (zero-initialized; use ``from_full_weights`` or ``load_full_weights``):
    ``w1 [P, O/G]``, ``b1 [O/G]``, ``w2 [O/G, N]``, ``b2 [N]``.

    Autograd: ``backend="reference"`` (any dtype, float64 included) backpropagates across ranks:
    ``X.grad`` and ``b2.grad`` are the full gradients on every rank, ``w1`` / ``b1`` / ``w2``
    get the gradient of this rank's slices; the backward all-reduces dX once (only when X
    requires grad). It assumes the upstream gradient dY is the same on every rank (the loss is
    computed from the replicated Y the same way on every rank); with a different dY per rank the
    gradients are wrong. Every rank must run the backward (it is collective). Under
    ``torch.no_grad()`` / ``inference_mode`` the forward is the plain in-place path.
    ``backend="fused"`` is inference-only: its parameters are created with
    ``requires_grad=False``; with grad mode on and X or a parameter requiring grad, ``forward``
    raises RuntimeError (naming ``backend='reference'``) before any kernel or
    communication; use ``torch.no_grad()`` / ``torch.inference_mode()`` or
    ``requires_grad_(False)``.
    """
    _grouped_compute = False  # the dense compute call (FusedFFNCompute.__call__)

    def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
                 *, act1: str = "gelu", act2: str | None = None, bias: bool = True, group=None,
                 dtype: torch.dtype = torch.bfloat16, device=None, backend: str = "reference",
                 comm: str | None = None, ccta: int | None = None, max_tokens: int | None = None,
                 tile_m: int | None = None, compute_options: dict | None = None,
                 allreduce_band_rows: int | None = None, error_check: str | None = None,
                 options: FFNOptions | None = None, compute: str | None = None,
                 symmetric: str | None = None):
        super().__init__()
        self.act1 = check_activation(act1, allow_none=False, what="act1")
        self.act2 = check_activation(act2, allow_none=True, what="act2")
        P, O, N, self.comm, rank, G, device = _check_layer(
            in_features, hidden_features, out_features, bias, dtype, backend, comm, group, device,
            "the TP world size")
        # "auto" decided once, here (before the parameters: their requires_grad follows it)
        backend = self._decide_backend(
            backend, P, O, N, G, dtype, device, options, comm=comm, ccta=ccta,
            max_tokens=max_tokens, tile_m=tile_m, compute_options=compute_options,
            allreduce_band_rows=allreduce_band_rows, error_check=error_check, compute=compute,
            symmetric=symmetric)
        self.in_features, self.hidden_features, self.out_features = P, O, N
        self.group, self.rank, self.world_size, self.backend = group, rank, G, backend
        self.local_hidden = O // G
        kw = dict(dtype=dtype, device=device)
        grad = dict(requires_grad=backend == "reference")  # fused: inference-only parameters
        self.w1 = torch.nn.Parameter(torch.zeros(P, O // G, **kw), **grad)
        self.w2 = torch.nn.Parameter(torch.zeros(O // G, N, **kw), **grad)
        self.b1 = torch.nn.Parameter(torch.zeros(O // G, **kw), **grad) if bias else None
        self.b2 = torch.nn.Parameter(torch.zeros(N, **kw), **grad) if bias else None
        self._init_backend(backend, device, options, comm, ccta, max_tokens, tile_m,
                           compute_options, allreduce_band_rows, error_check, compute,
                           requested=self.requested_backend, symmetric=symmetric)

    # ---- fused backend hooks (_FusedBackend) -------------------------------------------------
    @property
    def _fused_device(self):
        return self.w1.device

    @property
    def _fused_act2(self):
        return self.act2

    def _fused_b2(self):
        return self.b2.detach() if self.b2 is not None else None

    def _fused_b1_param(self):
        return self.b1

    @property
    def _fused_act1(self):
        return self.act1

    def _run_compute(self, x, acc, ready, epoch, mte, stream, ccta=None, b1=None, h_ring=None):
        b1 = self._b1_for_compute() if b1 is None else b1
        ccta = self.ccta if ccta is None else ccta
        if self._chained:  # acc: the bf16 partial [M, N] the kernel stores (its out)
            self._compute(x, self.w1.detach(), b1, self.w2.detach(), out=acc, band_ready=ready,
                          epoch=epoch, act1=self.act1, ccta=ccta, stream=stream, h_ring=h_ring)
            return
        self._compute(x, self.w1.detach(), b1, self.w2.detach(), acc, ready, epoch,
                      ccta=ccta, act1=self.act1, stream=stream)

    # ---- weights --------------------------------------------------------------------------
    def local_slice(self) -> slice:
        """This rank's hidden columns of W1 / b1 (rows of W2)."""
        o = self.local_hidden
        return slice(self.rank * o, (self.rank + 1) * o)

    @torch.no_grad()
    def load_full_weights(self, W1, b1, W2, b2):
        """Copy this rank's slices of the unsplit weights (any device / float dtype; cast to the
        module's dtype). ``W1 [P, O]``, ``b1 [O]``, ``W2 [O, N]``, ``b2 [N]`` (biases None iff
        the module has none)."""
        P, O, N = self.in_features, self.hidden_features, self.out_features
        has_bias = self.b1 is not None
        _check_tensor("W1", W1, (P, O), None, None)
        _check_tensor("W2", W2, (O, N), None, None)
        if has_bias:
            _check_tensor("b1", b1, (O,), None, None)
            _check_tensor("b2", b2, (N,), None, None)
        elif b1 is not None or b2 is not None:
            raise ValueError("this module was built with bias=False; pass b1=b2=None")
        s = self.local_slice()
        self.w1.copy_(W1[:, s])
        self.w2.copy_(W2[s, :])
        if has_bias:
            self.b1.copy_(b1[s])
            self.b2.copy_(b2)
        return self

    @classmethod
    def from_full_weights(cls, W1, b1, W2, b2, group=None, *, act1: str = "gelu",
                          act2: str | None = None, backend: str = "reference",
                          comm: str | None = None, dtype: torch.dtype | None = None, device=None,
                          **fused_kw):
        """Build the module from the unsplit weights (same on every rank) and keep this rank's
        slices. dtype / device default to W1's. b1 and b2 are both given or both None."""
        if not isinstance(W1, torch.Tensor) or W1.dim() != 2:
            raise TypeError("W1 must be a 2-D tensor [P, O]")
        if not isinstance(W2, torch.Tensor) or W2.dim() != 2:
            raise TypeError("W2 must be a 2-D tensor [O, N]")
        if (b1 is None) != (b2 is None):
            raise ValueError("pass both biases b1 and b2, or neither")
        P, O = W1.shape
        if W2.shape[0] != O:
            raise ValueError(f"W2 has {W2.shape[0]} rows but W1 has {O} columns (hidden size)")
        mod = cls(P, O, W2.shape[1], act1=act1, act2=act2, bias=b1 is not None, group=group,
                  dtype=dtype or W1.dtype, device=device if device is not None else W1.device,
                  backend=backend, comm=comm, **fused_kw)
        return mod.load_full_weights(W1, b1, W2, b2)

    # ---- forward --------------------------------------------------------------------------
    def check_input(self, x) -> torch.Tensor:
        """Validates X ([..., P], the module's dtype and device); returns it as [T, P]."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"X must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 2:
            raise ValueError(f"X must be [tokens, {self.in_features}] (or [..., "
                             f"{self.in_features}]), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"X has {x.shape[-1]} features, expected in_features="
                             f"{self.in_features}")
        if x.dtype != self.w1.dtype:
            raise TypeError(f"X has dtype {x.dtype}, the module computes in {self.w1.dtype}")
        if x.device != self.w1.device:
            raise ValueError(f"X is on {x.device}, the module's weights are on {self.w1.device}")
        return x.reshape(-1, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """X ``[..., P]`` (the same on every rank of the group) -> Y ``[..., N]`` on every rank."""
        lead = x.shape[:-1] if isinstance(x, torch.Tensor) else None
        x2 = self.check_input(x)
        if self.backend == "fused":
            check_fused_inference("FusedFFN", dict(X=x2, w1=self.w1, b1=self.b1, w2=self.w2,
                                                   b2=self.b2))
            return self._fused_call(x2.detach()).reshape(*lead, self.out_features)
        y = ffn_tp_reference(x2, self.w1, self.b1, self.w2, self.b2, self.act1, self.act2,
                             self.group, self.world_size, self.rank)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, hidden={self.hidden_features} ({self.local_hidden} on "
                f"rank {self.rank} of {self.world_size}), out={self.out_features}, "
                f"act1={self.act1}, act2={self.act2}, {self._backend_repr()}")


class ShardedExperts(_FusedBackend, torch.nn.Module):
    """E experts, each split over all G ranks of ``group`` (tensor-parallel experts).

    Expert e: ``y = act(x W_in[e] + b_in[e]) W_out[e] + b_out[e]`` with ``W_in [E, P, O]``,
    ``W_out [E, O, N]``; rank g holds ``w_in [E, P, O/G]`` (columns g O/G..), ``w_out [E, O/G, N]``
    (matching rows), the b_in slice and the full b_out. ``forward(x, rows_per_expert)``: x
    ``[R, P]`` with expert e's rows contiguous, expert-major (``rows_per_expert`` a list of E ints
    or an int tensor, sum <= R; rows past the sum are zero in the output) -> ``[R, N]``,
    identical on every rank. The fused options are FusedFFN's (``compute_options`` without
    ``cluster_m``: the grouped call keeps one expert per m-tile). ``compute="chained"``: the
    chained kernel's grouped call (``ChainedFFNCompute.grouped``: one expert per 128-row block)
    into the bf16 all-reduce, which adds b_out of each block's expert (``b2_per_band``: the
    layer gathers ``b_out[expert of block]`` before the launches); needs (O/G) % 256 == 0 and
    N % 256 == 0.

    Autograd: as ``FusedFFN``. ``backend="reference"`` gives every rank the full ``x.grad`` and
    ``b_out.grad`` and the gradient of its ``w_in`` / ``b_in`` / ``w_out`` slices (zero for an
    expert without rows; rows past the experts' rows get zero gradient), assuming the same dY on
    every rank; ``backend="fused"`` refuses a forward that autograd would record.
    """
    _grouped_compute = True  # FusedFFNCompute.grouped / ChainedFFNCompute.grouped
    _block_b2_buf = None  # chained with b_out: the per-block b2 rows (grow, reused per call)

    def __init__(self, num_experts: int, in_features: int, hidden_features: int,
                 out_features: int | None = None, *, activation: str = "silu", bias: bool = False,
                 group=None, dtype: torch.dtype = torch.bfloat16, device=None,
                 backend: str = "reference", comm: str | None = None, ccta: int | None = None,
                 max_tokens: int | None = None, tile_m: int | None = None,
                 compute_options: dict | None = None, allreduce_band_rows: int | None = None,
                 error_check: str | None = None, options: FFNOptions | None = None,
                 compute: str | None = None, symmetric: str | None = None):
        super().__init__()
        E = _pos_int("num_experts", num_experts)
        self.activation = check_activation(activation, allow_none=False, what="activation")
        P, O, N, self.comm, rank, G, device = _check_layer(
            in_features, hidden_features, out_features, bias, dtype, backend, comm, group, device,
            "the world size")
        # "auto" decided once, here (before the parameters: their requires_grad follows it)
        backend = self._decide_backend(
            backend, P, O, N, G, dtype, device, options, comm=comm, ccta=ccta,
            max_tokens=max_tokens, tile_m=tile_m, compute_options=compute_options,
            allreduce_band_rows=allreduce_band_rows, error_check=error_check, compute=compute,
            symmetric=symmetric)
        self.num_experts, self.in_features, self.hidden_features = E, P, O
        self.out_features, self.local_hidden = N, O // G
        self.group, self.rank, self.world_size, self.backend = group, rank, G, backend
        kw = dict(dtype=dtype, device=device)
        grad = dict(requires_grad=backend == "reference")  # fused: inference-only parameters
        self.w_in = torch.nn.Parameter(torch.zeros(E, P, O // G, **kw), **grad)
        self.w_out = torch.nn.Parameter(torch.zeros(E, O // G, N, **kw), **grad)
        self.b_in = torch.nn.Parameter(torch.zeros(E, O // G, **kw), **grad) if bias else None
        self.b_out = torch.nn.Parameter(torch.zeros(E, N, **kw), **grad) if bias else None
        self._init_backend(backend, device, options, comm, ccta, max_tokens, tile_m,
                           compute_options, allreduce_band_rows, error_check, compute,
                           requested=self.requested_backend, symmetric=symmetric)

    # ---- fused backend hooks (_FusedBackend) -------------------------------------------------
    @property
    def _fused_device(self):
        return self.w_in.device

    @property
    def _fused_act2(self):
        return "none"

    def _fused_b2(self):
        return None  # b_out differs per expert: it seeds the accumulator instead (forward)

    def _fused_b1_param(self):
        return self.b_in

    @property
    def _fused_act1(self):
        return self.activation

    @property
    def _b2_per_band(self):
        return self.b_out is not None  # chained: b_out[expert] per row block, in the all-reduce

    def _run_compute(self, x, acc, ready, epoch, mte, stream, ccta=None, b1=None, h_ring=None):
        b1 = self._b1_for_compute() if b1 is None else b1
        ccta = self.ccta if ccta is None else ccta
        if self._chained:  # acc: the bf16 partial [M, N] the kernel stores (its out)
            self._compute.grouped(x, self.w_in.detach(), b1, self.w_out.detach(), acc, ready,
                                  epoch, mte, ccta=ccta, act1=self.activation, stream=stream,
                                  h_ring=h_ring)
            return
        self._compute.grouped(x, self.w_in.detach(), b1, self.w_out.detach(), acc, ready, epoch,
                              mte, ccta=ccta, act1=self.activation, stream=stream)

    def _block_b2(self, mte):
        """compute="chained" with b_out: b_out of each row block's expert, bf16 [blocks, N]
        (the all-reduce's ``b2_per_band`` b2), gathered on the current stream into a buffer
        that grows and is reused (the previous call's all-reduce, which read it, is joined
        into this stream before the call returns)."""
        n = mte.numel()
        buf = self._block_b2_buf
        if buf is None or buf.shape[0] < n:
            buf = torch.empty(max(n, 2 * (0 if buf is None else buf.shape[0])),
                              self.out_features, dtype=torch.bfloat16, device=mte.device)
            self._block_b2_buf = buf
        torch.index_select(self.b_out.detach(), 0, mte, out=buf[:n])
        return buf[:n]

    def _forward_fused(self, x, rows):
        """Experts' row groups padded to tile_m (an m-tile, hence a band, belongs to one
        expert), one grouped compute launch || one band all-reduce, then the valid rows."""
        tm, dev = self.tile_m, x.device
        total = sum(rows)
        out = torch.zeros(x.shape[0], self.out_features, dtype=x.dtype, device=dev)
        if total == 0:
            return out
        dst_t, mte, row_e_t, R_pad = padded_expert_layout(rows, tm, dev)
        x_pad = torch.zeros(R_pad, self.in_features, dtype=x.dtype, device=dev)
        x_pad.index_copy_(0, dst_t, x[:total])
        if self._chained:  # b_out[e] per row block, added once by the bf16 all-reduce
            b2 = self._block_b2(mte) if self.b_out is not None else None
            y_pad = self._fused_call(x_pad, mte, b2=b2)
            out[:total] = y_pad.index_select(0, dst_t)
            return out
        seed_acc = None
        if self.b_out is not None and self.rank == 0:  # b_out[e] added once, to the sum
            b_out32 = self.b_out.detach().float()

            def _seed(acc):
                torch.index_select(b_out32, 0, row_e_t, out=acc)
            seed_acc = _seed
        y_pad = self._fused_call(x_pad, mte, seed_acc)
        out[:total] = y_pad.index_select(0, dst_t)
        return out

    def local_slice(self) -> slice:
        o = self.local_hidden
        return slice(self.rank * o, (self.rank + 1) * o)

    @torch.no_grad()
    def load_full_weights(self, W_in, W_out, b_in=None, b_out=None):
        E, P, O, N = self.num_experts, self.in_features, self.hidden_features, self.out_features
        _check_tensor("W_in", W_in, (E, P, O), None, None)
        _check_tensor("W_out", W_out, (E, O, N), None, None)
        if self.b_in is not None:
            _check_tensor("b_in", b_in, (E, O), None, None)
            _check_tensor("b_out", b_out, (E, N), None, None)
        elif b_in is not None or b_out is not None:
            raise ValueError("this module was built with bias=False; pass b_in=b_out=None")
        s = self.local_slice()
        self.w_in.copy_(W_in[:, :, s])
        self.w_out.copy_(W_out[:, s, :])
        if self.b_in is not None:
            self.b_in.copy_(b_in[:, s])
            self.b_out.copy_(b_out)
        return self

    @classmethod
    def from_full_weights(cls, W_in, W_out, b_in=None, b_out=None, group=None, *,
                          activation: str = "silu", backend: str = "reference",
                          comm: str | None = None, dtype: torch.dtype | None = None,
                          device=None, **fused_kw):
        """Unsplit expert weights ``W_in [E, P, O]``, ``W_out [E, O, N]`` (biases ``[E, O]`` /
        ``[E, N]``, both or neither), the same on every rank; keeps this rank's slices."""
        if not isinstance(W_in, torch.Tensor) or W_in.dim() != 3:
            raise TypeError("W_in must be a 3-D tensor [E, P, O]")
        if not isinstance(W_out, torch.Tensor) or W_out.dim() != 3:
            raise TypeError("W_out must be a 3-D tensor [E, O, N]")
        if (b_in is None) != (b_out is None):
            raise ValueError("pass both biases b_in and b_out, or neither")
        E, P, O = W_in.shape
        if W_out.shape[0] != E or W_out.shape[1] != O:
            raise ValueError(f"W_out has shape {tuple(W_out.shape)}, expected [{E}, {O}, N]")
        mod = cls(E, P, O, W_out.shape[2], activation=activation, bias=b_in is not None,
                  group=group, dtype=dtype or W_in.dtype,
                  device=device if device is not None else W_in.device, backend=backend,
                  comm=comm, **fused_kw)
        return mod.load_full_weights(W_in, W_out, b_in, b_out)

    def check_input(self, x, rows_per_expert) -> list[int]:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be [rows, {self.in_features}], got {tuple(x.shape)}")
        if x.dtype != self.w_in.dtype:
            raise TypeError(f"x has dtype {x.dtype}, the module computes in {self.w_in.dtype}")
        if x.device != self.w_in.device:
            raise ValueError(f"x is on {x.device}, the module's weights are on {self.w_in.device}")
        if isinstance(rows_per_expert, torch.Tensor):
            if rows_per_expert.dim() != 1 or rows_per_expert.is_floating_point():
                raise TypeError("rows_per_expert must be a 1-D integer tensor or a list of ints")
            rows = [int(v) for v in rows_per_expert.tolist()]  # host sync
        else:
            try:
                rows = list(rows_per_expert)
            except TypeError:
                raise TypeError("rows_per_expert must be a list of ints or a 1-D int tensor")
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in rows):
                raise TypeError("rows_per_expert must hold ints")
        if len(rows) != self.num_experts:
            raise ValueError(f"rows_per_expert has {len(rows)} entries, expected num_experts="
                             f"{self.num_experts}")
        if any(v < 0 for v in rows):
            raise ValueError(f"rows_per_expert has negative counts: {rows}")
        if sum(rows) > x.shape[0]:
            raise ValueError(f"rows_per_expert sums to {sum(rows)} but x has only "
                             f"{x.shape[0]} rows")
        return rows

    def forward(self, x: torch.Tensor, rows_per_expert) -> torch.Tensor:
        rows = self.check_input(x, rows_per_expert)
        if self.backend == "fused":
            check_fused_inference("ShardedExperts", dict(x=x, w_in=self.w_in, b_in=self.b_in,
                                                         w_out=self.w_out, b_out=self.b_out))
            return self._forward_fused(x.detach(), rows)
        return experts_tp_reference(x, rows, self.w_in, self.w_out, self.b_in, self.b_out,
                                    self.activation, self.group, self.world_size, self.rank)

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, in={self.in_features}, hidden="
                f"{self.hidden_features} ({self.local_hidden} on rank {self.rank} of "
                f"{self.world_size}), out={self.out_features}, activation={self.activation}, "
                f"{self._backend_repr()}")
