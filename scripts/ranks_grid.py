"""The combine's validation grid with W ranks as processes sharing one GPU (issue 35, item 3), in
parts that each fit one device call of at most 9 minutes:

    python scripts/ranks_grid.py w2|w4|w8 --out DIR [--budget-s 510] [--mode mps|time-sliced]
    python scripts/ranks_grid.py w2 --dry-run        # the plan, its points and time estimates

(``scripts/gpu_check.sh ranks grid w2`` runs it under MPS and folds the results.) Part wW runs
``moe-overlap sweep --validate-only --share-gpu --world-size W`` once per transport (nvlink,
nvshmem), each over both layouts (aligned, packed), both orders (remote_first, expert), the three
router modes, every rank routing tokens and some ranks routing none (``--empty-ranks``), on a
synthetic shape and model-shaped routings at small token counts (every point followed by race
calls: fresh data, NaN-poisoned buffers); then the soak (1000 CUDA-graph replays, a new routing
before each, each checked, device memory flat after the first replay cycle); part w2 first runs
one point with the deliberately broken ordering
(``MOE_OVERLAP_TEST_BROKEN_ORDER=flags_before_stores``, torch producer), which passes only if
the check fails it. Parts w2 and w4 together are the issue's >= 200 points; w8 is planned but
not part of them (its estimate is printed).

Each sweep writes DIR/validate_<name>.json (scripts/ranks_report.py folds every validate_*.json
into the ranks_onegpu JSON) and appends each finished point to DIR/validate_<name>.progress.jsonl;
a sweep killed at its timeout, or dead, leaves a stub validate_<name>.json with the points it
finished and why it stopped, so a hang or crash is a failure in the report, not a gap. Each
sweep runs in its own process group, killed whole at its timeout (its ranks too). No sweep starts
once the part's budget is spent; its stub says so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Time model (seconds), conservative, from session 21's runs under MPS on an H100 (sweep
# meta.seconds, bench/NOTES.md): W = 2 72 points in 45-49 s, 1 point in 15 s; W = 4 48 points
# in 37 s (nvlink) and 61 s (nvshmem); soaks of 1000 replays (a routing every 10) 32 / 38 s;
# session 20: 16 points with a 7168-wide shape in 40 s (start-up kept at 30 s for it).
# A routing before every replay now adds an exchange and a plan per replay; W = 8 is a guess.
STARTUP_S = {2: 30.0, 4: 30.0, 8: 50.0}  # spawn, CUDA contexts, NVSHMEM, compiles / cache loads
POINT_S = {2: 0.7, 4: 1.0, 8: 2.5}  # one point with 2 race calls
REPLAY_S = {2: 0.05, 4: 0.08, 8: 0.16}  # one checked soak replay, a new routing each
TIME_SLICED = 1.5  # without MPS cross-rank waits progress at time-slice grain
MIN_START_S = 45.0  # a sweep is started only with this much of the budget left

SYNTH = "512x16x4x1024x512"
MODELS_AT = {  # per part and transport: the model shapes at 256 tokens per rank
    "w2": {"nvlink": ("deepseek-v3@256", "qwen3-30b-a3b@256"),
           "nvshmem": ("qwen3-235b-a22b@256", "mixtral-8x7b@256")},
    "w4": {"nvlink": ("qwen3-235b-a22b@256",), "nvshmem": ("deepseek-v3@256",)},
    "w8": {"nvlink": ("mixtral-8x7b@256",), "nvshmem": ("qwen3-30b-a3b@256",)},
}
EMPTY = {"w2": "none,1", "w4": "none,0+2", "w8": "none,1+4+7"}  # ranks that route no token
CCTA = {"w2": "8", "w4": "8", "w8": "4"}  # consumer SMs (each rank has 100 // W % of the SMs)
HEAP = "2G"  # NVSHMEM_SYMMETRIC_SIZE per rank: the receive buffers here are <= 60 MB a shape
RACE_CALLS = 2
SOAK_REPLAYS = 1000
BROKEN_ENV = {"MOE_OVERLAP_TEST_BROKEN_ORDER": "flags_before_stores"}


@dataclasses.dataclass
class Invocation:
    name: str  # validate_<name>.json
    world: int
    args: list  # the sweep's arguments, without --out / --progress
    env: dict = dataclasses.field(default_factory=dict)
    expect_fail: bool = False
    soak: int = 0

    def argv(self, out_dir: str) -> list:
        return self.args + ["--out", os.path.join(out_dir, f"validate_{self.name}.json"),
                            "--progress", os.path.join(out_dir,
                                                       f"validate_{self.name}.progress.jsonl")]


def _sweep_args(world, transport, shapes, modes="balanced,moderate_skew,stress_skew",
                layout="aligned,packed", order="remote_first,expert", empty="none", ccta="8",
                mgb="2", race_calls=RACE_CALLS, extra=()):
    return ["--validate-only", "--share-gpu", "--world-size", str(world),
            "--transport", transport, "--shapes", ",".join(shapes), "--modes", modes,
            "--layout", layout, "--order", order, "--empty-ranks", empty, "--ccta", ccta,
            "--mgb", mgb, "--race-calls", str(race_calls), "--autotune", "0", *extra]


def plan(part: str, only: str = "") -> list[Invocation]:
    """The sweeps of a part, in the order they run (the most needed first); ``only``: a
    comma-separated list of sweep names (e.g. "w4_soak") to keep, in the part's order, so that
    a part can be split over device calls."""
    invs = _plan(part)
    if not only:
        return invs
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {i.name for i in invs})
    if unknown or not names:
        raise ValueError(f"--only {only!r}: part {part} has the sweeps "
                         f"{', '.join(i.name for i in invs)}")
    return [i for i in invs if i.name in names]


def _plan(part: str) -> list[Invocation]:
    if part not in MODELS_AT:
        raise ValueError(f"part {part!r}: one of {', '.join(MODELS_AT)}")
    W = int(part[1:])
    invs = []
    if part == "w2":
        invs.append(Invocation(
            "w2_broken_order", W,
            _sweep_args(W, "nvlink", [SYNTH], modes="moderate_skew", layout="packed",
                        order="remote_first", extra=("--producer", "torch", "--expect-fail")),
            env=dict(BROKEN_ENV), expect_fail=True))
    grids = [Invocation(f"{part}_{tr}", W,
                        _sweep_args(W, tr, [SYNTH, *MODELS_AT[part][tr]], empty=EMPTY[part],
                                    ccta=CCTA[part]))
             for tr in ("nvlink", "nvshmem")]
    soak = Invocation(f"{part}_soak", W,
                      _sweep_args(W, "nvlink", [SYNTH], modes="balanced", layout="packed",
                                  order="remote_first", ccta=CCTA[part],
                                  extra=("--soak", str(SOAK_REPLAYS))), soak=SOAK_REPLAYS)
    return invs + [grids[0], soak, grids[1]]


def parsed(inv: Invocation):
    """The sweep's own parse of an invocation's arguments (argparse exits on a bad one)."""
    from moe_overlap.combine.sweep import parse_args
    return parse_args(inv.argv("/tmp"))


def points(inv: Invocation) -> int:
    from moe_overlap.combine.sweep import planned_points
    return planned_points(parsed(inv))


def estimate_s(inv: Invocation, mode: str = "mps") -> float:
    t = STARTUP_S[inv.world] + points(inv) * POINT_S[inv.world] * (
        1 + parsed(inv).race_calls) / (1 + RACE_CALLS) + inv.soak * REPLAY_S[inv.world]
    return t * (TIME_SLICED if mode != "mps" else 1.0)


def timeout_s(estimates: list[float], i: int, left_s: float) -> float:
    """The timeout of sweep i with ``left_s`` of the budget left: twice its estimate where that
    leaves the sweeps after it their estimates, else its estimate (the earlier sweeps, the more
    needed ones, come first); the last one gets all that is left. 0: do not start it (less than
    half its estimate, or than MIN_START_S of a longer one, would be left)."""
    est = estimates[i]
    later = sum(estimates[i + 1:])
    if not later:
        t = left_s
    elif left_s - later >= est:
        t = min(2.0 * est, left_s - later)
    else:
        t = min(est, left_s)
    if t < 0.5 * est or t < min(MIN_START_S, est):
        return 0.0
    return t


def stub(inv: Invocation, out_dir: str, error: str) -> dict:
    """The document of a sweep that wrote none: what its progress file holds, and why."""
    prog = os.path.join(out_dir, f"validate_{inv.name}.progress.jsonl")
    pts = []
    if os.path.exists(prog):
        with open(prog) as f:
            for line in f:
                try:
                    pts.append(json.loads(line))
                except json.JSONDecodeError:  # the last line of a killed writer
                    break
    a = parsed(inv)
    meta = dict(world_size=inv.world, transport=a.transport, layout=",".join(a.layout),
                order=",".join(a.order), planned_points=points(inv), soak=inv.soak,
                expect_fail=inv.expect_fail, race_calls=a.race_calls,
                test_broken_order=inv.env.get("MOE_OVERLAP_TEST_BROKEN_ORDER", ""))
    return dict(meta=meta, points=pts, soak=[], error=error)


def run_one(inv: Invocation, out_dir: str, timeout: float, env: dict) -> tuple[int, float]:
    """Runs one sweep with environment ``env`` in its own process group (killed whole at the
    timeout); (rc, seconds). rc 124: timed out."""
    cmd = [sys.executable, os.path.join(REPO, "scripts", "sweep.py"), *inv.argv(out_dir)]
    log = open(os.path.join(out_dir, f"validate_{inv.name}.log"), "w")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True, cwd=REPO)
    try:
        rc = p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the sweep, its ranks and its manager
        p.wait()
        rc = 124
    log.close()
    return rc, time.monotonic() - t0


def last_line(path: str) -> str:
    try:
        lines = [ln for ln in open(path, errors="replace").read().splitlines()
                 if ln.strip() and "Warning" not in ln]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def run_part(part: str, out_dir: str, budget_s: float, mode: str, runner=run_one,
             clock=time.monotonic, only: str = "") -> list[dict]:
    """Every sweep of the part (or those named in ``only``) within the budget; a stub for each
    that left no JSON. Returns one summary dict per sweep (name, rc, seconds, estimate, timeout,
    result)."""
    invs = plan(part, only)
    est = [estimate_s(inv, mode) for inv in invs]
    env = dict(os.environ, NVSHMEM_SYMMETRIC_SIZE=os.environ.get("NVSHMEM_SYMMETRIC_SIZE", HEAP),
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in BROKEN_ENV:  # only the sweep that asks for it runs broken
        env.pop(k, None)
    start = clock()
    rows = []
    for i, inv in enumerate(invs):
        out = os.path.join(out_dir, f"validate_{inv.name}.json")
        if os.path.exists(out):
            os.remove(out)
        t = timeout_s(est, i, budget_s - (clock() - start))
        if not t:
            rc, secs, why = None, 0.0, "not run: the part's time budget was spent"
        else:
            rc, secs = runner(inv, out_dir, t, {**env, **inv.env})
            log = os.path.join(out_dir, f"validate_{inv.name}.log")
            why = (f"timed out after {t:.0f} s (killed)" if rc == 124 else
                   f"exit code {rc}: {last_line(log)}")
        if not os.path.exists(out):
            with open(out, "w") as f:
                json.dump(stub(inv, out_dir, why), f, indent=1)
        from moe_overlap.combine.sweep import verdict
        v = verdict(json.load(open(out)))
        rows.append(dict(name=inv.name, rc=rc, seconds=round(secs, 1), estimate_s=round(est[i]),
                         timeout_s=round(t), points=v["points"], passed=v["passed"],
                         failures=len(v["failures"])))
        print(f"{inv.name:<22} rc={rc!s:<4} {secs:6.0f} s (est {est[i]:.0f}, limit {t:.0f}) "
              f"{v['passed']}/{v['points']} passed", flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=sorted(MODELS_AT))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/moe_overlap_out"))
    ap.add_argument("--budget-s", type=float, default=510.0,
                    help="no sweep runs past this many seconds after the start")
    ap.add_argument("--mode", default=None, choices=["mps", "time-sliced"],
                    help="for the estimates (default: OUT/ranks_mode.txt, else mps)")
    ap.add_argument("--only", default=os.environ.get("RANKS_GRID_ONLY", ""),
                    help="comma-separated sweep names of the part to run (default: all)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    a = ap.parse_args(argv)
    mode = a.mode
    if mode is None:
        f = os.path.join(a.out, "ranks_mode.txt")
        mode = open(f).read().split(":", 1)[-1].strip() if os.path.exists(f) else "mps"
    try:
        invs = plan(a.part, a.only)
    except ValueError as e:
        ap.error(str(e))
    est = [estimate_s(inv, mode) for inv in invs]
    print(f"ranks_grid {a.part} ({mode}): {sum(points(i) for i in invs)} points, "
          f"{sum(1 for i in invs if i.soak)} soak(s), estimated {sum(est):.0f} s of a "
          f"{a.budget_s:.0f} s budget")
    for inv, e in zip(invs, est):
        print(f"  {inv.name:<22} W={inv.world} {points(inv):>4} points"
              f"{f' + soak {inv.soak}' if inv.soak else ''}"
              f"{' (expected to fail)' if inv.expect_fail else ''}: ~{e:.0f} s", flush=True)
    if a.dry_run:
        return 0
    os.makedirs(a.out, exist_ok=True)
    rows = run_part(a.part, a.out, a.budget_s, mode, only=a.only)
    with open(os.path.join(a.out, f"ranks_grid_{a.part}.json"), "w") as f:
        json.dump(dict(part=a.part, mode=mode, budget_s=a.budget_s, sweeps=rows), f, indent=1)
    ok = all(r["failures"] == 0 for r in rows)
    print(f"ranks_grid {a.part}: {sum(r['passed'] for r in rows)}/"
          f"{sum(r['points'] for r in rows)} checks passed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
