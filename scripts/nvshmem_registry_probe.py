"""Probe of the stale NVSHMEM registration (bench/NOTES.md, "Session 20: the one-process crash of
test_overlap_gpu, by reading"). Diagnostic only; prints one line per step and a verdict per rank.

    python scripts/nvshmem_registry_probe.py [W]      # W GPU ranks (launch backend "cuda")

On each rank, after NVSHMEM starts:
  old path (what Consumer.compile did before the fix: every layer compiled and registered its own
  nvshmem consumer): compile build X and register it (cute_compile_helper), read the address and
  the bytes of its ``nvshmemi_device_state_d``; compile another kernel (the scale: CuTe DSL then
  drops its own reference, as in a layer's warm-up); drop the consumer (the layer is dropped: CuTe
  DSL unloads the library; NVSHMEM keeps the address); compile and register build X again.
  The theory predicts: the second library at the first one's address and its device state not
  the initialised one (NVSHMEM counted the address as initialised and wrote nothing: zeros, its
  kernels would fault on their first put or signal).
  fixed path (combine.consumer._nvshmem_consumer): the same build twice is one library, its state
  the initialised one.
No kernel is launched: a zero state is read, not run.
"""
import gc
import sys
import time
import weakref


def say(rank, msg):
    print(f"[rank {rank} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _state(handle):
    """(address, size, bytes) of a loaded library's nvshmemi_device_state_d."""
    import numpy as np
    from cuda.bindings import driver as drv
    err, dptr, size = drv.cuLibraryGetGlobal(drv.CUlibrary(int(handle)), b"nvshmemi_device_state_d")
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuLibraryGetGlobal: {err}")
    buf = np.zeros(size, dtype=np.uint8)
    (err,) = drv.cuMemcpyDtoH(buf.ctypes.data, dptr, size)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuMemcpyDtoH: {err}")
    return int(dptr), int(size), buf.tobytes()


def worker(rank, world):
    import torch
    from nvshmem.core.interop.cute import cute_compile_helper
    import nvshmem.core
    from moe_overlap.combine import consumer as C
    from moe_overlap.combine.scale import compile_scale
    from moe_overlap.launch import rank_device
    from moe_overlap.runtime.nvshmem import NvshmemRuntime
    torch.zeros(1, device=rank_device())
    rt = NvshmemRuntime.get(None)
    v = nvshmem.core.get_version()
    say(rank, f"NVSHMEM {v.libnvshmem_version} (nvshmem4py {v.nvshmem4py_version}) up, "
              f"{rt.world_size} PEs")
    opts = dict(local_copy=True, copy="ldst", stages=C.DEFAULT_STAGES,
                chunk_bytes=C.DEFAULT_CHUNK, lookahead=C.DEFAULT_LOOKAHEAD, arrival="counter")
    out = {}
    # ---- old path
    launch = C.build_consumer("nvshmem", C.DEFAULT_THREADS, C.DEFAULT_UNROLL, **opts)
    fn, obj = cute_compile_helper(launch, *C.consumer_example_args())
    a1, size, s1 = _state(obj.handle)
    nz1 = sum(b != 0 for b in s1)
    say(rank, f"old path, first library: state at {a1:#x} ({size} B), {nz1} nonzero bytes")
    module = weakref.ref(fn.jit_module)  # the owner of the loaded library (CuTe DSL)
    del launch
    compile_scale(2)  # another compile: CuTe DSL's last-function reference moves on
    del fn, obj
    gc.collect()  # the layer dropped: its library unloaded, NVSHMEM keeps the address
    unloaded = module() is None or getattr(module(), "is_unloaded", lambda: False)()
    say(rank, f"old path, first library unloaded after the drop: {unloaded}")
    launch = C.build_consumer("nvshmem", C.DEFAULT_THREADS, C.DEFAULT_UNROLL, **opts)
    fn2, obj2 = cute_compile_helper(launch, *C.consumer_example_args())
    a2, _, s2 = _state(obj2.handle)
    say(rank, f"old path, second library: state at {a2:#x}, {sum(b != 0 for b in s2)} nonzero "
              f"bytes, {'equal to' if s2 == s1 else 'NOT equal to'} the first's "
              f"({'same address' if a2 == a1 else 'another address'})")
    out.update(old_first_nonzero=nz1, old_unloaded=unloaded, old_same_address=a2 == a1,
               old_second_initialised=s2 == s1)
    # ---- fixed path
    f1 = C._nvshmem_consumer(C.DEFAULT_THREADS, 2, opts)  # unroll 2: a build not loaded above
    f2 = C._nvshmem_consumer(C.DEFAULT_THREADS, 2, opts)
    _, _, s3 = _state(f1[1].handle)
    say(rank, f"fixed path: one library for two layers: {f1 is f2}, state "
              f"{'equal to' if s3 == s1 else 'NOT equal to'} the first old-path library's")
    out.update(fixed_shared=f1 is f2, fixed_initialised=s3 == s1)
    out["verdict"] = ("theory confirmed: stale registration, second library not initialised"
                      if nz1 and out["old_same_address"] and s2 != s1 else
                      "theory not confirmed on this step (see the numbers)")
    say(rank, out["verdict"])
    rt.barrier()
    return out


if __name__ == "__main__":
    from moe_overlap.launch import spawn
    W = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    print(spawn(worker, W, backend="cuda", join_timeout_s=300, hard_exit=True))
