"""The projections' inputs and checks (issue 38): every rate both projections use is named in
their JSON with its file, card, GPUs, date, commit and freshness; the combine model compares like
with like on the measured 2-GPU sweep (the GEMM alone on every SM, the slowest rank's rows) and
holds on the points no rate was fitted on; the GEMM rates of one token count predict the other
(current one-GPU data); the plot's text states what is assumed."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from moe_overlap.combine import projection as cp
from moe_overlap.combine.tuning import CostModel
from moe_overlap.ffn import projection as fp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")


def _load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


def _assert_named(name, src):
    """A source is either a result file with its card, GPUs, date, commit and freshness, or a
    sentence saying what it is instead."""
    if src.get("file") is None:
        assert src.get("stated"), name
        return
    assert os.path.isfile(os.path.join(ROOT, src["file"])), (name, src["file"])
    assert src["card"] in ("H100", "H200") and src["gpus"] in (1, 2), (name, src)
    assert src["freshness"]["state"] in ("current", "stale", "unknown"), (name, src)
    assert src["area"], name
    if src["file"].endswith("consumer_run3_fastlaunch.json"):  # the file records neither
        assert src["date"] is None and src["commit"] is None
    else:
        assert src["date"] and src["date"][:4] == "2026" and src["commit"], (name, src)


# ------------------------------------------------------------------ combine: sources
@pytest.fixture(scope="module")
def combine_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("project")
    r = subprocess.run([sys.executable, "-m", "moe_overlap", "project", "--models",
                        "qwen3-30b-a3b", "--world-sizes", "2", "--tokens", "256", "--out",
                        str(out)], capture_output=True, text=True, cwd=str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    with open(out / "projection.json") as f:
        return r.stdout, json.load(f)


def test_combine_json_and_printout_name_every_input(combine_run):
    stdout, doc = combine_run
    inputs = doc["inputs"]
    # every rate the model reads: each field of Fabric and of CostModel (the GEMM rate as the
    # per-model producer and library rates)
    want = {f.name for f in dataclasses.fields(cp.Fabric)} | {
        f.name for f in dataclasses.fields(CostModel)} - {"gemm_tflops"} | {
        "producer_tflops", "library_tflops", "padding"}
    assert set(inputs) == want
    for name, e in inputs.items():
        assert e["what"] and "value" in e, name
        _assert_named(name, e["source"])
        assert f"  {name} = " in stdout, name  # printed too
    src = inputs["producer_tflops"]["source"]
    assert (src["file"], src["card"], src["gpus"], src["date"], src["commit"]) == (
        "bench/results/" + cp.PRODUCER_FILE, "H100", 1, "2026-12-07", "fffb23c")
    assert cp.PRODUCER_FILE + " (H100, 1 GPU, 2026-12-07, fffb23c; " in stdout
    # the link rates from the last 2-GPU runs, dated
    for k in ("copy_gbps", "nvlink_gbps"):
        s = inputs[k]["source"]
        assert s["gpus"] == 2 and s["date"] == "2026-11-30", k
    assert "2x H200, 2026-12-01" in inputs["nccl_a2a_gbps"]["source"]["stated"]
    assert "not measured" in inputs["ib_gbps"]["source"]["stated"]
    # the sweep check's own rate (the era of the data it is checked on) is named as well
    g = doc["check_inputs"]["gemm_tflops"]["source"]
    assert g["file"] == "bench/results/" + cp.GEMM_FIT_FILE and g["card"] == "H200"
    assert doc["meta"]["device"] == "model" and doc["meta"]["git_commit"]


def test_combine_default_rates_are_their_files():
    cost, fabric = CostModel(), cp.Fabric()
    measured = cp.consumer_rates(_load(cp.CONSUMER_FILE))
    assert sorted(measured) == [8, 16, 24]
    for c, gbps in measured.items():
        assert cost.copy_gbps[c] == pytest.approx(gbps, abs=1.0), c
    scale = max(v["TBs"] for v in _load(cp.SCALE_FILE)["variants"])
    assert fabric.scale_tbps == pytest.approx(scale, rel=0.02)
    ce = max(r["gbps"] for r in _load(cp.LINK_FILE)["results"] if r["variant"] == "copy_engine")
    assert fabric.nvlink_gbps == cost.link_gbps == pytest.approx(ce, rel=0.03)
    doc = _load(cp.PRODUCER_FILE)
    assert doc["card"] == "h100" and doc["gpus"] == 1 and doc["num_sms"] == cost.num_sms
    rates = cp.ProducerRates.from_doc(doc)
    assert set(rates.producer_tflops) == {f"{m}@{t}" for m in cp.MODELS for t in (4096, 16384)}


# ------------------------------------------------------------------ combine: sweep check
@pytest.fixture(scope="module")
def sweep_check():
    return cp.check_sweep_files({n: _load(n) for n in cp.SWEEP_FILES})


def test_every_ranks_rows_rebuilt_and_skewed_ranks_differ():
    for name in cp.SWEEP_FILES:
        pts = _load(name)["points"]
        ranks = cp.sweep_ranks(pts)
        assert all(r is not None for r in ranks), name  # rank 0 rebuilt = recorded, every point
        skewed = [r for p, r in zip(pts, ranks) if p["mode"] != "balanced"]
        # the mismatch the check fixes: on skewed routings the other rank computes other rows
        assert max(max(x["rows"] for x in r) / min(x["rows"] for x in r) for r in skewed) > 1.5


def test_sweep_model_on_held_out_points_within_15_percent_every_mode(sweep_check):
    """Held out (HELD_OUT_SWEEP): the K 14336 sweep and sweep v7's 12-SM points, every router
    mode: 15 points. The data is old (0c40dc2, H200), checked with the rates of its era. Fails
    with the GEMM predicted on 132 - ccta SMs against the sweep's GEMM alone on every SM (t_gemm
    up to +18 % on K 14336) and with rank 0's rows standing for both ranks (t_overlap -45 % on
    K 14336 moderate_skew)."""
    held = [e for e in sweep_check["points"] if e["held_out"]]
    assert len(held) == 15 and {e["mode"] for e in held} == {
        "balanced", "moderate_skew", "stress_skew"}
    for e in held:
        assert abs(e["err_t_overlap"]) <= 0.15, e
        assert abs(e["err_t_gemm"]) <= 0.10, e
    assert all(e["ranks"] == 2 for e in held)
    # the consumer's rate is measured at N 8192: within 15 % there; at N 4096 it ships 11-28 %
    # slower than that rate says (printed, not hidden: the check's t_comm summary)
    for e in held:
        if e["N"] == 8192:
            assert abs(e["err_t_comm"]) <= 0.15, e
    assert sweep_check["held_out"]["t_comm"]["max_abs"] > 0.15


# ------------------------------------------------------------------ combine: GEMM rates
def test_gemm_rates_of_one_token_count_predict_the_other():
    """Current one-GPU data (the producer as MoECombine launches it, H100): the rates fitted at
    4096 tokens predict 16384 and back. ours / library (the GEMM part of the projected speedup)
    within 15 % per point, each time alone within 25 % (mixtral's 31 ms calls at 16384 run
    18 % slower per FLOP than its 6 ms ones at 4096). Fails where the producer's rate is not
    normalized by the SMs of its grid (qwen3's ccta 24: +23 % on the ratio)."""
    check = cp.check_producer(_load(cp.PRODUCER_FILE))
    assert len(check["points"]) == 8
    for p in check["points"]:
        assert p["fitted_on_tokens"] and p["label"].split("@")[1].split("/")[0] not in map(
            str, p["fitted_on_tokens"])  # not fitted on its own token count
        assert abs(p["err_ratio"]) <= 0.15, p
        assert abs(p["err_producer_ms"]) <= 0.25 and abs(p["err_library_ms"]) <= 0.25, p


def test_projection_uses_each_models_rates():
    doc = _load(cp.PRODUCER_FILE)
    rates = cp.ProducerRates.from_doc(doc)
    rows = cp.project(models=("qwen3-30b-a3b", "mixtral-8x7b"), worlds=(2,), tokens=1024,
                      layouts=("packed",), producer=rates)
    for r in rows:
        key = f"{r['model']}@4096"  # the measured token count nearest 1024
        assert r["gemm_tflops"] == rates.producer_tflops[key]
        assert r["library_tflops"] == rates.library_tflops[key]
    # the library's rate sets the baseline: a faster library, a smaller projected speedup
    fast = dataclasses.replace(rates, library_tflops={k: 2 * v for k, v in
                                                      rates.library_tflops.items()})
    again = cp.project(models=("qwen3-30b-a3b",), worlds=(2,), tokens=1024, layouts=("packed",),
                       producer=fast)
    assert again[0]["speedup_same_scale"] < rows[0]["speedup_same_scale"]


# ------------------------------------------------------------------ combine: the plot's text
def test_plot_text_states_the_assumptions(combine_run, tmp_path):
    _, doc = combine_run
    text = doc["assumptions"]
    assert text.startswith("Projection, not a measurement.")
    for needle in (cp.PRODUCER_FILE, "H100", "combine_split_2xh200_pieces.json", "2026-11-30",
                   "NCCL a2a 281 GB/s", "2026-12-01", "IB 50 GB/s", "held-out"):
        assert needle in text, needle
    pytest.importorskip("matplotlib")
    import matplotlib.figure
    seen = []
    orig = matplotlib.figure.Figure.text
    try:
        matplotlib.figure.Figure.text = lambda self, x, y, s, **kw: (seen.append(s),
                                                                     orig(self, x, y, s, **kw))[1]
        fab = cp.Fabric(**doc["fabric"])
        cp.plot(doc["rows"], str(tmp_path / "p.png"), fab, doc["check"], doc["inputs"],
                doc["producer_check"])
    finally:
        matplotlib.figure.Figure.text = orig
    assert (tmp_path / "p.png").is_file()
    assert any(" ".join(s.split()) == " ".join(text.split()) for s in seen)


# ------------------------------------------------------------------ FFN
def test_ffn_json_names_every_rate_source(tmp_path):
    out = tmp_path / "f.json"
    r = subprocess.run([sys.executable, "-m", "moe_overlap", "project-ffn", "--shapes",
                        "llama3-8b", "--world-sizes", "2,8", "--tokens", "8192", "--out",
                        str(out)], capture_output=True, text=True, cwd=str(tmp_path),
                       timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.load(open(out))
    inputs = doc["inputs"]
    rate_fields = {f.name for f in dataclasses.fields(fp.FFNRates)} - {"num_sms"}
    assert set(inputs) == rate_fields | {"busbw_gbps_above_2"}
    for name, e in inputs.items():
        _assert_named(name, e["source"])
        assert f"  {name} (" in r.stdout, name
    for k in ("nccl_busbw_gbps", "ar_gbps_per_sm", "ar_cap_ratio", "reduce_rel"):
        s = inputs[k]["source"]  # the link rates: the last 2-GPU run, dated
        assert (s["file"], s["gpus"], s["date"], s["commit"]) == (
            "bench/results/ffn_fused_v7_final_2xh200.json", 2, "2026-11-30", "9c63cd0"), k
    assert inputs["torch_tflops"]["source"]["gpus"] == 1
    assert "ffn_fused_v7_final_2xh200.json (H200, 2 GPUs, 2026-11-30, 9c63cd0; " in r.stdout
    assert inputs["torch_tflops"]["value"] == pytest.approx(doc["rates"]["torch_tflops"])
