"""Which source a result was measured with, and whether the tree still holds it.

A bench stamps its result with `stamp(doc, area, gpus=...)`: the git blob hash of every file in
`DEPENDENCIES[area]` (the kernels, launchers, options and the bench script the number depends
on), the commit, date, device and number of GPUs. `freshness()` compares such a record with the
files in the tree. A result written before the stamp existed has only its commit: the files'
hashes at that commit are read from git instead.

Hashes are git's blob hashes (sha1 of "blob <size>\\0" + content), computed here without git, so
a device machine's copy of the tree (no .git) stamps the same hashes git would give.

Pure Python (json, hashlib, subprocess for git): no torch.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess

_K = "moe_overlap/kernels/"
_C = "moe_overlap/combine/"
_F = "moe_overlap/ffn/"
_GEMM = (_K + "gemm_sm90.py", _K + "primitives.py", _K + "tile_scheduler.py")
_PRODUCER = (_C + "grouped_gemm.py", _C + "grouped_gemm_sm90.py") + _GEMM
_PLANNER = (_C + "plan.py", _C + "plan_kernel.py", _C + "routes.py")

# area of the README status table -> the files its numbers depend on (paths from the repository
# root): the kernels and their host wrappers, the options they were launched with, the bench
# that timed them and the timing helpers it calls. A change to any of them marks the row stale.
DEPENDENCIES = {
    "producer": _PRODUCER + _PLANNER + (
        _C + "band_groups.py", _C + "options.py", _C + "overlap.py", _C + "tuning.py",
        _K + "stamps.py", "bench/bench_producer_models.py", "moe_overlap/timing.py"),
    "upproj": _PRODUCER + _PLANNER + (
        _C + "band_groups.py", _C + "options.py", "moe_overlap/moe_layer.py",
        "bench/bench_upproj.py", "bench/bench_producer_models.py", "moe_overlap/timing.py"),
    "ranks": ("moe_overlap/launch.py", "moe_overlap/runtime/collectives.py",
              "moe_overlap/runtime/device.py", "moe_overlap/runtime/nvshmem.py",
              _C + "overlap.py", _C + "consumer.py", _C + "comm_buffer.py", _C + "scale.py",
              _C + "sweep.py", _C + "race_check.py", _C + "checks.py", _C + "reference.py",
              _C + "dispatch_dedup.py", _C + "dispatch_send.py", _C + "dispatch_expand.py",
              _C + "dispatch_index.py", "moe_overlap/moe_layer.py", "moe_overlap/ffn/layers.py",
              "moe_overlap/ffn/band_allreduce.py")
             + _PRODUCER + ("tests/conftest.py", "scripts/ranks_report.py"),
    "layer": _PRODUCER + _PLANNER + (
        _C + "band_groups.py", _C + "options.py", _C + "tuning.py", _C + "overlap.py",
        _C + "consumer.py", _C + "scale.py", _C + "comm_buffer.py", _C + "baseline.py",
        _C + "dispatch.py", _C + "reference.py", "moe_overlap/moe_layer.py",
        "bench/bench_moe_layer.py", "moe_overlap/timing.py"),
    "dispatch_bytes": (_C + "dispatch_dedup.py", "moe_overlap/routing.py",
                       "bench/bench_dispatch_bytes.py"),
    "consumer": (_C + "consumer.py", "moe_overlap/runtime/nvshmem.py", _K + "primitives.py",
                 "bench/bench_consumer.py"),
    "combine": _PRODUCER + _PLANNER + (
        _C + "consumer.py", _C + "scale.py", _C + "overlap.py", _C + "options.py",
        _C + "comm_buffer.py", _C + "baseline.py", _C + "sweep.py", _C + "metrics.py",
        "moe_overlap/timing.py", "bench/bench_combine_split.py"),
    "ffn": (_F + "layers.py", _F + "options.py", _F + "compute_reduce.py",
            _F + "compute_reduce_sm90.py", _F + "band_allreduce.py", _F + "reference.py")
           + _GEMM + ("bench/bench_ffn.py", "moe_overlap/timing.py"),
    "scale": (_C + "scale.py", _K + "primitives.py", "bench/bench_scale.py",
              "moe_overlap/timing.py"),
    "packed": _PRODUCER + (_C + "plan.py", "bench/bench_packed_gemm.py", "moe_overlap/timing.py"),
    "chained": (_F + "compute_chained.py", _F + "compute_chained_sm90.py",
                _F + "chained_schedule.py", _F + "activations.py") + _GEMM
               + ("bench/bench_chained_compute.py", "moe_overlap/timing.py"),
    "plan": _PLANNER + (_C + "plan_closed_form.py", "bench/bench_plan.py",
                        "moe_overlap/timing.py"),
    "ordered_tables": _PLANNER + (_C + "ordered_routes.py", _C + "ordered_routes_kernel.py",
                                  _C + "ordered_scale.py", _K + "primitives.py",
                                  "bench/bench_plan.py", "moe_overlap/timing.py"),
    # torch's FFN compute alone on one GPU (read by the FFN projection, not a status row)
    "ffn_baseline": (_F + "activations.py", "bench/bench_ffn_baseline.py", "bench/bench_ffn.py",
                     "moe_overlap/timing.py"),
}


def blob_hash(data: bytes) -> str:
    """git's object id of a file with this content (`git hash-object`)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def file_hash(root: str, path: str):
    """blob_hash of root/path, or None where the file is absent."""
    try:
        with open(os.path.join(root, path), "rb") as f:
            return blob_hash(f.read())
    except OSError:
        return None


def source_fingerprint(area: str, root: str | None = None) -> dict:
    """{path: blob hash} of the files DEPENDENCIES[area] names (None: absent)."""
    root = root or _repo_root()
    return {p: file_hash(root, p) for p in DEPENDENCIES[area]}


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stamp(doc: dict, area: str, *, gpus: int, device: str, commit: str = "",
          root: str | None = None) -> dict:
    """Adds doc["provenance"] = {area, source_fingerprint, commit, date, device, gpus}; returns
    doc. commit: what the bench recorded (GIT_COMMIT or `git rev-parse`), "" where unknown."""
    doc["provenance"] = dict(
        area=area, source_fingerprint=source_fingerprint(area, root), commit=commit or "",
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=device,
        gpus=int(gpus))
    return doc


# ------------------------------------------------------------------------------ git
class Git:
    """git of the repository at root, or unavailable (a tarball, a copy without .git, a shallow
    clone that lacks the commit asked about: those answer None)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)
        top = self._run("rev-parse", "--show-toplevel")
        self.ok = top is not None and os.path.realpath(top) == self.root

    def _run(self, *args):
        try:
            r = subprocess.run(["git", "-C", self.root, *args], capture_output=True, text=True,
                               timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    def run(self, *args):
        return self._run(*args) if self.ok else None

    def commit(self, rev: str):
        """The full hash of rev, or None where this history does not have it."""
        if not rev or not all(c in "0123456789abcdef" for c in rev.lower()):
            return None
        return self.run("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")

    def blobs_at(self, commit: str, paths) -> dict:
        """{path: blob hash at commit, None where the commit has no such file}."""
        out = self.run("ls-tree", "-r", "--full-tree", commit, "--", *paths) or ""
        have = {}
        for line in out.splitlines():
            meta, path = line.split("\t", 1)
            have[path] = meta.split()[2]
        return {p: have.get(p) for p in paths}

    def commits_since(self, commit: str, paths) -> int | None:
        n = self.run("rev-list", "--count", f"{commit}..HEAD", "--", *paths)
        return int(n) if n is not None else None

    def commits_since_blob(self, path: str, blob) -> int | None:
        """Commits of HEAD's history that changed path after the newest one that left it with
        this blob (all that touched it where none did); None where git cannot say."""
        out = self.run("log", "--format=C %H", "--raw", "--no-abbrev", "--no-renames", "--",
                       path)
        if out is None:
            return None
        n = 0
        for line in out.splitlines():
            if line.startswith("C "):
                n += 1
            elif line.startswith(":") and line.split()[3] == blob:
                return n - 1
        return n

    def changed_since_head(self, paths) -> bool:
        """Whether the work tree's content of any of paths differs from HEAD's."""
        head = self.blobs_at("HEAD", paths)
        return any(file_hash(self.root, p) != head[p] for p in paths)


def freshness(root: str, area: str, doc: dict, git: Git | None = None) -> dict:
    """Whether the source a result was measured with is the tree's.

    Returns {state: "current" | "stale" | "unknown", changed: [paths], commits: int | None,
    basis: "fingerprint" | "commit", why: str}. The recorded hash of each dependency comes from
    the result's fingerprint, else from git at the result's commit; state "stale" where one
    differs from the file in the tree. commits: how many commits touched the changed files since
    the result's commit (git rev-list <commit>..HEAD), plus one where the work tree changes
    them beyond HEAD (the commit that will carry the change), so a report generated before a
    commit and checked after it counts the same; None where git cannot say."""
    git = git or Git(root)
    deps = list(DEPENDENCIES[area])
    prov = doc.get("provenance") or {}
    meta = doc.get("meta", doc)
    rev = prov.get("commit") or meta.get("git_commit") or meta.get("commit") or ""
    full = git.commit(str(rev)) if git.ok else None
    recorded = dict(prov.get("source_fingerprint") or {})
    basis = "fingerprint" if recorded else "commit"
    missing = [p for p in deps if p not in recorded]
    if missing:
        if full is None:
            why = ("no git history here" if not git.ok else
                   f"commit {rev or '(none recorded)'} is not in this history")
            return dict(state="unknown", changed=[], commits=None, basis=basis, why=why)
        recorded.update(git.blobs_at(full, missing))
    current = {p: file_hash(root, p) for p in deps}
    if not git.ok and any(v is None for v in current.values()):
        return dict(state="unknown", changed=[], commits=None, basis=basis,
                    why="the source files are not here")
    changed = [p for p in deps if recorded[p] != current[p]]
    if not changed:
        return dict(state="current", changed=[], commits=0, basis=basis, why="")
    commits = None
    if git.ok:
        if full is not None:
            commits = git.commits_since(full, changed)
        else:  # a stamped run without a known commit: count from each file's recorded content
            counts = [git.commits_since_blob(p, recorded[p]) for p in changed]
            commits = None if None in counts else max(counts)
        if commits is not None and git.changed_since_head(changed):
            commits += 1
    return dict(state="stale", changed=changed, commits=commits, basis=basis, why="")


# ------------------------------------------------------------------------------ inputs
def result_source(root: str, name: str, area: str, *, gpus: int, git: Git | None = None,
                  field: str = "") -> dict:
    """Where a rate read from bench/results/<name> comes from, for a projection's inputs: the
    file, the card, GPUs, date and commit it records, the field the rate is read from, and its
    freshness against DEPENDENCIES[area] (state, commits since, changed files, why unknown).
    gpus: the GPUs the run used (the caller knows the bench; most files do not say)."""
    with open(os.path.join(root, "bench", "results", name)) as f:
        doc = json.load(f)
    m = doc.get("provenance") or doc.get("meta", doc)
    device = str(m.get("device") or "")
    f = freshness(root, area, doc, git)
    return dict(file=f"bench/results/{name}", field=field, device=device or None,
                card=device.replace("NVIDIA ", "").split()[0] if device.strip() else None,
                gpus=int(gpus), date=str(m.get("date") or "")[:10] or None,
                commit=str(m.get("git_commit") or m.get("commit") or "")[:10] or None,
                area=area, freshness=dict(state=f["state"], commits=f["commits"],
                                          changed=f["changed"], why=f["why"]))


def source_text(src: dict) -> str:
    """One line naming a source: file (card, GPUs, date, commit; freshness), or what it is where
    it is not a result file (src["stated"])."""
    if not src.get("file"):
        return src.get("stated") or "stated"
    gpus = src["gpus"]
    head = src["file"].replace("bench/results/", "", 1)
    f = src["freshness"]
    if f["state"] == "current":
        fresh = "current"
    elif f["state"] == "stale":
        n = "? commits" if f["commits"] is None else f"{f['commits']} commit" + (
            "s" if f["commits"] != 1 else "")
        fresh = f"stale: {n} touched {len(f['changed'])} of its source files since"
    else:
        fresh = f"freshness unknown: {f['why']}"
    return (f"{head} ({src['card'] or '?'}, {gpus} GPU{'s' if gpus != 1 else ''}, "
            f"{src['date'] or 'date not recorded'}, {src['commit'] or 'commit not recorded'}; "
            f"{fresh})")
