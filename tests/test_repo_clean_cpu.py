"""Tests write nothing into the repository: CuTe DSL's kept PTX / cubin and Hypothesis's database
go to a temporary folder (tests/conftest.py), and a run that leaves a file in the repository
root fails (checked here on a throwaway repository with the same conftest)."""
import os
import pathlib
import shutil
import subprocess
import sys

from conftest import REPO


def _inside(path, folder) -> bool:
    return pathlib.Path(path).resolve().is_relative_to(pathlib.Path(folder).resolve())


def test_dsl_dumps_and_hypothesis_database_go_outside_the_repo():
    from hypothesis.configuration import storage_directory
    for var in ("CUTE_DSL_DUMP_DIR", "HYPOTHESIS_STORAGE_DIRECTORY"):
        assert os.environ.get(var) and not _inside(os.environ[var], REPO), var
    where = storage_directory("examples", intent_to_write=False).path
    assert not _inside(where, REPO) and not _inside(where, os.getcwd()), where


def _run_inner(tmp_path, body):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "tests").mkdir()
    shutil.copy(REPO / "tests" / "conftest.py", tmp_path / "tests" / "conftest.py")
    (tmp_path / "tests" / "test_inner.py").write_text(body)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "no:benchmark", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_run_that_writes_into_the_repo_root_fails(tmp_path):
    r = _run_inner(tmp_path, "def test_dump():\n    open('kernel_0x1.sm_90a.ptx', 'w').close()\n")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed" in r.stdout  # the test itself passed: the root check failed the run
    assert "tests wrote into the repository root" in r.stdout and "kernel_0x1.sm_90a.ptx" \
        in r.stdout, r.stdout


def test_a_run_that_writes_to_tmp_path_passes(tmp_path):
    r = _run_inner(tmp_path, "def test_dump(tmp_path):\n    (tmp_path / 'k.ptx').write_text('')\n")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "repository root" not in r.stdout
