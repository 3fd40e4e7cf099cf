"""A stand-in for the combine's consumer beside the producer GEMM in GPU tests: a grid of k CTAs,
each holding one SM (more shared memory than leaves room for a producer CTA beside it) for
``hold_ns``, and a one-thread kernel on the producer's stream that returns once all k are
resident, so that a producer launched after it finds only the other SMs free and the rest of its
grid starts ``hold_ns`` later (a second wave). Built here, compiled by the compile-only tests
too (tests/test_grouped_gemm_tile_fetch_compile.py)."""
HOLD_SMEM_BYTES = 120 * 1024  # two do not fit one SM (228 KB), nor one beside a producer CTA
HOLD_THREADS = 128


def build_sm_hold():
    """``launch(started, hold_ns, k, hold_stream, wait_stream)``: started is the address of an
    int32 zero on the device (the hold CTAs count themselves on it)."""
    import cutlass
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64

    from moe_overlap.kernels import primitives as P

    @cute.kernel
    def hold_kernel(started: Int64, hold_ns: Int64):
        tid, _, _ = P.thread_block_grid()
        alloc = cutlass.memory.SmemAllocator()
        buf = alloc.allocate_array(Int32, HOLD_SMEM_BYTES // 4, byte_alignment=16).toint()
        if tid == Int32(0):
            P.st_shared_s32(buf, Int32(0))
            P.red_release_gpu_add_s32(started, Int32(1))
            t0 = P.globaltimer()
            t = t0
            while t - t0 < hold_ns:
                t = P.globaltimer()

    @cute.kernel
    def wait_kernel(started: Int64, k: Int32):
        v = P.ld_acquire_gpu_s32(started)
        while v < k:
            v = P.ld_acquire_gpu_s32(started)

    @cute.jit
    def launch(started: Int64, hold_ns: Int64, k: Int32, hold_stream: cuda.CUstream,
               wait_stream: cuda.CUstream):
        hold_kernel(started, hold_ns).launch(grid=[k, 1, 1], block=[HOLD_THREADS, 1, 1],
                                             stream=hold_stream)
        wait_kernel(started, k).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=wait_stream)

    return launch


def sm_hold_example_args():
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    return [Int64(0), Int64(1), Int32(1), cuda.CUstream(0), cuda.CUstream(0)]
