"""bench/bench_moe_layer.py end to end on the CPU: 2 gloo ranks, reference backend, tiny shapes.

The run must write the JSON with its fields, the two layers (ours: plan on the side stream,
MoECombine; base: the sequential layer) must agree on every timed call, and a deliberately
wrong layer (`--wrong`: ours' output rows rolled by one) must be caught by that check."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = "64x8x2x32x16,40x4x1x16x32"  # TxExkxNxK: 2 and 1 experts per rank, top-2 and top-1


def run_bench(out, *extra, shapes=SHAPES):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               GIT_COMMIT="testcommit")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "bench_moe_layer.py"), "--device", "cpu",
           "--backend", "reference", "--spawn", "2", "--shapes", shapes, "--calls", "3",
           "--out", str(out), "--tag", "t", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("good")
    res = run_bench(out)
    assert res.returncode == 0, res.stdout + res.stderr
    with open(out / "moe_layer_t.json") as f:
        return json.load(f), out, res


def test_json_fields(good):
    doc, out, _ = good
    assert doc["bench"] == "moe_layer" and doc["device"] == "cpu" and doc["world_size"] == 2
    assert doc["git_commit"] == "testcommit" and doc["date"] and doc["agree"] is True
    assert [r["shape"]["tokens"] for r in doc["rows"]] == [64, 40]
    for r in doc["rows"]:
        assert r["backend"] == "reference" and r["timing"] == "eager"
        assert len(r["ours_times_ms"]) == len(r["base_times_ms"]) == len(r["rel_errs"]) == 3
        assert r["ours_ms"] > 0 and r["base_ms"] > 0
        assert r["speedup"] == pytest.approx(r["base_ms"] / r["ours_ms"])
        assert set(r["timeline_ours"]) == {"router", "counts", "plan", "prepare", "place_index",
                                           "dispatch_a2a", "place", "up", "combine"}
        assert set(r["timeline_base"]) == {"router", "counts", "dispatch_a2a", "permute", "up",
                                           "combine"}
        for tl in (r["timeline_ours"], r["timeline_base"]):
            ends = [v["end_ms"] for v in tl.values()]
            assert ends == sorted(ends)  # one stream on the CPU: parts in order, back to back
            for v in tl.values():
                assert v["ms"] >= 0 and v["end_ms"] == pytest.approx(v["start_ms"] + v["ms"])
        assert r["plan_prepare_ms"] == pytest.approx(
            r["timeline_ours"]["plan"]["ms"] + r["timeline_ours"]["prepare"]["ms"])
        assert r["side_ms"] == pytest.approx(
            r["plan_prepare_ms"] + r["timeline_ours"]["place_index"]["ms"])
        assert r["plan_hidden"] is None  # no side stream on the CPU: nothing is claimed
        assert r["max_rel_err"] == max(r["rel_errs"]) <= 8e-3 and r["agree"]
        # both layers against the fp32 reference on each rank's first tokens (fp32 on the CPU)
        assert r["ref_tokens"] > 0 and r["ours_err_vs_fp32"] <= 1e-5
        assert r["base_err_vs_fp32"] <= 1e-5
        # every rank's received rows land in the plan layout: within the plan's padded rows
        assert 0 < r["recv_rows"] <= r["plan_rows"]
        assert r["plan_order"] == "remote_first"
    assert doc["up"] == "library"  # --up auto without the overlap backend


def test_png_or_message(good):
    _, out, res = good
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib is not installed" in res.stdout
    else:
        assert (out / "moe_layer_t.png").stat().st_size > 1000


def test_wrong_layer_is_caught(tmp_path):
    res = run_bench(tmp_path, "--wrong", shapes=SHAPES.split(",")[0])
    assert res.returncode == 1, res.stdout + res.stderr
    assert "outputs disagree" in res.stderr
    with open(tmp_path / "moe_layer_t.json") as f:
        doc = json.load(f)
    assert doc["wrong"] is True and doc["agree"] is False
    assert all(r["ours_err_vs_fp32"] > 8e-3 for r in doc["rows"])  # caught by the reference too
    assert all(not r["agree"] and min(r["rel_errs"]) > 8e-3 for r in doc["rows"])


def test_expert_order_runs_and_agrees(tmp_path):
    """--order expert: the plans' schedule expert by expert; the layers still agree on every
    call and the JSON says which order ran."""
    res = run_bench(tmp_path, "--order", "expert", shapes="128x4x2x32x16")
    assert res.returncode == 0, res.stdout + res.stderr
    with open(tmp_path / "moe_layer_t.json") as f:
        doc = json.load(f)
    assert doc["order"] == "expert" and doc["agree"] is True
    # the timed calls' plans were expert-ordered (the schedule is the band order)
    assert all(r["plan_order"] == "expert" and r["plan_schedule_sorted"] for r in doc["rows"])
