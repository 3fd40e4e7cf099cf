"""The SIMT kernels' CTA-wide exclusive scan (``plan_kernel.simt_helpers().block_scan``) on CTAs
of fewer than 32 warps, run as compiled PTX on the host emulator, whose shared memory starts
poisoned as a GPU's holds an earlier kernel's data: the totals and prefixes must not include
the scratch words of warps the CTA does not have (a wrong total sends the dispatch expand's
copy loop past its lists: bench/NOTES.md, "The overlapped dispatch's fault, found")."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx  # noqa: E402
from ptx_emulator import Emulator  # noqa: E402

pytestmark = pytest.mark.compile


def _scan_launcher(NT, pass_warps):
    import cutlass.cute as cute
    import cuda.bindings.driver as cuda
    from cutlass import Int32, Int64
    from moe_overlap.combine.plan_kernel import simt_helpers
    from moe_overlap.kernels import primitives as P
    H = simt_helpers()

    @cute.kernel
    def scan_kernel(vals: Int64, ex_out: Int64, tot_out: Int64):
        tidx, _, _ = P.thread_block_grid()
        lane = tidx & Int32(31)
        warp = tidx >> Int32(5)
        alloc = cutlass.memory.SmemAllocator()
        scr = alloc.allocate_array(cutlass.Int32, 32, byte_alignment=16).toint()
        v = P.ld_s32(vals + Int64(tidx) * Int64(4))
        if cutlass.const_expr(pass_warps):
            (ex,), (tot,) = H.block_scan([v], scr, lane, warp, NT // 32)
        else:
            (ex,), (tot,) = H.block_scan([v], scr, lane, warp)
        P.st_s32(ex_out + Int64(tidx) * Int64(4), ex)
        P.st_s32(tot_out + Int64(tidx) * Int64(4), tot)

    @cute.jit
    def launch(vals: Int64, ex_out: Int64, tot_out: Int64, stream: cuda.CUstream):
        scan_kernel(vals, ex_out, tot_out).launch(grid=[1, 1, 1], block=[NT, 1, 1],
                                                 stream=stream)

    return launch


def _run(NT, pass_warps):
    import cuda.bindings.driver as cuda
    from cutlass import Int64
    ptx = compile_ptx(_scan_launcher(NT, pass_warps), Int64(0), Int64(0), Int64(0),
                      cuda.CUstream(0))
    vals = torch.randint(0, 5, (NT,), generator=torch.Generator().manual_seed(NT),
                         dtype=torch.int32)
    mem = bytearray(0x1000) + vals.numpy().tobytes() + bytearray(8 * NT + 0x1000)
    a_vals, a_ex, a_tot = 0x1000, 0x1000 + 4 * NT, 0x1000 + 8 * NT
    Emulator(ptx, mem=mem, shared_bytes=1024).launch(1, NT, [a_vals, a_ex, a_tot])
    ex = torch.frombuffer(bytearray(mem[a_ex:a_ex + 4 * NT]), dtype=torch.int32)
    tot = torch.frombuffer(bytearray(mem[a_tot:a_tot + 4 * NT]), dtype=torch.int32)
    return vals, ex, tot


@pytest.mark.parametrize("NT", [64, 256])
def test_block_scan_of_a_small_cta_ignores_the_scratch_of_warps_it_lacks(NT):
    vals, ex, tot = _run(NT, True)
    assert torch.equal(ex, torch.cumsum(vals, 0, dtype=torch.int32) - vals)
    assert (tot == int(vals.sum())).all()


def test_without_the_warp_count_the_total_takes_the_stale_words():
    # the poisoned scratch is what makes the count matter: the default (32 warps) sums it
    vals, _, tot = _run(64, False)
    assert not (tot == int(vals.sum())).all()
