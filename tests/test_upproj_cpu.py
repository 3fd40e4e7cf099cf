"""CPU checks of the up-projection's host pieces (issue 39 item 2): the SwiGLU weight layout
(``interleave_gate_up``) and the torch reference of the arrival-gated SwiGLU GEMM."""
import torch

from moe_overlap.combine.grouped_gemm import interleave_gate_up, up_projection_reference


def _bands(rows, tile_m, experts):
    nb = rows // tile_m
    be = torch.tensor([b * experts // nb for b in range(nb)], dtype=torch.int32)
    bs = torch.arange(nb, dtype=torch.int32) * tile_m
    sched = torch.arange(nb, dtype=torch.int32).flip(0)
    return be, bs, sched, torch.tensor([nb], dtype=torch.int32)


def test_interleave_puts_matching_gate_up_columns_in_one_tile():
    E, D, I, tile_n = 2, 8, 192, 128
    w = torch.arange(E * D * 2 * I, dtype=torch.float32).reshape(E, D, 2 * I)
    wi = interleave_gate_up(w, tile_n)
    h = tile_n // 2
    for j in range(2 * I // tile_n):
        tile = wi[..., j * tile_n:(j + 1) * tile_n]
        assert torch.equal(tile[..., :h], w[..., j * h:(j + 1) * h])  # gate columns
        assert torch.equal(tile[..., h:], w[..., I + j * h:I + (j + 1) * h])  # their up columns
    # a permutation of the columns: nothing lost, nothing repeated
    assert torch.equal(wi.sort(dim=2).values, w.sort(dim=2).values)


def test_reference_matches_moe_layer_formula_and_skips_unarrived_bands():
    torch.manual_seed(0)
    E, D, I, tile_m = 3, 64, 96, 16
    rows = 8 * tile_m
    x = torch.randn(rows, D).to(torch.bfloat16)
    w = (torch.randn(E, D, 2 * I) / D ** 0.5).to(torch.bfloat16)
    be, bs, sched, nb = _bands(rows, tile_m, E)
    y = torch.full((rows, I), float("nan"), dtype=torch.bfloat16)
    up_projection_reference(x, w, y, be, bs, sched, nb, tile_m)
    # independent: the MoELayer's formula, per band in float64
    for b in range(rows // tile_m):
        xb = x[b * tile_m:(b + 1) * tile_m].double()
        we = w[int(be[b])].double()
        want = torch.nn.functional.silu(xb @ we[:, :I]) * (xb @ we[:, I:])
        got = y[b * tile_m:(b + 1) * tile_m].double()
        assert torch.allclose(got, want, rtol=8e-3, atol=8e-3)
    # the interleaved layout paired tile by tile (as the kernel's epilogue) is the same math
    tile_n = 64
    wi = interleave_gate_up(w, tile_n).float()
    h = tile_n // 2
    for b in range(rows // tile_m):
        acc = x[b * tile_m:(b + 1) * tile_m].float() @ wi[int(be[b])]
        out = torch.cat([torch.nn.functional.silu(acc[:, j * tile_n:j * tile_n + h])
                         * acc[:, j * tile_n + h:(j + 1) * tile_n]
                         for j in range(2 * I // tile_n)], dim=1)
        assert torch.allclose(out.to(torch.bfloat16).float(),
                              y[b * tile_m:(b + 1) * tile_m].float(), rtol=2e-2, atol=2e-2)
    # bands whose arrival flag is not the epoch are not stored
    epoch = torch.tensor([5], dtype=torch.int32)
    arrived = torch.full((rows // tile_m,), 5, dtype=torch.int32)
    arrived[3] = 4
    y2 = torch.full_like(y, float("nan"))
    up_projection_reference(x, w, y2, be, bs, sched, nb, tile_m, arrived, epoch)
    assert torch.isnan(y2[3 * tile_m:4 * tile_m].float()).all()
    keep = torch.ones(rows, dtype=torch.bool)
    keep[3 * tile_m:4 * tile_m] = False
    assert torch.equal(y2[keep].view(torch.int16), y[keep].view(torch.int16))
