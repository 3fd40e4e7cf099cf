"""A status row turns stale when a source file its number depends on changes
(moe_overlap/provenance.py, moe_overlap/report.py), and the count of commits it states reads the
same when the report is written before the commit that carries the change and checked after."""
import json
import os
import shutil
import subprocess

import pytest

from moe_overlap import provenance, report

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


def _row(readme: str, piece: str) -> str:
    return next(line for line in readme.splitlines() if line.startswith(f"| {piece} |"))


def test_blob_hash_is_gits(tmp_path):
    (tmp_path / "f.py").write_bytes(b"x = 1\n")
    want = subprocess.run(["git", "hash-object", str(tmp_path / "f.py")], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert provenance.file_hash(str(tmp_path), "f.py") == want


@pytest.fixture
def stamped_copy(tmp_path, monkeypatch):
    """results, docs and README plus the scale row's source files, no git; the scale result
    stamped with those files' hashes."""
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp
    for d in ("bench/results", "docs"):
        shutil.copytree(os.path.join(ROOT, d), tmp_path / d,
                        ignore=shutil.ignore_patterns("archive"))
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    for p in provenance.DEPENDENCIES["scale"]:
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, p), tmp_path / p)
    path = tmp_path / "bench" / "results" / "scale_bench_h200.json"
    doc = json.loads(path.read_text())
    provenance.stamp(doc, "scale", gpus=1, device=doc["device"], commit="",
                     root=str(tmp_path))
    path.write_text(json.dumps(doc))
    assert report.main(["--root", str(tmp_path)]) == 0
    return tmp_path


def test_a_row_turns_stale_when_a_file_it_depends_on_changes(stamped_copy):
    row = _row((stamped_copy / "README.md").read_text(), report.ROW_OF["scale"])
    assert "current" in row and "stale" not in row
    assert report.problems(str(stamped_copy)) == []
    dep = stamped_copy / "moe_overlap" / "combine" / "scale.py"
    dep.write_text(dep.read_text() + "\n# changed\n")
    assert any("README.md" in p for p in report.problems(str(stamped_copy)))
    assert report.main(["--root", str(stamped_copy)]) == 0
    row = _row((stamped_copy / "README.md").read_text(), report.ROW_OF["scale"])
    assert "**stale**" in row and "combine/scale.py" in row and "current" not in row
    # a file the row does not depend on changes nothing
    assert "moe_overlap/combine/grouped_gemm.py" not in provenance.DEPENDENCIES["scale"]
    grouped = stamped_copy / "moe_overlap" / "combine" / "grouped_gemm.py"
    grouped.parent.mkdir(parents=True, exist_ok=True)
    grouped.write_text("# not a dependency of the scale row\n")
    assert report.problems(str(stamped_copy)) == []


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A git repository with one dependency file (area "t": a.py) and one other file."""
    monkeypatch.setitem(provenance.DEPENDENCIES, "t", ("a.py",))
    (tmp_path / "a.py").write_text("a = 1\n")
    (tmp_path / "b.py").write_text("b = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def _commit(repo, name, text, msg):
    (repo / name).write_text(text)
    _git(repo, "commit", "-q", "-am", msg)


@pytest.mark.parametrize("recorded", ["commit", "fingerprint"])
def test_stale_count_is_the_same_before_and_after_the_commit_that_changes_a_dependency(
        repo, recorded):
    first = _git(repo, "rev-parse", "--short", "HEAD")
    if recorded == "commit":  # a result written before the stamp: only its commit
        doc = {"git_commit": first}
    else:  # stamped on a machine without git: hashes, no commit
        doc = provenance.stamp({}, "t", gpus=1, device="d", root=str(repo))

    def fresh():
        return provenance.freshness(str(repo), "t", doc)
    assert fresh()["state"] == "current"
    _commit(repo, "b.py", "b = 2\n", "unrelated")
    assert fresh()["state"] == "current"
    _commit(repo, "a.py", "a = 2\n", "dependency")
    f = fresh()
    assert (f["state"], f["changed"], f["commits"]) == ("stale", ["a.py"], 1)
    (repo / "a.py").write_text("a = 3\n")  # the report is written before the commit ...
    before = fresh()
    _git(repo, "commit", "-q", "-am", "dependency again")  # ... and checked after it
    after = fresh()
    assert before == after and after["commits"] == 2
    _commit(repo, "b.py", "b = 3\n", "unrelated again")
    assert fresh() == after


def test_a_commit_this_history_lacks_is_unknown_not_current(repo):
    f = provenance.freshness(str(repo), "t", {"git_commit": "0123456"})
    assert f["state"] == "unknown" and "0123456" in f["why"]


def test_same_scale_estimate_swaps_in_our_scale_and_the_fastest_library_gemm():
    shape = {"tokens": 8, "experts": 2, "topk": 1, "N": 4, "K": 4}
    point = {"shape": shape, "t_seq_ms": 3.0, "seq_gemm": "blocks", "seq_scale": "bmm",
             "seq_variants_ms": {"gemm": {"blocks": 1.0, "loop": 0.5},
                                 "scale": {"bmm": 1.0, "fp32": 2.0}}}
    ours = {json.dumps(shape, sort_keys=True): 0.25}
    # 3.0 - 1.0 (blocks) + 0.5 (loop, the fastest) - 1.0 (bmm) + 0.25 (ours)
    assert report._same_scale_estimate(point, ours) == pytest.approx(1.75)
    assert report._same_scale_estimate(point, {}) is None
