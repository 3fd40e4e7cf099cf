"""The one-GPU multi-rank results of a `gpu_check.sh ranks` run as one JSON file.

    python scripts/ranks_report.py OUT_DIR [--out FILE]
    python scripts/ranks_report.py --merge A.json B.json ... --out FILE   # runs of one session

Reads OUT_DIR/junit_*.xml (one per pytest module run with its ranks sharing the GPU),
OUT_DIR/ranks_mode.txt (mps or time-sliced) and OUT_DIR/validate_*.json (`moe-overlap sweep
--validate-only --share-gpu` grids), and writes ranks_onegpu_<card>_<commit>.json: device, date,
commit, mode, and per check its points, how many passed and each failure with its reason."""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys
import xml.etree.ElementTree as ET

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _reason(el) -> str:
    """A failure's first message line and the innermost error named in its traceback (a rank's
    own error, not only the launcher's "rank 0 failed")."""
    import re
    msg = (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
    named = re.findall(r"^(?:E\s+)?([A-Za-z_.]*(?:Error|Exception)[^\n]*)$", el.text or "", re.M)
    inner = [n for n in named if "rank 0 failed" not in n and "ranks [" not in n]
    return msg + (f" | {inner[-1][:300]}" if inner else "")


def junit_check(path: str) -> dict:
    root = ET.parse(path).getroot()
    cases, failures, skipped = [], [], []
    for tc in root.iter("testcase"):
        name = f"{tc.get('classname', '')}::{tc.get('name')}"
        cases.append(name)
        bad = tc.find("failure") if tc.find("failure") is not None else tc.find("error")
        skip = tc.find("skipped")
        if tc.get("name") is None:  # pytest's record of the test a SIGINT stopped
            failures.append(dict(test=f"test {len(cases)} of the file (no name recorded)",
                                 reason="interrupted before it finished (the run was cut)"))
        elif bad is not None:
            failures.append(dict(test=name, reason=_reason(bad)))
        elif skip is not None:
            skipped.append(dict(test=name, reason=(skip.get("message") or "")[:300]))
    return dict(points=len(cases), passed=len(cases) - len(failures) - len(skipped),
                skipped=skipped, failures=failures)


def grid_check(path: str) -> dict:
    """One validate_*.json (a sweep's document, or the stub scripts/ranks_grid.py writes for a
    run that left none): its checks as ``moe_overlap.combine.sweep.verdict`` counts them (a
    broken-ordering run passes where its points fail; planned points that did not run and a
    soak whose memory grew fail)."""
    from moe_overlap.combine.sweep import verdict
    doc = json.load(open(path))
    v = verdict(doc)
    return dict(points=v["points"], passed=v["passed"], failures=v["failures"],
                meta=doc.get("meta", {}),
                soak=[{k: val for k, val in s.items() if k not in ("records", "memory_samples")}
                      for s in doc.get("soak", [])])


def totals(checks: dict) -> dict:
    return dict(points=sum(c["points"] for c in checks.values()),
                passed=sum(c["passed"] for c in checks.values()),
                failed=sum(len(c["failures"]) for c in checks.values()))


def merge(paths: list[str]) -> dict:
    """One document from several runs' files (same card): each check keeps the commit, date and
    mode of its run; a check name seen twice keeps the later run's."""
    docs = [json.load(open(p)) for p in paths]
    devs = {d["device"] for d in docs}
    if len(devs) != 1:
        raise SystemExit(f"runs on different cards: {sorted(devs)}")
    checks = {}
    for d in sorted(docs, key=lambda d: d["date"]):
        for name, c in d["checks"].items():
            # a merged file's checks carry their own run's commit, date and mode already
            checks[name] = dict(c, commit=c.get("commit", d["commit"]),
                                date=c.get("date", d["date"]), mode=c.get("mode", d["mode"]))
    last = max(docs, key=lambda d: d["date"])
    return dict(last, checks=checks, totals=totals(checks),
                commits=sorted({c["commit"] for c in checks.values()}),
                modes=sorted({c["mode"] for c in checks.values()}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir", nargs="?")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", nargs="+", default=None, help="ranks_onegpu JSON files to merge")
    a = ap.parse_args(argv)
    if a.merge:
        if not a.out:
            ap.error("--merge needs --out")
        doc = merge(a.merge)
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"{a.out}: {doc['totals']}")
        return
    if not a.out_dir:
        ap.error("OUT_DIR is required")
    import torch
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "unknown"
    card = "h200" if "H200" in dev else "h100" if "H100" in dev else "gpu"
    commit = os.environ.get("GIT_COMMIT", "unknown")
    mode_file = os.path.join(a.out_dir, "ranks_mode.txt")
    mode = open(mode_file).read().split(":", 1)[-1].strip() if os.path.exists(mode_file) else "?"
    checks = {}
    for p in sorted(glob.glob(os.path.join(a.out_dir, "junit_*.xml"))):
        checks[os.path.basename(p)[6:-4]] = junit_check(p)
    for p in sorted(glob.glob(os.path.join(a.out_dir, "validate_*.json"))):
        checks[os.path.basename(p)[:-5]] = grid_check(p)
    doc = dict(device=dev, gpus=torch.cuda.device_count(), mode=mode, commit=commit,
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               what="multi-rank checks with the ranks as processes sharing one GPU "
                    "(correctness only: no NVLink, one L2, no timings)",
               checks=checks, totals=totals(checks))
    out = a.out or os.path.join(a.out_dir, f"ranks_onegpu_{card}_{commit}.json")
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{out}: {doc['totals']}")


if __name__ == "__main__":
    main()
