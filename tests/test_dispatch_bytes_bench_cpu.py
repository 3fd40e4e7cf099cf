"""CPU smoke test of bench/bench_dispatch_bytes.py on a tiny config: it runs, writes its result
file with the header, and its rows add up (totals of the per-rank counts, savings of them)."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

import bench_dispatch_bytes as BB  # noqa: E402


def test_bench_runs_and_its_rows_add_up(tmp_path):
    path = BB.main(["--tokens", "16", "--worlds", "2,4", "--models", "qwen3-30b-a3b",
                    "--modes", "balanced,stress_skew", "--out", str(tmp_path)])
    (name,) = os.listdir(tmp_path)
    assert name.startswith("dispatch_bytes_") and name.endswith(".json")
    assert os.path.join(str(tmp_path), name) == path
    doc = json.load(open(path))
    assert doc["bench"] == "bench_dispatch_bytes" and doc["device"] == "cpu" and doc["git_commit"]
    rows = doc["rows"]
    assert [(r["world_size"], r["mode"]) for r in rows] == [
        (2, "balanced"), (2, "stress_skew"), (4, "balanced"), (4, "stress_skew")]
    for r in rows:
        pr = r["per_rank"]
        assert len(pr) == r["world_size"]
        assert r["per_assignment_bytes"] == sum(p["per_assignment"] for p in pr)
        assert r["once_bytes"] == sum(p["once"] for p in pr)
        assert r["per_assignment_bytes"] == sum(p["assignments"] for p in pr) * 2048 * 2
        new = r["once_bytes"] + r["once_index_bytes"]
        assert abs(r["saving"] - (1 - new / r["per_assignment_bytes"])) < 1e-12
        assert r["busiest_rank_per_assignment_bytes"] == max(p["per_assignment"] for p in pr)
        # a token goes to at most as many ranks as it has off-rank experts
        assert r["off_rank_destinations_per_token"] <= r["off_rank_assignments_per_token"]
