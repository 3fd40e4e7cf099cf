"""The command line: the demo (the main job) and plan-stats."""
import json
import os
import subprocess
import sys

import pytest


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "moe_overlap", *args], capture_output=True,
                          text=True, timeout=timeout)


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
    assert len(rows) == 2 * 2 * 3 * 2  # scalings x W x modes x tile_m
    for row in rows:
        assert row["rows_padded"] >= row["rows_valid"] > 0
        assert row["padding_overhead"] == pytest.approx(
            (row["rows_padded"] - row["rows_valid"]) / row["rows_valid"])
    # strong scaling: fewer tokens per rank at W=4 than W=2, so no less padding (same tile_m)
    for mode in ("balanced",):
        p = {r["world_size"]: r["padding_overhead"] for r in rows
             if r["scaling"] == "strong" and r["mode"] == mode and r["tile_m"] == 128}
        assert p[4] >= p[2]
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
