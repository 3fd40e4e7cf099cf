"""MoELayer(backend="overlap")'s flag wiring, emulated without a GPU (issue 39 items 2-3): the
dispatch's send and expand PTX (the layer's expand_wait) with signal_arrival run for W = 2
emulated ranks (tests/ptx_emulator.py through test_dispatch_overlap_emulated's ``Ranks``), then the
up-projection's torch reference (``up_projection_reference``: the arrival-gated SwiGLU GEMM,
which stores a band only where band_arrived[b] == epoch) reads the expand's output and flags as
the layer passes them: flags of the plan's band capacity, band ids of the plan's band tables,
the epoch of the dispatch call (the layer forks the GEMM before the combine advances it).

Checked: every scheduled band of every rank is stored and bitwise the same GEMM on the
reference dispatch's output (so the expand's row // tile_m flags are the plan's band ids, none
missing); with the epoch the combine would have advanced to, nothing is stored (the fork's
place matters). Concurrency and memory ordering stay for tests/test_moe_layer_overlap_gpu.py."""
import os

import pytest
import torch

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from moe_overlap.combine.dispatch_index import arrival_schedule  # noqa: E402
from moe_overlap.combine.grouped_gemm import up_projection_reference  # noqa: E402
from moe_overlap.moe_layer import MoELayerOptions  # noqa: E402
from moe_overlap.combine.plan import plan_combine  # noqa: E402
from test_dispatch_overlap_emulated import (CASES, TILE_M, Ranks, _inputs,  # noqa: E402
                                            _layout_of, _reference)

pytestmark = pytest.mark.compile

I = 64  # the experts' intermediate width of the emulated layer


def _bits(t):
    return t.view(torch.int16)


@pytest.mark.parametrize("call", [0, 1])
def test_expand_flags_gate_exactly_the_plans_scheduled_bands(call):
    W = 2
    El, D, tokens = CASES[W][:3]
    ref = _reference(W)
    counts = ref[0][call][0]
    plans = [plan_combine(counts, r, tile_m=TILE_M, layout=_layout_of(call)) for r in range(W)]
    ranks = Ranks(W, max(max(t) for t in tokens), max(p.row_capacity for p in plans),
                  arrival=True, wait=MoELayerOptions().expand_wait)  # the layer's expand
    for c in range(call + 1):  # the earlier call too: flags of an old epoch stay behind
        xs, ids = _inputs(W, c)
        ps = [plan_combine(ref[0][c][0], r, tile_m=TILE_M, layout=_layout_of(c))
              for r in range(W)]
        ranks.set_inputs(xs, ids, ref[0][c][0], ps, [p.row_capacity for p in ps])
        ranks.call()
    epoch = torch.tensor([call + 1], dtype=torch.int32)  # the dispatch's: the GEMM's epoch
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(El, D, 2 * I, generator=g) / D ** 0.5).to(torch.bfloat16)
    for r, p in enumerate(plans):
        rows, cap = p.row_capacity, p.band_capacity
        x_plan = torch.frombuffer(bytearray(ranks.out(r)), dtype=torch.bfloat16).view(rows, D)
        flags = torch.tensor(ranks.flags(r)[:cap], dtype=torch.int32)  # the layer's size
        # the layer's up-projection order (MoELayer._forward_overlap)
        args = (p.band_expert, p.band_src_row, arrival_schedule(p, counts), p.num_bands,
                TILE_M)
        nan = lambda: torch.full((rows, I), float("nan"), dtype=torch.bfloat16)  # noqa: E731
        got = up_projection_reference(x_plan, w, nan(), *args, flags, epoch)
        want = up_projection_reference(ref[r][call][1], w, nan(), *args)
        total = int(p.total_rows)
        assert total > 0 and not torch.isnan(got[:total].float()).any(), (call, r)
        assert torch.equal(_bits(got), _bits(want)), (call, r)
        late = up_projection_reference(x_plan, w, nan(), *args, flags, epoch + 1)
        assert torch.isnan(late.float()).all(), (call, r)
