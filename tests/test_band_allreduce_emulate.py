"""CPU model of the band all-reduce schedule (same band / chunk / column arithmetic as the kernel):
every vector is reduced exactly once, every rank ends with act2(sum + b2), accumulators zeroed.
No CuTe DSL or GPU needed; the GPU test runs the real kernel against NCCL."""
import pytest
import torch

from moe_overlap.ffn.activations import activation
from moe_overlap.ffn.band_allreduce import emulate_band_allreduce


@pytest.mark.parametrize("G,M,N,band_rows,grid,act2,bias", [
    (2, 256, 64, 128, 1, "none", False),
    (2, 300, 36, 128, 3, "silu", True),  # ragged last band, N/4 odd
    (4, 77, 8, 16, 2, "gelu", True),  # chunk smaller than a row, some ranks' chunks empty
    (8, 5, 4, 128, 4, "relu", False),  # 5 vectors for 8 ranks
    (3, 129, 12, 32, 8, "gelu_tanh", True),  # grid > bands
])
def test_model_matches_sum(G, M, N, band_rows, grid, act2, bias):
    g = torch.Generator().manual_seed(G * 1000 + M)
    parts = [torch.randn(M + 3, N, generator=g) for _ in range(G)]  # rows past M untouched
    accs = [p.clone() for p in parts]
    b2 = (torch.randn(N, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    outs, cov = emulate_band_allreduce(accs, M, band_rows, b2, act2, grid)
    assert bool((cov == 1).all()), cov
    s = sum(p[:M].double() for p in parts)
    ref = activation(s + (b2.double() if bias else 0), act2)
    for r in range(G):
        err = ((outs[r].double() - ref).abs() / (ref.abs() + 1e-2)).max().item()
        assert err < 1e-2, (r, err)
        assert bool((accs[r][:M] == 0).all())
        assert torch.equal(accs[r][M:], parts[r][M:])
    assert all(torch.equal(outs[0], o) for o in outs[1:])
