"""The FFN projection to G = 2, 4, 8: its rates are the result files', the model of the
compute="reduce" path reproduces the measured 2-GPU layer within the stated error, and it moves
with G the way the setting says (per-GPU compute shrinks, all-reduce bytes do not)."""
import json
import os
import subprocess
import sys

import pytest

from moe_overlap.ffn.projection import (PATHS, Assumptions, FFNRates, best_ccta, check_reduce,
                                        predict, project)
from moe_overlap.ffn.shapes import FFN_SHAPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
V7 = os.path.join(ROOT, "bench/results/ffn_fused_v7_final_2xh200.json")
RESULT = os.path.join(ROOT, "bench/results/projection_ffn_g2_8.json")


def _v7():
    with open(V7) as f:
        return json.load(f)["results"]


def test_default_rates_are_the_result_files():
    ref, got = FFNRates.from_results(ROOT), FFNRates()
    for k in ("torch_tflops", "chained_rel", "reduce_rel", "nccl_busbw_gbps"):
        a, b = getattr(ref, k), getattr(got, k)
        assert a.keys() == b.keys(), k
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-3), (k, key)
    assert got.ar_gbps_per_sm == pytest.approx(ref.ar_gbps_per_sm, rel=1e-3)
    assert got.ar_cap_ratio == pytest.approx(ref.ar_cap_ratio, rel=1e-3)
    # every seed shape has both token counts for the torch and chained rates
    assert set(got.torch_tflops) == {f"{s}@{t}" for s in FFN_SHAPES for t in (8192, 32768)}


def test_reduce_model_reproduces_the_measured_2gpu_layer():
    check = check_reduce(_v7())
    same, cross = check["same_run"], check["cross_run"]
    assert len(same["per_shape"]) == len(FFN_SHAPES) == same["summary"]["fused"]["n"]
    # the error the NOTES and the JSON state: speedup within 7 % on every shape (both ways of
    # taking torch's rate), the fused layer within 7 % where every input is from that run
    assert same["summary"]["speedup"]["max_abs"] < 0.07
    assert cross["summary"]["speedup"]["max_abs"] < 0.07
    assert same["summary"]["fused"]["max_abs"] < 0.07
    # the reference layer is its two measured parts added (compute + NCCL): within 2 %
    assert same["summary"]["reference"]["max_abs"] < 0.02
    # and the model says what was measured: the reduce path is slower than the reference
    assert all(p["model_speedup"] < 1 and p["measured_speedup"] < 1 for p in same["per_shape"])
    assert "no 2-GPU measurement" in check["chained"]


def test_reduce_model_speedup_holds_with_each_shapes_own_rates_held_out():
    """Out of sample by shape: each shape's own rates from the run it is checked on (its fused
    compute / torch ratio and its NCCL bus bandwidth) replaced by the median of the other
    shapes', torch's rate from the one-GPU baseline file ("cross_run"), the speedup of that
    shape's measured layer still within the 7 % the model states. (The band all-reduce's rates
    stay medians over all seven shapes: one shape moves a median of seven by at most one
    neighbour.)"""
    import statistics
    from dataclasses import replace
    rates = FFNRates()
    results = _v7()
    for r in results:
        others = [x["shape"] for x in results if x["shape"] != r["shape"]]
        held = replace(rates, **{
            k: {**getattr(rates, k), r["shape"]: statistics.median(getattr(rates, k)[o]
                                                                   for o in others)}
            for k in ("reduce_rel", "nccl_busbw_gbps")})
        check = check_reduce([r], held)["cross_run"]
        assert check["summary"]["speedup"]["max_abs"] < 0.07, (r["shape"], check["per_shape"])


@pytest.mark.parametrize("shape", list(FFN_SHAPES))
@pytest.mark.parametrize("tokens", [8192, 32768])
def test_per_gpu_compute_shrinks_and_allreduce_does_not(shape, tokens):
    P, O = FFN_SHAPES[shape]
    prev = None
    for G in (2, 4, 8):
        p = {path: predict(P, O, P, tokens, G, path, 16, shape=shape) for path in PATHS}
        r = p["chained"]
        if prev is not None:
            assert r["t_comp_ref"] == pytest.approx(prev["t_comp_ref"] / 2)  # FLOPs / G
            assert r["t_nccl"] > prev["t_nccl"]  # bus factor 2 (G - 1) / G grows, bytes fixed
            assert r["t_nccl"] / r["t_ref"] > prev["t_nccl"] / prev["t_ref"]
            assert r["t_comp"] < prev["t_comp"] and r["t_ar"] > prev["t_ar"]
        # bf16 bands move half the bytes of fp32 ones, at the same rate
        assert p["chained"]["t_ar"] == pytest.approx(p["reduce"]["t_ar"] / 2)
        prev = r


def test_fused_never_beats_its_own_floors():
    rates = FFNRates()
    for shape, (P, O) in FFN_SHAPES.items():
        for G in (2, 4, 8):
            for path in PATHS:
                b = best_ccta(P, O, P, 8192, G, path, rates, shape)
                floor_comp = b["t_comp_ref"] / rates.path_rel(path, shape, 8192)  # all SMs
                bytes_ = 2 * (G - 1) / G * 8192 * P * (2 if path == "chained" else 4)
                floor_ar = bytes_ / (rates.ar_cap_ratio * b["busbw_gbps"] * 1e9)
                assert b["t_fused"] >= max(floor_comp, floor_ar)


def test_more_comm_sms_trade_compute_for_allreduce():
    P, O = FFN_SHAPES["llama3-8b"]
    a = predict(P, O, P, 8192, 8, "chained", 8, shape="llama3-8b")
    b = predict(P, O, P, 8192, 8, "chained", 24, shape="llama3-8b")
    assert b["t_comp"] > a["t_comp"] and b["t_ar"] < a["t_ar"]
    with pytest.raises(ValueError, match="ccta"):
        predict(P, O, P, 8192, 8, "chained", 132)
    with pytest.raises(ValueError, match="path"):
        predict(P, O, P, 8192, 8, "fastest", 16)
    with pytest.raises(ValueError, match="divisible"):
        predict(P, O, P, 8192, 3, "chained", 16)


def test_assumed_bus_bandwidth_applies_above_2_gpus_only():
    P, O = FFN_SHAPES["llama3-70b"]
    a = Assumptions(busbw_gbps=350.0)
    g2 = predict(P, O, P, 8192, 2, "chained", 16, shape="llama3-70b", assumptions=a)
    g8 = predict(P, O, P, 8192, 8, "chained", 16, shape="llama3-70b", assumptions=a)
    assert g2["busbw_gbps"] == pytest.approx(FFNRates().nccl_busbw_gbps["llama3-70b"])
    assert g8["t_nccl"] == pytest.approx(2 * 7 / 8 * 8192 * P * 2 / 350e9)
    base = predict(P, O, P, 8192, 8, "chained", 16, shape="llama3-70b")
    assert base["busbw_gbps"] == pytest.approx(g2["busbw_gbps"])  # default: the 2-GPU value


def test_result_file_is_the_model_output_with_its_assumptions():
    with open(RESULT) as f:
        doc = json.load(f)
    meta, a = doc["meta"], doc["assumptions"]
    assert meta["device"] == "model" and meta["date"] and meta["git_commit"] not in ("", "?")
    assert "assumed" in a["text"] and "not a measurement" in a["text"]
    assert set(doc["sources"]) == {"torch_tflops", "chained_rel", "reduce_rel", "nccl_busbw_gbps",
                                   "ar_gbps_per_sm", "ar_cap_ratio"}
    assert "1.3-2.6x" in a["seed_claim"]
    assert doc["check"]["same_run"]["per_shape"] and "chained" in doc["check"]
    # regenerated from the code and the files, not typed: the rows are project()'s
    rows = project(rates=FFNRates.from_results(ROOT),
                   assumptions=Assumptions(busbw_gbps=a["busbw_gbps"]))
    assert len(doc["rows"]) == len(rows) == len(FFN_SHAPES) * 2 * 3
    for got, want in zip(doc["rows"], rows):
        assert (got["shape"], got["tokens"], got["world"]) == (want["shape"], want["tokens"],
                                                               want["world"])
        for k in ("t_ref_ms", "chained_ms", "reduce_ms", "chained_goal_ms"):
            assert got[k] == pytest.approx(want[k], rel=1e-9), k


def test_project_ffn_command(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "moe_overlap", "project", "--ffn", "--shapes",
                        "llama3-8b,deepseek-v3-expert", "--world-sizes", "2,8", "--tokens", "8192",
                        "--busbw-gbps", "350", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "not a measurement" in r.stdout and "350 GB/s" in r.stdout
    assert "no 2-GPU measurement" in r.stdout
    doc = json.load(open(out))
    assert {(x["shape"], x["world"]) for x in doc["rows"]} == {
        ("llama3-8b", 2), ("llama3-8b", 8), ("deepseek-v3-expert", 2), ("deepseek-v3-expert", 8)}
    assert doc["assumptions"]["busbw_gbps"] == 350.0 and doc["meta"]["device"] == "model"
    for argv in (["--shapes", "gpt-5"], ["--world-sizes", "1"], ["--world-sizes", "3"],
                 ["--busbw-gbps", "-1"]):
        bad = subprocess.run([sys.executable, "-m", "moe_overlap", "project-ffn", *argv,
                              "--out", str(tmp_path / "bad.json")],
                             capture_output=True, text=True, cwd=ROOT)
        assert bad.returncode == 2 and "Traceback" not in bad.stderr, argv
        assert not (tmp_path / "bad.json").exists()
