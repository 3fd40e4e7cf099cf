"""CPU checks of the one-GPU multi-rank combine grid (scripts/ranks_grid.py, issue 35 item 3):
the sweeps it plans parse with the sweep's own parser and hold what the issue asks for (>= 200
points at W = 2 and 4, both transports, layouts and orders, model-shaped and synthetic routings,
ranks with no token, the soak, the broken-ordering point), fit their device-call budget, and
what a run leaves (JSON, a killed sweep's progress, a sweep never started) is folded into the
ranks_onegpu report with the right verdicts. Also the pieces below it that run on the CPU: the
sweep's named shapes, the soak's memory verdict, the zero-token routing of the race check and
the broken ordering's late stores."""
import importlib.util
import json
import os
import pathlib
import sys
import types

import pytest
import torch

from conftest import spawn_ranks

REPO = pathlib.Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


RG = _script("ranks_grid")
REPORT = _script("ranks_report")


# ------------------------------------------------------------------------ the sweep's arguments
def test_named_model_shapes_parse():
    """`--shapes models` / name@tokens carry a "name" string: the size check must skip it."""
    from moe_overlap.combine.sweep import parse_args
    a = parse_args(["--validate-only", "--shapes", "deepseek-v3@256,mixtral-8x7b@128,64x8x2x256x128",
                    "--out", "/tmp/x.json"])
    assert [s.get("name") for s in a.shapes] == ["deepseek-v3@256", "mixtral-8x7b@128", None]
    with pytest.raises(SystemExit):  # a real bad size is still refused
        parse_args(["--shapes", "64x8x0x256x128", "--out", "/tmp/x.json"])


def test_list_options_and_empty_ranks():
    from moe_overlap.combine.sweep import parse_args, parse_empty_ranks, planned_points
    a = parse_args(["--layout", "aligned,packed", "--order", "expert", "--empty-ranks",
                    "none,2+0", "--shapes", "64x8x2x256x128", "--modes", "balanced",
                    "--ccta", "4,8", "--mgb", "2", "--out", "/tmp/x.json"])
    assert a.layout == ["aligned", "packed"] and a.order == ["expert"]
    assert a.empty_ranks == [(), (0, 2)]
    assert planned_points(a) == 1 * 1 * 2 * 2 * 1 * 2 * 1
    for bad in (["--layout", "diagonal"], ["--order", ""], ["--empty-ranks", "one"]):
        with pytest.raises(SystemExit):
            parse_args(bad + ["--out", "/tmp/x.json"])
    with pytest.raises(ValueError):
        parse_empty_ranks(",")


# ------------------------------------------------------------------------ the grid's plan
def _parts():
    return {p: RG.plan(p) for p in ("w2", "w4")}


def test_the_grid_holds_what_the_issue_asks_for():
    from moe_overlap.combine.shapes import MODELS
    parts = _parts()
    grid_points = 0
    for part, invs in parts.items():
        W = int(part[1:])
        grids = [i for i in invs if not i.soak and not i.expect_fail]
        args = [RG.parsed(i) for i in grids]
        assert {a.world_size for a in args} == {W}
        assert all(a.validate_only and a.share_gpu and a.race_calls >= 2 for a in args)
        assert {a.transport for a in args} == {"nvlink", "nvshmem"}
        for a in args:  # every transport over both layouts, both orders, all modes
            assert set(a.layout) == {"aligned", "packed"} and set(a.order) == {"remote_first",
                                                                                "expert"}
            assert set(a.modes) == {"balanced", "moderate_skew", "stress_skew"}
            assert () in a.empty_ranks and any(e for e in a.empty_ranks)
            assert all(max(e, default=0) < W for e in a.empty_ranks)
            names = [s.get("name") for s in a.shapes]
            assert None in names and any(names)  # synthetic and model-shaped
            assert all(s["tokens"] <= 512 for s in a.shapes)  # small token counts
        models = {s["name"].split("@")[0] for a in args for s in a.shapes if s.get("name")}
        if part == "w2":
            assert models == set(MODELS)
        grid_points += sum(RG.points(i) for i in grids)
        soak = [i for i in invs if i.soak]
        assert len(soak) == 1 and RG.parsed(soak[0]).soak == 1000
        assert RG.parsed(soak[0]).world_size == W
    assert grid_points >= 200, grid_points
    broken = [i for p in parts.values() for i in p if i.expect_fail]
    assert len(broken) == 1
    b = RG.parsed(broken[0])
    assert b.expect_fail and b.producer == "torch" and RG.points(broken[0]) == 1
    assert broken[0].env == {"MOE_OVERLAP_TEST_BROKEN_ORDER": "flags_before_stores"}
    assert b.race_calls >= 1  # only poisoned calls can see the broken order (stale y is right)


DEVICE_CALL_LIMIT_S = 600  # the device tool's limit on one command


def _grid_call_limits():
    """(budget, timeout) gpu_check.sh gives `ranks grid` by default (its command line)."""
    import re
    text = (REPO / "scripts" / "gpu_check.sh").read_text()
    timeout = re.search(r'"ranks_grid_\$part" "\$\{RANKS_GRID_TIMEOUT_S:-(\d+)\}"', text)
    budget = re.search(r'--budget-s "\$\{RANKS_GRID_BUDGET_S:-(\d+)\}"', text)
    assert timeout and budget, "gpu_check.sh no longer names the grid's budget and timeout"
    return int(budget.group(1)), int(timeout.group(1))


def test_each_part_fits_one_device_call():
    budget, timeout = _grid_call_limits()
    # the part stops itself within its budget, its command's timeout is later (MPS start,
    # the stub / report after it) and the timeout's SIGKILL grace (30 s) still ends within the
    # device call
    assert budget + 30 <= timeout and timeout + 30 <= DEVICE_CALL_LIMIT_S, (budget, timeout)
    for part, invs in _parts().items():
        est = [RG.estimate_s(i, "mps") for i in invs]
        assert sum(est) <= budget * 0.9, (part, est)
    w8 = sum(RG.estimate_s(i) for i in RG.plan("w8"))
    assert w8 > budget  # W = 8 does not fit one call (said in the plan's print)


def test_the_time_model_covers_the_one_measured_run():
    """Session 20: 16 points (512x16x4x1024x512 and deepseek-v3@256, 2 race calls, W = 2, MPS)
    took 40 s in all: the model must not promise less."""
    inv = RG.Invocation("s20", 2, RG._sweep_args(
        2, "nvlink", ["512x16x4x1024x512", "256x256x8x7168x2048"], modes="balanced,stress_skew",
        layout="auto", order="remote_first", ccta="4,8", mgb="1,2"))
    assert RG.points(inv) == 16
    assert RG.estimate_s(inv) >= 40.0
    assert RG.estimate_s(inv, "time-sliced") > RG.estimate_s(inv)


def test_timeouts_leave_the_later_sweeps_their_estimate():
    est = [30.0, 120.0, 70.0, 120.0]
    assert RG.timeout_s(est, 0, 510) == 60.0  # twice its estimate
    assert RG.timeout_s(est, 3, 200) == 200.0  # the last one: all that is left
    assert RG.timeout_s(est, 1, 400) == 400 - 190  # not into the later ones' estimates
    assert RG.timeout_s(est, 1, 250) == 120.0  # short of time: its estimate comes first
    assert RG.timeout_s(est, 1, 100) == 100.0
    assert RG.timeout_s(est, 1, 50) == 0.0  # less than half its estimate: not started
    assert RG.timeout_s(est, 3, 30) == 0.0  # under MIN_START_S
    assert RG.timeout_s(est, 0, 31) == 30.0  # a short sweep is started with its estimate


# ------------------------------------------------------------------------ a run, folded
def _point(name, passed, **kw):
    return dict(shape=dict(tokens=64, experts=8, topk=2, N=256, K=128, name=name), mode="balanced",
                ccta=8, mgb=2, layout="packed", order="expert", empty_ranks=[], passed=passed,
                bitwise_equal=passed, rel_err_vs_seq=1e-3, race_check=None, **kw)


def _soak(grew=0):
    return dict(calls=1000, failures=0, replays=1000, check_every=1,
                memory_allocated_before=1 << 30, memory_allocated_after=(1 << 30) + grew,
                memory_slack_bytes=200_000, max_rel_err=1e-3)


def _fake_runner(now, killed=()):
    """A stand-in for run_one: writes what a sweep writes (every point; the broken one failing),
    or, for the sweeps in ``killed``, only a progress file with one point and a cut line, and
    uses up its timeout (rc 124)."""
    def runner(inv, out_dir, timeout, env):
        assert env["NVSHMEM_SYMMETRIC_SIZE"] and timeout > 0
        # the broken ordering in its own sweep only, whatever the caller's environment holds
        assert env.get("MOE_OVERLAP_TEST_BROKEN_ORDER") == (
            "flags_before_stores" if inv.expect_fail else None), inv.name
        n = RG.points(inv)
        if inv.name in killed:
            with open(os.path.join(out_dir, f"validate_{inv.name}.progress.jsonl"), "w") as f:
                f.write(json.dumps(_point("s", True)) + "\n" + '{"trunc')
            now[0] += timeout
            return 124, timeout
        meta = dict(planned_points=n, soak=inv.soak, expect_fail=inv.expect_fail)
        pts = [_point("b", False)] if inv.expect_fail else [_point("g", True)] * n
        soak = [_soak()] if inv.soak else []
        with open(os.path.join(out_dir, f"validate_{inv.name}.json"), "w") as f:
            json.dump(dict(meta=meta, points=pts, soak=soak), f)
        now[0] += 20
        return 0, 20.0
    return runner


def test_a_run_is_folded_with_stubs_for_what_left_no_json(tmp_path, monkeypatch):
    """Fake sweeps: the broken point caught, two grids that passed, the soak killed at its
    timeout after its one point. The report counts the broken check as passed, the soak that
    never reported as failed, with the reason."""
    monkeypatch.setenv("MOE_OVERLAP_TEST_BROKEN_ORDER", "flags_before_stores")
    now = [0.0]
    rows = RG.run_part("w2", str(tmp_path), 510, "mps", runner=_fake_runner(now, ("w2_soak",)),
                       clock=lambda: now[0])
    by = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows] == [i.name for i in RG.plan("w2")]
    assert by["w2_broken_order"]["failures"] == 0 and by["w2_broken_order"]["passed"] == 1
    for g in ("w2_nvlink", "w2_nvshmem"):
        assert by[g]["failures"] == 0 and by[g]["passed"] == 72 and by[g]["rc"] == 0
    soak = json.load(open(tmp_path / "validate_w2_soak.json"))
    assert "timed out" in soak["error"] and len(soak["points"]) == 1
    assert by["w2_soak"]["passed"] == 1 and by["w2_soak"]["points"] == 2  # its point; no soak
    assert now[0] <= 510  # the budget held
    checks = {os.path.basename(p)[:-5]: REPORT.grid_check(str(p))
              for p in sorted(tmp_path.glob("validate_*.json"))}
    assert checks["validate_w2_broken_order"]["failures"] == []
    assert [f["test"] for f in checks["validate_w2_soak"]["failures"]] == ["soak"]
    assert "timed out" in checks["validate_w2_soak"]["failures"][0]["reason"]
    t = REPORT.totals(checks)
    assert t["points"] == 1 + 72 + 2 + 72 and t["passed"] == 1 + 72 + 1 + 72


def test_sweeps_past_the_budget_leave_a_stub_and_fail(tmp_path):
    now = [0.0]
    rows = RG.run_part("w2", str(tmp_path), 100, "mps", runner=_fake_runner(now, ("w2_nvlink",)),
                       clock=lambda: now[0])
    by = {r["name"]: r for r in rows}
    assert now[0] <= 100
    assert by["w2_nvlink"]["rc"] == 124 and by["w2_nvlink"]["passed"] == 1  # its one point
    for name in ("w2_soak", "w2_nvshmem"):
        assert by[name]["rc"] is None and by[name]["failures"] > 0
        stub = json.load(open(tmp_path / f"validate_{name}.json"))
        assert "budget" in stub["error"] and stub["meta"]["planned_points"] == RG.points(
            next(i for i in RG.plan("w2") if i.name == name))
    checks = REPORT.grid_check(str(tmp_path / "validate_w2_nvshmem.json"))
    assert checks["passed"] == 0 and checks["points"] == 72


def test_only_runs_the_named_sweeps_and_refuses_unknown_names(tmp_path):
    """A part split over device calls: only the named sweeps run (and leave their JSON), in the
    part's order; a name the part lacks is refused before anything runs."""
    ran = []

    def runner(inv, out_dir, t, env):
        ran.append(inv.name)
        return 1, 1.0

    rows = RG.run_part("w8", str(tmp_path), 500, "mps", runner=runner,
                       only="w8_nvshmem,w8_nvlink")
    assert ran == [r["name"] for r in rows] == ["w8_nvlink", "w8_nvshmem"]
    assert sorted(p.name for p in tmp_path.glob("validate_*.json")) == [
        "validate_w8_nvlink.json", "validate_w8_nvshmem.json"]
    assert [i.name for i in RG.plan("w4", "w4_soak")] == ["w4_soak"]
    for bad in ("w4_soak", "w8_x", ","):
        with pytest.raises(ValueError, match="has the sweeps"):
            RG.plan("w8", bad)


def test_verdicts_of_a_broken_run_and_a_soak():
    from moe_overlap.combine.sweep import verdict
    # the broken ordering: a point that passes means the check missed it
    v = verdict(dict(meta=dict(expect_fail=True, planned_points=1), points=[_point("b", True)]))
    assert v["passed"] == 0 and "not caught" in v["failures"][0]["reason"]
    v = verdict(dict(meta=dict(expect_fail=True, planned_points=1), points=[]))
    assert v["passed"] == 0 and v["points"] == 1  # no point at all is no evidence either
    # the soak: correct replays but memory that grew fails; flat passes
    for grew, ok in ((150_000, True), (250_000, False)):
        v = verdict(dict(meta=dict(planned_points=1, soak=1000), points=[_point("g", True)],
                         soak=[_soak(grew)]))
        assert (v["failures"] == []) == ok and v["passed"] == (2 if ok else 1), (grew, v)
    v = verdict(dict(meta=dict(planned_points=3), points=[_point("g", True), _point("h", False)],
                     error="exit code 1"))
    assert v["points"] == 3 and v["passed"] == 1 and len(v["failures"]) == 2


def test_soak_memory_verdict():
    from moe_overlap.combine.race_check import memory_slack_bytes, soak_passed
    slack = memory_slack_bytes(2, 512, 4)
    assert slack == 2 * 8 * 2 * 512 * 4 + (64 << 10)
    # a 512-byte block leaked per replay shows within the soak
    assert 900 * 512 > slack
    s = dict(_soak(), memory_slack_bytes=slack)
    assert soak_passed(s) == (True, "")
    ok, why = soak_passed(dict(s, memory_allocated_after=s["memory_allocated_before"] + slack + 1))
    assert not ok and "grew" in why
    ok, why = soak_passed(dict(s, calls=40))
    assert not ok and "stopped after 40" in why
    ok, why = soak_passed({k: v for k, v in s.items() if k != "memory_slack_bytes"})
    assert not ok and "not recorded" in why


# ------------------------------------------------------------------------ zero-token ranks
def _empty_rank_routing(rank, world):
    from moe_overlap.combine.race_check import _Routing, rank_tokens
    from moe_overlap.combine.reference import reference_combine
    E, k, K, N, T = 8, 2, 16, 24, 40
    ov = types.SimpleNamespace(num_experts=E, topk=k, rank=rank, world_size=world,
                               device=torch.device("cpu"), group=None, tile_m=64)
    r = _Routing(ov, T, "stress_skew", 3, 2, "packed", "expert", empty_ranks=(1,))
    g = torch.Generator().manual_seed(rank)
    h = torch.randn(int(r.plan.total_rows), K, generator=g)
    w = torch.randn(E // world, K, N, generator=g) / K ** 0.5
    got = r.ref32(h, w)
    want = reference_combine(h.double(), w.double(), r.plan, r.ids, r.gates)
    return dict(ids=tuple(r.ids.shape), sent=int(r.counts[rank].sum()),
                received=int(r.plan.valid_rows), out=tuple(got.shape),
                err=float((got.double() - want).abs().max()) if got.numel() else 0.0,
                tokens=rank_tokens(T, rank, (1,)))


def test_a_rank_with_no_tokens_in_the_race_checks_routing():
    res = spawn_ranks(_empty_rank_routing, 2)
    r0, r1 = res
    assert r1["ids"] == (0, 2) and r1["sent"] == 0 and r1["out"] == (0, 24) and r1["tokens"] == 0
    assert r0["ids"] == (40, 2) and r0["sent"] == 80 and r0["out"] == (40, 24)
    assert r1["received"] > 0  # it still owns experts and computes rank 0's rows
    assert r0["err"] < 1e-4, r0


# ------------------------------------------------------------------------ broken ordering
def test_broken_ordering_raises_the_flags_before_late_stores(monkeypatch):
    """MOE_OVERLAP_TEST_BROKEN_ORDER=flags_before_stores (torch stand-in producer): every valid
    band's flag is up, and y still untouched, while the stores wait (a GPU sleep), so the
    consumer ships poisoned rows on every call; the normal order sleeps never."""
    from moe_overlap.combine.overlap import OverlapCombine
    from moe_overlap.combine.plan import plan_combine
    E, K, N = 4, 16, 8
    counts = torch.tensor([[70, 0, 200, 9]])
    plan = plan_combine(counts, 0, tile_m=64, mgb=1, impl="torch")
    h = torch.randn(plan.row_capacity, K)
    w = torch.randn(E, K, N)
    epoch = torch.tensor([5], dtype=torch.int32)
    for broken in ("flags_before_stores", ""):
        seen = []
        y = torch.full((plan.row_capacity + 1, N), float("nan"))
        flags = torch.zeros(plan.band_capacity, dtype=torch.int32)
        monkeypatch.setattr(torch.cuda, "_sleep",
                            lambda cycles: seen.append((cycles, flags.clone(), y.clone())),
                            raising=False)
        fake = types.SimpleNamespace(_test_broken_order=broken)
        OverlapCombine._torch_producer(fake, h, w, plan, y, flags, epoch)
        nb = int(plan.num_bands)
        assert bool((flags[:nb] == 5).all()) and bool((flags[nb:] == 0).all())
        assert not torch.isnan(y[:int(plan.total_rows)]).any()  # stored in the end
        if broken:
            assert len(seen) == 1 and seen[0][0] > 0
            _, f_then, y_then = seen[0]
            assert bool((f_then[:nb] == 5).all()) and bool(torch.isnan(y_then).all())
        else:
            assert seen == []


def test_the_worker_builds_the_layer_the_arguments_ask_for(monkeypatch):
    """The sweep's ranks build their layer from the parsed options (the broken point needs the
    torch producer): the layer's constructor is stopped right there."""
    import moe_overlap.combine.overlap as overlap
    import moe_overlap.launch as launch
    from moe_overlap.combine import sweep
    seen = {}

    class Stop(Exception):
        pass

    def fake_layer(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(overlap, "OverlapCombine", fake_layer)
    monkeypatch.setattr(launch, "rank_device", lambda: torch.device("cpu"))
    broken = next(i for i in RG.plan("w2") if i.expect_fail)
    with pytest.raises(Stop):
        sweep.worker(0, 2, RG.parsed(broken))
    assert seen["producer"] == "torch" and seen["transport"] == "nvlink"
    grid = next(i for i in RG.plan("w2") if i.name == "w2_nvshmem")
    with pytest.raises(Stop):
        sweep.worker(0, 2, RG.parsed(grid))
    assert seen["producer"] is None and seen["transport"] == "nvshmem" and seen["ccta"] == 8


def test_merging_a_merged_file_keeps_each_checks_own_run(tmp_path):
    # a session's file merged again (the next session's runs added) must not restamp its
    # checks with the file's newest commit or mode (a time-sliced check read as MPS)
    old = dict(device="H100", commit="bbb", date="2026-12-02", mode="mps", checks={
        "faults": dict(points=2, passed=2, failures=[], commit="aaa", date="2026-12-01",
                       mode="time-sliced"),
        "grid": dict(points=3, passed=3, failures=[], commit="bbb", date="2026-12-02",
                     mode="mps")})
    new = dict(device="H100", commit="ccc", date="2026-12-03", mode="mps", checks={
        "grid": dict(points=3, passed=2, failures=[{"test": "x", "reason": "y"}])})
    paths = []
    for i, doc in enumerate((old, new)):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(doc, f)
    d = REPORT.merge(paths)
    assert d["checks"]["faults"]["commit"] == "aaa"
    assert d["checks"]["faults"]["mode"] == "time-sliced"
    assert d["checks"]["grid"]["commit"] == "ccc" and d["checks"]["grid"]["passed"] == 2
    assert d["commits"] == ["aaa", "ccc"] and d["modes"] == ["mps", "time-sliced"]



def test_a_pytest_run_cut_by_the_limit_counts_its_interrupted_test_as_failed(tmp_path):
    # gpu_check.sh stops a module at its limit with SIGINT (timeout -s INT): pytest still writes
    # the junit file, where the test it stopped has no name; that test must not read as passed
    import shutil
    import subprocess
    if shutil.which("timeout") is None:
        pytest.fail("coreutils timeout is needed (gpu_check.sh uses it)")
    (tmp_path / "test_cut.py").write_text(
        "import time\n"
        "def test_done():\n    pass\n"
        "def test_stopped():\n    time.sleep(60)\n"
        "def test_never():\n    pass\n")
    junit = tmp_path / "junit_cut.xml"
    r = subprocess.run(["timeout", "-s", "INT", "-k", "30", "15", sys.executable, "-m", "pytest",
                        "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                        str(tmp_path / "test_cut.py")], cwd=tmp_path, capture_output=True)
    assert r.returncode == 124, r.stdout[-2000:]
    c = REPORT.junit_check(str(junit))
    assert c["passed"] == 1 and len(c["failures"]) == 1, c
    assert "interrupted" in c["failures"][0]["reason"]


def test_the_time_model_is_not_below_the_grid_runs_recorded_after_it_was_set():
    """Held out: the time model's constants were set from session 21's sweeps (f088e61,
    2026-12-06 17:53); the grid runs recorded in ranks_onegpu_h100_3efe759.json are later (the
    evening of 12-06 and the morning of 12-07). Each sweep's estimate must be at or above its
    measured time, or a part's budget could cut it."""
    name = "ranks_onegpu_h100_3efe759.json"
    path = next((p for p in (REPO / "bench" / "results" / name,
                             REPO / "bench" / "results" / "archive" / name) if p.exists()), None)
    assert path is not None, name
    checks = json.loads(path.read_text())["checks"]
    seen = 0
    for part in ("w2", "w4", "w8"):
        for inv in RG.plan(part):
            c = checks.get(f"validate_{inv.name}")
            if c is None or c.get("mode", "mps") != "mps" or c.get("date", "") < "2026-12-06T18":
                continue
            seen += 1
            assert RG.estimate_s(inv) >= c["meta"]["seconds"], (inv.name, c["meta"]["seconds"])
    assert seen == 10, seen  # the ten sweeps of the three parts, each recorded once
