"""CPU checks of what the 2-GPU sweep and race validation compute: the shape table, the per-point
fields, the exchange pieces of the copy-engine floor, and the poison / compare verdicts."""
import math

import pytest
import torch

from moe_overlap.combine.baseline import SameScaleBaseline, exchange_plan
from moe_overlap.combine.metrics import point_fields
from moe_overlap.combine.race_check import compare, poison_, summarize
from moe_overlap.combine.shapes import MODELS, check_world, parse_shapes


def test_shape_table_has_the_model_shapes_at_both_token_counts():
    got = {s["name"]: s for s in parse_shapes("models")}
    assert got["deepseek-v3@4096"] == dict(tokens=4096, experts=256, topk=8, N=7168, K=2048,
                                           name="deepseek-v3@4096")
    expect = {"deepseek-v3": (256, 8, 2048, 7168), "qwen3-235b-a22b": (128, 8, 1536, 4096),
              "qwen3-30b-a3b": (128, 8, 768, 2048), "mixtral-8x7b": (8, 2, 14336, 4096)}
    assert MODELS == expect
    for m, (E, k, K, N) in expect.items():
        for T in (4096, 16384):
            s = got[f"{m}@{T}"]
            assert (s["tokens"], s["experts"], s["topk"], s["K"], s["N"]) == (T, E, k, K, N)
    synth = parse_shapes("synthetic")
    assert [(s["K"], s.get("name")) for s in synth] == [(1024, None), (2048, None)]
    assert len(parse_shapes("all")) == len(synth) + 8
    assert parse_shapes("mixtral-8x7b@2048,64x8x2x256x128") == [
        dict(tokens=2048, experts=8, topk=2, N=4096, K=14336, name="mixtral-8x7b@2048"),
        dict(tokens=64, experts=8, topk=2, N=256, K=128)]
    with pytest.raises(ValueError):
        parse_shapes("llama-nope")
    check_world(parse_shapes("all"), 2)
    with pytest.raises(ValueError):
        check_world(parse_shapes("mixtral-8x7b"), 16)


def test_point_fields_ratios_bound_and_padding():
    f = point_fields(t_gemm=1.0, t_comm=0.8, t_overlap=1.25, t_seq_same_scale=2.0, t_seq_torch=2.5,
                     t_a2a_nccl=0.9, t_a2a_copy_engine=0.5, t_scale=0.1, plan_rows=1200,
                     valid_rows=1000)
    assert f["bound"] == 1.0
    assert f["speedup_same_scale"] == pytest.approx(1.6)
    assert f["speedup_torch"] == pytest.approx(2.0)
    assert f["overlap_over_bound"] == pytest.approx(1.25)
    assert f["hidden_fraction"] == pytest.approx((1.0 + 0.8 - 1.25) / 0.8)
    assert f["padding"] == pytest.approx(1.2)
    assert f["comm_over_copy_engine"] == pytest.approx(1.6)
    for k in ("t_gemm", "t_comm", "t_overlap", "t_seq_same_scale", "t_seq_torch", "t_a2a_nccl",
              "t_a2a_copy_engine", "t_scale"):
        assert k in f
    # the bound is the larger part, whichever it is; a perfect overlap hides everything
    g = point_fields(t_gemm=0.5, t_comm=0.8, t_overlap=0.8, t_seq_same_scale=1.3, t_seq_torch=1.3,
                     t_a2a_nccl=0.7, t_a2a_copy_engine=0.6, t_scale=0.1, plan_rows=5,
                     valid_rows=5)
    assert g["bound"] == 0.8 and g["overlap_over_bound"] == 1.0 and g["padding"] == 1.0
    assert g["hidden_fraction"] == pytest.approx(0.5 / 0.8)  # only the GEMM's length hides
    h = point_fields(t_gemm=1.0, t_comm=0.8, t_overlap=1.0, t_seq_same_scale=1.8, t_seq_torch=2,
                     t_a2a_nccl=0.7, t_a2a_copy_engine=0.6, t_scale=0.1, plan_rows=5,
                     valid_rows=5)
    assert h["hidden_fraction"] == 1.0 and h["overlap_over_bound"] == 1.0
    # a time not measured (validation-only run) leaves NaN, not a made-up ratio
    n = point_fields(t_gemm=float("nan"), t_comm=float("nan"), t_overlap=float("nan"),
                     t_seq_same_scale=float("nan"), t_seq_torch=float("nan"),
                     t_a2a_nccl=float("nan"), t_a2a_copy_engine=float("nan"),
                     t_scale=float("nan"), plan_rows=10, valid_rows=8)
    assert all(math.isnan(n[k]) for k in ("bound", "speedup_same_scale", "overlap_over_bound",
                                          "hidden_fraction"))
    with pytest.raises(ValueError):
        point_fields(t_gemm=1, t_comm=1, t_overlap=1, t_seq_same_scale=1, t_seq_torch=1,
                     t_a2a_nccl=1, t_a2a_copy_engine=1, t_scale=1, plan_rows=4, valid_rows=5)


def test_exchange_pieces_match_all_to_all_layout():
    """Every remote piece lands where all_to_all_single puts it: the receiver's rows are ordered
    by source rank, each source's rows by its send order."""
    W, El = 3, 2
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 5, (W, W * El), generator=g).tolist()
    # what rank s sends to d: in_splits_s[d] = sum(counts[d][s's experts]) rows, tagged (s, d, j)
    sends = {s: [(s, d, j) for d in range(W) for j in range(sum(counts[d][s * El:(s + 1) * El]))]
             for s in range(W)}
    for d in range(W):
        want = [x for s in range(W) for x in sends[s] if x[1] == d]  # all_to_all: by source
        got = [None] * len(want)
        for s in range(W):
            for dd, start, n, off in exchange_plan(counts, s, El):
                if dd == d:
                    got[off:off + n] = sends[s][start:start + n]
        assert [x for x in got if x is not None] == [x for x in want if x[0] != d]
        assert all(got[i] == want[i] for i in range(len(want)) if want[i][0] != d)


def test_same_scale_baseline_refuses_cpu():
    ids = torch.zeros(4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="CUDA"):
        SameScaleBaseline(torch.full((1, 2), 4), ids)


def test_poison_and_compare_catch_stale_or_racy_output():
    ref32 = torch.randn(6, 8)
    good = ref32.to(torch.bfloat16)
    assert compare(good.clone(), good, ref32)["ok"]
    # a value read from a poisoned buffer: not finite, not bitwise, fails
    bad = good.clone()
    bad[2, 3] = float("nan")
    v = compare(bad, good, ref32)
    assert not v["ok"] and not v["finite"] and not v["bitwise"]
    # one bit off the non-overlapped path fails even where the error is tiny
    off = good.clone()
    off.view(torch.int16)[0, 0] += 1
    v = compare(off, good, ref32)
    assert not v["bitwise"] and not v["ok"] and v["rel_err"] < 8e-3
    # bitwise equal to a path that is itself wrong still fails against the fp32 baseline
    wrong = (ref32 * 1.1).to(torch.bfloat16)
    v = compare(wrong.clone(), wrong, ref32)
    assert v["bitwise"] and not v["ok"]
    # both paths reading the same poison are bitwise equal, but not finite: fails
    nan = torch.full((6, 8), float("nan"), dtype=torch.bfloat16)
    assert not compare(nan.clone(), nan, ref32)["ok"]
    x, idx = torch.ones(3, 4, dtype=torch.bfloat16), torch.arange(3)
    poison_(x, idx, None)
    assert torch.isnan(x.float()).all() and idx.tolist() == [0, 1, 2]
    s = summarize([dict(ok=True, bitwise=True, rel_err=1e-3), dict(ok=False, bitwise=False,
                                                                    rel_err=0.5)])
    assert s == dict(calls=2, failures=1, max_rel_err=0.5, all_bitwise=False)


def test_importing_the_sweep_leaves_the_environment_alone():
    """The sweep sets its run environment (multicast off, heap size) in main, not at import."""
    import subprocess
    import sys
    code = ("import os; before = dict(os.environ); import moe_overlap.combine.sweep as s; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "s.set_run_environment(); assert os.environ['NVSHMEM_DISABLE_NVLS'] == '1'; "
            "assert os.environ['NVSHMEM_SYMMETRIC_SIZE'] == os.environ.get('EXPECT_HEAP', '48G')")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("NVSHMEM_SYMMETRIC_SIZE", "NVSHMEM_DISABLE_NVLS")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
