"""GPU checks (one GPU; written without one, NOT RUN yet) of the arrival-gated SwiGLU
up-projection (GroupedGemm(signal=False, wait_arrival=True, swiglu=True), issue 39 item 2).

The writer of the rows is a stand-in for the dispatch's expand (whose per-band flags are not
written yet): a torch copy of x into the plan rows, then band_arrived[:] = epoch, in one stream
order (writer, then GEMM) and with the GEMM launched first on another stream (it must really wait;
ccta leaves SMs free for the writer). Against ``up_projection_reference``: <= 2e-2 (bf16 out)
and bitwise across the two orders; a band whose flag never comes times out
(ERR_ARRIVAL_TIMEOUT naming it) and no tile is stored after it.
"""
import pytest
import torch

from conftest import require_module

pytestmark = [pytest.mark.gpu]

require_module(gpus=1, nvshmem=False)

E, D, I, TILE_M = 4, 512, 512, 128


def _case(seed=0):
    from moe_overlap.combine.grouped_gemm import interleave_gate_up
    g = torch.Generator().manual_seed(seed)
    nb = 12
    rows = nb * TILE_M
    x = torch.randn(rows, D, generator=g).to(torch.bfloat16).cuda()
    w = (torch.randn(E, D, 2 * I, generator=g) / D ** 0.5).to(torch.bfloat16).cuda()
    be = torch.tensor([b * E // nb for b in range(nb)], dtype=torch.int32).cuda()
    bs = (torch.arange(nb, dtype=torch.int32) * TILE_M).cuda()
    sched = torch.arange(nb, dtype=torch.int32).cuda()
    num = torch.tensor([nb], dtype=torch.int32).cuda()
    return x, w, interleave_gate_up(w, 256), be, bs, sched, num


@pytest.mark.parametrize("order", ["writer_first", "gemm_first"])
def test_gated_swiglu_up_projection(order):
    from moe_overlap.combine.grouped_gemm import GroupedGemm, up_projection_reference
    x, w, wi, be, bs, sched, num = _case()
    nb = be.numel()
    gemm = GroupedGemm(signal=False, wait_arrival=True, swiglu=True)
    epoch = torch.tensor([7], dtype=torch.int32, device="cuda")
    ready = torch.zeros(nb, dtype=torch.int32, device="cuda")
    arrived = torch.zeros(nb, dtype=torch.int32, device="cuda")
    err = torch.zeros(8, dtype=torch.int64, device="cuda")
    xp = torch.full_like(x, float("nan"))
    y = torch.full((x.shape[0], I), float("nan"), dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()

    def write():
        xp.copy_(x)
        arrived.fill_(7)

    def run():
        gemm(xp, wi, y, be, bs, sched, num, ready, epoch, ccta=16, err=err, band_arrived=arrived)

    if order == "writer_first":
        write()
        run()
    else:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda._sleep(50_000_000)  # the GEMM is spinning on the flags meanwhile
        write()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert int(err[0]) == 0
    ref = up_projection_reference(x.cpu(), w.cpu(), torch.empty(x.shape[0], I,
                                  dtype=torch.bfloat16), be.cpu(), bs.cpu(), sched.cpu(),
                                  num.cpu(), TILE_M)
    assert torch.allclose(y.cpu().float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_band_that_never_arrives_times_out_and_is_not_stored():
    from moe_overlap.combine.grouped_gemm import GroupedGemm
    from moe_overlap.kernels import errors as Er
    x, w, wi, be, bs, sched, num = _case(1)
    nb = be.numel()
    gemm = GroupedGemm(signal=False, wait_arrival=True, swiglu=True,
                       arrival_timeout_ns=20_000_000)
    epoch = torch.tensor([3], dtype=torch.int32, device="cuda")
    arrived = torch.full((nb,), 3, dtype=torch.int32, device="cuda")
    arrived[5] = 2
    err = torch.zeros(8, dtype=torch.int64, device="cuda")
    y = torch.full((x.shape[0], I), float("nan"), dtype=torch.bfloat16, device="cuda")
    gemm(x, wi, y, be, bs, sched, num, torch.zeros_like(arrived), epoch, err=err,
         band_arrived=arrived)
    torch.cuda.synchronize()
    e = err.cpu().tolist()
    assert e[0] == Er.ERR_ARRIVAL_TIMEOUT and e[2] == 5 and e[4] == 2 and e[5] == 3
    assert torch.isnan(y[5 * TILE_M:6 * TILE_M].float()).all()
