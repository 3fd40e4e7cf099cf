"""bench/lab_upproj_window.py: the windowed band order is a permutation with the windows,
experts and arrival keys in that order; its extremes are arrival_schedule's two orders; the
bench run with a window launches that schedule and names its file by the window."""
import torch
import pytest

from conftest import load_bench
from moe_overlap.combine import dispatch_index
from moe_overlap.combine.plan import plan_combine
from test_arrival_schedule_cpu import _counts, _far_by_rows

L = load_bench("lab_upproj_window")
ARRIVAL = dispatch_index.arrival_schedule  # before any test patches it


@pytest.mark.parametrize("layout", ["aligned", "packed"])
@pytest.mark.parametrize("W", [2, 3, 4, 5])
def test_windows_of_one_and_of_all_are_arrival_and_expert_order(W, layout):
    El, tm = 3, 64
    for seed in range(3):
        counts = _counts(W, El, seed, skew=seed == 2)
        for r in range(W):
            p = plan_combine(counts, r, tile_m=tm, layout=layout)
            assert torch.equal(L.window_schedule(p, counts, 1), ARRIVAL(p, counts))
            for w in (W, W + 3):
                assert torch.equal(L.window_schedule(p, counts, w),
                                   ARRIVAL(p, counts, order="expert"))


@pytest.mark.parametrize("W,window", [(4, 2), (5, 2), (5, 3), (8, 3)])
def test_a_window_groups_its_sources_then_experts_then_arrival(W, window):
    El, tm = 3, 64
    for seed in range(3):
        counts = _counts(W, El, seed, skew=seed == 1)
        for r in (0, W - 1):
            p = plan_combine(counts, r, tile_m=tm)
            sched = L.window_schedule(p, counts, window)
            n, B = int(p.num_bands), p.band_capacity
            assert sched.dtype == torch.int32 and sorted(sched.tolist()) == list(range(B))
            far = _far_by_rows(p, counts)
            expert = [int(p.band_expert[b]) for b in range(n)]
            want = sorted(range(n), key=lambda b: (far[b] // window, expert[b], far[b], b))
            assert sched[:n].tolist() == want
            assert sched[n:].tolist() == list(range(n, B))
    with pytest.raises(ValueError, match="window"):
        L.window_schedule(p, counts, 0)


def test_the_bench_runs_the_window_and_tags_its_file(monkeypatch, tmp_path, capsys):
    """--dry-run per window: the file name carries the window; a real run_point (stand-ins as in
    test_upproj_bench_cpu) launches window_schedule's order and records lab_window."""
    monkeypatch.setattr(dispatch_index, "arrival_schedule", ARRIVAL)  # use_window patches it
    monkeypatch.setattr(L.bench, "result_header", L.bench.result_header)
    monkeypatch.setattr(L, "_HEADER", lambda *a, **k: dict(bench=a[0]))
    monkeypatch.setenv("MOE_OVERLAP_TUNE_CACHE", str(tmp_path / "none.json"))
    assert L.main(["--windows", "1,4", "--dry-run", "--models", "qwen3-30b-a3b", "--tokens",
                   "4096", "--worlds", "8", "--tag", "s"]) == 0
    out = capsys.readouterr().out
    assert "== window 1" in out and "== window 4" in out
    assert "_s_w1.json" in out and "_s_w4.json" in out
    assert L.bench.result_header("x") == dict(bench="x", lab_window=4)
    import test_upproj_bench_cpu as T
    calls = []
    rec, counts, _ = T._run_tiny(monkeypatch, T._reference_kernel(calls), tmp_path)
    assert rec["correct"] and rec["err_vs_reference"] == 0.0
    plan = plan_combine(counts, 0, tile_m=128, mgb=rec["mgb"], max_rows=2 * 96 * 2,
                        validate=False, layout=rec["layout"], order=rec["order"])
    assert torch.equal(calls[-1]["sched"], L.window_schedule(plan, counts, 4))
    # the name run_point imports answers the window's order where it is not arrival order
    c4 = _counts(4, 3, 0, False)
    p4 = plan_combine(c4, 0, tile_m=64)
    got = dispatch_index.arrival_schedule(p4, c4)
    assert torch.equal(got, L.window_schedule(p4, c4, 4)) and not torch.equal(got, ARRIVAL(p4, c4))
    with pytest.raises(SystemExit):
        L.main(["--windows", "0", "--dry-run"])
    with pytest.raises(SystemExit):
        L.main(["--windows", "2", "--up-order", "expert", "--dry-run"])
