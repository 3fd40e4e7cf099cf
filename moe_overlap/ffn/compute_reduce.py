"""Fused FFN compute blocks (issue 5): ``acc += act1(X W1_g + b1_g) W2_g`` with band ready flags.

This is the compute half of ``FusedFFN(backend="fused")`` and ``ShardedExperts(backend="fused")``
(the same kernel over several experts: weights ``[E, ...]``, one expert per m-tile named by a
device table, see ``FusedFFNCompute.grouped``); the communication half is
``moe_overlap.ffn.band_allreduce.BandAllReduce`` (``producer=True``), running concurrently on its own
``ccta`` SMs and waiting on the flags written here.

Per GPU g (tensors all CUDA, row-major, no host synchronization in the call path)::

    x     [M, P]    bf16          (the same on every rank)
    w1    [P, O_g]  bf16          (this rank's column slice of W1; O_g contiguous)
    b1    [O_g]     bf16 or None
    w2    [O_g, N]  bf16          (this rank's row slice of W2; N contiguous)
    acc   [M, N]    fp32          (BandAllReduce.acc[:M]; zero on entry, the previous call's
                                   all-reduce zeroed it)
    band_ready [>= ceil(M / band_rows)] int32   (BandAllReduce.band_ready)
    epoch      [1] int32          (BandAllReduce.epoch, advanced in stream order before the call)

    acc[m, n] += sum_j act1(x[m] @ w1[:, j] + b1[j]) @ w2[j, n]      (fp32, TMA reduce-add)
    band_ready[b] = epoch          (st.release.gpu) once every contribution to rows
                                   [b * band_rows, (b + 1) * band_rows) of acc is complete

This module is the host side, importable without CuTe DSL (option and argument checks, the
shared-memory plan, compile cache, launch, the torch reference). The device kernel is
``ffn.compute_reduce_sm90.FusedFFNKernel``, a subclass of the shared Hopper base
``kernels.gemm_sm90.GemmSm90`` (persistent CTAs, one TMA producer warp, WGMMA consumer
warpgroups, TMA-store epilogue through a ``PipelineTmaStore``):

* work unit = (m-tile of ``tile_m`` rows, j-tile of ``tile_o`` hidden columns), linear index
  u = m_tile * J + j (J = O_g / tile_o): m-major, so the J contributions of one band run at the
  same time on J CTAs and bands complete (and are published) in order; CTA i takes
  u = i, i + G, ... with G = SMs - ccta (a launch argument).
* One TMA/mbarrier ring of stages feeds both GEMMs, consumed in the order it is filled: per unit,
  P / tile_k GEMM1 stages (X tile + W1 tile), then two W2 chunk stages per n-tile (a W2 chunk,
  tile_n x tile_o / 2, lives in the W1 tile's buffer: same size). One ring gives each GEMM every
  stage and streams the next GEMM's operands while the current one finishes (``_ring_plan``:
  tile_o 256 -> 4 x 48 KiB stages + 32 KiB epilogue buffers; 3 stages + 64 KiB H + 16 KiB
  with h_pair).
* GEMM1: the unit's whole tile_m x tile_o H tile at once (64 x tile_o WGMMA accumulator per
  warpgroup, X read once per unit); the accumulator starts at b1 (fp32), so the bias costs
  nothing; act1 in registers; converted to bf16 in place into GEMM2's A fragment (the m64
  accumulator fragment is the m64k16 A fragment element for element, as in FlashAttention-3's
  P.V); with h_pair the unit's first H tile is written to shared memory (``sH``, K-major
  swizzled) with stmatrix + ``fence.proxy.async.shared::cta``. H never goes to HBM.
* GEMM2: for each n-tile (rotated start n = j mod N/tile_n, so the J CTAs of a band do not
  reduce into the same columns at once): acc_tile = H @ W2[j, n] with K = tile_o (A from
  registers, h_pair's second tile from sH; B = the W2 chunks from the ring), then the fp32
  tile is added into acc in ``tile_m x epi_n`` sub-tiles through ``epi_stages`` shared-memory
  buffers with TMA reduce-add (``cp.reduce.async.bulk.tensor...add``).
* Counting: the unit (m, j) is complete once its N/tile_n reductions have completed; the
  epilogue warp (the one that issued them) counts it on ``band_counter[b]`` and the last of the
  band's J * (m-tiles in band) contributions publishes ``band_ready[b] = epoch``. The count is
  posted (deferred, as in grouped_gemm) in the middle of the next unit's GEMM1 k-loop, when the
  reductions are long finished. See ``FusedFFNKernel._count_unit`` for the memory ordering.

* ``cluster_m=2`` (option, dense call only): clusters of two CTAs on units (2p, j), (2p + 1, j)
  load half of every W1 tile and W2 chunk each and multicast it to both.

Without GEMM2's fp32 reductions both GEMMs run at cuBLAS speed, so the reduce epilogue is the
limit (its throughput depends on the sub-tile row width and buffering). Timings of the variants,
and of those tried and dropped: bench/NOTES.md.
Limits: tile_n = 128 only; one consumer warpgroup per 64 rows of tile_m (tile_m 64 or 128).
The pipeline mbarrier waits are the usual unbounded ones (TMA completion); the kernel never waits
on the communication blocks (one-way dependency). With ``cluster_m=2`` the ring's waits have the
other CTA of the cluster on their far side (its TMA warp fills half of every stage, its consumers
free each stage in both CTAs) and stay unbounded, because nothing can make the two CTAs diverge:
the kernel has no bounded wait that could give up (no error word, no timeout), and both CTAs of
a cluster walk the same static units (cluster c takes u = c, c + C, ...; k and n counts from the
shapes; the CTA past M of an odd m-tile count runs them too), so every stage one waits for the
other fills and frees. Bounding them as the chained kernel does (``ring_wait``) would need an
error word and a timeout in the launch, a kernel signature of its own for cluster_m=2 (else the
default PTX changes) and a ``check()``; its W2 chunk stages, armed by hand with their own byte
count, would take the bounded acquire with that count.
"""

import torch

from ..kernels.host_checks import chained_gemm_dims, check_tensors
from ..runtime.device import num_sms

__all__ = ["FusedFFNCompute", "fused_ffn_compute_reference", "ACTIVATIONS"]

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")
_SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic shared memory per CTA on sm_90


# --------------------------------------------------------------------------------------------
# Plain torch reference (the truth the tests use)
# --------------------------------------------------------------------------------------------
def fused_ffn_compute_reference(x, w1, b1, w2, act1: str, acc=None):
    """fp32 ``act1(x @ w1 + b1) @ w2`` with H rounded to bf16 like the kernel (inputs any float
    dtype, any device); added into ``acc`` when given (returned), else returned as a new tensor."""
    from .activations import activation
    if act1 not in ACTIVATIONS:
        raise ValueError(f"act1={act1!r}: choose from {ACTIVATIONS}")
    h = x.float() @ w1.float()
    if b1 is not None:
        h = h + b1.float()
    h = activation(h, act1).to(torch.bfloat16).float()
    y = h @ w2.float()
    if acc is None:
        return y
    acc += y
    return acc


def _ring_plan(tile_m, tile_o, tile_n, tile_k, stages, epi_n, epi_stages, h_pair=False):
    """Shared-memory plan of the kernel: returns (ring stages, epi_n).

    Per CTA: the ring (stage = X tile tile_m x tile_k + one W1 tile tile_o x tile_k, or one W2
    chunk tile_n x tile_o / 2 in the W1 tile's place: the same size when tile_n = 2 tile_k), the
    H tile in shared memory (tile_m x tile_o bf16, h_pair only; else a 1 KiB-aligned stub) and
    the fp32 epilogue buffers (tile_m x epi_n x epi_stages), plus 1 KiB for the mbarriers and
    alignment. stages None: as many as fit; epi_n None: 32 unless that leaves fewer than 3
    stages, then 16 (tile_o 256: 4 stages + 32 KiB of 128-byte-row epilogue buffers; with
    h_pair 3 x 48 KiB stages + 64 KiB H + 16 KiB epilogue = 225 KiB of 227)."""
    x_bytes, b_bytes = tile_m * tile_k * 2, tile_o * tile_k * 2
    if tile_n * (tile_o // 2) * 2 != b_bytes:
        raise ValueError(f"tile_n={tile_n} must be 2 * tile_k = {2 * tile_k} (a W2 chunk fills "
                         f"a W1 stage buffer)")
    h_bytes = tile_m * tile_o * 2 if h_pair else 1024

    def fit(n):
        epi = tile_m * n * 4 * epi_stages
        return (_SMEM_CAPACITY_SM90 - 1024 - h_bytes - epi) // (x_bytes + b_bytes)

    if epi_n is None:
        epi_n = 32 if fit(32) >= 3 else 16
    max_stages = fit(epi_n)
    stages = max_stages if stages is None else stages
    if stages < 2 or stages > max_stages:
        raise ValueError(f"stages={stages} does not fit in shared memory (2..{max_stages} with "
                         f"tile_m={tile_m}, tile_o={tile_o}, epi_n={epi_n}, "
                         f"epi_stages={epi_stages})")
    return stages, epi_n


# --------------------------------------------------------------------------------------------
# Host wrapper (the device kernel: ffn/compute_reduce_sm90.py, imported when compiling)
# --------------------------------------------------------------------------------------------
class FusedFFNCompute:
    """Compute blocks of the fused TP FFN (see the module docstring).

    FusedFFNCompute(tile_m=128, tile_o=256, tile_n=128, band_rows=None, stages=None,
                    epi_n=None, epi_stages=2, signal_k_tile=None, cluster_m=1, h_pair=False)
        tile_m in {64, 128} (one consumer warpgroup per 64 rows); tile_o in {128, 256} (hidden
        columns per unit: GEMM1's N, GEMM2's K; 256 halves the fp32 reduce-add traffic, 128
        serves O_g that 256 does not divide); tile_n = 128; band_rows: rows per ready flag, a
        multiple of tile_m (None: tile_m); must equal the BandAllReduce's band_rows; stages:
        depth of the operand ring (None: as many as fit, see _ring_plan); epi_n (fp32 columns
        per reduce sub-tile; None: 32, or 16 where 32 would leave fewer than 3 stages) and
        epi_stages (sub-tile buffers); signal_k_tile: GEMM1 k iteration of the next unit at
        which the previous unit is counted (None: the middle, < 0: the last); cluster_m: 2 =
        clusters of two CTAs on adjacent m-tiles sharing every W1 tile and W2 chunk by TMA
        multicast (dense __call__ only; the grid is rounded down to even). H of a unit stays in
        registers as GEMM2's A operand (WGMMA RS). h_pair (O_g / tile_o even): a unit covers
        two hidden tiles of one m-tile, one H in registers and one in shared memory, and GEMM2
        reduces over both before each fp32 reduce-add (half the reduce-add bytes; 3 ring
        stages); off here, on in FusedFFN / ShardedExperts wherever O_g / tile_o is even.
    All option checks are ``FusedFFNCompute.check_options`` (a static function, no CuTe DSL).

    __call__(x, w1, b1, w2, acc, band_ready, epoch, ccta=0, act1="gelu", stream=None) -> acc
        x [M, P] bf16, w1 [P, O_g] bf16, b1 [O_g] (any float dtype) or None, w2 [O_g, N] bf16,
        acc [M, N] fp32 (contiguous rows; zero on entry unless you want the sum added),
        band_ready int32 [>= ceil(M / band_rows)], epoch int32 [1] (read on the device);
        P % 64 == 0, O_g % tile_o == 0, N % tile_n == 0; any M >= 1 (the TMA clips the ragged
        last m-tile). ccta: SMs left to the communication blocks (grid = SMs - ccta, capped at
        the number of units). Never synchronizes. All checks raise before any launch.
    grouped(x, w1 [E, P, O_g], b1 [E, O_g] | None, w2 [E, O_g, N], acc, band_ready, epoch,
            m_tile_expert, ...): the same kernel over several experts (expert groups padded to
        tile_m rows; m_tile_expert names each m-tile's expert). The dense call is the E = 1 case.
    Compile cache key: (kernel class, tiles, stages, act1, P, O_g, N); M, E, the flag capacity
    and the m-tile table are runtime values.
    """

    _compiled = {}

    @staticmethod
    def check_options(tile_m=128, tile_o=256, tile_n=128, band_rows=None, stages=None,
                      epi_n=None, epi_stages=2, signal_k_tile=None, cluster_m=1, h_pair=False):
        """ValueError for any option value the kernel does not implement, including a
        shared-memory plan that does not fit (CPU only, no CuTe DSL); returns the plan's
        (stages, epi_n). The keywords are the constructor's."""
        if tile_m not in (64, 128):
            raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
        if tile_o not in (128, 256):
            raise ValueError(f"tile_o must be 128 or 256, got {tile_o}")
        if tile_n != 128:
            raise ValueError(f"tile_n must be 128 in this version, got {tile_n}")
        band_rows = tile_m if band_rows is None else band_rows
        if isinstance(band_rows, bool) or not isinstance(band_rows, int) or band_rows < 1 \
                or band_rows % tile_m:
            raise ValueError(f"band_rows={band_rows!r} must be a positive multiple of "
                             f"tile_m={tile_m}")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)
                                   or stages < 2):
            raise ValueError(f"stages must be None or an int >= 2, got {stages!r}")
        if epi_n not in (None, 16, 32):
            raise ValueError(f"epi_n must be None, 16 or 32, got {epi_n}")
        if not isinstance(epi_stages, int) or epi_stages < 1:
            raise ValueError(f"epi_stages must be an int >= 1, got {epi_stages!r}")
        if cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {cluster_m!r}")
        return _ring_plan(tile_m, tile_o, tile_n, 64, stages, epi_n, epi_stages, bool(h_pair))

    def __init__(self, tile_m=128, tile_o=256, tile_n=128, band_rows=None, stages=None,
                 epi_n=None, epi_stages=2, signal_k_tile=None, cluster_m=1, h_pair=False):
        # shared-memory plan (raises if it does not fit): ring depth and epilogue sub-tile
        self.stages, self.epi_n = FusedFFNCompute.check_options(
            tile_m, tile_o, tile_n, band_rows, stages, epi_n, epi_stages, signal_k_tile,
            cluster_m, h_pair)
        self.tile_m, self.tile_o, self.tile_n, self.tile_k = tile_m, tile_o, tile_n, 64
        self.band_rows = tile_m if band_rows is None else band_rows
        self.h_pair = bool(h_pair)
        self.epi_stages = epi_stages
        self.signal_k_tile = None if signal_k_tile is None else int(signal_k_tile)
        self.cluster_m = int(cluster_m)
        self._counters = {}
        self._b1_zero = {}

    # ---------------------------------------------------------------- validation
    def check(self, x, w1, b1, w2, acc, band_ready, epoch, ccta=0, act1="gelu",
              need_cuda=True):
        """All argument checks (TypeError / ValueError); returns (M, P, O_g, N)."""
        if act1 not in ACTIVATIONS:
            raise ValueError(f"act1={act1!r}: choose from {ACTIVATIONS}")
        tensors = dict(x=x, w1=w1, w2=w2, acc=acc, band_ready=band_ready, epoch=epoch)
        if b1 is not None:
            tensors["b1"] = b1
        check_tensors(tensors, x, need_cuda)
        for name in ("x", "w1", "w2", "acc"):
            if tensors[name].data_ptr() % 16:
                raise ValueError(f"{name} must be 16-byte aligned (TMA)")
        for name in ("x", "w1", "w2"):
            if tensors[name].dtype != torch.bfloat16:
                raise TypeError(f"{name} must be bfloat16, got {tensors[name].dtype}")
        if acc.dtype != torch.float32:
            raise TypeError(f"acc must be float32, got {acc.dtype}")
        if b1 is not None and not b1.is_floating_point():
            raise TypeError(f"b1 must be floating point, got {b1.dtype}")
        for name in ("band_ready", "epoch"):
            if tensors[name].dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {tensors[name].dtype}")
        M, P, O, N = chained_gemm_dims(x, w1, w2)
        if acc.dim() != 2:
            raise ValueError(f"expected acc [M, N], got {tuple(acc.shape)}")
        if b1 is not None and (b1.dim() != 1 or b1.numel() != O):
            raise ValueError(f"b1 must be [{O}], got {tuple(b1.shape)}")
        if tuple(acc.shape) != (M, N):
            raise ValueError(f"acc must be [{M}, {N}], got {tuple(acc.shape)}")
        if P % self.tile_k:
            raise ValueError(f"P={P} must be a multiple of tile_k={self.tile_k}")
        if O % self.tile_o:
            raise ValueError(f"O_g={O} must be a multiple of tile_o={self.tile_o}")
        if self.h_pair and O % (2 * self.tile_o):
            raise ValueError(f"h_pair: O_g={O} must be a multiple of 2 * tile_o = "
                             f"{2 * self.tile_o}")
        if N % self.tile_n:
            raise ValueError(f"N={N} must be a multiple of tile_n={self.tile_n}")
        nb = -(-M // self.band_rows)
        if band_ready.dim() != 1 or band_ready.numel() < nb:
            raise ValueError(f"band_ready must be 1-D with >= ceil(M / band_rows) = {nb} "
                             f"entries, got {tuple(band_ready.shape)}")
        if epoch.numel() != 1:
            raise ValueError("epoch must have exactly one element")
        if isinstance(ccta, bool) or not isinstance(ccta, int) or ccta < 0:
            raise ValueError(f"ccta must be a non-negative int, got {ccta!r}")
        return M, P, O, N

    # ---------------------------------------------------------------- compilation
    def _kernel_class(self):
        """The device kernel class (a benchmark's subclass may return a FusedFFNKernel
        subclass, e.g. with its timing-split attributes set)."""
        from .compute_reduce_sm90 import FusedFFNKernel
        return FusedFFNKernel

    def _key(self, P, O, N, act1):
        return (self._kernel_class(), self.tile_m, self.tile_o, self.tile_n, self.stages,
                self.epi_n, self.epi_stages, self.signal_k_tile, act1, self.cluster_m,
                self.h_pair, int(P), int(O), int(N))

    def _kernel(self, act1):
        return self._kernel_class()(self.tile_m, self.tile_o, self.tile_n, self.tile_k, act1,
                                    self.stages, self.epi_n, self.epi_stages,
                                    self.signal_k_tile, self.cluster_m, self.h_pair)

    def compile(self, P, O, N, act1="gelu", keep_ptx=False):
        """Compiles from symbolic tensors (M and the flag capacity are runtime values); needs no
        GPU with CUTE_DSL_ARCH=sm_90a (compile-only tests). keep_ptx: keep ``fn.__ptx__`` (text)
        and ``fn.__cubin__``."""
        if act1 not in ACTIVATIONS:
            raise ValueError(f"act1={act1!r}: choose from {ACTIVATIONS}")
        key = ("fake", bool(keep_ptx)) + self._key(P, O, N, act1)
        fn = FusedFFNCompute._compiled.get(key)
        if fn is not None:
            return fn
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor
        from cutlass.runtime import make_fake_stream
        M, nb, E, mt = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
        bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        fx = make_fake_tensor(bf16, (M, P), (P, 1), assumed_align=16)
        fw1 = make_fake_tensor(bf16, (O, P, E), (1, O, P * O), assumed_align=16)
        fb1 = make_fake_tensor(f32, (E, O), (O, 1), assumed_align=16)
        fw2 = make_fake_tensor(bf16, (N, O, E), (1, N, O * N), assumed_align=16)
        facc = make_fake_tensor(f32, (M, N), (N, 1), assumed_align=16)
        fr = make_fake_tensor(i32, (nb,), (1,), assumed_align=4)
        fc = make_fake_tensor(i32, (nb,), (1,), assumed_align=4)
        fe = make_fake_tensor(i32, (1,), (1,), assumed_align=4)
        fm = make_fake_tensor(i32, (mt,), (1,), assumed_align=4)
        args = (fx, fw1, fb1, fw2, facc, fr, fc, fe, fm, cutlass.Int32(1), cutlass.Int32(1),
                make_fake_stream())
        if keep_ptx:  # PTX and cubin in memory (fn.__ptx__, fn.__cubin__); dumps to a tmp dir
            from ..kernels.compile import compile_keep
            fn = compile_keep(self._kernel(act1), *args)
        else:
            fn = cute.compile(self._kernel(act1), *args)
        FusedFFNCompute._compiled[key] = fn
        return fn

    # ---------------------------------------------------------------- launch
    @staticmethod
    def _cute_args(x, w1, b1f, w2, acc, band_ready, counter, epoch, mte):
        """torch -> cute tensors (w1 [E, P, O_g], b1f [E, O_g] fp32, w2 [E, O_g, N]); M, E, the
        flag capacity and the m-tile table length are marked dynamic."""
        from cutlass.cute.runtime import from_dlpack

        def dyn(t, mode, align):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(
                mode=mode, stride_order=t.dim_order())

        w1t = w1.permute(2, 1, 0)  # (O_g, P, E) view, strides (1, O_g, P O_g): MN-major B
        w2t = w2.permute(2, 1, 0)  # (N, O_g, E) view, strides (1, N, O_g N): MN-major B
        return (dyn(x, 0, 16), dyn(w1t, 2, 16), dyn(b1f, 0, 16), dyn(w2t, 2, 16),
                dyn(acc, 0, 16), dyn(band_ready, 0, 4), dyn(counter, 0, 4),
                from_dlpack(epoch, assumed_align=4), dyn(mte, 0, 4))

    def counter_for(self, band_ready):
        """The persistent zero scratch counter that goes with band_ready (same length)."""
        key = (band_ready.device, band_ready.data_ptr(), band_ready.numel())
        c = self._counters.get(key)
        if c is None:
            c = torch.zeros(band_ready.numel(), dtype=torch.int32, device=band_ready.device)
            self._counters[key] = c
        return c

    def grid(self, M, O, device, ccta):
        cl = self.cluster_m
        units = -(-(-(-M // self.tile_m)) // cl) * cl * (O // self.tile_o // (1 + self.h_pair))
        g = min(num_sms(device) - ccta, units)
        g -= g % cl  # whole clusters
        if g < 1:
            raise ValueError(f"ccta={ccta} leaves no SM (no whole cluster of {cl}) for the "
                             f"compute blocks")
        return g

    def __call__(self, x, w1, b1, w2, acc, band_ready, epoch, ccta=0, act1="gelu",
                 stream=None):
        M, P, O, N = self.check(x, w1, b1, w2, acc, band_ready, epoch, ccta, act1)
        dev = x.device
        torch_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        mt = -(-M // self.tile_m)
        with torch.cuda.stream(torch_stream):
            b1f = self._b1_rows(b1, 1, O, dev)
        # the dense layer is the grouped kernel with one expert: every m-tile reads expert 0
        zk = ("mte", dev)
        mte = self._b1_zero.get(zk)
        if mte is None or mte.numel() < mt:
            mte = torch.zeros(max(mt, 1024), dtype=torch.int32, device=dev)
            self._b1_zero[zk] = mte
        return self._launch(x, w1.unsqueeze(0), b1f, w2.unsqueeze(0), acc, band_ready, epoch,
                            mte, ccta, act1, torch_stream, M, P, O, N)

    def grouped(self, x, w1, b1, w2, acc, band_ready, epoch, m_tile_expert, ccta=0,
                act1="gelu", stream=None):
        """One launch over several experts (``ShardedExperts``): x [M, P] holds the experts'
        rows with every expert's group padded to a multiple of tile_m (so an m-tile, and a
        band, belongs to one expert); w1 [E, P, O_g], b1 [E, O_g] or None, w2 [E, O_g, N];
        m_tile_expert int32 [>= ceil(M / tile_m)]: the expert of each m-tile, in [0, E) (device
        values: the caller guarantees the range; see ShardedExperts). Otherwise as __call__."""
        if self.cluster_m > 1:  # the pair of m-tiles of a cluster must share one expert
            raise ValueError("cluster_m=2 supports the dense call only, not grouped()")
        for name, t, d in (("w1", w1, 3), ("w2", w2, 3)):
            if not isinstance(t, torch.Tensor) or t.dim() != d:
                raise ValueError(f"{name} must be a {d}-D tensor [E, ...]")
        E = w1.shape[0]
        if E < 1 or w2.shape[0] != E:
            raise ValueError(f"w1 has {E} experts, w2 {w2.shape[0]}")
        if b1 is not None and (not isinstance(b1, torch.Tensor) or b1.dim() != 2
                               or b1.shape[0] != E):
            raise ValueError(f"b1 must be [E={E}, O_g]")
        M, P, O, N = self.check(x, w1[0], None if b1 is None else b1[0], w2[0], acc, band_ready,
                                epoch, ccta, act1)
        for name, t in (("w1", w1), ("w2", w2)):
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        mt = -(-M // self.tile_m)
        if not isinstance(m_tile_expert, torch.Tensor) or m_tile_expert.dtype != torch.int32 \
                or m_tile_expert.dim() != 1 or m_tile_expert.numel() < mt \
                or m_tile_expert.device != x.device:
            raise ValueError(f"m_tile_expert must be an int32 vector of >= {mt} entries on "
                             f"{x.device}")
        dev = x.device
        torch_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        with torch.cuda.stream(torch_stream):
            b1f = self._b1_rows(b1, E, O, dev)
        return self._launch(x, w1, b1f, w2, acc, band_ready, epoch, m_tile_expert, ccta, act1,
                            torch_stream, M, P, O, N)

    def _b1_rows(self, b1, E, O, dev):
        """b1 as a 16-byte aligned fp32 [E, O] (zeros, cached, when None)."""
        if b1 is None:
            zk = (dev, E, O)
            if zk not in self._b1_zero:
                self._b1_zero[zk] = torch.zeros(E, O, dtype=torch.float32, device=dev)
            return self._b1_zero[zk]
        b1f = b1.reshape(E, O)
        b1f = b1f if b1f.dtype == torch.float32 else b1f.float()
        if b1f.data_ptr() % 16 or not b1f.is_contiguous():
            b1f = b1f.contiguous().clone()
        return b1f

    def _launch(self, x, w1, b1f, w2, acc, band_ready, epoch, mte, ccta, act1, torch_stream,
                M, P, O, N):
        grid = self.grid(M, O, x.device, ccta)
        counter = self.counter_for(band_ready)
        import cutlass
        import cutlass.cute as cute
        import cuda.bindings.driver as cuda_drv
        cu_stream = cuda_drv.CUstream(torch_stream.cuda_stream)
        args = self._cute_args(x, w1, b1f, w2, acc, band_ready, counter, epoch, mte)
        mt = cutlass.Int32(self.band_rows // self.tile_m)
        key = ("dlpack",) + self._key(P, O, N, act1)
        fn = FusedFFNCompute._compiled.get(key)
        if fn is None:
            fn = cute.compile(self._kernel(act1), *args, mt, cutlass.Int32(grid), cu_stream)
            FusedFFNCompute._compiled[key] = fn
        # b1f (if converted) was allocated on torch_stream: freeing it after the launch is safe
        fn(*args, mt, cutlass.Int32(grid), cu_stream)
        return acc
