"""README status table and docs/RESULTS.md from bench/results/ (see moe_overlap/report.py; also
`moe-overlap report`).

    python scripts/report.py [--check]
"""
import os
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

if __name__ == "__main__":
    from moe_overlap.report import main
    args = sys.argv[1:]
    sys.exit(main(args if "--root" in args else ["--root", ROOT] + args))
