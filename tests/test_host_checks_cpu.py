"""The kernels' shared host-side argument checks (moe_overlap/kernels/host_checks.py)."""
import pytest
import torch

from moe_overlap.kernels.host_checks import chained_gemm_dims, check_tensors


def test_check_tensors_names_the_bad_argument():
    x = torch.zeros(4, 8)
    check_tensors(dict(x=x, w=torch.zeros(8, 2)), x, need_cuda=False)
    with pytest.raises(TypeError, match="w must be a torch.Tensor, got list"):
        check_tensors(dict(x=x, w=[1, 2]), x, need_cuda=False)
    with pytest.raises(ValueError, match="w must be contiguous"):
        check_tensors(dict(x=x, w=torch.zeros(8, 2).t()), x, need_cuda=False)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        check_tensors(dict(x=x), x, need_cuda=True)
    with pytest.raises(ValueError, match="w is on meta, x on cpu"):
        check_tensors(dict(x=x, w=torch.empty(2, device="meta")), x, need_cuda=False)


def test_chained_gemm_dims():
    x, w1, w2 = torch.zeros(3, 8), torch.zeros(8, 16), torch.zeros(16, 4)
    assert chained_gemm_dims(x, w1, w2) == (3, 8, 16, 4)
    with pytest.raises(ValueError, match="P mismatch"):
        chained_gemm_dims(x, torch.zeros(7, 16), w2)
    with pytest.raises(ValueError, match="hidden mismatch"):
        chained_gemm_dims(x, w1, torch.zeros(15, 4))
    with pytest.raises(ValueError, match="at least one row"):
        chained_gemm_dims(torch.zeros(0, 8), w1, w2)
    with pytest.raises(ValueError, match="expected x"):
        chained_gemm_dims(torch.zeros(8), w1, w2)
