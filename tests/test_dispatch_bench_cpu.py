"""CPU smoke test of bench/bench_dispatch.py: it runs, its checks pass on the library's placement
and catch a broken one."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

import bench_dispatch as BD  # noqa: E402


def test_bench_runs_and_writes_rows(tmp_path):
    BD.main(["--tokens", "48", "--rounds", "1", "--models", "qwen3-30b-a3b,mixtral-8x7b",
             "--out", str(tmp_path)])
    (f,) = os.listdir(tmp_path)
    rows = json.load(open(tmp_path / f))["rows"]
    assert [r["name"] for r in rows] == ["qwen3-30b-a3b@48", "mixtral-8x7b@48"]
    assert all(r["bitwise_gather_eq_scatter"] and r["plan_rows"] >= r["received_rows"]
               for r in rows)


@pytest.mark.parametrize("fault", ["swap", "padding"])
def test_a_broken_placement_fails(fault):
    def broken(x):
        from moe_overlap.combine.plan import count_assignments, plan_combine
        from moe_overlap.routing import route
        E, k, _, _ = BD.MODELS["qwen3-30b-a3b"]
        ids, _ = route(48, E, k, "balanced", seed=0)
        counts = count_assignments(ids, E)[None]
        out = BD.dispatch_scatter(x, ids, plan_combine(counts, 0, tile_m=128), counts)
        if fault == "swap":
            out[[0, 1]] = out[[1, 0]]  # two rows of expert 0 (>= 2 rows at 48 x 8 / 128)
        else:
            out[-1] = 1.0  # the last row is padding here
        return out
    with pytest.raises(RuntimeError):
        BD.run_shape("qwen3-30b-a3b", 48, 1, 0, placement=broken)


@pytest.mark.parametrize("fault,match", [(None, None), ("swap", "plan rows"),
                                         ("padding", "padding")])
def test_layout_check_is_independent_of_the_plan_math(fault, match):
    from moe_overlap.combine import dispatch_to_plan
    from moe_overlap.combine.plan import count_assignments, plan_combine
    from moe_overlap.routing import route
    E, k, _, N = BD.MODELS["qwen3-30b-a3b"]
    ids, _ = route(48, E, k, "balanced", seed=1)
    counts = count_assignments(ids, E)[None]
    plan = plan_combine(counts, 0, tile_m=128)
    x = torch.randn(48, 16).to(torch.bfloat16)
    got = dispatch_to_plan(x, ids, plan, counts)
    e = int(torch.nonzero(counts[0] >= 2)[0])
    r0 = int(plan.expert_row_start[e])
    if fault == "swap":
        got[[r0, r0 + 1]] = got[[r0 + 1, r0]]
    elif fault == "padding":
        got[r0 + int(counts[0, e])] = 1.0  # the row after expert e's rows: padding
    if match is None:
        BD.check_layout("t", got, BD.permute(x, ids), plan, counts)
    else:
        with pytest.raises(RuntimeError, match=match):
            BD.check_layout("t", got, BD.permute(x, ids), plan, counts)
