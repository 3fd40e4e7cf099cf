"""Tile order of the chained FFN compute kernel (GEMM1 -> bf16 H ring -> full-depth GEMM2).

The kernel computes, for a row block of `tile_m` rows of x [M, P]:
    GEMM1 tiles  H[blk, h-tile]  = act1(x[blk] @ W1[:, h-tile] + b1[h-tile])   (depth P), stored bf16
                 into ring slot `blk % ring` of a ring of `ring` row blocks of H [tile_m, hidden];
    GEMM2 tiles  out[blk, n-tile] = H[blk, :] @ W2[:, n-tile]                    (depth hidden),
                 stored bf16 (final: no split over the hidden dimension), then the band flag.
Two one-way dependencies, both on tiles that come earlier in the tile list:
    GEMM2(blk, *) waits until all GEMM1(blk, *) are done (a per-block counter);
    GEMM1(blk, *) with blk >= ring waits until all GEMM2(blk - ring, *) are done (slot free).
Persistent CTAs take tiles in list order (a global atomic tile counter), so a CTA only ever waits
on tiles that running CTAs already hold: no deadlock with any grid of co-resident CTAs.

The list software-pipelines the two kinds: the GEMM1 tiles of the first `lookahead` blocks, then
step i = the GEMM1 tiles of block i + lookahead interleaved with the GEMM2 tiles of block i. A
GEMM2 tile waits only if the GEMM1 tiles of its block, `lookahead` steps earlier in the list, are
still running; a GEMM1 tile waits only if the GEMM2 tiles of the block that used its slot, `ring -
lookahead` steps earlier, are. The grid works through a step in about step_work / grid time
(step_work = h_tiles * t1 + n_tiles * t2, t the tile durations, proportional to their depth), so a
tile of duration t started at step k ends by step k + w(t), w(t) = ceil(grid * t / step_work).
Hence lookahead = w(t1) + 1 (at least grid / h_tiles, so that the prologue alone fills the
grid) and ring = lookahead + w(t2) + 1 (`derive`; one step of slack each);
`simulate` checks it (tests/test_chained_schedule_cpu.py).

``split`` k phases a step instead: its first k GEMM1 tiles, then all its GEMM2 tiles, then the
rest of its GEMM1 tiles. Any order within a step keeps every dependency earlier in the list (a
GEMM2 tile's GEMM1 tiles are `lookahead` steps back, a GEMM1 tile's slot was freed by GEMM2 tiles
`ring - lookahead` steps back). Why: the CTAs then run one kind on one super-block at a time
for long stretches, so fewer operands stream through L2 at once and those that are shared stay
there between their readers (bench/predict_chained_dram.py models the DRAM bytes). And the
GEMM1 tiles on both sides of the GEMM2 run are the slack the proportional order buys with whole
steps of lookahead and ring: the first k cover the tail of the previous step's GEMM1 tiles
before this step's GEMM2 tiles need them, the rest cover the GEMM2 tail before the next step's
GEMM1 tiles reuse its slots, so one step of lookahead and a ring of two steps can keep the CTAs
busy where h_tiles is large enough (``simulate`` says where).

This module is the reference of the order: the kernel walks `tile_table()` and its tests compare
against `execute_reference`.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

GEMM1, GEMM2 = 0, 1
TILE_K = 64  # the kernel's k tile (bf16: one 128-byte swizzle row)

# error codes of the kernel's two dependency waits and of the grouped call's expert check (its
# error word: int64[8], the layout of kernels.primitives.record_error); here, beside the order
# they follow from, so that the host wrapper (no cutlass) and the kernel module share them
ERR_SLOT_TIMEOUT = 21  # a GEMM1 tile waited too long for g2_done[blk - ring] (its ring slot)
ERR_BLOCK_TIMEOUT = 22  # a GEMM2 tile waited too long for g1_done[blk] (its H row block)
ERR_EXPERT_RANGE = 23  # grouped call: a row block's expert index is outside [0, E)
ERR_MAILBOX_TIMEOUT = 24  # cluster=2: a CTA waited too long for its cluster peer's mailbox side
ERR_RING_TIMEOUT = 25  # cluster=2: a wait of the operand ring (both CTAs fill / free a stage)
# which wait of the operand ring timed out (word 3 of ERR_RING_TIMEOUT)
RING_ACQUIRE, RING_FULL, RING_TAIL = 0, 1, 2


@dataclass(frozen=True)
class ChainedSchedule:
    """The tile list of one chained FFN call.

    rows M, hidden (this rank's slice of the FFN's hidden size), out N; tile shapes; grid (CTAs
    running tiles); lookahead and ring in row blocks (see the module docstring)."""

    rows: int
    hidden: int
    out: int
    tile_m: int
    tile_h: int
    tile_n: int
    grid: int
    lookahead: int
    ring: int
    inputs: int = 0  # GEMM1's depth P; 0: equal to out (the tensor-parallel FFN)
    split: int | None = None  # None: the kinds interleaved over each step; k: phased (module doc)

    def __post_init__(self):
        if not self.inputs:
            object.__setattr__(self, "inputs", self.out)
        if self.split is not None and (isinstance(self.split, bool)
                                       or not isinstance(self.split, int)
                                       or not 0 <= self.split <= self.h_tiles):
            raise ValueError(f"split must be None or an int in [0, h_tiles={self.h_tiles}], got "
                             f"{self.split!r}")

    @property
    def blocks(self) -> int:
        return math.ceil(self.rows / self.tile_m)

    @property
    def h_tiles(self) -> int:
        return self.hidden // self.tile_h

    @property
    def n_tiles(self) -> int:
        return math.ceil(self.out / self.tile_n)

    @property
    def ring_bytes(self) -> int:
        """Bytes of the bf16 H ring (held instead of an [M, hidden] H)."""
        return min(self.ring, self.blocks) * self.tile_m * self.hidden * 2

    def tiles(self) -> list[tuple[int, int, int]]:
        """(kind, block, column tile) in list order. Every tile exactly once; every dependency
        of a tile earlier in the list."""
        nb, n1, n2, L = self.blocks, self.h_tiles, self.n_tiles, min(self.lookahead, self.blocks)
        out = [(GEMM1, b, j) for b in range(L) for j in range(n1)]
        for i in range(nb):
            g1 = [(GEMM1, i + L, j) for j in range(n1)] if i + L < nb else []
            g2 = [(GEMM2, i, n) for n in range(n2)]
            if self.split is not None:
                out.extend(g1[:self.split] + g2 + g1[self.split:])
                continue
            # interleave proportionally so both kinds are spread over the step
            merged = sorted([((k + 0.5) / len(g1), 0, t) for k, t in enumerate(g1)]
                            + [((k + 0.5) / len(g2), 1, t) for k, t in enumerate(g2)])
            out.extend(t for _, _, t in merged)
        return out

    def tile_table(self, device=None) -> torch.Tensor:
        """int32 [num_tiles, 3] (kind, block, column tile): what the kernel walks."""
        return torch.tensor(self.tiles(), dtype=torch.int32, device=device).reshape(-1, 3)


def _durations(inputs: int, hidden: int, tile_h: int, tile_n: int) -> tuple[float, float]:
    """Relative tile durations: GEMM1 tiles have depth `inputs`, GEMM2 tiles depth `hidden`."""
    return float(inputs * tile_h), float(hidden * tile_n)


def _check_positive(**kw):
    for name, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def derive(rows: int, hidden: int, out: int, tile_m: int = 128, tile_h: int = 256,
           tile_n: int = 256, grid: int = 132, lookahead: int | None = None,
           ring: int | None = None, inputs: int | None = None,
           split: int | None = None) -> ChainedSchedule:
    """The schedule with lookahead and ring derived from the tiles per step and the grid
    (module docstring). inputs: GEMM1's depth P (x's width; the tensor-parallel FFN has P = out,
    the default). Explicit values are checked: ring > lookahead is needed for the slot of
    block i + lookahead to be freed by tiles that come earlier in the list. split: the phased
    step (module docstring); the derived lookahead and ring are the interleaved order's."""
    _check_positive(rows=rows, hidden=hidden, out=out, tile_m=tile_m, tile_h=tile_h,
                    tile_n=tile_n, grid=grid)
    if hidden % tile_h:
        raise ValueError(f"hidden={hidden} must be a multiple of tile_h={tile_h}")
    n1, n2 = hidden // tile_h, math.ceil(out / tile_n)
    t1, t2 = _durations(inputs if inputs is not None else out, hidden, tile_h, tile_n)
    step_work = n1 * t1 + n2 * t2

    def w(t):
        return math.ceil(grid * t / step_work)

    # and the prologue alone fills the grid, so no CTA of the first round waits
    L = max(w(t1) + 1, math.ceil(grid / n1)) if lookahead is None else lookahead
    S = L + w(t2) + 1 if ring is None else ring
    _check_positive(lookahead=L, ring=S)
    if S <= L:
        raise ValueError(f"ring={S} must exceed lookahead={L}: GEMM1 of block i + lookahead "
                         f"reuses the slot of block i + lookahead - ring, whose GEMM2 tiles must "
                         f"come earlier in the list")
    return ChainedSchedule(rows, hidden, out, tile_m, tile_h, tile_n, grid, L, S,
                           inputs or out, split)


@dataclass
class Simulation:
    makespan: float  # time units of the given durations
    busy: float  # sum of tile durations
    wait: float  # sum over tiles of time a CTA held a tile before its dependencies were done
    ideal: float  # busy / grid

    @property
    def efficiency(self) -> float:
        return self.ideal / self.makespan if self.makespan else 1.0


def _replay(s, t_gemm1=None, t_gemm2=None, policy="dynamic", scale=None):
    """Yields (kind, block, column, cta, start, begin, end) per tile in list order: the CTA
    that took it, when it took it and when it ran (``simulate``'s model); scale: a factor per
    list position on the tile's duration."""
    if policy not in ("dynamic", "static"):
        raise ValueError(f"policy={policy!r}; choose 'dynamic' or 'static'")
    d1, d2 = _durations(s.inputs, s.hidden, s.tile_h, s.tile_n)
    t1 = d1 if t_gemm1 is None else t_gemm1
    t2 = d2 if t_gemm2 is None else t_gemm2
    nb, n1, n2 = s.blocks, s.h_tiles, s.n_tiles
    g1_done = [0.0] * nb  # end time of the block's last GEMM1 tile (once all are assigned)
    g2_done = [0.0] * nb
    g1_left, g2_left = [n1] * nb, [n2] * nb
    # (free time, CTA): a heap (dynamic) or indexed by CTA (static); equal times go to the
    # lower CTA, which changes no time
    free = [(0.0, c) for c in range(s.grid)]
    tiles = s.tiles()
    if scale is not None and len(scale) != len(tiles):
        raise ValueError(f"scale has {len(scale)} entries for {len(tiles)} tiles")
    for p, (kind, b, col) in enumerate(tiles):
        start, cta = heapq.heappop(free) if policy == "dynamic" else free[p % s.grid]
        if kind == GEMM1:
            ready = g2_done[b - s.ring] if b >= s.ring else 0.0
            if b >= s.ring and g2_left[b - s.ring]:
                raise AssertionError(f"GEMM1 of block {b} before all GEMM2 of block {b - s.ring}")
            dur = t1
        else:
            ready = g1_done[b]
            if g1_left[b]:
                raise AssertionError(f"GEMM2 of block {b} before all its GEMM1 tiles")
            dur = t2
        begin = max(start, ready)
        end = begin + (dur if scale is None else dur * scale[p])
        if kind == GEMM1:
            g1_done[b] = max(g1_done[b], end)
            g1_left[b] -= 1
        else:
            g2_done[b] = max(g2_done[b], end)
            g2_left[b] -= 1
        if policy == "dynamic":
            heapq.heappush(free, (end, cta))
        else:
            free[p % s.grid] = (end, cta)
        yield kind, b, col, cta, start, begin, end


def simulate(s: ChainedSchedule, t_gemm1: float | None = None, t_gemm2: float | None = None,
             policy: str = "dynamic") -> Simulation:
    """Run the list on `grid` persistent CTAs; a CTA that holds a tile spins until its
    dependencies are done. policy "dynamic": the earliest free CTA takes the next tile (a global
    atomic tile counter); "static": CTA c takes tiles c, c + grid, ... (no counter; with tiles of
    two durations the CTAs drift apart and wait: 0.46-0.98 efficiency on the FFN shapes against
    0.96-1.00, which is why the kernel takes tiles from a counter). Tile durations default to
    their depth (inputs, hidden) times their width."""
    busy = wait = end_max = 0.0
    for *_, start, begin, end in _replay(s, t_gemm1, t_gemm2, policy):
        wait += begin - start
        busy += end - begin
        end_max = max(end_max, end)
    return Simulation(makespan=end_max, busy=busy, wait=wait, ideal=busy / s.grid)


def timeline(s: ChainedSchedule, t_gemm1: float | None = None, t_gemm2: float | None = None,
             policy: str = "dynamic", scale=None) -> list[tuple]:
    """``simulate``'s replay tile by tile: (kind, block, column tile, cta, begin, end) in list
    order, the CTA that ran the tile and when (what a model of the memory traffic replays).
    scale: a factor per list position on that tile's duration (None: all 1, ``simulate``'s
    times): tiles that take the same time start in lock step on many CTAs at once, which a GPU's
    tiles, a few percent apart, do not."""
    return [(k, b, c, cta, begin, end)
            for k, b, c, cta, _, begin, end in _replay(s, t_gemm1, t_gemm2, policy, scale)]


def execute_reference(s: ChainedSchedule, x: torch.Tensor, w1: torch.Tensor, b1, w2: torch.Tensor,
                      act) -> torch.Tensor:
    """Walk the tile list with a ring of `ring` H blocks (float32 math, bf16 H like the kernel):
    out [M, N] in x's dtype. A ring slot overwritten too early, or a GEMM2 tile run before its
    block's GEMM1 tiles, gives a wrong result (the ring is poisoned with NaN at the start)."""
    M, P = x.shape
    tm, th, tn = s.tile_m, s.tile_h, s.tile_n
    ring = torch.full((min(s.ring, s.blocks), tm, s.hidden), float("nan"), dtype=torch.bfloat16,
                      device=x.device)
    out = torch.full((M, s.out), float("nan"), dtype=x.dtype, device=x.device)
    for kind, b, c in s.tiles():
        r0, r1 = b * tm, min((b + 1) * tm, M)
        slot = ring[b % s.ring]
        if kind == GEMM1:
            h = x[r0:r1].float() @ w1[:, c * th:(c + 1) * th].float()
            if b1 is not None:
                h = h + b1[c * th:(c + 1) * th].float()
            slot[:r1 - r0, c * th:(c + 1) * th] = act(h).to(torch.bfloat16)
        else:
            n0, n1_ = c * tn, min((c + 1) * tn, s.out)
            out[r0:r1, n0:n1_] = (slot[:r1 - r0].float() @ w2[:, n0:n1_].float()).to(x.dtype)
    return out
