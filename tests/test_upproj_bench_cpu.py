"""bench/bench_upproj.py (issue 39 goal 3: the arrival-gated up-projection's rate on one GPU) on
the CPU: its points and shapes, the layer's options it launches with, the baseline's unpadded
rows, one point end to end with the kernel and the clock replaced by stand-ins (and the
correctness check catching a wrong kernel), the result's name and the goal's evaluation."""
import json
import math

import pytest
import torch

from conftest import load_bench
from moe_overlap.combine.tuning import TuneCache
from moe_overlap.routing import routing_counts

U = load_bench("bench_upproj")
P = load_bench("bench_producer_models")

# the issue's shapes: (D, 2K) of [rows, D] x [D, 2K]
ISSUE_SHAPES = {"deepseek-v3": (7168, 4096), "qwen3-235b-a22b": (4096, 3072),
                "qwen3-30b-a3b": (2048, 1536), "mixtral-8x7b": (4096, 28672)}


def test_points_are_the_producer_bench_points_with_the_up_projection_shapes():
    points, skipped = U.P.make_points()
    want, want_skipped = P.make_points()
    assert [p["label"] for p in points] == [p["label"] for p in want]
    assert skipped == want_skipped and len(points) == 60
    assert {p["model"] for p in points} == set(ISSUE_SHAPES)
    for p in points:
        assert U.up_shape(p) == ISSUE_SHAPES[p["model"]], p["label"]


@pytest.mark.parametrize("model", sorted(ISSUE_SHAPES))
def test_options_are_the_layers_overlap_options(model, tmp_path):
    cache = TuneCache(str(tmp_path / "t.json"))
    points, _ = U.P.make_points(models=[model], tokens=[4096], worlds=[1, 2, 8],
                                routings=["skewed"])
    for p in points:
        r = U.resolve(p, 132, "FakeGPU", cache)
        lo = r["layer"]
        # MoELayerOptions' defaults for the overlap backend: N tile 256, the send's 8 CTAs' SMs
        assert (lo.up_tile_n, lo.up_ccta, lo.weight_layout) == (256, 8, "interleaved")
        g = r["gemm"]
        assert g.swiglu and g.wait_arrival and not g.signal
        assert (g.tile_m, g.tile_n, r["tile_m"]) == (128, 256, 128)
        assert r["cluster_n"] == 2 and r["grid"] == 124  # 2K / 256 tiles is even: pairs
        # the plan's options: the combine's, as the producer bench resolves them
        _, copts, _, _ = P.resolve(p, P.parse_variants("default")[0], 132, "FakeGPU", cache)
        assert (r["combine"].ccta, r["combine"].mgb, r["combine"].order) == (
            copts.ccta, copts.mgb, copts.order)
        assert (r["combine"].ccta == 0) == (p["world_size"] == 1)


def test_dry_run_lists_points_options_and_the_result_name(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_OVERLAP_TUNE_CACHE", str(tmp_path / "none.json"))
    assert U.main(["--dry-run", "--plans", "--points", "qwen3-30b-a3b@4096/W8/*"]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = [line for line in out if line.startswith("qwen3-30b-a3b@4096/W8/")]
    assert len(rows) == 2 and all("D  2048 2K  1536" in r and "up_ccta 8 grid 124" in r
                                  for r in rows)
    assert "2 points (NVIDIA H100 80GB HBM3, 132 SMs)" in out[-1]
    assert "would write upproj_models_h100_" in out[-1]


def test_baseline_rows_are_the_routings_per_expert_counts(tmp_path):
    cache = TuneCache(str(tmp_path / "t.json"))
    points, _ = U.P.make_points(models=["qwen3-235b-a22b"], tokens=[4096], worlds=[1, 8],
                                routings=["balanced", "skewed"])
    recs = U.dry_run(points, [1, 8], 132, "FakeGPU", cache, plans=True)
    for p, r in zip(points, recs):
        counts, _ = P.routing_counts_for(p["model"], 4096, p["routing"], 8)
        W, El = p["world_size"], p["E"] // p["world_size"]
        want = [sum(int(counts[s, e]) for s in range(W)) for e in range(El)]
        assert r["base_rows"] == want, p["label"]
        assert r["valid_rows"] == sum(want) == r["plan_valid_rows"]
        assert r["plan_rows"] >= r["valid_rows"] and r["plan_rows"] % 128 == 0
    # W = 1: every expert, every token's k assignments
    assert recs[0]["valid_rows"] == 4096 * 8 and len(recs[0]["base_rows"]) == 128


# K = 256: two N tiles of 256, so the interleaved layout differs from the gate-first one
TINY = dict(model="tiny", tokens=96, world_size=2, routing="skewed", E=8, topk=2, K=256, N=128,
            label="tiny@96/W2/skewed")


def _stand_ins(monkeypatch, kernel):
    """The CUDA parts swapped for plain calls: the up-projection kernel (``kernel``), the
    graphs, the clock (fixed medians) and the device's SM count (132)."""
    from moe_overlap import timing
    from test_producer_models_bench_cpu import gpu_stand_ins
    gpu_stand_ins(monkeypatch, U, kernel)
    ms = {"base:grouped_mm": 1.1, "base:mm_loop": 0.9, "base:grouped_mm+swiglu": 1.3,
          "base:mm_loop+swiglu": 1.0, "ours": 1.25, "extra:plain": 1.125,
          "extra:group_by=expert": 1.0}
    seen = {}

    def fake_time(fns, rounds, **kw):
        for f in fns.values():
            f()
        seen["names"] = sorted(fns)
        return {k: dict(median_ms=ms[k], p10_ms=ms[k], p90_ms=ms[k], times=[ms[k]] * rounds)
                for k in fns}
    monkeypatch.setattr(timing, "time_interleaved", fake_time)
    grouped = torch._grouped_mm

    def spy(x, w, offs=None, **kw):
        seen["offs"] = offs.tolist()
        return grouped(x, w, offs=offs, **kw)
    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return seen


def _reference_kernel(calls):
    """The kernel's torch reference: the interleaved weights undone, bands stored only where
    band_arrived == epoch (as the kernel after its timeout)."""
    from moe_overlap.combine import grouped_gemm as gg

    def call(self, x, w, y, be, bs, sched, nb, ready, epoch, ccta=0, err=None, rank=0,
             band_arrived=None, **kw):
        calls.append(dict(ccta=ccta, sched=sched.clone(), epoch=int(epoch), swiglu=self.swiglu,
                          arrived=None if band_arrived is None else band_arrived.clone()))
        if not self.swiglu:  # the plain GEMM of the interleaved weights
            return gg.grouped_gemm_reference(x, w, y, be, bs, sched, nb, self.tile_m)
        return gg.up_projection_reference(x, gg.deinterleave_gate_up(w, self.tile_n), y, be, bs,
                                          sched, nb, self.tile_m, band_arrived=band_arrived,
                                          epoch=epoch)
    return call


def _run_tiny(monkeypatch, kernel, tmp_path, extras=()):
    seen = _stand_ins(monkeypatch, kernel)
    counts = routing_counts(2, 96, 8, 2, "moderate_skew", 1)
    res = U.resolve(TINY, 132, "FakeGPU", TuneCache(str(tmp_path / "t.json")), extras=extras)
    return U.run_point(TINY, counts, res, rounds=3, seed=0), counts, seen


def test_one_point_on_the_cpu_with_stand_ins(monkeypatch, tmp_path):
    from moe_overlap.combine.dispatch_index import arrival_schedule
    from moe_overlap.combine.plan import plan_combine
    calls = []
    rec, counts, seen = _run_tiny(monkeypatch, _reference_kernel(calls), tmp_path)
    json.dumps(rec)
    assert rec["correct"] and rec["finite"] and rec["close_to_reference"], rec
    assert rec["err_vs_reference"] == 0.0 and not rec["error_word"]
    # the baseline's rows: rank 0's 4 experts, summed over both ranks, unpadded
    want = [int(counts[0, e] + counts[1, e]) for e in range(4)]
    assert rec["base_rows"] == want and seen["offs"] == [sum(want[:i + 1]) for i in range(4)]
    assert rec["valid_rows"] == sum(want) < rec["plan_rows"]
    # ours: the layer's launch, every band already arrived, up_ccta SMs left, arrival order
    c = calls[-1]
    assert c["swiglu"] and c["ccta"] == 8 and rec["grid"] == 124
    assert bool((c["arrived"] == c["epoch"]).all())
    plan = plan_combine(counts, 0, tile_m=128, mgb=rec["mgb"], max_rows=2 * 96 * 2,
                        validate=False, layout=rec["layout"], order=rec["order"])
    assert torch.equal(c["sched"], arrival_schedule(plan, counts))
    # timing: every path timed; base = the faster GEMM + SwiGLU, GEMM alone reported
    assert seen["names"] == ["base:grouped_mm", "base:grouped_mm+swiglu", "base:mm_loop",
                             "base:mm_loop+swiglu", "ours"]
    assert rec["base"] == "mm_loop+swiglu" and rec["base_ms"] == 1.0
    assert rec["base_gemm_alone"] == "mm_loop" and rec["base_gemm_alone_ms"] == 0.9
    assert rec["ratio"] == pytest.approx(1.0 / 1.25)
    assert rec["scaled_ratio"] == pytest.approx(0.8 * 132 / 124)
    assert rec["scaled_ratio_vs_gemm_alone"] == pytest.approx(0.9 / 1.25 * 132 / 124)


def test_a_wrong_kernel_output_is_caught(monkeypatch, tmp_path):
    """The correctness check fails a kernel that skips a band, or reads the weights in the gate-
    first layout instead of the interleaved one."""
    from moe_overlap.combine import grouped_gemm as gg
    ref = _reference_kernel([])

    def drops_a_band(self, x, w, y, be, bs, sched, nb, ready, epoch, band_arrived=None, **kw):
        arrived = band_arrived.clone()
        arrived[sched[0]] = int(epoch) - 1
        return ref(self, x, w, y, be, bs, sched, nb, ready, epoch, band_arrived=arrived, **kw)

    def halves_layout(self, x, w, y, be, bs, sched, nb, ready, epoch, band_arrived=None, **kw):
        return gg.up_projection_reference(x, w, y, be, bs, sched, nb, self.tile_m)
    for kernel in (drops_a_band, halves_layout):
        rec, _, _ = _run_tiny(monkeypatch, kernel, tmp_path)
        assert not rec["correct"], kernel.__name__
        assert U.summarize(dict(points=[rec]))["failed"]


def test_extras_are_timed_beside_ours_and_checked(monkeypatch, tmp_path):
    """--extra: the plain GEMM (no SwiGLU, no wait) against the base GEMM alone and checked
    against x @ w per expert; a SwiGLU variant against the base and bitwise ours; neither
    changes the goal's fields; a wrong extra is marked incorrect without failing ours."""
    extras = U.parse_extras("plain,group_by=expert")
    assert extras == [("plain", dict(swiglu=False, wait_arrival=False)),
                      ("group_by=expert", dict(group_by="expert"))]
    calls = []
    rec, _, seen = _run_tiny(monkeypatch, _reference_kernel(calls), tmp_path, extras)
    json.dumps(rec)
    assert "extra:plain" in seen["names"] and "extra:group_by=expert" in seen["names"]
    plain, grouped = rec["extra"]["plain"], rec["extra"]["group_by=expert"]
    assert plain["correct"] and grouped["correct"] and rec["correct"]
    assert plain["against"] == "base_gemm_alone" and grouped["against"] == "base"
    assert plain["ratio"] == pytest.approx(0.9 / 1.125)
    assert grouped["scaled_ratio"] == pytest.approx(1.0 * 132 / 124)
    assert rec["ratio"] == pytest.approx(1.0 / 1.25)  # ours' fields are ours'
    assert not next(c for c in calls if not c["swiglu"])["arrived"]  # plain: no wait
    ref = _reference_kernel([])

    def wrong_plain(self, x, w, y, *a, **kw):
        out = ref(self, x, w, y, *a, **kw)
        if not self.swiglu:
            y.mul_(2)
        return out
    rec, _, _ = _run_tiny(monkeypatch, wrong_plain, tmp_path, extras)
    assert rec["correct"] and not rec["extra"]["plain"]["correct"]
    assert rec["extra"]["group_by=expert"]["correct"]
    with pytest.raises(ValueError, match="given twice"):
        U.parse_extras("plain,plain")


def test_result_name():
    assert U.result_name("NVIDIA H100 80GB HBM3", "abc1234") == "upproj_models_h100_abc1234.json"
    assert U.result_name("NVIDIA H200", "abc1234", "s24") == "upproj_models_h200_abc1234_s24.json"
    assert P.result_name("NVIDIA H200", "abc1234") == "producer_models_h200_abc1234.json"


def _doc(scaled, correct=True):
    return dict(points=[dict(label=f"p{i}", correct=correct, scaled_ratio=s, ratio=s * 124 / 132,
                             scaled_ratio_vs_gemm_alone=s * 1.1) for i, s in enumerate(scaled)])


def test_goal_on_synthetic_records():
    ok = U.summarize(_doc([0.96, 1.2]))
    assert not ok["failed"] and ok["goals"]["met"] and ok["all_correct"]
    assert ok["goals"]["geomean_scaled"] == pytest.approx(math.sqrt(0.96 * 1.2))
    assert ok["unscaled"]["min_scaled"] == pytest.approx(0.96 * 124 / 132)
    # every point >= 0.95 is the goal; a geomean under 1 is stated, not a miss
    low_mean = U.summarize(_doc([0.96, 0.97]))
    assert not low_mean["failed"] and low_mean["goals"]["geomean_scaled"] < 1.0
    one_low = U.summarize(_doc([0.94, 2.0]))
    assert one_low["failed"] and one_low["goals"]["below"] == ["p0"]
    assert U.summarize(_doc([1.2, 1.3], correct=False))["failed"]  # a wrong output fails
    assert U.summarize(_doc([]))["failed"]  # no point: nothing met


def test_a_run_cut_mid_way_keeps_the_points_it_finished(monkeypatch, tmp_path):
    """The device call's time limit can end a run between points: the points done so far are
    in <result>.partial (the final JSON is written only at the end)."""
    monkeypatch.setenv("MOE_OVERLAP_TUNE_CACHE", str(tmp_path / "none.json"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    from test_producer_models_bench_cpu import gpu_stand_ins
    gpu_stand_ins(monkeypatch, U)
    done = []

    def run_point(p, counts, res, rounds, seed):
        if done:
            raise RuntimeError("cut")
        done.append(p["label"])
        return dict(U.describe(p, counts, res), base="mm_loop+swiglu", base_ms=1.0,
                    base_gemm_alone_ms=0.9, ms=1.25, ratio=0.8, scaled_ratio=0.85,
                    correct=True)
    monkeypatch.setattr(U, "run_point", run_point)
    with pytest.raises(RuntimeError, match="cut"):
        U.main(["--quick", "--models", "qwen3-30b-a3b", "--out", str(tmp_path / "o")])
    files = list((tmp_path / "o").iterdir())
    assert [f.name.endswith(".json.partial") for f in files] == [True]
    doc = json.load(open(files[0]))
    assert doc["partial"] == dict(done=1, of=2) and [p["label"] for p in doc["points"]] == done


def _run(scaled, commit="abc1234", routing="r1", date="2026-12-07T10:00", skipped=("s",)):
    return dict(_doc(scaled), device="NVIDIA H100 80GB HBM3", git_commit=commit, rounds=8,
                method="m", date=date, skipped_points=list(skipped),
                routings={routing: {}})


def test_merged_runs_are_summarized_over_all_their_points(tmp_path):
    a = _run([1.2, 1.1])
    b = _run([0.9], routing="r2", date="2026-12-07T11:00")
    for p in b["points"]:
        p["label"] = "q" + p["label"]
    b["partial"] = dict(done=1, of=2)
    merged = U.merge_runs([a, b], ["a.json", "b.json.partial"])
    assert [p["label"] for p in merged["points"]] == ["p0", "p1", "qp0"]
    g = merged["goals"]
    assert g["below"] == ["qp0"] and g["geomean_scaled"] == pytest.approx((1.2 * 1.1 * 0.9) ** (1 / 3))
    assert merged["failed"] and "partial" not in merged
    assert merged["merged_from"][1] == dict(name="b.json.partial", points=1,
                                            partial=dict(done=1, of=2))
    assert merged["date"] == b["date"] and set(merged["routings"]) == {"r1", "r2"}
    assert merged["skipped_points"] == ["s"]  # the same skipped point named once
    # the command line writes the same document
    for name, d in (("a.json", a), ("b.json.partial", b)):
        (tmp_path / name).write_text(json.dumps(d))
    assert U.main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json.partial"),
                   "--out", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text()) == json.loads(json.dumps(merged))


def test_runs_of_other_commits_or_with_a_common_point_are_not_merged():
    with pytest.raises(ValueError, match="differ"):
        U.merge_runs([_run([1.0]), _run([1.0], commit="def5678")], ["a", "b"])
    with pytest.raises(ValueError, match="two runs"):
        U.merge_runs([_run([1.0]), _run([1.0])], ["a", "b"])


def test_relative_error_in_row_chunks_is_the_whole_tensors():
    g = torch.Generator().manual_seed(0)
    b = torch.randn(1000, 37, generator=g)
    a = b + 1e-3 * torch.randn(1000, 37, generator=g)
    want = float((a - b).norm() / b.norm())
    for chunk in (1, 7, 1000, 5000):
        assert U._rel(a, b, chunk_rows=chunk) == pytest.approx(want, rel=1e-5)
    assert U._rel(b, b) == 0.0
