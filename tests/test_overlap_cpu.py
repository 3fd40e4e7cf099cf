"""CPU-only checks of the communication half: imports without CuTe DSL / nvshmem4py / CUDA, and
clear errors before any kernel runs."""
import pytest
import torch


def test_modules_import_without_gpu_stack():
    import moe_overlap.overlap as ov
    import moe_overlap.runtime.nvshmem as rt
    import moe_overlap.kernels.consumer as cons
    import moe_overlap.kernels.scale as sc
    assert ov.TRANSPORTS == cons.TRANSPORTS == ("nvlink", "nvshmem")
    assert hasattr(rt, "NvshmemRuntime") and hasattr(sc, "Scale")


def test_runtime_needs_a_process_group():
    from moe_overlap.runtime.nvshmem import NvshmemError, NvshmemRuntime
    with pytest.raises(NvshmemError, match="torch.distributed"):
        NvshmemRuntime()


def test_consumer_rejects_bad_transport_before_compiling():
    from moe_overlap.kernels.consumer import Consumer
    with pytest.raises(ValueError, match="transport"):
        Consumer("pigeon")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_overlap_needs_cuda():
    from moe_overlap.overlap import OverlapCombine, OverlapError
    with pytest.raises(OverlapError, match="CUDA"):
        OverlapCombine()
