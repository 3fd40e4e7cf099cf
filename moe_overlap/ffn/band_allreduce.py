"""All-reduce of finished row bands across the TP group: the communication blocks of the fused FFN.

Three operations, two backends (``BACKENDS``):

============  =====================================================  ==============================
operation     ``switch`` (NVLink multicast address, NVLS)            ``unicast`` (peer addresses)
============  =====================================================  ==============================
load-reduce   ``multimem.ld_reduce.relaxed.sys.global.add.v4.f32``   G x ``ld.relaxed.sys.v4.f32``
              (SASS ``LDGMC.E.ADD.F32x4.RN.STRONG.SYS``; the bf16    from every peer's buffer,
              form ``...add.acc::f32.v4.bf16x2`` is                  summed in fp32
              ``LDGMC.E.F32ADD.BF16x8.RN.STRONG.SYS``)
store-all     ``multimem.st.relaxed.sys.global.v4.f32``              G x ``st.relaxed.sys.v4.f32``
              (SASS ``STG.E.128.STRONG.SYS`` on the multicast VA)    to every peer's buffer
flag-add-all  ``multimem.red.release.sys.global.add.u32``            G x ``red.release.sys.add.u32``
              (SASS ``MEMBAR.ALL.SYS`` + ``REDG.E.ADD.STRONG.SYS``)  on every peer's flag
============  =====================================================  ==============================

Only the load-reduce has a multicast-specific SASS opcode (``LDGMC``) on sm_90a: ``multimem.st`` and
``multimem.red`` assemble to the same ``STG``/``REDG`` as their unicast forms (the multicast is in
the address mapping), so tests check them in the PTX and ``LDGMC`` in the SASS.

NVLink multicast is FORBIDDEN on our machines: the ``switch`` backend is compiled (and its SASS
checked) in tests, but every host entry point calls ``require_multicast()`` first, which refuses
unless multicast is explicitly allowed AND available. Nothing here calls ``cuMulticastCreate``;
a switch launch takes multicast addresses made elsewhere.

Band all-reduce kernel (``build_band_allreduce``), communication CTAs only, G = world size
(compile-time), fp32 accumulator ``acc [M, N]`` (row-major, contiguous, N % 4 == 0) in symmetric
memory, bands of ``band_rows`` rows; CTA c owns bands c, c + grid, ... and takes them one at a
time, as the producer finishes them: steps 1 and 2 of band b, then step 3 of its previous band
(the kernel's comment has the no-deadlock argument); with ``arrive_ahead`` (default) step 1 of
the next band is posted before step 2 of this one when that band is already ready, so the
cross-GPU handshake of one band overlaps the reduce of the other. ``ready_rows`` (a multiple of
band_rows) rows share one ready flag: the producer's bands may be coarser than the all-reduce's,
so a finished producer band is all-reduced by ready_rows / band_rows CTAs at once.

1. ready (only with a concurrent producer, ``wait_ready``): thread 0 waits (``ld.acquire.gpu``,
   bounded) until ``band_ready[b * band_rows / ready_rows] - epoch >= 0``
   (written with release semantics, gpu scope, by this GPU's compute blocks after their TMA
   reduce-adds into the band completed, ``cp.async.bulk.wait_group`` + ``fence.proxy.async``);
   ``bar.red.or`` shares the outcome and orders the CTA after the acquire; then
   ``fence.acq_rel.sys`` + flag-add-all(arrive[b], 1): "my partial of band b is complete".
2. reduce-scatter + all-gather: thread 0 advances ``expected[b] += G`` (local; band b belongs to
   one CTA per call) and waits (``ld.acquire.sys``, bounded) until the local
   ``arrive[b] - expected[b] >= 0`` (every rank's partial is complete and, by the release/acquire
   chain, visible); the CTA load-reduces chunk ``rank`` of the band (the band's 16-byte vectors cut
   into G equal chunks) from all G accumulators, stores the fp32 sum to all G accumulators
   (overwriting chunk ``rank`` everywhere; only this rank ever reads or writes chunk ``rank`` of a
   band in this phase, and every thread's loads of a vector precede its stores of it), then
   ``bar.sync`` + ``fence.acq_rel.sys`` + flag-add-all(done[b], 1).
3. epilogue: thread 0 waits until ``done[b] - expected[b] >= 0`` (every chunk of the band holds the
   total in the local accumulator), ``fence.proxy.alias`` (switch: the totals arrived through the
   multicast alias of the memory read here through its unicast address), then every thread reads
   its vectors of the band, adds b2 (bf16 [N]; zeros when the layer has none), applies act2,
   writes bf16 ``out`` and, with ``zero_acc``, zeroes the accumulator for the next call's
   reduce-adds (no rank touches this band of this accumulator again in this call once done[b]
   is complete).

bf16 partials (``partial="bf16"``, the chained compute kernel's output): ``acc`` is a bf16
``[M, N]`` buffer in symmetric memory (N % 8 == 0) holding this rank's FINAL partial tiles (stored
by the producer with TMA, not added), 16-byte vectors of 8 bf16. Step 1 is unchanged (the
producer raises ``band_ready[blk] = epoch`` with st.release.gpu after ``cp.async.bulk.wait_group
0`` + ``fence.proxy.async``). Step 2 (reduce-scatter, finalize, all-gather): chunk ``rank`` of the
band is loaded from all G partials (``ld.relaxed.sys.v4.u32``, the peer table in rank order),
summed in fp32 in the FIXED order 0..G-1, + b2, act2, rounded to bf16 once, and the final
vector is stored into every rank's buffer (``st.relaxed.sys.v4.u32``) over the partial it
replaces (only rank r reads or writes chunk r of a band in this phase; every thread's G loads of
a vector precede its stores of it). Each chunk is computed by exactly one rank, so all ranks
hold bitwise equal outputs; the fixed order makes them independent of which rank computed
it. Step 3 waits for done[b] like the fp32 mode, then copies the band (``ld.global.cg``, written
by peers during this kernel) to ``out``; nothing is zeroed. Switch: ``multimem.ld_reduce ...
acc::f32.v4.bf16x2`` (the switch's fp32 sum, rounded to bf16 before b2 / act2, order not
fixed) and ``multimem.st`` of the final; compiled, refused at run time like the fp32 switch.
``b2_per_band`` (bf16 mode, compile-time): b2 is bf16 ``[ceil(M / ready_rows), N]``, one row per
ready flag (producer band), and band b adds row ``b * band_rows // ready_rows``: the grouped
experts layer (``ShardedExperts(compute="chained")``), whose producer bands are row blocks of one
expert each, passes ``b_out[expert of the block]`` per row (the layer gathers them before the
launches), so the kernel's arguments are the same as the shared-b2 variant's.
Slot protection (completion handshake, no second buffer): rank p's kernel ends only after
done[b] == expected for every band it finishes, i.e. after every rank's step-2 loads from and
stores into p's buffer completed (their release precedes done); the next call's producer on
p, which overwrites the buffer, runs after this kernel in stream order (FusedFFN joins the
communication stream into the compute stream before it returns), and a peer's next step 2
waits for p's next arrive, which p posts only after its next producer's band_ready.

Flags are monotone u32 counters in symmetric memory, never reset; ``expected[b]`` (int32, local)
is advanced by the kernel itself for every band a call covers (calls with fewer rows leave the
later bands' counters and expectations alone); ``epoch [1]`` (int32, device) is advanced on the
stream before each call that waits for a producer. No host int changes between calls of one
shape, so CUDA graphs replay.
Comparisons are wrap-safe (signed difference). Every wait is bounded by ``%globaltimer``
(``timeout_ns`` since the CTA started); a timeout records (code, rank, band, observed, expected,
elapsed) in the error buffer (``int64[8]``, first writer wins) and the CTA stops. All CTAs of all
ranks must be co-resident (grid <= SMs left free by the compute blocks), as in any persistent
spinning kernel: ``BandAllReduce.compile`` computes the CTAs per SM from the kernel's registers and
shared memory (read from its cubin) and refuses a grid that cannot all be resident.

All pointers are 64-bit ints (``tensor.data_ptr()``); ``acc_remote`` / ``arrive_remote`` /
``done_remote`` are multicast addresses (switch) or device pointers to ``int64[G]`` tables of every
rank's address (unicast, own rank included). CuTe DSL is imported lazily.

Because the kernel only sees addresses, ``EmulatedRanks`` runs G unicast ranks on ONE GPU (G
buffer sets on that device, rank r's launch on stream r, all concurrent, world * ccta <= SMs):
the one-GPU test (tests/test_band_allreduce_onegpu_gpu.py) and bench
(bench/bench_band_allreduce_onegpu.py, local memory: the per-SM limit, not NVLink) use it.
``band_allreduce_traffic`` counts the bytes each rank's call moves.
"""

import functools
import os

from ..kernels.compile import compile_keep
from ..runtime.multicast import require_multicast
from .activations import ACT2
from ..runtime.device import num_sms

BACKENDS = ("unicast", "switch")
PARTIALS = ("fp32", "bf16")  # the producer's partial: fp32 accumulator or bf16 final tiles
DEFAULT_THREADS = 1024  # x unroll 4: the most bytes in flight per SM (bench/NOTES.md, session 7)
DEFAULT_UNROLL = 4
# bf16 partials: 512 threads, unroll 8 / G: every load of a vector (G of them) and its fp32
# finalize live in registers at once; more spills to local memory (the compile test checks)
DEFAULT_BF16_THREADS = 512


def default_threads_unroll(partial: str, world: int) -> tuple[int, int]:
    """(threads, unroll) a BandAllReduce of this partial dtype and world size runs by default."""
    if partial == "bf16":
        return DEFAULT_BF16_THREADS, max(1, 8 // max(1, world))
    return DEFAULT_THREADS, DEFAULT_UNROLL

DEFAULT_BAND_ROWS = 128
DEFAULT_TIMEOUT_NS = 10_000_000_000  # 10 s
ERR_WORDS = 8
ERR_READY_TIMEOUT = 11  # this GPU's compute blocks never marked the band ready
ERR_ARRIVE_TIMEOUT = 12  # some rank's partial of the band never arrived
ERR_DONE_TIMEOUT = 13  # some rank never finished its chunk of the band
ERR_NAMES = {ERR_READY_TIMEOUT: "band all-reduce timed out waiting for band_ready (local compute)",
             ERR_ARRIVE_TIMEOUT: "band all-reduce timed out waiting for every rank's partial",
             ERR_DONE_TIMEOUT: "band all-reduce timed out waiting for every rank's reduced chunk"}

# ---------------------------------------------------------------- device functions
@functools.lru_cache(maxsize=None)
def device_lib():
    """Namespace of the CuTe DSL device functions (imports CuTe DSL on first use)."""
    import types

    import cutlass.cute as cute
    from cutlass import Float32, Int32

    def ptx(s, out=(), args=()):
        return cute.arch.inline_ptx(s, write_only_types=list(out), read_only_args=list(args))

    V4 = "{{$w0}, {$w1}, {$w2}, {$w3}}"

    # flags, fences, CTA vote, error record and bounded waits: the shared ones
    from ..kernels.primitives import (block_any, fence_acq_rel_sys, ld_acquire_gpu_s32,  # noqa: F401
                             ld_s32, ld_s64, record_error, st_s32, thread_block_grid,
                             wait_ge_gpu_s32 as wait_ge_gpu, wait_ge_sys_s32 as wait_ge_sys)

    # -- switch: NVLink multicast addresses --
    def mm_ld_reduce_v4_f32(mc_addr):
        """Sum over every GPU of the 4 fp32 at the multicast address (fp32 add)."""
        return ptx("multimem.ld_reduce.relaxed.sys.global.add.v4.f32 " + V4 + ", [{$r0}];",
                   [Float32] * 4, [mc_addr])

    def mm_ld_reduce_v4_bf16x2(mc_addr):
        """Sum over every GPU of 8 bf16 (fp32 accumulation in the switch), packed bf16x2."""
        return ptx("multimem.ld_reduce.relaxed.sys.global.add.acc::f32.v4.bf16x2 " + V4
                   + ", [{$r0}];", [Int32] * 4, [mc_addr])

    def mm_st_v4_f32(mc_addr, v):
        ptx("multimem.st.relaxed.sys.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};",
            (), [mc_addr, v[0], v[1], v[2], v[3]])

    def mm_red_release_add_u32(mc_addr, val):
        ptx("multimem.red.release.sys.global.add.u32 [{$r0}], {$r1};", (), [mc_addr, Int32(val)])

    # -- unicast: one peer address at a time --
    def ld_v4_f32_sys(addr):
        return ptx("ld.relaxed.sys.global.v4.f32 " + V4 + ", [{$r0}];", [Float32] * 4, [addr])

    def ld_v4_f32_cg(addr):
        return ptx("ld.global.cg.v4.f32 " + V4 + ", [{$r0}];", [Float32] * 4, [addr])

    def st_v4_f32_sys(addr, v):
        ptx("st.relaxed.sys.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", (),
            [addr, v[0], v[1], v[2], v[3]])

    def st_v4_zero(addr):
        ptx("st.global.v4.u32 [{$r0}], {{$r1}, {$r1}, {$r1}, {$r1}};", (), [addr, Int32(0)])

    def red_release_sys_add_u32(addr, val):
        ptx("red.release.sys.global.add.u32 [{$r0}], {$r1};", (), [addr, Int32(val)])

    def uc_ld_reduce_v4_f32(peer_addrs, off):
        """Load-reduce from every peer: all G loads issued before the adds (in flight together)."""
        vs = [ld_v4_f32_sys(a + off) for a in peer_addrs]
        s = list(vs[0])
        for v in vs[1:]:
            s = [s[j] + v[j] for j in range(4)]
        return s

    def uc_st_v4_f32(peer_addrs, off, v):
        for a in peer_addrs:
            st_v4_f32_sys(a + off, v)

    # -- bf16 partials (16-byte vectors of 8 bf16, as 4 packed bf16x2 words) --
    def ld_v4_u32_sys(addr):
        return ptx("ld.relaxed.sys.global.v4.u32 " + V4 + ", [{$r0}];", [Int32] * 4, [addr])

    def st_v4_u32_sys(addr, w):
        ptx("st.relaxed.sys.global.v4.u32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", (),
            [addr, w[0], w[1], w[2], w[3]])

    from ..kernels.primitives import ld_v4 as ld_v4_u32, ld_v4_cg as ld_v4_u32_cg  # noqa: F401
    from ..kernels.primitives import st_v4 as st_v4_u32  # noqa: F401

    def mm_st_v4_u32(mc_addr, w):
        ptx("multimem.st.relaxed.sys.global.v4.f32 [{$r0}], {{$r1}, {$r2}, {$r3}, {$r4}};", (),
            [mc_addr, as_f32(w[0]), as_f32(w[1]), as_f32(w[2]), as_f32(w[3])])

    def unpack_bf16x8(w):
        """4 packed bf16x2 words -> 8 fp32 (element 2j in the low half of word j)."""
        out = []
        for j in range(4):
            out.append(as_f32(w[j] << Int32(16)))
            out.append(as_f32(w[j] & Int32(-65536)))
        return out

    def pack_bf16x8(x):
        return [pack_bf16x2(x[2 * j], x[2 * j + 1]) for j in range(4)]

    # -- other flags --
    def ld_v2_u32(addr):
        return ptx("ld.global.v2.u32 {{$w0}, {$w1}}, [{$r0}];", [Int32] * 2, [addr])

    def st_v2_u32(addr, a, b):
        ptx("st.global.v2.u32 [{$r0}], {{$r1}, {$r2}};", (), [addr, a, b])

    def fence_proxy_alias():
        ptx("fence.proxy.alias;")

    def as_f32(bits):
        return ptx("mov.b32 {$w0}, {$r0};", [Float32], [bits])

    def pack_bf16x2(lo, hi):
        return ptx("cvt.rn.bf16x2.f32 {$w0}, {$r0}, {$r1};", [Int32], [hi, lo])

    from ..kernels.primitives import act_f32 as act  # noqa: F401 (act2 on one fp32 value)

    return types.SimpleNamespace(**{k: v for k, v in locals().items()
                                    if callable(v) and not k.startswith("_")})


# ---------------------------------------------------------------- band all-reduce kernel
def _check_options(world, backend, act2, threads, unroll, partial="fp32", b2_per_band=False):
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 16:
        raise ValueError(f"world={world!r} must be an int in [1, 16]")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose from {BACKENDS}")
    if partial not in PARTIALS:
        raise ValueError(f"partial={partial!r}: choose from {PARTIALS}")
    if act2 not in ACT2:
        raise ValueError(f"act2={act2!r}: choose from {ACT2}")
    if threads % 32 or not world <= threads <= 1024 or threads < 32:
        raise ValueError(f"threads={threads} must be a multiple of 32 in [32, 1024]")
    if unroll < 1 or unroll > 8:
        raise ValueError(f"unroll={unroll} must be in [1, 8]")
    if b2_per_band and partial != "bf16":
        raise ValueError("b2_per_band needs partial='bf16' (the fp32 mode's layers seed their "
                         "accumulator with per-row biases instead)")


def build_band_allreduce(world: int, backend: str = "unicast", act2: str = "none",
                         threads: int = DEFAULT_THREADS, unroll: int = DEFAULT_UNROLL,
                         zero_acc: bool = True, arrive_ahead: bool = True,
                         partial: str = "fp32", _test_skip_ready_wait: bool = False,
                         b2_per_band: bool = False):
    """The @cute.jit launcher of one (world, backend, act2, threads, unroll, zero_acc,
    arrive_ahead, partial, b2_per_band) variant.
    Arguments: see ``ARG_NAMES`` (ints), then a ``CUstream``.

    ``partial="bf16"`` (the bf16-partial mode, module docstring): ``acc`` is the bf16 ``[M, N]``
    partial (N % 8 == 0), step 2 reduces in fp32 and stores the FINAL bf16 values, step 3
    copies; ``zero_acc`` does not apply (the producer overwrites a bf16 partial, it does not add
    into it). ``_test_skip_ready_wait``: private test switch, step 1 does not wait for
    band_ready (a deliberately broken ordering: tests/test_band_allreduce_bf16_gpu.py shows
    it reads unfinished partials). ``b2_per_band`` (bf16 only): b2 is ``[ceil(M / ready_rows),
    N]``, one row per ready flag (module docstring)."""
    _check_options(world, backend, act2, threads, unroll, partial, b2_per_band)
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64

    L = device_lib()
    G, NT, U = world, threads, unroll
    SWITCH = backend == "switch"
    ACT = act2
    BF16 = partial == "bf16"
    ZERO = bool(zero_acc) and not BF16
    AHEAD = bool(arrive_ahead)
    SKIP_READY = bool(_test_skip_ready_wait)
    B2_ROWS = bool(b2_per_band)

    @cute.jit
    def reduce_chunk(acc_r: Int64, peers, v0: Int64, lo: Int64, hi: Int64, tidx: Int32):
        """Vectors [lo, hi) of the band starting at vector v0: load-reduce from all, store to all;
        U vectors (G loads each) in flight per thread."""
        i = lo + Int64(tidx)
        step = Int64(NT * U)
        while i + Int64((U - 1) * NT) < hi:
            sums = []
            for u in cutlass.range_constexpr(U):
                off = (v0 + i + Int64(u * NT)) * Int64(16)
                if cutlass.const_expr(SWITCH):
                    sums.append(L.mm_ld_reduce_v4_f32(acc_r + off))
                else:
                    sums.append(L.uc_ld_reduce_v4_f32(peers, off))
            for u in cutlass.range_constexpr(U):
                off = (v0 + i + Int64(u * NT)) * Int64(16)
                if cutlass.const_expr(SWITCH):
                    L.mm_st_v4_f32(acc_r + off, sums[u])
                else:
                    L.uc_st_v4_f32(peers, off, sums[u])
            i = i + step
        while i < hi:
            off = (v0 + i) * Int64(16)
            if cutlass.const_expr(SWITCH):
                L.mm_st_v4_f32(acc_r + off, L.mm_ld_reduce_v4_f32(acc_r + off))
            else:
                L.uc_st_v4_f32(peers, off, L.uc_ld_reduce_v4_f32(peers, off))
            i = i + Int64(NT)

    @cute.jit
    def finalize_bf16x8(words, b2: Int64, gv: Int64, ncolsv: Int64):
        """Vector gv (8 columns): fp32 sum of the loaded partials in rank order 0..G-1 (switch:
        the switch's bf16 sum), + b2, act2 -> 4 packed bf16x2 words of the final output."""
        if cutlass.const_expr(SWITCH):
            s = L.unpack_bf16x8(words)
        else:
            s = L.unpack_bf16x8(words[0])
            for p in cutlass.range_constexpr(1, G):
                t = L.unpack_bf16x8(words[p])
                s = [s[j] + t[j] for j in range(8)]
        # b2 is always a valid 16-byte aligned bf16 [N] (zeros when the layer has none)
        c8 = gv - (gv // ncolsv) * ncolsv  # column / 8
        bb = L.unpack_bf16x8(L.ld_v4_u32(b2 + c8 * Int64(16)))
        return L.pack_bf16x8([L.act(s[j] + bb[j], ACT) for j in range(8)])

    @cute.jit
    def reduce_chunk_bf16(acc_r: Int64, peers, v0: Int64, lo: Int64, hi: Int64, b2: Int64,
                          ncolsv: Int64, tidx: Int32):
        """Vectors [lo, hi) of the band starting at vector v0 (8 bf16 each): load from all G
        partials, reduce in fp32, + b2, act2, store the final bf16 to all G buffers; U vectors
        (G loads each) in flight per thread; every load of a vector precedes its stores."""
        i = lo + Int64(tidx)
        step = Int64(NT * U)
        while i + Int64((U - 1) * NT) < hi:
            ws = []
            for u in cutlass.range_constexpr(U):
                off = (v0 + i + Int64(u * NT)) * Int64(16)
                if cutlass.const_expr(SWITCH):
                    ws.append(L.mm_ld_reduce_v4_bf16x2(acc_r + off))
                else:
                    ws.append([L.ld_v4_u32_sys(a + off) for a in peers])
            for u in cutlass.range_constexpr(U):
                gv = v0 + i + Int64(u * NT)
                y = finalize_bf16x8(ws[u], b2, gv, ncolsv)
                if cutlass.const_expr(SWITCH):
                    L.mm_st_v4_u32(acc_r + gv * Int64(16), y)
                else:
                    for a in peers:
                        L.st_v4_u32_sys(a + gv * Int64(16), y)
            i = i + step
        while i < hi:
            gv = v0 + i
            off = gv * Int64(16)
            if cutlass.const_expr(SWITCH):
                y = finalize_bf16x8(L.mm_ld_reduce_v4_bf16x2(acc_r + off), b2, gv, ncolsv)
                L.mm_st_v4_u32(acc_r + off, y)
            else:
                y = finalize_bf16x8([L.ld_v4_u32_sys(a + off) for a in peers], b2, gv, ncolsv)
                for a in peers:
                    L.st_v4_u32_sys(a + off, y)
            i = i + Int64(NT)

    @cute.jit
    def epilogue_copy(acc: Int64, out: Int64, v0: Int64, nvec: Int64, tidx: Int32):
        """bf16 mode, vectors [0, nvec) of the band at vector v0: the final values (every
        rank's chunk, stored into this rank's buffer in step 2) to ``out``. ld.cg: written by
        peers during this kernel, never through the non-coherent cache."""
        i = Int64(tidx)
        while i < nvec:
            gv = v0 + i
            L.st_v4_u32(out + gv * Int64(16), L.ld_v4_u32_cg(acc + gv * Int64(16)))
            i = i + Int64(NT)

    @cute.jit
    def flag_add_all(flag_r: Int64, fpeers, boff: Int64, tidx: Int32):
        """+1 on flag[b] of every rank, release at sys scope (after a bar.sync of the CTA)."""
        if cutlass.const_expr(SWITCH):
            if tidx == Int32(0):
                L.fence_acq_rel_sys()
                L.mm_red_release_add_u32(flag_r + boff, 1)
        else:
            if tidx == Int32(0):
                L.fence_acq_rel_sys()
                for p in cutlass.range_constexpr(G):
                    if cutlass.const_expr(BF16):
                        # bf16: the flag table is re-read here rather than kept in registers
                        # (thread 0 only; the registers go to the loads in flight)
                        L.red_release_sys_add_u32(L.ld_s64(flag_r + Int64(p * 8)) + boff, 1)
                    else:
                        L.red_release_sys_add_u32(fpeers[p] + boff, 1)

    @cute.jit
    def epilogue(acc: Int64, out: Int64, b2: Int64, v0: Int64, nvec: Int64, ncols4: Int64,
                 tidx: Int32):
        """Vectors [0, nvec) of the band at vector v0: (+ b2), act2, bf16 out, (zero acc)."""
        i = Int64(tidx)
        while i < nvec:
            gv = v0 + i
            v = L.ld_v4_f32_cg(acc + gv * Int64(16))
            # b2 is always a valid bf16 [N] (the host passes zeros when there is none): no branch
            c4 = gv - (gv // ncols4) * ncols4  # column / 4
            w = L.ld_v2_u32(b2 + c4 * Int64(8))
            x = [v[0] + L.as_f32(w[0] << Int32(16)), v[1] + L.as_f32(w[0] & Int32(-65536)),
                 v[2] + L.as_f32(w[1] << Int32(16)), v[3] + L.as_f32(w[1] & Int32(-65536))]
            y = [L.act(x[j], ACT) for j in range(4)]
            L.st_v2_u32(out + gv * Int64(8), L.pack_bf16x2(y[0], y[1]),
                        L.pack_bf16x2(y[2], y[3]))
            if cutlass.const_expr(ZERO):
                L.st_v4_zero(acc + gv * Int64(16))
            i = i + Int64(NT)

    @cute.jit
    def timed_out(addr: Int64, target: Int32, sys_scope: cutlass.Constexpr,
                  code: cutlass.Constexpr, err: Int64, rank: Int32, b: Int32, flag: Int32,
                  t_start: Int64, timeout_ns: Int64):
        """Thread 0: bounded acquire wait (gpu or sys scope) until ``flag - target >= 0``; on a
        timeout records (code, rank, band, flag index, observed, target, elapsed), returns 1."""
        if cutlass.const_expr(sys_scope):
            t, v, el = L.wait_ge_sys(addr, target, t_start, timeout_ns)
        else:
            t, v, el = L.wait_ge_gpu(addr, target, t_start, timeout_ns)
        to = Int32(0)
        if t != Int32(0):
            to = Int32(1)
            L.record_error(err, Int32(code), rank, b, flag, Int64(v), Int64(target), el)
        return to

    @cute.jit
    def band_span(b: Int32, M: Int32, band_rows: Int32, ncols4: Int64):
        """(first 16-byte vector, vector count) of band b (the last band may be ragged)."""
        row0 = b * band_rows
        rows = M - row0
        if rows > band_rows:
            rows = band_rows
        return Int64(row0) * ncols4, Int64(rows) * ncols4

    @cute.jit
    def ready_and_arrive(b: Int32, band_ready: Int64, epoch: Int32, arrive_remote: Int64,
                         arr_p, err: Int64, rank: Int32, t_start: Int64, timeout_ns: Int64,
                         wait_ready: Int32, band_rows: Int32, ready_rows: Int32, tidx: Int32):
        """Step 1: (with a producer) wait until the ready flag covering band b holds this call's
        epoch, then arrive[b] += 1 on every rank. Returns the CTA's failure vote."""
        to = Int32(0)
        if tidx == Int32(0):
            if cutlass.const_expr(not SKIP_READY):
                if wait_ready != Int32(0):
                    r = (b * band_rows) // ready_rows
                    to = timed_out(band_ready + Int64(r) * Int64(4), epoch, False,
                                   ERR_READY_TIMEOUT, err, rank, b, r, t_start, timeout_ns)
        failed = L.block_any(to)
        if failed == Int32(0):
            flag_add_all(arrive_remote, arr_p, Int64(b) * Int64(4), tidx)
        return failed

    @cute.jit
    def try_arrive(b: Int32, band_ready: Int64, epoch: Int32, arrive_remote: Int64, arr_p,
                   wait_ready: Int32, band_rows: Int32, ready_rows: Int32, tidx: Int32):
        """Step 1 of band b without waiting: arrive-all now if its ready flag is already set (one
        acquire load), so the peers' wait on it in step 2 finds it done. Returns 1 if posted."""
        ok = Int32(0)
        if tidx == Int32(0):
            ok = Int32(1)
            if cutlass.const_expr(not SKIP_READY):
                if wait_ready != Int32(0):
                    r = (b * band_rows) // ready_rows
                    if L.ld_acquire_gpu_s32(band_ready + Int64(r) * Int64(4)) - epoch \
                            < Int32(0):
                        ok = Int32(0)
        posted = L.block_any(ok)  # thread 0's answer, to the whole CTA
        if posted != Int32(0):
            flag_add_all(arrive_remote, arr_p, Int64(b) * Int64(4), tidx)
        return posted

    @cute.jit
    def reduce_band(b: Int32, arrive: Int64, expected: Int64, acc_remote: Int64, acc_p,
                    done_remote: Int64, done_p, err: Int64, rank: Int32, t_start: Int64,
                    timeout_ns: Int64, M: Int32, band_rows: Int32, ncols4: Int64, tidx: Int32,
                    b2: Int64):
        """Step 2: once every rank's partial of band b arrived, reduce-scatter + all-gather
        chunk ``rank`` of it, then done[b] += 1 on every rank."""
        to = Int32(0)
        if tidx == Int32(0):
            # band b belongs to this CTA alone in this call: advance its expectation here
            # (step 3 re-reads it, same thread; the next call sees it after the kernel ends)
            exp_b = L.ld_s32(expected + Int64(b) * Int64(4)) + Int32(G)
            L.st_s32(expected + Int64(b) * Int64(4), exp_b)
            to = timed_out(arrive + Int64(b) * Int64(4), exp_b, True, ERR_ARRIVE_TIMEOUT, err,
                           rank, b, b, t_start, timeout_ns)
        failed = L.block_any(to)
        if failed == Int32(0):
            v0, nvec = band_span(b, M, band_rows, ncols4)
            per = (nvec + Int64(G - 1)) // Int64(G)
            lo = Int64(rank) * per
            hi = lo + per
            if hi > nvec:
                hi = nvec
            if cutlass.const_expr(BF16):
                reduce_chunk_bf16(acc_remote, acc_p, v0, lo, hi, b2, ncols4, tidx)
            else:
                reduce_chunk(acc_remote, acc_p, v0, lo, hi, tidx)
            cute.arch.barrier()
            flag_add_all(done_remote, done_p, Int64(b) * Int64(4), tidx)
        return failed

    @cute.jit
    def finish_band(b: Int32, done: Int64, expected: Int64, acc: Int64, out: Int64, b2: Int64,
                    err: Int64, rank: Int32, t_start: Int64, timeout_ns: Int64, M: Int32,
                    band_rows: Int32, ncols4: Int64, tidx: Int32):
        """Step 3: once every chunk of band b is reduced, + b2, act2, bf16 out (, zero acc)."""
        to = Int32(0)
        if tidx == Int32(0):
            exp_b = L.ld_s32(expected + Int64(b) * Int64(4))
            to = timed_out(done + Int64(b) * Int64(4), exp_b, True, ERR_DONE_TIMEOUT, err, rank,
                           b, b, t_start, timeout_ns)
        failed = L.block_any(to)
        if failed == Int32(0):
            if cutlass.const_expr(SWITCH):
                L.fence_proxy_alias()
            v0, nvec = band_span(b, M, band_rows, ncols4)
            if cutlass.const_expr(BF16):
                epilogue_copy(acc, out, v0, nvec, tidx)
            else:
                epilogue(acc, out, b2, v0, nvec, ncols4, tidx)
        return failed

    @cute.kernel
    def band_allreduce_kernel(acc: Int64, acc_remote: Int64, out: Int64, b2: Int64, M: Int32,
                              N: Int32, band_rows: Int32, ready_rows: Int32, band_ready: Int64,
                              arrive: Int64, arrive_remote: Int64, done: Int64,
                              done_remote: Int64, expected: Int64, epoch_ptr: Int64, err: Int64,
                              timeout_ns: Int64, rank: Int32, wait_ready: Int32):
        tidx, bidx, nblk = L.thread_block_grid()
        t_start = cute.arch.globaltimer()
        epoch = L.ld_s32(epoch_ptr)
        nbands = (M + band_rows - Int32(1)) // band_rows
        # 16-byte vectors per row: 4 fp32 or 8 bf16 (the name says fp32's; both modes use it)
        ncols4 = Int64(N // Int32(8 if BF16 else 4))
        # peer tables (unicast): G addresses each, kept in registers
        acc_p = []
        arr_p = []
        done_p = []
        if cutlass.const_expr(not SWITCH):
            for p in cutlass.range_constexpr(G):
                acc_p.append(L.ld_s64(acc_remote + Int64(p * 8)))
                if cutlass.const_expr(not BF16):
                    arr_p.append(L.ld_s64(arrive_remote + Int64(p * 8)))
                    done_p.append(L.ld_s64(done_remote + Int64(p * 8)))
        failed = Int32(0)
        # Bands are pipelined one at a time (a CTA's bands become ready one after another while
        # the producer runs): 1 and 2 for band b, then 3 for the CTA's previous band (its done
        # flags had a whole band's reduce to arrive). No wait depends on a later step of any CTA
        # of any rank: by induction every CTA c of every rank finishes iteration k, since 1
        # waits on the local producer only, 2 on every rank's step 1 of the same band and 3 on
        # every rank's step 2 of the previous one (bands -> CTAs is the same on every rank).
        # arrive_ahead: step 1 of the next band is also tried (without waiting) before step 2 of
        # this one, so its cross-GPU handshake is under way while this band is reduced; it only
        # ever posts earlier what step 1 would post, so the argument above holds.
        b = bidx
        b_prev = Int32(-1)
        arrived = Int32(0)  # step 1 of band b already done by the previous iteration
        while b < nbands and failed == Int32(0):
            if arrived == Int32(0):
                failed = ready_and_arrive(b, band_ready, epoch, arrive_remote, arr_p, err, rank,
                                          t_start, timeout_ns, wait_ready, band_rows,
                                          ready_rows, tidx)
            b_next = b + nblk
            arrived = Int32(0)
            if cutlass.const_expr(AHEAD):
                if failed == Int32(0) and b_next < nbands:
                    arrived = try_arrive(b_next, band_ready, epoch, arrive_remote, arr_p,
                                         wait_ready, band_rows, ready_rows, tidx)
            if failed == Int32(0):
                if cutlass.const_expr(B2_ROWS):
                    # the b2 row of the ready flag (producer band) that band b belongs to
                    b2_b = b2 + Int64((b * band_rows) // ready_rows) * ncols4 * Int64(16)
                else:
                    b2_b = b2
                failed = reduce_band(b, arrive, expected, acc_remote, acc_p, done_remote,
                                     done_p, err, rank, t_start, timeout_ns, M, band_rows,
                                     ncols4, tidx, b2_b)
            if failed == Int32(0) and b_prev >= Int32(0):
                failed = finish_band(b_prev, done, expected, acc, out, b2, err, rank, t_start,
                                     timeout_ns, M, band_rows, ncols4, tidx)
            b_prev = b
            b = b_next
        if failed == Int32(0) and b_prev >= Int32(0):
            failed = finish_band(b_prev, done, expected, acc, out, b2, err, rank, t_start,
                                 timeout_ns, M, band_rows, ncols4, tidx)

    @cute.jit
    def launch(acc: Int64, acc_remote: Int64, out: Int64, b2: Int64, M: Int32, N: Int32,
               band_rows: Int32, ready_rows: Int32, band_ready: Int64, arrive: Int64,
               arrive_remote: Int64, done: Int64, done_remote: Int64, expected: Int64,
               epoch_ptr: Int64, err: Int64, timeout_ns: Int64, rank: Int32, wait_ready: Int32,
               grid: Int32, stream: cuda.CUstream):
        band_allreduce_kernel(acc, acc_remote, out, b2, M, N, band_rows, ready_rows, band_ready,
                              arrive, arrive_remote, done, done_remote, expected, epoch_ptr, err,
                              timeout_ns, rank, wait_ready).launch(
            grid=[grid, 1, 1], block=[NT, 1, 1], stream=stream)

    return launch


ARG_NAMES = ("acc", "acc_remote", "out", "b2", "M", "N", "band_rows", "ready_rows", "band_ready",
             "arrive", "arrive_remote", "done", "done_remote", "expected", "epoch", "err",
             "timeout_ns", "rank", "wait_ready", "grid")
_INT32_ARGS = {"M", "N", "band_rows", "ready_rows", "rank", "wait_ready", "grid"}


def example_args():
    """Placeholder arguments for ``cute.compile`` (no GPU needed)."""
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int32(1) if n in _INT32_ARGS else Int64(0) for n in ARG_NAMES] + [cuda.CUstream(0)]


def compile_band_allreduce(world: int, backend: str = "unicast", act2: str = "none",
                           threads: int = DEFAULT_THREADS, unroll: int = DEFAULT_UNROLL,
                           zero_acc: bool = True, keep: bool = False,
                           arrive_ahead: bool = True, partial: str = "fp32",
                           _test_skip_ready_wait: bool = False, b2_per_band: bool = False):
    """cute.compile one variant (``CUTE_DSL_ARCH=sm_90a`` compiles without a GPU). With
    ``keep=True`` the result carries ``__ptx__`` and ``__cubin__`` for inspection."""
    import cutlass.cute as cute
    launch = build_band_allreduce(world, backend, act2, threads, unroll, zero_acc, arrive_ahead,
                                  partial, _test_skip_ready_wait, b2_per_band)
    if keep:
        return compile_keep(launch, *example_args())
    return cute.compile(launch, *example_args())


def emulate_band_allreduce(accs, M: int, band_rows: int, b2=None, act2: str = "none",
                            grid: int = 1, zero_acc: bool = True):
    """CPU model of the kernel's schedule and index math, rank by rank and phase by phase, in
    torch (tests use it to check the band / chunk / column arithmetic without a GPU).

    ``accs``: one fp32 ``[>= M, N]`` tensor per rank (modified in place like the symmetric
    accumulators). Returns (outs: bf16 ``[M, N]`` per rank, coverage: int ``[M * N / 4]`` counting
    how many (rank, vector) reduce steps touched each vector: must be all ones)."""
    import torch
    from .activations import activation
    G = len(accs)
    N = accs[0].shape[1]
    if N % 4:
        raise ValueError(f"N={N} must be a multiple of 4")
    ncols4 = N // 4
    flat = [a.view(-1, 4) for a in accs]  # 16-byte vectors, like the kernel's gv index
    nbands = (M + band_rows - 1) // band_rows
    coverage = torch.zeros(M * ncols4, dtype=torch.int64)
    for bidx in range(grid):  # phase 2 of every CTA: reduce-scatter + all-gather
        for b in range(bidx, nbands, grid):
            row0 = b * band_rows
            rows = min(M - row0, band_rows)
            v0, nvec = row0 * ncols4, rows * ncols4
            per = (nvec + G - 1) // G
            for rank in range(G):
                lo, hi = rank * per, min(rank * per + per, nvec)
                if hi <= lo:
                    continue
                total = sum(f[v0 + lo:v0 + hi] for f in flat)
                for f in flat:
                    f[v0 + lo:v0 + hi] = total
                coverage[v0 + lo:v0 + hi] += 1
    outs = []
    for rank in range(G):  # phase 3: epilogue on every rank
        out = torch.empty(M * ncols4, 4, dtype=torch.bfloat16)
        bias = torch.zeros(N) if b2 is None else b2.float()
        for bidx in range(grid):
            for b in range(bidx, nbands, grid):
                row0 = b * band_rows
                rows = min(M - row0, band_rows)
                gv = torch.arange(row0 * ncols4, (row0 + rows) * ncols4)
                c4 = gv - (gv // ncols4) * ncols4
                x = flat[rank][gv] + bias.view(-1, 4)[c4]
                out[gv] = activation(x, act2).to(torch.bfloat16)
                if zero_acc:
                    flat[rank][gv] = 0
        outs.append(out.view(M, N))
    return outs, coverage


def _b2_rows(b2, M: int, ready_rows):
    """b2 as fp32 per row of [M, N]: b2 [N] for every row, or (``b2_per_band``) b2
    [>= ceil(M / ready_rows), N] with row r * ready_rows + i taking b2[r]."""
    if b2.dim() == 1:
        return b2.float()
    if ready_rows is None:
        raise ValueError("a 2-D b2 (one row per ready flag) needs ready_rows")
    nr = -(-M // ready_rows)
    if b2.shape[0] < nr:
        raise ValueError(f"b2 has {b2.shape[0]} rows, M={M} rows need {nr} (one per "
                         f"{ready_rows} rows)")
    return b2[:nr].float().repeat_interleave(ready_rows, 0)[:M]


def bf16_allreduce_reference(partials, b2=None, act2: str = "none", ready_rows=None):
    """The bf16-partial mode's math in torch: ``act2(sum_q float(partial_q) + b2)`` with the fp32
    sum taken in rank order 0..G-1, rounded to bf16 once (what every rank's output must equal;
    bitwise for act2 "none" / "relu", whose device and torch forms round alike). b2 [N], or
    [ceil(M / ready_rows), N] with ``ready_rows`` (the ``b2_per_band`` variant)."""
    import torch
    from .activations import activation
    s = partials[0].float()
    for p in partials[1:]:
        s = s + p.float()
    if b2 is not None:
        s = s + _b2_rows(b2, s.shape[0], ready_rows)
    return activation(s, act2).to(torch.bfloat16)


def emulate_band_allreduce_bf16(partials, M: int, band_rows: int, b2=None, act2: str = "none",
                                grid: int = 1, ready_rows=None):
    """CPU model of the ``partial="bf16"`` kernel, rank by rank and phase by phase, with its
    index math (16-byte vectors of 8 bf16; band vectors cut into G chunks; rank r finalizes
    chunk r: loads it from every buffer, fp32 sum in rank order, + b2, act2, bf16, stores it
    into every buffer; then each rank copies the band to its out).

    ``partials``: one bf16 ``[>= M, N]`` tensor per rank, modified in place like the symmetric
    buffers (rows [0, M) end holding the final output). b2: bf16 [N], or with ``ready_rows`` the
    ``b2_per_band`` variant's [ceil(M / ready_rows), N], band b adding row
    ``b * band_rows // ready_rows`` as the kernel does. Returns (outs: bf16 ``[M, N]`` per rank,
    coverage: int ``[M * N / 8]``, how many (rank, vector) finalize steps touched each vector:
    must be all ones)."""
    import torch
    from .activations import activation
    G = len(partials)
    N = partials[0].shape[1]
    if N % 8:
        raise ValueError(f"N={N} must be a multiple of 8")
    ncols8 = N // 8
    flat = [p.view(-1, 8) for p in partials]
    nbands = (M + band_rows - 1) // band_rows
    coverage = torch.zeros(M * ncols8, dtype=torch.int64)
    per_band = b2 is not None and b2.dim() == 2
    if per_band and (ready_rows is None or ready_rows % band_rows):
        raise ValueError(f"a 2-D b2 needs ready_rows, a multiple of band_rows={band_rows}")
    bias = torch.zeros(N) if b2 is None else b2.float()
    for bidx in range(grid):  # step 2 of every CTA of every rank
        for b in range(bidx, nbands, grid):
            row0 = b * band_rows
            rows = min(M - row0, band_rows)
            if per_band:  # the row of the ready flag band b belongs to (kernel: b2_b)
                bias = b2[(b * band_rows) // ready_rows].float()
            v0, nvec = row0 * ncols8, rows * ncols8
            per = (nvec + G - 1) // G
            for rank in range(G):
                lo, hi = rank * per, min(rank * per + per, nvec)
                if hi <= lo:
                    continue
                gv = torch.arange(v0 + lo, v0 + hi)
                s = flat[0][gv].float()
                for f in flat[1:]:
                    s = s + f[gv].float()
                c8 = gv % ncols8
                y = activation(s + bias.view(-1, 8)[c8], act2).to(torch.bfloat16)
                for f in flat:
                    f[gv] = y
                coverage[gv] += 1
    outs = [flat[r][:M * ncols8].clone().view(M, N) for r in range(G)]  # step 3: the copy
    return outs, coverage


@functools.lru_cache(maxsize=None)
def _compiled_variant(world, backend, act2, threads, unroll, zero_acc, arrive_ahead,
                      partial="fp32", skip_ready_wait=False, b2_per_band=False):
    # kept cubin: its registers / shared memory bound the CTAs that can be co-resident
    return compile_band_allreduce(world, backend, act2, threads, unroll, zero_acc,
                                  arrive_ahead=arrive_ahead, keep=True, partial=partial,
                                  _test_skip_ready_wait=skip_ready_wait,
                                  b2_per_band=b2_per_band)


def coresident_ctas_per_sm(compiled, threads: int) -> int:
    """CTAs of a compiled (``keep=True``) band all-reduce that fit on one SM, from its cubin's
    registers and shared memory (moe_overlap.runtime.device.ctas_per_sm)."""
    from ..runtime.device import cubin_resources, ctas_per_sm
    res = cubin_resources(compiled.__cubin__)
    if not res:
        raise RuntimeError("no kernel resources in the band all-reduce cubin")
    return min(ctas_per_sm(regs, threads, smem) for regs, smem in res.values())


def describe_error(err_host) -> str | None:
    """Text of an error buffer read back to the host (None when clear)."""
    code = int(err_host[0])
    if code == 0:
        return None
    rank, band, flag, obs, exp, el = (int(v) for v in err_host[1:7])
    what = ERR_NAMES.get(code, f"device error code {code}")
    where = f"band {band}" + (f" (ready flag {flag})" if code == ERR_READY_TIMEOUT else "")
    return (f"{what}: rank {rank}, {where}: flag={obs}, expected>={exp} after {el / 1e6:.1f} "
            f"ms (a rank not launched, stalled, timed out earlier, or epochs out of step)")


# ---------------------------------------------------------------- host side
def _check_host_options(max_rows, N, backend, act2, band_rows, ready_rows, partial,
                        b2_per_band):
    """The checks a BandAllReduce makes before touching CUDA (ValueError / TypeError); returns
    (act2, ready_rows) with their defaults filled in ("none", band_rows)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose from {BACKENDS}")
    if partial not in PARTIALS:
        raise ValueError(f"partial={partial!r}: choose from {PARTIALS}")
    bf16 = partial == "bf16"
    if not isinstance(b2_per_band, bool):
        raise TypeError(f"b2_per_band={b2_per_band!r} must be a bool")
    if b2_per_band and not bf16:
        raise ValueError("b2_per_band needs partial='bf16' (the fp32 mode's layers seed their "
                         "accumulator with per-row biases instead)")
    if act2 is None:
        act2 = "none"
    if act2 not in ACT2:
        raise ValueError(f"act2={act2!r}: choose from {ACT2}")
    for name, v in (("max_rows", max_rows), ("N", N), ("band_rows", band_rows)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")
    if N % 4:
        raise ValueError(f"N={N} must be a multiple of 4 (16-byte fp32 vectors)")
    if bf16 and N % 8:
        raise ValueError(f"N={N} must be a multiple of 8 with partial='bf16' (16-byte "
                         f"vectors of 8 bf16)")
    ready_rows = band_rows if ready_rows is None else ready_rows
    if isinstance(ready_rows, bool) or not isinstance(ready_rows, int) or ready_rows < 1 \
            or ready_rows % band_rows:
        raise ValueError(f"ready_rows={ready_rows!r} must be a positive multiple of "
                         f"band_rows={band_rows}")
    return act2, ready_rows


def symmetric_layout(max_rows: int, N: int, band_rows: int, partial: str = "fp32"):
    """Bytes of one rank's symmetric allocation: (data bytes, offset of ``arrive``, bytes per
    flag array, total). Data: ``[max_rows, N]`` fp32 (4 bytes) or bf16 (2 bytes, half the fp32
    mode's); then ``arrive`` and ``done``, one u32 per band, each array 256-byte aligned."""
    if partial not in PARTIALS:
        raise ValueError(f"partial={partial!r}: choose from {PARTIALS}")
    data = max_rows * N * (2 if partial == "bf16" else 4)
    bands = -(-max_rows // band_rows)
    flag_off = (data + 255) // 256 * 256
    flag_bytes = (bands * 4 + 255) // 256 * 256
    return data, flag_off, flag_bytes, flag_off + 2 * flag_bytes


SYMMETRIC_ALLOCS = ("torch", "nvshmem")  # who allocates the symmetric buffer
SYMMETRICS = ("auto",) + SYMMETRIC_ALLOCS


def check_symmetric(symmetric: str, backend: str) -> None:
    """ValueError unless ``symmetric`` is one of ``SYMMETRICS`` and fits ``backend``: only torch
    symmetric memory gives the multicast address that ``backend="switch"`` loads and stores
    through, so switch with the NVSHMEM allocation is refused (before any allocation)."""
    if symmetric not in SYMMETRICS:
        raise ValueError(f"symmetric={symmetric!r}: choose from {SYMMETRICS}")
    if symmetric == "nvshmem" and backend == "switch":
        raise ValueError("'switch' (NVLink multicast) needs the multicast address of torch "
                         "symmetric memory (symmetric='torch', one rank per GPU); the NVSHMEM "
                         "allocation, symmetric='nvshmem', has none: use 'unicast' with it")


def resolve_symmetric(symmetric: str, backend: str, ranks_share_device: bool) -> str:
    """The allocator of the band all-reduce's symmetric buffer, resolved once: ``"torch"``
    (torch symmetric memory, one rank per GPU: it refuses ranks whose allocations sit on one
    device) or ``"nvshmem"`` (``runtime.nvshmem.NvshmemRuntime``: several PEs per GPU work);
    ``"auto"``: nvshmem where ranks of the group share a device (``ranks_share_device``, the
    same on every rank), else torch. Both hand the kernel the same layout and peer tables.
    Raises as ``check_symmetric`` (auto with switch on a shared device included: multicast
    needs one rank per GPU)."""
    check_symmetric(symmetric, backend)
    if symmetric == "auto":
        symmetric = "nvshmem" if ranks_share_device else "torch"
        if symmetric == "nvshmem" and backend == "switch":
            raise ValueError("'switch' (NVLink multicast) cannot run with ranks that share a "
                             "GPU (multicast needs torch symmetric memory, one rank per GPU); "
                             "use 'unicast'")
    return symmetric


def agree_on_geometry(geometry: dict, group, device) -> None:
    """Collective (every rank, before any rank-local check can raise): the same ValueError on
    every rank when the ranks' launch geometries differ (e.g. ccta=None on GPUs of different SM
    counts), naming each field's range, instead of a launch whose CTAs wait on peers that never
    come."""
    import torch
    import torch.distributed as dist

    from ..runtime import collectives
    keys = sorted(geometry)
    v = torch.tensor([int(geometry[k]) for k in keys], dtype=torch.int64, device=device)
    lo, hi = v.clone(), v.clone()
    collectives.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    collectives.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    bad = {k: (int(a), int(b)) for k, a, b in zip(keys, lo.tolist(), hi.tolist()) if a != b}
    if bad:
        raise ValueError("BandAllReduce: the ranks' launch settings differ (every rank must "
                         "launch the same grid over the same bands): "
                         + ", ".join(f"{k} from {a} to {b}" for k, (a, b) in bad.items()))


class BandAllReduce:
    """Band all-reduce of an fp32 ``[M, N]`` accumulator (``partial="fp32"``) or of bf16
    ``[M, N]`` partials (``partial="bf16"``) over a process group of G CUDA ranks, then
    ``out = act2(sum + b2)`` in bf16 on every rank (bitwise equal on every rank: each chunk is
    finalized by one rank and copied to all).

    ``partial="bf16"``: the symmetric buffer is ``self.partial`` (bf16 ``[max_rows, N]``,
    N % 8 == 0; ``self.acc`` is None): the producer stores (not adds) its partial there, the
    all-reduce sums the G partials in fp32 in rank order 0..G-1, adds b2, applies act2 and
    stores the final bf16 values over every rank's partial, which step 3 copies to ``out``.
    Half the bytes of the fp32 accumulator; nothing is zeroed between calls.
    ``b2_per_band=True`` (bf16 only): b2 is bf16 ``[>= ceil(M / ready_rows), N]``, one row per
    ready flag (the grouped experts layer: each producer band is one expert's). Defaults:
    ``default_threads_unroll``. Slot protection: a rank's next call cannot overwrite its
    partial before every rank is done with it, because this call ends on that rank only after
    its done[b] counters of every band reached G (every rank's loads from, and final stores
    into, its buffer completed), and the caller starts the next producer after this call in
    stream order (FusedFFN joins the streams).

    Owns (per rank): one symmetric allocation (torch symmetric memory, CUDA backend, multicast
    off; or with ``symmetric="nvshmem"`` an ``NvshmemRuntime`` tensor, which also works for ranks
    sharing a GPU; ``"auto"``, the default: nvshmem exactly where ranks of the group share a
    device, ``resolve_symmetric``; ``release()`` frees it collectively)
    holding ``acc [max_rows, N]`` fp32 and the ``arrive`` / ``done`` u32 counters, the local
    ``band_ready`` flags, ``epoch`` and the error buffer. Typical use::

        ar = BandAllReduce(max_rows, N, group, act2="silu")
        ar.acc[:M].copy_(partial)            # or let compute blocks reduce-add into ar.acc
        out = ar(M, b2=b2)                   # bf16 [M, N], identical on every rank
        ar.check()                           # optional: syncs, raises on a device timeout

    Standalone (``producer=False``) a call is one kernel launch; with a producer kernel
    (``producer=True``) the call advances ``epoch`` and the producer writes
    ``band_ready[r] = epoch`` (release, gpu scope) as each of its bands of ``ready_rows`` rows
    (default: band_rows) is complete.
    ``backend="switch"`` calls ``require_multicast()`` first (refused on our machines).
    """

    def __init__(self, max_rows: int, N: int, group=None, *, backend: str = "unicast",
                 act2: str = "none", band_rows: int = DEFAULT_BAND_ROWS, ccta: int | None = None,
                 threads: int | None = None, unroll: int | None = None,
                 zero_acc: bool = True, timeout_ns: int = DEFAULT_TIMEOUT_NS,
                 arrive_ahead: bool = True, ready_rows: int | None = None,
                 partial: str = "fp32", _test_skip_ready_wait: bool = False,
                 b2_per_band: bool = False, symmetric: str = "auto"):
        import torch
        import torch.distributed as dist
        act2, ready_rows = _check_host_options(max_rows, N, backend, act2, band_rows, ready_rows,
                                               partial, b2_per_band)
        check_symmetric(symmetric, backend)
        if backend == "switch":
            require_multicast()
        if not torch.cuda.is_available():
            raise RuntimeError("BandAllReduce needs CUDA GPUs (use the reference backend on CPU)")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("BandAllReduce needs an initialized torch.distributed process "
                               "group (NCCL)")
        grp = group if group is not None else dist.group.WORLD
        self._configure(dist.get_rank(grp), dist.get_world_size(grp), max_rows, N, backend,
                        act2, band_rows, ready_rows, threads, unroll, zero_acc, timeout_ns,
                        arrive_ahead, partial, _test_skip_ready_wait, b2_per_band)
        self.group = grp
        dev = torch.device("cuda", torch.cuda.current_device())
        sms = num_sms(dev)
        agree_on_geometry(self.launch_geometry(int(ccta) if ccta is not None else sms), grp,
                          dev)
        if symmetric == "auto":
            from ..runtime.device import ranks_share_device
            symmetric = resolve_symmetric(symmetric, backend, ranks_share_device(grp, dev))
        self.symmetric = symmetric
        _, _, _, total = symmetric_layout(max_rows, N, band_rows, partial)
        if symmetric == "nvshmem":
            buf, ptrs = self._alloc_nvshmem(total, group, dev)
            mc = None
        else:
            buf, ptrs, mc = self._alloc_torch(total, dev, backend)
        self._attach(buf, ptrs, dev, sms, ccta, multicast=mc)
        torch.cuda.synchronize(dev)
        dist.barrier(group=self.group)  # every rank's counters are zero before anyone signals

    def _alloc_torch(self, total: int, dev, backend: str):
        """Torch symmetric memory (one rank per GPU): (zeroed uint8 buffer of ``total`` bytes,
        every rank's address of it in rank order, its multicast address with backend="switch"
        else None); keeps the handle in ``self._hdl``."""
        import torch
        # our own symmetric memory never asks for multicast (setdefault: only if unset)
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        import torch.distributed._symmetric_memory as symm_mem

        buf = symm_mem.empty(total, dtype=torch.uint8, device=dev)
        buf.zero_()
        self._runtime = None
        self._hdl = symm_mem.rendezvous(buf, self.group)
        ptrs = [int(p) for p in self._hdl.buffer_ptrs]
        # the tensor may sit at an offset inside the symmetric segment (mempool allocations);
        # allocations are made in the same order on every rank, so the offset is the same
        seg_off = buf.data_ptr() - ptrs[self.rank]
        seg_size = getattr(self._hdl, "buffer_size", None)
        if seg_off < 0 or (seg_size is not None and seg_off + total > int(seg_size)):
            raise RuntimeError(f"symmetric buffer at offset {seg_off} outside its segment")
        ptrs = [p + seg_off for p in ptrs]
        mc = None
        if backend == "switch":
            mc = int(self._hdl.multicast_ptr)
            if mc == 0:
                raise RuntimeError("the symmetric buffer has no multicast address (multicast "
                                   "was not set up by torch symmetric memory)")
            mc += seg_off
        return buf, ptrs, mc

    def _alloc_nvshmem(self, total: int, group, dev):
        """NVSHMEM symmetric memory through the process's ``NvshmemRuntime`` (shared with the
        combine's CommBuffer: NVSHMEM starts once per process), which also maps ranks that share
        a GPU: (zeroed uint8 buffer of ``total`` bytes, every rank's address of it as mapped
        here, in rank order: ``peer_table``). Collective; every rank raises the same error when
        some rank cannot reach a peer by load/store (the unicast kernel loads and stores peers'
        memory directly)."""
        import torch
        import torch.distributed as dist

        from ..runtime import collectives
        from ..runtime.nvshmem import NvshmemError, NvshmemRuntime
        rt = NvshmemRuntime.get(group)
        if (rt.rank, rt.world_size) != (self.rank, self.world):
            raise NvshmemError(f"the NVSHMEM runtime is rank {rt.rank} of {rt.world_size}, the "
                               f"band all-reduce's group rank {self.rank} of {self.world}")
        # int64 words, the dtype the combine's symmetric tensors already use (total is a multiple
        # of 256 bytes); the kernel's views are bytes of it
        sym = rt.alloc((total // 8,), torch.int64, note="(the band all-reduce's symmetric buffer)")
        table, unreachable = rt.peer_table(sym)
        bad = torch.tensor([len(unreachable)], dtype=torch.int64, device=dev)
        collectives.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        if int(bad.item()):
            rt.free(sym)
            here = (f"rank {self.rank} cannot reach ranks {list(unreachable)}" if unreachable
                    else "a rank of the group cannot reach all of its peers")
            raise NvshmemError("the band all-reduce loads and stores its peers' buffers directly, "
                               f"but {here} by load/store (no P2P mapping)")
        self._runtime, self._hdl, self._sym = rt, None, sym
        return sym.view(torch.uint8), [int(p) for p in table.tolist()]

    def release(self):
        """Collective (every rank, between calls): frees the NVSHMEM symmetric buffer now (the
        runtime keeps its tensors until freed; a layer that grows its all-reduce releases the
        old one). Torch symmetric memory is freed with the object as before. The object cannot
        run afterwards."""
        rt, sym = getattr(self, "_runtime", None), getattr(self, "_sym", None)
        if rt is not None and sym is not None:
            self.acc = self.partial = self._data = self.arrive = self.done = None
            self._buf = self._sym = self._runtime = None
            rt.free(sym)

    def _configure(self, rank, world, max_rows, N, backend, act2, band_rows, ready_rows, threads,
                   unroll, zero_acc, timeout_ns, arrive_ahead, partial, skip_ready_wait,
                   b2_per_band):
        """The options of rank ``rank`` of ``world`` (checked by ``_check_host_options`` first):
        defaults of threads / unroll, ``_check_options``, the attributes every call reads."""
        bf16 = partial == "bf16"
        d_threads, d_unroll = default_threads_unroll(partial, world)
        threads = d_threads if threads is None else threads
        unroll = d_unroll if unroll is None else unroll
        _check_options(world, backend, act2, threads, unroll, partial, b2_per_band)
        self.rank, self.world = rank, world
        self.max_rows, self.N, self.band_rows = max_rows, N, band_rows
        self.ready_rows = ready_rows
        self.backend, self.act2, self.timeout_ns = backend, act2, int(timeout_ns)
        self.partial_dtype = partial
        self._skip_ready_wait = bool(skip_ready_wait)
        self.b2_per_band = b2_per_band
        # a bf16 partial is overwritten by the producer, never added into: nothing to zero
        self.threads, self.unroll, self.zero_acc = threads, unroll, bool(zero_acc) and not bf16
        self.arrive_ahead = bool(arrive_ahead)

    def launch_geometry(self, ccta: int) -> dict:
        """What every rank's launch must share (CTA c of one rank waits on CTA c of every peer,
        and both must walk the same bands with the same chunks): the grid, the buffer's and
        bands' shape, the vector work per thread and the compiled variant's mode."""
        return dict(ccta=ccta, max_rows=self.max_rows, N=self.N, band_rows=self.band_rows,
                    ready_rows=self.ready_rows, threads=self.threads, unroll=self.unroll,
                    bf16=int(self.partial_dtype == "bf16"), zero_acc=int(self.zero_acc),
                    arrive_ahead=int(self.arrive_ahead), b2_per_band=int(self.b2_per_band))

    def _attach(self, buf, ptrs, dev, sms: int, ccta, multicast=None):
        """This rank's state on ``dev`` around its symmetric buffer ``buf`` (uint8, laid out as
        ``symmetric_layout`` says, zeroed): the data / ``arrive`` / ``done`` views, the peer
        tables (unicast: every rank's address of its buffer, ``ptrs``, in rank order; switch:
        the buffer's ``multicast`` address), the local flags, epoch, expectations and error
        word; ``ccta`` checked against the device's ``sms``."""
        import torch
        bf16 = self.partial_dtype == "bf16"
        max_rows, N = self.max_rows, self.N
        self.device = dev
        self.max_bands = -(-max_rows // self.band_rows)
        acc_bytes, flag_off, flag_bytes, total = symmetric_layout(max_rows, N, self.band_rows,
                                                                  self.partial_dtype)
        if buf.dtype != torch.uint8 or buf.numel() < total or len(ptrs) != self.world:
            raise ValueError(f"the symmetric buffer must be uint8 of >= {total} bytes and ptrs "
                             f"one address per rank ({self.world})")
        self._buf = buf
        if bf16:
            self.acc = None
            self.partial = self._buf[:acc_bytes].view(torch.bfloat16).view(max_rows, N)
        else:
            self.acc = self._buf[:acc_bytes].view(torch.float32).view(max_rows, N)
            self.partial = None
        self._data = self.partial if bf16 else self.acc  # the symmetric [max_rows, N] buffer
        self.arrive = self._buf[flag_off:flag_off + self.max_bands * 4].view(torch.int32)
        self.done = self._buf[flag_off + flag_bytes:
                              flag_off + flag_bytes + self.max_bands * 4].view(torch.int32)
        if self.backend == "switch":
            mc = int(multicast)
            self._remote = (mc, mc + flag_off, mc + flag_off + flag_bytes)
            self._tables = None
        else:
            self._tables = torch.tensor(
                [ptrs, [p + flag_off for p in ptrs], [p + flag_off + flag_bytes for p in ptrs]],
                dtype=torch.int64, device=dev)
            self._remote = tuple(int(self._tables[i].data_ptr()) for i in range(3))
        # one ready flag per ready_rows rows (the producer's bands)
        self.band_ready = torch.zeros(-(-max_rows // self.ready_rows), dtype=torch.int32,
                                      device=dev)
        self.epoch = torch.zeros(1, dtype=torch.int32, device=dev)
        # b2 when the call has none: [N], or one row per ready flag (b2_per_band)
        self._zero_b2 = torch.zeros(*self.b2_shape(max_rows), dtype=torch.bfloat16, device=dev)
        self.expected = torch.zeros(self.max_bands, dtype=torch.int32, device=dev)
        self.err = torch.zeros(ERR_WORDS, dtype=torch.int64, device=dev)
        self.ccta = int(ccta) if ccta is not None else sms
        if not 1 <= self.ccta <= sms:
            raise ValueError(f"ccta={self.ccta} must be in [1, {sms}] (CTAs must be co-resident)")
        self._fn = None
        self.ctas_per_sm = None  # set by compile() from the cubin

    @classmethod
    def _emulated_rank(cls, rank: int, bufs, dev, sms: int, max_rows: int, N: int, *,
                       act2: str = "none", band_rows: int = DEFAULT_BAND_ROWS, ccta=None,
                       threads=None, unroll=None, zero_acc: bool = True,
                       timeout_ns: int = DEFAULT_TIMEOUT_NS, arrive_ahead: bool = True,
                       ready_rows=None, partial: str = "fp32",
                       _test_skip_ready_wait: bool = False, b2_per_band: bool = False):
        """Rank ``rank`` of ``len(bufs)`` ranks emulated in ONE process on ONE device (unicast
        only; ``EmulatedRanks`` builds all of them): ``bufs[q]`` is rank q's buffer (uint8,
        ``symmetric_layout`` bytes, zeroed, on ``dev``); the peer tables list every rank's
        ``data_ptr()`` in rank order, as a real rank's list the symmetric-memory addresses. The
        calls, checks and kernel are the ones of a real rank; no process group, no symmetric
        memory. ``dev`` may be the CPU for host-side tests (no launch there)."""
        act2, ready_rows = _check_host_options(max_rows, N, "unicast", act2, band_rows,
                                               ready_rows, partial, b2_per_band)
        self = cls.__new__(cls)
        self.group, self._hdl, self._runtime, self.symmetric = None, None, None, None
        self._configure(rank, len(bufs), max_rows, N, "unicast", act2, band_rows, ready_rows,
                        threads, unroll, zero_acc, timeout_ns, arrive_ahead, partial,
                        _test_skip_ready_wait, b2_per_band)
        self._attach(bufs[rank], [int(b.data_ptr()) for b in bufs], dev, sms, ccta)
        return self

    def compile(self):
        """Compiles (once per variant) and checks co-residency: CTA c waits on CTA c of every
        peer, so all ``ccta`` CTAs of every rank must be resident at once on the ``ccta`` SMs the
        compute blocks leave free (the same variant, hence the same bound, on every rank)."""
        if self._fn is None:
            from ..runtime.device import require_coresident
            fn = _compiled_variant(self.world, self.backend, self.act2, self.threads,
                                   self.unroll, bool(self.zero_acc), self.arrive_ahead,
                                   self.partial_dtype, self._skip_ready_wait, self.b2_per_band)
            self.ctas_per_sm = coresident_ctas_per_sm(fn, self.threads)
            require_coresident(self.ccta, self.ccta, self.ctas_per_sm,
                               f"band all-reduce (threads={self.threads}, unroll={self.unroll}, "
                               f"world={self.world})")
            self._fn = fn
        return self._fn

    def b2_shape(self, M: int) -> tuple:
        """The b2 a call on M rows takes: (N,), or with b2_per_band (ceil(M / ready_rows), N)
        (more rows are allowed; the first ones are read)."""
        if self.b2_per_band:
            return (-(-M // self.ready_rows), self.N)
        return (self.N,)

    def __call__(self, M: int, b2=None, out=None, *, producer: bool = False, stream=None,
                 bump_epoch: bool = True):
        """All-reduce rows [0, M) of ``self.acc`` / ``self.partial`` (same M on every rank);
        returns ``out``
        (bf16 [M, N], allocated when None). Never synchronizes.

        ``producer=False``: the accumulator is complete in stream order (one kernel launch, no
        ready waits). ``producer=True``: advances ``epoch`` on the stream and waits for
        ``band_ready[b] == epoch``, written by a concurrently running producer.
        ``bump_epoch=False`` (with ``producer=True``): the caller has already advanced
        ``self.epoch`` in this stream's order (e.g. on the producer's stream, which this stream
        waited on), so the producer kernel and this call read the same epoch."""
        import torch
        import cuda.bindings.driver as cuda
        if isinstance(M, bool) or not isinstance(M, int) or not 0 <= M <= self.max_rows:
            raise ValueError(f"M={M!r} must be an int in [0, max_rows={self.max_rows}]")
        if self._data is None:
            raise RuntimeError("this BandAllReduce was released (its symmetric buffer is freed)")
        if out is None:
            out = torch.empty(M, self.N, dtype=torch.bfloat16, device=self.device)
        elif (out.dtype != torch.bfloat16 or tuple(out.shape) != (M, self.N)
              or not out.is_contiguous() or out.device != self.device):
            raise ValueError(f"out must be a contiguous bf16 [{M}, {self.N}] tensor on "
                             f"{self.device}")
        align = 16 if self.partial is not None else 8  # bf16: 16-byte vectors of out and b2
        if out.data_ptr() % align:
            raise ValueError(f"out must be {align}-byte aligned")
        if self.b2_per_band:
            rows = self.b2_shape(M)[0]
            if b2 is not None and (b2.dtype != torch.bfloat16 or b2.dim() != 2
                                   or b2.shape[0] < rows or b2.shape[1] != self.N
                                   or not b2.is_contiguous() or b2.device != self.device
                                   or b2.data_ptr() % align):
                raise ValueError(f"b2 must be a contiguous, {align}-byte aligned bf16 "
                                 f"[>= {rows}, {self.N}] tensor on {self.device} (b2_per_band: "
                                 f"one row per {self.ready_rows} rows)")
        elif b2 is not None and (b2.dtype != torch.bfloat16 or tuple(b2.shape) != (self.N,)
                                 or not b2.is_contiguous() or b2.device != self.device
                                 or b2.data_ptr() % align):
            raise ValueError(f"b2 must be a contiguous, {align}-byte aligned bf16 [{self.N}] "
                             f"tensor on {self.device}")
        fn = self.compile()
        if stream is None:
            stream = torch.cuda.current_stream(self.device)
        if M == 0:
            return out
        nb = -(-M // self.band_rows)
        if producer and bump_epoch:
            with torch.cuda.stream(stream):  # on the device: no host int changes (CUDA graphs)
                self.epoch.add_(1)
        fn(self._data.data_ptr(), self._remote[0], out.data_ptr(),
           (self._zero_b2 if b2 is None else b2).data_ptr(), M, self.N, self.band_rows,
           self.ready_rows, self.band_ready.data_ptr(), self.arrive.data_ptr(), self._remote[1],
           self.done.data_ptr(), self._remote[2], self.expected.data_ptr(),
           self.epoch.data_ptr(), self.err.data_ptr(),
           self.timeout_ns, self.rank, int(bool(producer)), min(self.ccta, nb),
           cuda.CUstream(stream.cuda_stream))
        return out

    def check(self):
        """Synchronize and raise RuntimeError if the kernel recorded a timeout."""
        import torch
        torch.cuda.synchronize(self.device)
        msg = describe_error(self.err.tolist())
        if msg:
            raise RuntimeError(msg)


# ---------------------------------------------------------------- G ranks on one GPU
def band_allreduce_traffic(M: int, N: int, band_rows: int, world: int, partial: str = "fp32",
                           zero_acc: bool = True) -> list:
    """Bytes each rank's kernel moves in one call on rows [0, M), counted band by band with the
    kernel's own arithmetic (16-byte vectors, the band's vectors cut into ``world`` chunks of
    ceil(nvec / world), rank r taking chunk r). Per rank a dict:

    - ``step2_read`` / ``step2_write``: chunk r of every band loaded from all G buffers and
      stored into all G buffers (its own included): G x 16 bytes per vector of the chunk;
      ``step2_peer_read`` / ``step2_peer_write``: the (G - 1) / G of it in peers' buffers (the
      NVLink bytes on a real group);
    - ``step3_read`` / ``step3_write``: the epilogue reads the whole band from the own buffer
      (16 bytes per vector) and writes ``out`` (bf16: 16 bytes per vector of 8; fp32: 8 bytes per
      vector of 4) and, fp32 with ``zero_acc``, zeroes the band (16 more bytes written);
    - ``b2_read``: b2 loads (bf16: 16 bytes per vector finalized in step 2; fp32: 8 bytes per
      vector in step 3), mostly cache hits (b2 is one row of N), kept out of ``total``;
    - ``total``: step 2 + step 3 reads and writes. Flags (2 G 4-byte reds and a few polls per
      band) are not counted."""
    if partial not in PARTIALS:
        raise ValueError(f"partial={partial!r}: choose from {PARTIALS}")
    bf16 = partial == "bf16"
    per_row = N // (8 if bf16 else 4)
    G = world
    keys = ("step2_read", "step2_write", "step2_peer_read", "step2_peer_write", "step3_read",
            "step3_write", "b2_read")
    out = [dict.fromkeys(keys, 0) for _ in range(G)]
    for b in range(-(-M // band_rows)):
        nvec = min(M - b * band_rows, band_rows) * per_row
        per = -(-nvec // G)
        for r in range(G):
            c = max(0, min(per, nvec - r * per))
            t = out[r]
            t["step2_read"] += G * c * 16
            t["step2_write"] += G * c * 16
            t["step2_peer_read"] += (G - 1) * c * 16
            t["step2_peer_write"] += (G - 1) * c * 16
            t["step3_read"] += nvec * 16
            if bf16:
                t["step3_write"] += nvec * 16
                t["b2_read"] += c * 16
            else:
                t["step3_write"] += nvec * 8 + (nvec * 16 if zero_acc else 0)
                t["b2_read"] += nvec * 8
    for t in out:
        t["total"] = t["step2_read"] + t["step2_write"] + t["step3_read"] + t["step3_write"]
    return out


class EmulatedRanks:
    """G ranks of the band all-reduce emulated on ONE GPU (tests and benches). The kernel only
    sees addresses, so G sets of buffers on one device, each rank's data / ``arrive`` / ``done``
    in one ``symmetric_layout`` allocation plus its own ``band_ready``, ``epoch``, ``expected``
    and error word, with peer tables that list all G data buffers in rank order, are G ranks to
    it. Each rank is a real ``BandAllReduce`` (``BandAllReduce._emulated_rank``: the same
    buffer views, tables, argument checks, compiled variant and launch as on a group of GPUs,
    without a process group or symmetric memory); a call launches rank r's kernel on its own
    CUDA stream (``streams[r]``, forked from the caller's stream and joined back into it), all
    G concurrently.

    Co-residency: the G grids share the GPU and CTA c of every rank waits on CTA c of every
    other, so ``world * ccta`` CTAs must be resident at once: refused unless
    ``world * ccta <= SMs`` (default ccta: SMs // world) and the kernel's CTAs-per-SM bound
    (from its cubin, ``require_coresident``) holds. The G launches must reach separate hardware
    queues: refused when ``CUDA_DEVICE_MAX_CONNECTIONS`` is set below world + 1. A rank waiting
    for one that was not launched (or was serialized behind it) ends at ``timeout_ns`` (counted
    from its CTA's start) with the timeout in its error word; nothing hangs.

    Not emulated: NVLink (every "peer" access is local HBM, so timings measure the kernel's
    per-SM issue / local-memory limits, not the link) and separate GPUs' caches (all ranks share
    one L2: an ordering bug that needs two GPUs to show, e.g. gpu scope where sys scope is
    needed, passes here).

        er = EmulatedRanks(2, 1024, 4096, partial="bf16", ccta=8, band_rows=32)
        for r, ar in enumerate(er):
            ar.partial[:M].copy_(parts[r])
        outs = er(M, b2=b2)          # one bf16 [M, N] per rank, bitwise equal
        er.check()                   # syncs; raises naming rank / band / flag on a timeout
    """

    def __init__(self, world: int, max_rows: int, N: int, *, ccta: int | None = None,
                 device=None, act2: str = "none", band_rows: int = DEFAULT_BAND_ROWS,
                 threads: int | None = None, unroll: int | None = None, zero_acc: bool = True,
                 timeout_ns: int = DEFAULT_TIMEOUT_NS, arrive_ahead: bool = True,
                 ready_rows: int | None = None, partial: str = "fp32",
                 _test_skip_ready_wait: bool = False, b2_per_band: bool = False):
        import torch
        from ..runtime.device import require_coresident
        if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 16:
            raise ValueError(f"world={world!r} must be an int in [1, 16]")
        _check_host_options(max_rows, N, "unicast", act2, band_rows, ready_rows, partial,
                            b2_per_band)
        conn = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "").strip()
        if conn.isdigit() and int(conn) < world + 1:
            raise RuntimeError(f"CUDA_DEVICE_MAX_CONNECTIONS={conn}: the {world} emulated ranks' "
                               f"kernels wait on each other from {world} streams (plus the "
                               f"caller's); fewer hardware queues can serialize them (unset it "
                               f"or set >= {world + 1})")
        if not torch.cuda.is_available():
            raise RuntimeError("EmulatedRanks needs a CUDA GPU")
        dev = torch.device("cuda") if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device={device!r} must be a CUDA device")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        sms = num_sms(dev)
        ccta = max(1, sms // world) if ccta is None else ccta
        if isinstance(ccta, bool) or not isinstance(ccta, int) or ccta < 1 \
                or world * ccta > sms:
            raise ValueError(f"ccta={ccta!r}: the {world} emulated ranks' grids share one GPU of "
                             f"{sms} SMs and wait on each other, so world * ccta CTAs must all "
                             f"be resident, one per SM: ccta in [1, {sms // world}]")
        total = symmetric_layout(max_rows, N, band_rows, partial)[3]
        with torch.cuda.device(dev):
            bufs = [torch.zeros(total, dtype=torch.uint8, device=dev) for _ in range(world)]
            opts = dict(act2=act2, band_rows=band_rows, ccta=ccta, threads=threads,
                        unroll=unroll, zero_acc=zero_acc, timeout_ns=timeout_ns,
                        arrive_ahead=arrive_ahead, ready_rows=ready_rows, partial=partial,
                        _test_skip_ready_wait=_test_skip_ready_wait, b2_per_band=b2_per_band)
            self.ranks = [BandAllReduce._emulated_rank(r, bufs, dev, sms, max_rows, N, **opts)
                          for r in range(world)]
            for ar in self.ranks:  # one variant (cached): compiled, its CTAs per SM read
                ar.compile()
            require_coresident(world * ccta, sms, self.ranks[0].ctas_per_sm,
                               f"{world} emulated ranks of the band all-reduce on one GPU "
                               f"(ccta={ccta} each, threads={self.ranks[0].threads})")
            # high priority, like the layer's communication stream; also a pool apart from the
            # default-priority streams (torch.cuda.graph's capture stream, a caller's producer
            # stream), so a rank's stream is never one of those when the pool wraps around
            try:
                lo, hi = torch.cuda.Stream.priority_range()
                prio = min(lo, hi)
            except Exception:  # noqa: BLE001 - older torch
                prio = -1
            self.streams = [torch.cuda.Stream(device=dev, priority=prio) for _ in range(world)]
            torch.cuda.synchronize(dev)
        self.world, self.device, self.sms, self.ccta = world, dev, sms, ccta
        self.max_rows, self.N, self.band_rows = max_rows, N, band_rows
        self.partial_dtype = partial

    def __len__(self):
        return self.world

    def __getitem__(self, r):
        return self.ranks[r]

    def __iter__(self):
        return iter(self.ranks)

    @property
    def data(self) -> list:
        """Every rank's symmetric ``[max_rows, N]`` buffer (bf16 ``partial`` or fp32 ``acc``)."""
        return [ar._data for ar in self.ranks]

    def __call__(self, M: int, b2=None, outs=None, *, ranks=None, producer: bool = False,
                 bump_epoch: bool = True, stream=None) -> list:
        """One all-reduce of rows [0, M) over the emulated ranks: ``streams[r]`` waits for
        ``stream`` (default: the current one), rank r's ``BandAllReduce.__call__`` launches on
        it, ``stream`` waits for all of them. ``outs``: one bf16 ``[M, N]`` per rank (allocated
        when None); ``ranks``: launch only these (a rank left out never arrives: the others end
        at their timeout); b2 / producer / bump_epoch: as ``BandAllReduce.__call__``, the same
        for every rank. Returns ``outs``. Never synchronizes (CUDA-graph capturable)."""
        import torch
        ranks = list(range(self.world)) if ranks is None else [int(r) for r in ranks]
        if len(set(ranks)) != len(ranks) or any(not 0 <= r < self.world for r in ranks):
            raise ValueError(f"ranks={ranks!r} must be distinct ranks in [0, {self.world})")
        if isinstance(M, bool) or not isinstance(M, int) or not 0 <= M <= self.max_rows:
            raise ValueError(f"M={M!r} must be an int in [0, max_rows={self.max_rows}]")
        with torch.cuda.device(self.device):
            cur = torch.cuda.current_stream(self.device) if stream is None else stream
            if outs is None:
                outs = [torch.empty(M, self.N, dtype=torch.bfloat16, device=self.device)
                        for _ in range(self.world)]
            if len(outs) != self.world:
                raise ValueError(f"outs must hold one tensor per rank ({self.world})")
            for r in ranks:  # every check before the first launch (a rank that raises after
                o = outs[r]  # another launched would leave that one waiting)
                if (o.dtype != torch.bfloat16 or tuple(o.shape) != (M, self.N)
                        or not o.is_contiguous() or o.device != self.device
                        or o.data_ptr() % 16):
                    raise ValueError(f"outs[{r}] must be a contiguous, 16-byte aligned bf16 "
                                     f"[{M}, {self.N}] tensor on {self.device}")
            if any(self.streams[r] == cur for r in ranks):
                raise ValueError("the caller's stream is one of the ranks' streams (their "
                                 "launches would be serialized behind each other)")
            for r in ranks:
                self.streams[r].wait_stream(cur)
            for r in ranks:
                self.ranks[r](M, b2=b2, out=outs[r], producer=producer, stream=self.streams[r],
                              bump_epoch=bump_epoch)
            for r in ranks:
                cur.wait_stream(self.streams[r])
        return outs

    def error_words(self) -> list:
        """Synchronizes; every rank's error buffer (``ERR_WORDS`` ints: code, rank, band, flag,
        observed, expected, elapsed ns, 0)."""
        import torch
        torch.cuda.synchronize(self.device)
        return [ar.err.tolist() for ar in self.ranks]

    def errors(self) -> list:
        """Synchronizes; ``describe_error`` of every rank's error buffer (None when clear)."""
        return [describe_error(w) for w in self.error_words()]

    def check(self):
        """Synchronizes; RuntimeError naming every rank whose kernel recorded a timeout."""
        bad = [f"emulated rank {r}: {m}" for r, m in enumerate(self.errors()) if m]
        if bad:
            raise RuntimeError("; ".join(bad))
