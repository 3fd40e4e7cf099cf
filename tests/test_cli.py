"""The command line: the demo (the main job) and plan-stats."""
import json
import os
import subprocess
import sys

import pytest


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_A_FOLDER = os.path.join(ROOT, "README.md", "sub")  # under a file: never writable, even as root


def run_cli(*args, timeout=600, cwd=None):
    env = dict(os.environ)
    if cwd is not None:  # outside the checkout: import the package under test all the same
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "moe_overlap", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=cwd, env=env)


def test_demo_is_the_default_and_passes():
    r = run_cli("--world-size", "2", "--tokens", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "demo passed" in r.stdout
    for mode in ("balanced", "moderate_skew", "stress_skew"):
        assert mode in r.stdout


def test_plan_stats_writes_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    r = run_cli("plan-stats", "--world-sizes", "2,4", "--tile-m", "64,128", "--tokens", "256",
                "--global-tokens", "512", "--experts", "16", "--topk", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.load(open(tmp_path / "plan_stats.json"))
    rows = data["rows"]
    assert len(rows) == 2 * 2 * 3 * 2 * 2  # scalings x W x modes x tile_m x layouts
    for row in rows:
        assert row["rows_padded"] >= row["rows_valid"] > 0
        assert row["padding_overhead"] == pytest.approx(
            (row["rows_padded"] - row["rows_valid"]) / row["rows_valid"])
    # strong scaling, aligned: fewer tokens per rank at W=4 than W=2, so no less padding
    for mode in ("balanced",):
        p = {r["world_size"]: r["padding_overhead"] for r in rows if r["scaling"] == "strong"
             and r["mode"] == mode and r["tile_m"] == 128 and r["layout"] == "aligned"}
        assert p[4] >= p[2]
    # the packed layout never lays out more rows than the aligned one, same routed rows
    key = lambda r: (r["scaling"], r["world_size"], r["mode"], r["tile_m"])  # noqa: E731
    aligned = {key(r): r for r in rows if r["layout"] == "aligned"}
    for r in rows:
        if r["layout"] == "packed":
            a = aligned[key(r)]
            assert r["rows_valid"] == a["rows_valid"] and r["rows_padded"] <= a["rows_padded"]
    png = tmp_path / "plan_stats.png"
    assert png.exists() and png.read_bytes()[:4] == b"\x89PNG"


def test_validate_small_grid():
    r = run_cli("validate", "--world-sizes", "2", "--tokens", "32")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "18/18 cases passed" in r.stdout


def test_bad_subcommand_fails():
    r = run_cli("nonsense")
    assert r.returncode != 0


def test_gpu_commands_fail_clearly_without_gpus():
    r = run_cli("validate", "--backend", "overlap")
    assert r.returncode != 0 and "needs at least 2 GPUs" in r.stderr
    r = run_cli("sweep", "--help")
    assert r.returncode == 0 and "--validate-only" in r.stdout


# ---------------------------------------------------------------- argument errors and help
@pytest.mark.parametrize("args,msg", [
    (("validate", "--world-sizes", "2", "--experts", "5"), "--experts 5 is not divisible by "
                                                           "world size 2"),
    (("plan-stats", "--world-sizes", "4,x"), "--world-sizes: expected a positive integer"),
    (("plan-stats", "--experts", "100"), "--experts 100 is not divisible by world size 8"),
    (("plan-stats", "--modes", "balanced,hot"), "'hot' is not one of"),
    (("plan-stats", "--tile-m", "100"), "100 is not one of 64, 128, 256"),
    (("demo", "--experts", "6"), "--experts 6 is not divisible by world size 4"),
    (("demo", "--topk", "17"), "--topk 17 exceeds --experts 16"),
    (("validate", "--world-sizes", "0"), "expected a positive integer, got 0"),
    (("validate", "--backend", "overlap", "--world-sizes", "2,4"), "one --world-sizes value"),
    (("validate", "--backend", "overlap", "--dtype", "float32"), "bfloat16"),
    (("validate", "--backend", "overlap", "--device", "cpu"), "--device cpu is for the "
                                                              "reference backend"),
    (("sweep", "--reps", "0"), "--reps must be >= 1"),
    (("sweep", "--out", NOT_A_FOLDER), "is not a folder"),
])
def test_argument_errors_are_one_line_usage_errors(args, msg):
    r = run_cli(*args, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert ": error: " in last and msg in last, r.stderr
    assert "world sizes" not in r.stderr and "cases passed" not in r.stdout  # no work was done


def _main_exit(capsys, args):
    """cli.main in this process: (exit status, stdout, stderr); parser errors exit via
    SystemExit, report's root check returns its status."""
    from moe_overlap import cli
    try:
        code = cli.main(list(args))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("args,msg", [
    (("plan-stats", "--global-tokens", "1000"), "--global-tokens 1000 is not divisible by world "
                                                "size 16"),
    (("plan-stats", "--out", NOT_A_FOLDER), "is not a folder"),
    (("validate", "--world-sizes", "2", "--tokens", "8", "--out", NOT_A_FOLDER + ".json"),
     "is not a folder"),
    (("validate", "--backend", "overlap", "--out", NOT_A_FOLDER), "is not a folder"),
    (("validate", "--backend", "overlap", "--race-calls", "-1"), "expected an integer >= 0"),
    (("validate", "--backend", "overlap", "--soak", "x"), "expected an integer >= 0"),
    (("project", "--world-sizes", "3"), "none divides the 256 experts of deepseek-v3"),
    (("project", "--ib-gbps", "0"), "--ib-gbps: expected a number > 0, got 0"),
    (("project", "--ib-gbps", "-5"), "--ib-gbps: expected a number > 0, got -5"),
    (("project", "--ib-gbps", "inf"), "--ib-gbps: expected a number > 0, got inf"),
    (("project", "--ib-latency-us", "-1"), "--ib-latency-us: expected a number >= 0"),
    (("project", "--ib-latency-us", "nan"), "--ib-latency-us: expected a number >= 0"),
    (("project", "--gpus-per-node", "0"), "expected a positive integer, got 0"),
    (("project", "--sweep", os.path.join(ROOT, "no-such-sweep.json")), "pass --sweep ''"),
    (("project", "--sweep", os.path.join(ROOT, "README.md")), "not a readable sweep JSON"),
    (("project", "--out", NOT_A_FOLDER), "is not a folder"),
    (("project-ffn", "--busbw-gbps", "nan"), "--busbw-gbps: expected a number > 0"),
    (("project-ffn", "--tokens", "0"), "expected a positive integer, got 0"),
    (("project-ffn", "--root", os.path.join(ROOT, "docs")), "lacks ffn_baseline_h200.json"),
    (("project-ffn", "--out", NOT_A_FOLDER + ".json"), "is not a folder"),
    (("project-ffn", "--out", ROOT), "is a folder, not a file"),
    (("heap", "--tile-m", "7"), "invalid choice: 7"),
    (("heap", "--world-size", "0"), "expected a positive integer, got 0"),
    (("report", "--root", os.path.join(ROOT, "docs")), "is not a moe-overlap checkout"),
])
def test_bad_arguments_stop_with_a_usage_error_before_any_work(capsys, args, msg):
    code, out, err = _main_exit(capsys, args)
    assert code == 2, out + err
    last = err.strip().splitlines()[-1]
    assert ": error: " in last and msg in last, err
    assert "world sizes" not in err and "cases passed" not in out  # no work was done


# ---------------------------------------------------------------- outside the checkout
def _tracked_results():
    res = os.path.join(ROOT, "bench", "results")
    return {n: os.stat(os.path.join(res, n)).st_mtime_ns for n in sorted(os.listdir(res))}


def test_project_ffn_defaults_write_under_the_working_folder_not_the_repo(tmp_path):
    before = _tracked_results()
    r = run_cli("project-ffn", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out" / "project-ffn" / "projection_ffn.json"
    doc = json.load(open(out))
    assert doc["rows"] and doc["meta"]["kind"] == "projection"
    assert _tracked_results() == before  # bench/results/ untouched, nothing added
    # read from the checkout the package runs from, not from the working folder
    assert "Check of the compute='reduce' model" in r.stdout


def test_project_runs_outside_the_checkout_with_its_sweep_check(tmp_path):
    r = run_cli("project", "--models", "qwen3-30b-a3b,mixtral-8x7b", "--world-sizes", "2,16",
                "--tokens", "256", cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "t_overlap error mean" in r.stdout  # the measured sweep was found and used
    assert "skipped (the experts do not split evenly over W ranks): mixtral-8x7b at W=16" \
        in r.stdout
    doc = json.load(open(tmp_path / "out" / "projection" / "projection.json"))
    assert {(x["model"], x["world_size"]) for x in doc["rows"]} == {
        ("qwen3-30b-a3b", 2), ("qwen3-30b-a3b", 16), ("mixtral-8x7b", 2)}


def test_plan_stats_default_out_is_under_the_working_folder(tmp_path):
    r = run_cli("plan-stats", "--world-sizes", "2", "--tile-m", "64", "--modes", "balanced",
                "--tokens", "64", "--global-tokens", "128", "--experts", "8", "--topk", "2",
                cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "out" / "plan-stats" / "plan_stats.json").is_file()


def test_report_outside_the_checkout_is_a_one_line_error(tmp_path):
    r = run_cli("report", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"moe-overlap report: error: {tmp_path} is not a moe-overlap checkout (no README.md and "
        "bench/results/ there): run it from the checkout or pass --root PATH"]
    assert list(tmp_path.iterdir()) == []


def test_plan_stats_rows_refuse_a_global_batch_that_would_round():
    from moe_overlap.cli import plan_stats_rows
    with pytest.raises(ValueError, match="--global-tokens 1000 is not divisible by world size 16"):
        plan_stats_rows([16], [128], ["balanced"], 1000, 16, 2, scaling="strong")
    rows = plan_stats_rows([16], [128], ["balanced"], 1024, 16, 2, scaling="strong")
    assert {r["tokens_per_rank"] for r in rows} == {64}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the no-CUDA error")
def test_validate_on_cuda_without_cuda_fails_before_spawning():
    r = run_cli("validate", "--device", "cuda", "--world-sizes", "2", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--device cuda: CUDA is not available" in r.stderr.strip().splitlines()[-1]
    assert "world sizes" not in r.stderr  # no rank was started (no progress bar)


def test_validate_overlap_passes_its_options_on(monkeypatch):
    import moe_overlap.combine.sweep as sweep
    from moe_overlap import cli
    seen = []
    monkeypatch.setattr(sweep, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main(["validate", "--backend", "overlap", "--world-sizes", "2", "--tokens", "64",
                     "--topk", "2", "--experts", "8", "--out", "v.json"]) == 0
    argv = seen[0]
    assert argv[:3] == ["--validate-only", "--out", "v.json"]
    assert argv[argv.index("--world-size") + 1] == "2"
    assert argv[argv.index("--shapes") + 1] == "64x8x2x8192x1024,64x8x2x8192x2048"
    assert cli.main(["validate", "--backend", "overlap"]) == 0  # defaults: the sweep's own
    assert seen[1] == ["--validate-only", "--out", "validate_overlap.json"]


def _option_blocks(help_text):
    """{option: its help block} from an argparse --help page."""
    body = help_text.split("options:", 1)[1]
    blocks, cur = {}, None
    for line in body.splitlines():
        if line.startswith("  -"):
            cur = line.split()[0].rstrip(",")
            blocks[cur] = line
        elif cur and line.strip():
            blocks[cur] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("cmd", ["demo", "plan-stats", "validate", "sweep"])
def test_help_describes_every_option_and_its_default(cmd):
    r = run_cli(cmd, "--help", timeout=120)
    assert r.returncode == 0, r.stderr
    blocks = _option_blocks(r.stdout)
    assert len(blocks) >= 5, blocks
    for opt, text in blocks.items():
        if opt in ("-h", "--validate-only"):
            continue
        described = " ".join(w for w in text.split() if not w.startswith(("-", "{")) and
                             not w.isupper())
        assert len(described) > 10 and "default" in text, (cmd, opt, text)


def test_plan_stats_shows_progress_on_stderr(tmp_path):
    r = run_cli("plan-stats", "--world-sizes", "2", "--tile-m", "64", "--tokens", "64",
                "--global-tokens", "128", "--experts", "8", "--topk", "2", "--out",
                str(tmp_path), timeout=300)
    assert r.returncode == 0, r.stderr
    assert "plan-stats" in r.stderr and "100%" in r.stderr and "6/6" in r.stderr, r.stderr
    assert "100%" not in r.stdout


def test_readme_command_line_section_mentions_sweep():
    import pathlib
    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Command line", 1)[1].split("\n## ", 1)[0]
    assert "- `sweep`" in section


def test_without_a_checkout_project_ffn_asks_for_root_and_project_runs_unchecked(
        capsys, monkeypatch, tmp_path):
    """An installed copy without bench/results/ beside it (not an editable install)."""
    from moe_overlap import cli
    monkeypatch.setattr(cli, "checkout_root", lambda: None)
    monkeypatch.setattr(cli, "checkout_file", lambda *parts: None)
    code, out, err = _main_exit(capsys, ["project-ffn", "--out", str(tmp_path / "p.json")])
    assert code == 2 and "no moe-overlap checkout found beside this package: pass --root PATH" \
        in err.strip().splitlines()[-1], err
    code, out, err = _main_exit(capsys, ["project", "--models", "mixtral-8x7b", "--world-sizes",
                                         "2", "--tokens", "64", "--out", str(tmp_path / "p")])
    assert code == 0, err
    assert "Not checked against a measured sweep" in out and "error mean" not in out
    assert (tmp_path / "p" / "projection.json").is_file()
