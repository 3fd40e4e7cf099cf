"""bench_producer_models with the producer's N tile width forced (a lab probe, not a setting
MoECombine runs: the layer takes the widest of 256 / 128 / 64 that divides N,
``combine.options.producer_tile_n``).

    python bench/lab_producer_tile_n.py 128 --models mixtral-8x7b --tokens 4096 \\
        --worlds 1,2,8 --points 'mixtral-8x7b@4096/W[12]/*' --beside none --tag tn128 --out $OUT

Every variant of the run gets the forced width (run once per width; compare runs only where
the card and the machine are the same). The band flag counts a band's N tiles inside the GEMM,
so the consumer needs no change; --beside none keeps the loopback consumer out of it. The result
file records ``lab_tile_n``.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_producer_models as bench  # noqa: E402
import bench_results  # noqa: E402
from moe_overlap.combine import options  # noqa: E402

TILE_NS = (64, 128, 256)


def force_tile_n(tile_n: int) -> None:
    """Make ``producer_tile_n`` answer tile_n wherever it divides N (the bench imports the name
    from the options module inside run_point, so the patched function is the one it calls)."""
    if tile_n not in TILE_NS:
        raise SystemExit(f"tile_n must be one of {TILE_NS}, got {tile_n}")
    widest = options.producer_tile_n
    options.producer_tile_n = lambda n: tile_n if n % tile_n == 0 else widest(n)
    header = bench_results.result_header

    def result_header(*args, **kwargs):
        return dict(header(*args, **kwargs), lab_tile_n=tile_n)
    bench.result_header = result_header


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        raise SystemExit(__doc__)
    if "--beside" not in argv:
        argv = argv + ["--beside", "none"]
    force_tile_n(int(argv[0]))
    return bench.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
