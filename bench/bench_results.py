"""What every bench writes with its rows: the result header (device, date, commit, torch) and the
JSON file in --out."""
import datetime
import json
import os
import subprocess

import torch


def git_commit() -> str:
    """GIT_COMMIT when set, else `git rev-parse --short HEAD` of this checkout, else "unknown".
    "unknown" also where the nearest git repository is not this tree's own (its root is not
    the folder above bench/): the device machine's copy of the tree has no .git, and a
    repository above it reports some other commit."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here,
                              timeout=10).stdout.strip()
    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or os.path.realpath(top) != os.path.realpath(os.path.dirname(here)):
            return "unknown"
        return git("rev-parse", "--short", "HEAD") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def result_header(bench: str, cuda: bool = True, area: str | None = None,
                  gpus: int = 1) -> dict:
    """bench, device, date (UTC), git_commit and torch of a result file; with area (a row of
    the README status table, moe_overlap.provenance.DEPENDENCIES) also the provenance stamp:
    the source files' hashes and the number of GPUs."""
    doc = dict(bench=bench, device=torch.cuda.get_device_name() if cuda else "cpu",
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               git_commit=git_commit(), torch=torch.__version__)
    if area is not None:
        from moe_overlap.provenance import stamp
        commit = doc["git_commit"]
        stamp(doc, area, gpus=gpus, device=doc["device"],
              commit="" if commit == "unknown" else commit)
    return doc


PARTIAL = ".partial"  # suffix of a run's points so far (not .json: no report reads it)


def write_result(doc: dict, out: str, name: str) -> str:
    """Writes doc to out/name (creating out) and removes the run's partial file; returns the
    path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    if os.path.exists(path + PARTIAL):
        os.remove(path + PARTIAL)
    return path


def write_partial(doc: dict, out: str, name: str, done: int, total: int) -> str:
    """Writes doc so far to out/name + ".partial" with ``partial = {done, of}``, replaced
    atomically (a device call cut at its time limit keeps the points it finished); returns the
    path. The run's write_result removes it."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name + PARTIAL)
    with open(path + ".tmp", "w") as f:
        json.dump(dict(doc, partial=dict(done=done, of=total)), f, indent=1)
    os.replace(path + ".tmp", path)
    return path
