"""The README status block and docs/RESULTS.md are what `moe-overlap report` builds from the
headline result files: a number edited by hand, a result file nobody classified, or a named file
that is missing fails here."""
import os
import shutil

import pytest

from moe_overlap import report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_readme_and_results_are_generated_from_the_headline_files():
    assert report.problems(ROOT) == []


def test_every_file_the_report_names_exists():
    res = os.path.join(ROOT, "bench", "results")
    headline = [n for _, files in report.HEADLINE.values() for n in files]
    named = headline + list(report.INPUTS) + list(report.READ_BY)
    assert named and all(os.path.isfile(os.path.join(res, n)) for n in named)
    text = "\n".join(report.build(ROOT).values())
    for n in headline + list(report.INPUTS):
        assert n in text  # every file the report reads is cited where its numbers are


def test_every_archived_file_is_in_the_index():
    arch = os.path.join(ROOT, "bench", "results", "archive")
    index = open(os.path.join(arch, "INDEX.md")).read()
    listed = [n for n in os.listdir(arch) if n != "INDEX.md"]
    assert listed and all(f"`{n}`" in index for n in listed)


@pytest.fixture
def repo_copy(tmp_path):
    for d in ("bench/results", "docs"):
        shutil.copytree(os.path.join(ROOT, d), tmp_path / d,
                        ignore=shutil.ignore_patterns("archive"))
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    assert report.problems(str(tmp_path)) == []
    return tmp_path


def test_a_hand_edited_number_is_caught(repo_copy):
    readme = (repo_copy / "README.md").read_text()
    block = readme[readme.index(report.BEGIN):readme.index(report.END)]
    edited = block.replace("0.55-0.76x", "0.95-1.06x")
    assert edited != block
    (repo_copy / "README.md").write_text(readme.replace(block, edited))
    assert any("README.md" in p for p in report.problems(str(repo_copy)))


def test_an_unclassified_new_result_and_a_missing_headline_are_caught(repo_copy):
    res = repo_copy / "bench" / "results"
    shutil.copy(res / "combine_sweep_2xh200_v7.json", res / "combine_sweep_2xh200_v8.json")
    assert any("combine_sweep_2xh200_v8.json" in p for p in report.problems(str(repo_copy)))
    (res / "combine_sweep_2xh200_v8.json").unlink()
    (res / "scale_bench_h200.json").unlink()
    assert any("missing" in p and "scale_bench_h200.json" in p
               for p in report.problems(str(repo_copy)))


def test_a_changed_result_changes_the_report(repo_copy):
    import json
    path = repo_copy / "bench" / "results" / "ffn_fused_v7_final_2xh200.json"
    d = json.loads(path.read_text())
    d["results"][0]["speedup_vs_baseline"] = 1.25
    path.write_text(json.dumps(d))
    bad = report.problems(str(repo_copy))
    assert any("README.md" in p for p in bad) and any("RESULTS.md" in p for p in bad)
    assert report.main(["--root", str(repo_copy)]) == 0  # regenerate
    assert report.problems(str(repo_copy)) == []
    assert "0.55-1.25x" in (repo_copy / "README.md").read_text()


def test_cli_report_check_and_script_agree():
    import subprocess
    import sys
    for cmd in ([sys.executable, "-m", "moe_overlap", "report", "--check", "--root", ROOT],
                [sys.executable, os.path.join(ROOT, "scripts", "report.py"), "--check"]):
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0 and "up to date" in r.stdout, r.stdout + r.stderr


def test_in_place_baseline_figure_is_the_ffn_model():
    from moe_overlap.ffn.compute_chained import baseline_activation_bytes
    from moe_overlap.report import in_place_baseline_bytes
    for M, hidden, N in ((8192, 7168, 4096), (32768, 9216, 7168), (4096, 1024, 7168)):
        assert in_place_baseline_bytes(M, hidden, N) == baseline_activation_bytes(M, hidden, N)


def test_the_ranks_row_names_every_checks_commit_and_is_no_fresher_than_any():
    """The ranks headline merges runs of several commits: its status row names the commit of
    every check, and its freshness is the least fresh of theirs (a module that last ran before
    a dependency changed keeps the row stale, whatever the file's last run)."""
    import json
    (name,) = report.HEADLINE["ranks"][1]
    with open(os.path.join(ROOT, "bench", "results", name)) as f:
        d = json.load(f)
    commits = {c.get("commit", d["commit"]) for c in d["checks"].values()}
    assert len(commits) > 1  # a merged file: else this checks nothing
    line = next(ln for ln in report.build(ROOT)["README.md"].splitlines()
                if ln.startswith("| " + report.ROW_OF["ranks"] + " |"))
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    assert set(cells[5].split(", ")) == commits
    rank = {"current": 0, "unknown": 1, "stale": 2}
    states = [report.freshness(ROOT, "ranks", dict(d, commit=c))["state"] for c in commits]
    shown = ("stale" if cells[6].startswith("**stale**") else
             "current" if cells[6].startswith("current") else "unknown")
    assert rank[shown] == max(rank[s] for s in states), (cells[6], states)
