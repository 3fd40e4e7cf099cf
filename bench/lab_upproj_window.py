"""bench_upproj with the up-projection's bands walked in windows of sources (a lab probe, not an
order MoELayer runs yet).

    python bench/lab_upproj_window.py --windows 1,2,4,16 --models deepseek-v3,qwen3-235b-a22b \\
        --tokens 4096 --worlds 2,8,16 --out $OUT

Why: in the layer's arrival order an (expert, source) group of deepseek-v3@4096 at W >= 8 is
about one band, so consecutive bands hold other experts and every band reads its expert's whole
58.7 MB [D, 2K] slice from DRAM (bench/NOTES.md, sessions 31 and 32); expert order reads it
once per band group but makes the first band wait for every source. A window of w rank
distances is the middle: the bands whose farthest source is at distance [k w, (k + 1) w) go
together, expert by expert inside the window, so an expert's bands of w sources sit side by
side while the first band waits for w - 1 remote sources, not W - 1. w = 1 is
``arrival_schedule(order="arrival")``, w >= W its ``order="expert"`` (a CPU test holds both).

window_schedule repeats arrival_schedule's farthest-source count: combine/dispatch_index.py is
one of the files the README's multi-rank row depends on, left unchanged until that row has been
rerun; the window becomes an order of arrival_schedule then, if it is worth one.

Each window is one run of bench_upproj over the selected points, in one process (one compile),
its file tagged ``w<window>`` and recording ``lab_window``; compare ratios within a run and
windows only on the same machine.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench_upproj as bench  # noqa: E402
from moe_overlap.combine import dispatch_index  # noqa: E402

_HEADER = bench.result_header


def window_schedule(plan, counts: torch.Tensor, window: int) -> torch.Tensor:
    """int32 [plan.band_capacity]: the plan's valid bands by window of their farthest source's
    rank distance (``far // window``), then expert, then ``arrival_schedule``'s key (distance,
    band id); the bands past ``num_bands`` last. Torch ops, no host sync."""
    if window < 1:
        raise ValueError(f"window={window}: at least 1")
    W, r, El, tm = plan.world_size, plan.rank, plan.experts_per_rank, plan.tile_m
    B = plan.band_capacity
    dev = plan.band_expert.device
    b = torch.arange(B, device=dev)
    valid = b < plan.num_bands.to(dev).long()
    e = plan.band_expert.long().clamp(0, El - 1)
    lo = plan.band_src_row.long()[:, None]
    g_lo = plan.expert_row_start.long()[e][:, None] + plan.group_row_start.long()[e]  # [B, W]
    c = counts.to(dev).long()[:, r * El:(r + 1) * El].t()[e]  # [B, W] rows of (e, s)
    meets = (c > 0) & (g_lo < lo + tm) & (g_lo + c > lo)
    dist = (torch.arange(W, device=dev) - r) % W
    far = torch.where(meets, dist[None, :], torch.full_like(c, -1)).amax(1).clamp(min=0)
    key = (far // window) * (El * W * B) + e * (W * B) + far * B + b
    key = torch.where(valid, key, (W + 1) * El * W * B + b)
    return torch.argsort(key).to(torch.int32)


def use_window(window: int) -> None:
    """Make bench_upproj's run_point take its schedule from window_schedule (it imports
    arrival_schedule from the module inside the function, so the patched name is the one it
    calls) and record the window in the result's header."""
    dispatch_index.arrival_schedule = lambda plan, counts, order="arrival": window_schedule(
        plan, counts, window)
    bench.result_header = lambda *args, **kwargs: dict(_HEADER(*args, **kwargs),
                                                       lab_window=window)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", default="1,2,4,16",
                    help="comma-separated window widths in rank distances (1: arrival order)")
    a, rest = ap.parse_known_args(argv)
    windows = [int(w) for w in a.windows.split(",") if w]
    if not windows or min(windows) < 1:
        ap.error("--windows: positive integers")
    if "--up-order" in rest:
        ap.error("the window replaces --up-order")
    tag = rest[rest.index("--tag") + 1] + "_" if "--tag" in rest else ""
    rest = [x for i, x in enumerate(rest) if x != "--tag" and (i == 0 or rest[i - 1] != "--tag")]
    worst = 0
    for w in windows:
        use_window(w)
        print(f"== window {w}", flush=True)
        worst = max(worst, bench.main(rest + ["--tag", f"{tag}w{w}"]))
    return worst


if __name__ == "__main__":
    sys.exit(main())
