"""bench/bench_results.git_commit: the commit a result file records."""
import importlib.util
import pathlib
import shutil
import subprocess

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "bench" / "bench_results.py"


def _load(path):
    spec = importlib.util.spec_from_file_location(f"bench_results_{abs(hash(str(path)))}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                   check=True, capture_output=True)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("GIT_COMMIT", raising=False)


def test_env_wins(monkeypatch):
    monkeypatch.setenv("GIT_COMMIT", "abc1234")
    assert _load(SRC).git_commit() == "abc1234"


def test_own_checkout_reports_its_head(tmp_path, no_env):
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    shutil.copy(SRC, repo / "bench" / "bench_results.py")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "x")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, text=True,
                          capture_output=True, check=True).stdout.strip()
    assert _load(repo / "bench" / "bench_results.py").git_commit() == head


def test_copy_inside_another_repository_is_unknown(tmp_path, no_env):
    # the device machine's copy of the tree has no .git of its own; a repository above it
    # must not lend it its HEAD
    outer = tmp_path / "outer"
    copy = outer / "copy" / "bench"
    copy.mkdir(parents=True)
    shutil.copy(SRC, copy / "bench_results.py")
    _git(outer, "init", "-q")
    _git(outer, "commit", "-q", "--allow-empty", "-m", "other")
    assert _load(copy / "bench_results.py").git_commit() == "unknown"


def test_no_repository_is_unknown(tmp_path, no_env, monkeypatch):
    copy = tmp_path / "copy" / "bench"
    copy.mkdir(parents=True)
    shutil.copy(SRC, copy / "bench_results.py")
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no repository above tmp
    assert _load(copy / "bench_results.py").git_commit() == "unknown"


def test_partial_file_holds_the_points_so_far_until_the_result(tmp_path):
    import json
    br = _load(SRC)
    out = tmp_path / "o"
    p = br.write_partial(dict(points=[1]), str(out), "r.json", 1, 3)
    assert p.endswith("r.json.partial") and not (out / "r.json").exists()
    assert json.load(open(p)) == dict(points=[1], partial=dict(done=1, of=3))
    br.write_partial(dict(points=[1, 2]), str(out), "r.json", 2, 3)
    assert json.load(open(p))["points"] == [1, 2]
    assert sorted(f.name for f in out.iterdir()) == ["r.json.partial"]  # no .tmp left
    br.write_result(dict(points=[1, 2, 3]), str(out), "r.json")
    assert sorted(f.name for f in out.iterdir()) == ["r.json"]
