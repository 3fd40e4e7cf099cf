"""Chained FFN compute kernel (issue 17): ``out = act1(x W1 + b1) W2`` through a bf16 H ring.

One persistent Hopper (sm_90a) CuTe DSL launch with two tile kinds (``chained_schedule``):

    GEMM1 tile (kind 0, block blk, hidden tile j):
        H_ring[slot] [:, j] = act1(x[blk] @ W1[:, j] + b1[j])      depth P, bf16, slot = blk % ring
    GEMM2 tile (kind 1, block blk, output tile n):
        out[blk, n] = H_ring[slot] @ W2[:, n]                       depth hidden (full), bf16

Tensors (CUDA, row-major, no host synchronization in the call path)::

    x    [M, P]       bf16
    w1   [P, hidden]  bf16   (hidden contiguous: read as an MN-major WGMMA B operand, no copy)
    b1   [hidden]     any float dtype, or None
    w2   [hidden, N]  bf16   (N contiguous: MN-major B)
    out  [M, N]       bf16   (final: no split over the hidden dimension, no fp32 partials)
    ring [R * tile_m, hidden] bf16, R = min(ring, blocks)       (``ring_bytes``)
    band_ready [>= blocks] int32: band_ready[blk] = epoch once all N / tile_n output tiles of
               rows [blk * tile_m, (blk + 1) * tile_m) are stored (the band-flag convention of
               compute_reduce, with band_rows = tile_m)

Work distribution: the CTAs (grid = SMs - ccta, capped at the number of tiles) take tiles of
``ChainedSchedule.tile_table()`` (int32 [num_tiles, 3]: kind, block, column tile) in list order
from a global atomic tile counter: lane 0 of the TMA warp takes the next index and broadcasts the
tile through a two-slot mailbox in shared memory (an mbarrier pair per slot) to the consumer
warpgroups and the store warp. Taking tiles in list order is what makes every wait safe: a tile
only waits on tiles earlier in the list, which CTAs that are running already hold, and a CTA's
roles process its tiles in order, so the lowest unfinished tile can always finish (no deadlock,
even if not every CTA is resident). Static striding loses 2-54 % (``simulate(policy="static")``).

Roles per CTA (384 threads): warp 0 = TMA loads (one smem ring of ``stages`` stages of an A
tile 128 x 64 and a B tile 256 x 64, shared by both kinds); warp 1 = store warp (epilogue TMA
stores and the dependency counters); warpgroups 1, 2 = WGMMA consumers (64 rows each, fp32
accumulators 64 x 256), epilogue through stmatrix into ``epi_stages`` sub-tile buffers of
128 x 32 that the store warp TMA-stores (the store-warp handshake of grouped_gemm).

Dependencies (counters ``g1_done[blk]``, ``g2_done[blk]`` and the tile counter, zeroed by one
memset on the stream before each launch, so the call is graph-capturable):
* GEMM1 tile, blk >= ring: before its first H store the store warp waits (bounded, ld.acquire.gpu)
  for g2_done[blk - ring] == N / tile_n (every GEMM2 tile that reads the slot is done), then
  ``fence.proxy.async.global`` (generic acquire -> async-proxy writes). After its last store:
  ``cp.async.bulk.wait_group 0`` (the writes are performed, not only their smem read),
  ``fence.proxy.async.global``, ``red.release.gpu`` g1_done[blk] += 1.
* GEMM2 tile: before the first H load the TMA warp waits (bounded, acquire) for g1_done[blk] ==
  hidden / tile_h, then ``fence.proxy.async.global`` so its TMA loads see the H that other CTAs'
  TMA stores wrote. After its last output store: wait_group 0, proxy fence, ``atom.acq_rel.gpu``
  g2_done[blk] += 1; the last of the block's tiles stores ``st.release.gpu band_ready[blk] =
  epoch`` (release is cumulative: a reader that acquires the flag sees the whole band).
The store warp waits only for its own bulk stores, so the consumer warpgroups go straight on to the
next tile's WGMMAs (no gpu-scope fence in a WGMMA warpgroup).
Every cross-CTA wait is bounded (``timeout_ms``, globaltimer) and, on timeout, writes the error
word (code, tile position, block, observed, expected, elapsed) and goes on, so the launch always
ends; a wait that sees the error word set stops waiting too. ``ChainedFFNCompute.check()`` raises
with the text. The intra-CTA mbarrier waits (TMA completion, the tile mailbox) are the usual
unbounded ones: their other side never waits on another CTA without a bound.

Structure: the kernel is ``ffn.compute_chained_sm90.ChainedFFNKernel``, a subclass of the shared
Hopper base ``kernels.gemm_sm90.GemmSm90`` (tiled MMA, layouts, TMA atoms, pipelines, the WGMMA
step of a ring stage); its own methods are ``fetch_tile`` / ``read_tile`` (the dynamic tile
scheduler), ``load_role`` (TMA mainloop producer), ``mma_tile`` (WGMMA mainloop) in
``mma_role``, ``epilogue_gemm1`` / ``epilogue_gemm2`` (accumulator -> bf16 sub-tiles) and
``store_role`` (store warp: waits, TMA stores, counters).

The kernel walks whatever valid list it is given (every dependency earlier in the list), so the
order is a host-side choice: ``group`` G > 1 runs the derived order on super-blocks of G row
blocks (``GroupedChainedSchedule``): G consecutive blocks take the same column tile next to each
other in the list, so the CTAs reading one weight panel (P x 256 of W1, hidden x 256 of W2) run
G times as many blocks side by side and the panel comes from DRAM about G times less often (with
G = 1, about grid / (h_tiles + n_tiles) blocks share a panel in time: 1.5 on llama3-70b's slice),
at G times the ring. ``patch`` C > 1 also puts each block's C column tiles next to each other,
so the CTAs reading one block's operand (its x rows, its H block) run side by side too, while
their k-slabs are still in L2 (with patch 1 they are ``group`` entries apart, spread over a
whole tile's duration, and on llama3-70b's slice x and H came from DRAM again for most column
tiles). The defaults ``group="auto"`` / ``patch="auto"`` pick the order per shape: a phased
order (below) where one fits the activation bound and simulate runs it well (``auto_phased``),
else G from the ring's share of H and C from G (``auto_group``, ``auto_patch``; each docstring
has its rule and the measurement it comes from).
``split`` k phases each step of the super-block order (``chained_schedule``): k GEMM1
super-tiles, the step's GEMM2 super-tiles, the other GEMM1 super-tiles, so the CTAs run one kind
of one super-block at a time; with it one super-block of lookahead and a ring of two hold the
order (group 8 in 16 blocks, inside the activation bound at 8192 tokens), and the model of
bench/predict_chained_dram.py puts its DRAM reads below the interleaved order's at the same
ring. Only the list changes: the kernel walks any valid list.

2-CTA clusters (``ChainedFFNCompute(cluster=2)``, compile-time, dense calls only): the CTAs of a
cluster along M run the same tile (kind, column) on adjacent row blocks 2 q and 2 q + 1 and load
each weight k-slab once, half each, multicast into both CTAs' rings (half the weight traffic from
L2; the x rows and the H block, the A tiles, stay per CTA). The table is the order on pair blocks
of 2 * tile_m rows over grid / 2 clusters (``PairedChainedSchedule``; ring and lookahead in row
blocks, even), so every per-block wait above still only waits on tiles earlier in the list. A ring
stage is free once the consumers of both CTAs released it (the base pipeline's cluster-aware
empty barriers). Mailbox: the leader (rank 0) takes the list position and writes the tile into
its own slot and, through distributed shared memory (``st.shared::cluster``, then a
``release.cluster`` remote arrive), into the peer's inbox; the peer's TMA warp reads the inbox,
forwards that to the leader with a remote arrive (the leader never overwrites an inbox slot the
peer has not read) and writes the tile into its own slot, so each slot has one writer, its
CTA's TMA warp. The waits that have the other CTA on their far side are bounded and give up on
an error word already set: the two mailbox waits (``ERR_MAILBOX_TIMEOUT``; the CTA then posts
kind -1 to its own roles) and the operand ring's waits (``ERR_RING_TIMEOUT``, naming the side,
stage and phase), so a CTA whose partner stopped ends too and both reach the closing cluster
barrier (the argument, wait by wait: ``compute_chained_sm90``'s module docstring). With an odd
block count the last pair's second block lies past M: that CTA still takes part in the loads,
the multicast and the barriers (its x / H rows past the tensors load as zeros), but skips the
counter waits, stores nothing and raises no counter or band flag. Clusters are co-scheduled, so
the deadlock argument is the one above with a cluster in place of a CTA. The variant is compiled
and CPU-modelled only, not yet run on a GPU (bench/NOTES.md, session 15).

Grouped over experts (``ChainedFFNCompute.grouped``, ``ShardedExperts``): the same tile list,
ring, counters and flags; w1 [E, P, hidden], b1 [E, hidden], w2 [E, hidden, N], and row block
blk (one expert's rows: each expert's group padded to tile_m) uses expert ``block_expert[blk]``,
which the host copies behind the tile table before the launch and the kernel range-checks. Blocks
of one super-block may belong to different experts (they then share no panel, but stay correct).

The tile order and its reference walk are ``chained_schedule.derive`` / ``execute_reference``;
``chained_ffn_reference`` is the plain math, ``chained_ffn_grouped_reference`` the grouped
call's. cutlass is imported lazily: this module imports with
torch only, and ``ChainedFFNCompute.can_implement`` / ``ring_bytes`` run without a GPU.
"""


import functools
import math
from dataclasses import dataclass, replace

import torch

from ..kernels.host_checks import chained_gemm_dims, check_tensors
from ..runtime.device import num_sms
from .activations import ACT2, activation
from .chained_schedule import (ERR_BLOCK_TIMEOUT, ERR_EXPERT_RANGE, ERR_MAILBOX_TIMEOUT,
                               ERR_RING_TIMEOUT, ERR_SLOT_TIMEOUT, GEMM2, RING_ACQUIRE,
                               RING_FULL, RING_TAIL, TILE_K, ChainedSchedule, derive,
                               simulate)

__all__ = ["ChainedFFNCompute", "GroupedChainedSchedule", "chained_ffn_reference",
           "chained_ffn_grouped_reference", "ACT1_CHAINED", "auto_group", "auto_patch",
           "schedule_for", "PairedChainedSchedule", "ring_cap_blocks", "activation_bytes",
           "baseline_activation_bytes", "auto_split", "auto_phased"]

ACT1_CHAINED = ACT2  # "none", relu, gelu, gelu_tanh, silu
_SMEM_CAPACITY_SM90 = 232448  # bytes of dynamic shared memory per CTA on sm_90


def chained_ffn_reference(x, w1, b1, w2, act1="gelu"):
    """fp32 ``act1(x @ w1 + b1) @ w2`` with H rounded to bf16 like the kernel; returns fp32."""
    h = x.float() @ w1.float()
    if b1 is not None:
        h = h + b1.float()
    return activation(h, act1).to(torch.bfloat16).float() @ w2.float()


def chained_ffn_grouped_reference(x, w1, b1, w2, block_expert, act1="gelu", tile_m=128):
    """The grouped call's math (``ChainedFFNCompute.grouped``): row block b (rows
    [b * tile_m, (b + 1) * tile_m) of x) through expert ``block_expert[b]``'s weights (w1 [E, P,
    hidden], b1 [E, hidden] or None, w2 [E, hidden, N]), ``chained_ffn_reference`` per block;
    returns fp32 [M, N]. Expert ids are read on the host (any device; a reference, not the call
    path)."""
    M = x.shape[0]
    blocks = -(-M // tile_m)
    experts = [int(e) for e in torch.as_tensor(block_expert)[:blocks].tolist()]
    if len(experts) < blocks:
        raise ValueError(f"block_expert has {len(experts)} entries, the {M} rows need {blocks}")
    out = torch.empty(M, w2.shape[-1], dtype=torch.float32, device=x.device)
    for b, e in enumerate(experts):
        r0, r1 = b * tile_m, min((b + 1) * tile_m, M)
        out[r0:r1] = chained_ffn_reference(x[r0:r1], w1[e], None if b1 is None else b1[e], w2[e],
                                           act1)
    return out


# what word 3 of ERR_RING_TIMEOUT names: which side of the operand ring waited
RING_WAITS = {RING_ACQUIRE: "producer side (TMA warp, producer_acquire: the stage freed by the "
                            "consumers of both CTAs)",
              RING_FULL: "consumer side (consumer_wait: the stage filled by both CTAs' loads, "
                         "the weight half multicast by the other CTA included)",
              RING_TAIL: "producer side at its end (TMA warp, producer_tail: every stage freed "
                         "by the consumers of both CTAs)"}


def describe_chained_error(err) -> str | None:
    """Text of the chained kernel's error word (None when clear)."""
    code = int(err[0])
    if code == 0:
        return None
    rank, pos, blk, obs, exp, el = (int(v) for v in err[1:7])
    if code == ERR_SLOT_TIMEOUT:
        return (f"chained FFN: GEMM1 tile at list position {pos} (block {blk}) timed out after "
                f"{el / 1e6:.1f} ms waiting for its ring slot: g2_done[{blk} - ring] = {obs}, "
                f"expected {exp} (GEMM2 tiles of the slot's previous block not done: ring too "
                f"small for the tile order, or a stalled CTA)")
    if code == ERR_BLOCK_TIMEOUT:
        return (f"chained FFN: GEMM2 tile at list position {pos} (block {blk}) timed out after "
                f"{el / 1e6:.1f} ms waiting for its H row block: g1_done[{blk}] = {obs}, "
                f"expected {exp} (GEMM1 tiles of the block not done)")
    if code == ERR_EXPERT_RANGE:
        return (f"chained FFN (grouped): row block {blk} (tile at list position {pos}) names "
                f"expert {obs}, outside [0, {exp}) (block_expert out of range; the block ran "
                f"with expert 0's weights, its output is wrong)")
    if code == ERR_MAILBOX_TIMEOUT:
        side = ("the peer's TMA warp to read the inbox slot's previous tile (its forward)"
                if rank == 0 else "the leader to post the tile to the inbox")
        return (f"chained FFN (cluster=2): the CTA of cluster rank {rank} timed out after "
                f"{el / 1e6:.1f} ms at its tile {pos} waiting on mailbox slot {blk} (phase "
                f"parity {exp}) for {side}: the other CTA of the cluster stalled; this CTA "
                f"stopped taking tiles (kind -1 to its roles), its partner's waits on it gave up")
    if code == ERR_RING_TIMEOUT:
        stage, side, parity, bidx = pos, blk, obs, exp
        what = RING_WAITS.get(side, f"ring wait {side}")
        return (f"chained FFN (cluster=2): operand ring wait timed out after {el / 1e6:.1f} ms: "
                f"the CTA of cluster rank {rank} (block {bidx}, cluster {bidx // 2}), "
                f"{what}, stage {stage}, phase parity {parity}: the other CTA of the cluster "
                f"stopped filling or freeing that stage (it stalled, or took other tiles)")
    return f"chained FFN: unknown device error code {code}: {list(int(v) for v in err)}"


class _ExpandedSchedule:
    """What a schedule expanded from a coarser ``base`` order shares: the shape and tiles are
    the base's, the row blocks are counted in ``tile_m`` rows of ``rows``."""

    @property
    def hidden(self):
        return self.base.hidden

    @property
    def out(self):
        return self.base.out

    @property
    def inputs(self):
        return self.base.inputs

    @property
    def tile_h(self):
        return self.base.tile_h

    @property
    def tile_n(self):
        return self.base.tile_n

    @property
    def h_tiles(self):
        return self.base.h_tiles

    @property
    def n_tiles(self):
        return self.base.n_tiles

    @property
    def blocks(self):
        return math.ceil(self.rows / self.tile_m)


@dataclass(frozen=True)
class GroupedChainedSchedule(_ExpandedSchedule):
    """The derived tile order on super-blocks of ``group`` row blocks, expanded to row blocks.

    ``base`` is ``derive`` for rows in super-blocks (tile_m * group rows) on grid / group CTAs
    (each super-tile is ``group`` tiles side by side); a super-tile (kind, sb, c) becomes the tiles
    (kind, sb * group + g, c), g < group, of the blocks that exist. Every dependency stays earlier
    in the list: GEMM2 of block b needs the GEMM1 tiles of its super-block, GEMM1 of b >= ring
    (= base.ring * group blocks) needs GEMM2 of b - ring, in super-block sb - base.ring. Duck-types
    ChainedSchedule for ``simulate`` and ``execute_reference``."""

    base: ChainedSchedule
    group: int
    rows: int
    tile_m: int
    grid: int
    patch: int = 1  # super-tiles of one kind and super-block expanded together (``tiles``)

    @property
    def lookahead(self):
        return self.base.lookahead * self.group

    @property
    def ring(self):
        return self.base.ring * self.group

    @property
    def ring_bytes(self):
        return min(self.ring, self.blocks) * self.tile_m * self.hidden * 2

    def tiles(self):
        """patch 1: each super-tile's ``group`` tiles side by side (the weight tile's readers
        adjacent in the list; a row block's readers ``group`` entries apart). patch C: runs of up
        to C super-tiles of one kind and super-block (C column tiles) expanded block by block,
        each block's C tiles adjacent, so both operands' readers lie within group x C entries.
        A run is emitted where its last super-tile was, or earlier: before a tile of its kind
        on another super-block and before any tile that depends on it (GEMM2 of its super-block
        for a GEMM1 run, GEMM1 of its super-block + ring for a GEMM2 run), so every dependency
        stays earlier in the list."""
        nb, G = self.blocks, self.group
        out, runs = [], {}

        def flush(kind):
            run = runs.pop(kind, [])
            out.extend((kind, sb * G + g, c) for g in range(G) for _, sb, c in run
                       if sb * G + g < nb)

        def needs(t, run):  # does tile t depend on a tile of the other kind's run?
            if t[0] == GEMM2:
                return run[0][1] == t[1]
            return run[0][1] <= t[1] - self.base.ring

        for t in self.base.tiles():
            run = runs.get(t[0], [])
            if run and run[0][1] != t[1]:
                flush(t[0])
            other = 1 - t[0]
            if runs.get(other) and needs(t, runs[other]):
                flush(other)
            runs.setdefault(t[0], []).append(t)
            if len(runs[t[0]]) == self.patch:
                flush(t[0])
        for kind in sorted(runs):
            flush(kind)
        return out

    def tile_table(self, device=None):
        return torch.tensor(self.tiles(), dtype=torch.int32, device=device).reshape(-1, 3)


@dataclass(frozen=True)
class PairedChainedSchedule(_ExpandedSchedule):
    """The tile order of the 2-CTA cluster kernel (``ChainedFFNCompute(cluster=2)``): ``base`` is
    the order (``derive`` or ``GroupedChainedSchedule``) on pair blocks of 2 * tile_m rows and on
    grid / 2 clusters; its entry (kind, pair block q, column) is one tile of each CTA of a
    cluster, rank r taking row block 2 q + r (the two tiles share the weight tile, loaded once by
    multicast). ``tile_table`` is the pair list the kernel walks; ``tiles`` the row-block list
    (2 q, 2 q + 1 adjacent, the block past M of an odd count left out) that ``simulate`` and
    ``execute_reference`` check. ring and lookahead are in row blocks (twice the base's, so
    even): block 2 q + r uses slot (2 q + r) % ring = 2 (q % base.ring) + r, and GEMM1 of block b
    >= ring waits for GEMM2 of b - ring, in pair q - base.ring, which the base order puts
    earlier."""

    base: object
    rows: int
    tile_m: int
    grid: int  # CTAs (two per cluster)

    @property
    def pair_blocks(self):
        return self.base.blocks

    @property
    def lookahead(self):
        return self.base.lookahead * 2

    @property
    def ring(self):
        return self.base.ring * 2

    @property
    def ring_bytes(self):
        return min(self.ring, self.blocks) * self.tile_m * self.hidden * 2

    def pair_tiles(self):
        """(kind, pair block, column tile) in list order: the kernel's table."""
        return self.base.tiles()

    def tiles(self):
        nb = self.blocks
        return [(k, 2 * q + r, c) for k, q, c in self.base.tiles() for r in range(2)
                if 2 * q + r < nb]

    def tile_table(self, device=None):
        return torch.tensor(self.pair_tiles(), dtype=torch.int32,
                            device=device).reshape(-1, 3)


def schedule_for(M, P, hidden, N, grid, tile_m=128, tile_h=256, tile_n=256, group=1,
                 ring=None, patch=1, lookahead=None, cluster=1, split=None):
    """The tile list the kernel runs: ``derive`` (group 1) or its super-block form (group G);
    ring (row blocks) overrides the derived ring size (tests and the bench only): unchecked with
    group 1 (the GPU tests run invalid rings on purpose); with group G a multiple of G whose
    super-block count exceeds the lookahead's, so that the list stays valid (the grouped ring is
    derived in whole super-blocks, and on llama3-70b's slice the simulated efficiency is the same
    with one super-block less: ``simulate``). lookahead (row blocks, group G > 1 only, the bench's
    experiments): a multiple of G overriding the derived one, checked the same way (a shorter
    lookahead lets a smaller ring hold the order: group 16 in 32 blocks at 8192 tokens).
    split: None (each step's two kinds interleaved), k (the phased step of
    ``chained_schedule``: k GEMM1 super-tiles, the step's GEMM2 super-tiles, the rest; 0 <= k <=
    hidden / tile_h) or "auto" (``auto_split``: the k that ``simulate`` runs best). With a split
    one super-block of lookahead and a ring of two can hold the order (group 8 in 16 blocks).
    cluster 2: ``PairedChainedSchedule``, this order on pair blocks of 2 * tile_m rows over
    grid // 2 clusters; group, ring and lookahead stay in row blocks and must be even (group 1
    runs as 2: a pair is two blocks side by side already)."""
    if cluster == 2:
        for name, v in (("group", group), ("ring", ring), ("lookahead", lookahead)):
            if v is not None and not (name == "group" and v == 1) and (
                    isinstance(v, bool) or not isinstance(v, int) or v < 2 or v % 2):
                raise ValueError(f"{name}={v!r} with cluster=2: must be an even int >= 2 (row "
                                 f"blocks, taken in pairs)")
        base = schedule_for(M, P, hidden, N, max(1, grid // 2), tile_m * 2, tile_h, tile_n,
                            max(1, group // 2), None if ring is None else ring // 2, patch,
                            None if lookahead is None else lookahead // 2, split=split)
        return PairedChainedSchedule(base, M, tile_m, grid)
    if cluster != 1:
        raise ValueError(f"cluster must be 1 or 2, got {cluster!r}")
    if split == "auto":
        return auto_split(M, P, hidden, N, grid, tile_m, tile_h, tile_n, group, ring, patch,
                          lookahead)
    if group == 1:
        s = derive(M, hidden, N, tile_m, tile_h, tile_n, grid=grid, inputs=P, split=split)
        if ring is not None:
            s = replace(s, ring=ring)
        return s
    base = derive(M, hidden, N, tile_m * group, tile_h, tile_n, grid=max(1, grid // group),
                  inputs=P, split=split)
    if lookahead is not None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < group \
                or lookahead % group:
            raise ValueError(f"lookahead={lookahead!r} with group={group}: must be a positive "
                             f"multiple of the group")
        base = replace(base, lookahead=lookahead // group)
        if ring is None and base.ring <= base.lookahead:
            raise ValueError(f"lookahead={lookahead} with group={group}: the derived ring "
                             f"({base.ring * group} blocks) must exceed it; pass a ring")
    if ring is not None:
        if ring % group or ring // group <= base.lookahead:
            raise ValueError(f"ring={ring} with group={group}: must be a multiple of the group "
                             f"above lookahead={base.lookahead * group} blocks")
        base = replace(base, ring=ring // group)
    if isinstance(patch, bool) or not isinstance(patch, int) or patch < 1:
        raise ValueError(f"patch must be an int >= 1, got {patch!r}")
    return GroupedChainedSchedule(base, group, M, tile_m, grid, patch)


SPLIT_TOLERANCE = 0.002  # auto_split: efficiencies this close to the best count as the best


@functools.lru_cache(maxsize=64)
def auto_split(M, P, hidden, N, grid, tile_m=128, tile_h=256, tile_n=256, group=1, ring=None,
               patch=1, lookahead=None):
    """``schedule_for(..., split=k)`` for the k that ``simulate`` runs best: of the splits
    within SPLIT_TOLERANCE of the best efficiency, the middle one (the simulated durations are
    depth x width; a GPU's differ, and the middle of the plateau leaves slack on both sides).
    At most 17 splits are tried (0, h_tiles and evenly between), so the choice costs a few
    simulations once per shape (cached)."""
    n1 = hidden // tile_h
    cands = sorted({round(i * n1 / 16) for i in range(17)})
    sims = []
    for k in cands:
        s = schedule_for(M, P, hidden, N, grid, tile_m, tile_h, tile_n, group, ring, patch,
                         lookahead, split=k)
        sims.append((simulate(s).efficiency, s))
    best = max(e for e, _ in sims)
    good = [s for e, s in sims if e >= best - SPLIT_TOLERANCE]
    return good[(len(good) - 1) // 2]


AUTO_GROUPS = (16, 8, 4, 2)  # group="auto" picks from these (largest first), else 1
AUTO_PATCH, AUTO_PATCH_FROM_GROUP = 4, 8  # patch="auto": 4 column tiles per run from group 8 up
ACTIVATION_CAP = 0.6  # issue 17: out + H ring <= 0.6x the baseline's peak where hidden >= N


def auto_patch(group: int) -> int:
    """The patch ``patch="auto"`` runs with ``group``: AUTO_PATCH from AUTO_PATCH_FROM_GROUP up,
    else 1 (smaller groups were not measured with a patch; on llama3-70b's slice 4p4 moved more
    DRAM bytes than group 8 unpatched: bench/NOTES.md, session 15)."""
    return AUTO_PATCH if group >= AUTO_PATCH_FROM_GROUP else 1


def baseline_activation_bytes(M: int, hidden: int, N: int, act_in_place: bool = True) -> int:
    """Peak bytes one call of the library baseline (addmm + act + mm, bf16) allocates above its
    inputs (``peak_call_bytes`` measures this to the byte): H [M, hidden] beside out [M, N]
    with the activation in place (``activations.activation_``), or without it the larger of
    that and H beside its activated copy."""
    if act_in_place:
        return 2 * M * (hidden + N)
    return 2 * M * max(2 * hidden, hidden + N)


def b1_read_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel reads b1 in: bf16 as it is (the layers' and the baseline's bias, so
    no per-call copy; fp32 of a bf16 value is exact, so the output is bitwise the same as from
    its fp32 copy), every other float dtype as fp32 (a copy per call)."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32


def activation_bytes(M: int, hidden: int, N: int, ring_rows: int,
                     b1_dtype: torch.dtype | None = torch.bfloat16) -> int:
    """Bytes one chained call allocates above its inputs: out [M, N] and the H ring
    [ring_rows, hidden], bf16, and, where b1 (of dtype ``b1_dtype``, None: no bias) is neither
    bf16 nor fp32, its fp32 copy [hidden] (the tile table and counters are kept between
    calls)."""
    converted = b1_dtype is not None and b1_dtype not in (torch.bfloat16, torch.float32)
    return 2 * (M * N + ring_rows * hidden) + (4 * hidden if converted else 0)


def ring_cap_blocks(M: int, hidden: int, N: int, tile_m: int = 128) -> int:
    """The most H row blocks ``group="auto"`` lets a ring hold: half of H's blocks, and where the
    hidden slice is at least as wide as the output (issue 17's activation bound applies there)
    as many as keep ``activation_bytes`` <= ACTIVATION_CAP x ``baseline_activation_bytes``
    (H + out: the baseline's activation in place). That leaves a fraction 0.6 - 0.4 N / hidden
    of H: 0.31-0.37 on the seed's wide slices, e.g. 20-23 of 64 blocks at 8192 tokens."""
    blocks = -(-M // tile_m)
    cap = blocks // 2
    if hidden >= N:
        spare = int(ACTIVATION_CAP * baseline_activation_bytes(M, hidden, N)) \
            - activation_bytes(M, hidden, N, 0)
        cap = min(cap, max(0, spare // (2 * hidden * tile_m)))
    return cap


def auto_group(M, P, hidden, N, grid, tile_m=128, tile_h=256, tile_n=256, cluster=1):
    """The group ``group="auto"`` runs, the first that exists of: the largest G in (16, 8, 4, 2)
    whose H ring holds at most ``ring_cap_blocks`` row blocks (issue 17's activation bound); the
    largest whose ring holds at most half of H's blocks (where no group meets the bound: few
    rows, e.g. 4096 tokens, where group 1 would cost more time than the bound saves memory); the
    largest whose ring holds at most 1.25x the fewest blocks any group's does (group 1
    included: narrow hidden slices whose lookahead spans many blocks); 1.

    Why (one H200, the seven FFN slices at G = 2, 8192 and 32768 tokens; bench/NOTES.md,
    sessions 15-16; ``ffn_chained_compute_h200_holds_patch_606dff6.json``): what limits these
    calls is energy per FLOP at the 700 W cap, and DRAM traffic is where ours spent more than
    the library (ncu on llama3-70b at 8192 tokens: 12.4 GB against 4.5 for group 8). The group
    shares each weight panel between its blocks side by side; the patch (``auto_patch``) puts a
    row block's column tiles side by side too, so both operands are read while the other
    readers still hold them in L2 (16p4: 7.0 GB). Sustained (each path alone at the cap), group
    16 with patch 4 was the fastest variant on all 14 points (0.950-1.003x the library), 8p4
    0.939-0.983x, the same rule over (8, 4, 2) unpatched with half of H as the only cap 0.886-
    0.980x. The bound takes group 16 at 32768 tokens everywhere, but group 4 at 8192 tokens on
    the wide slices (group 8's ring of 32 blocks is 0.68-0.72x the baseline's H + out there);
    group 4's sustained rate there, measured later on an H100, was 0.82-0.91x, which is why
    ``group="auto"`` tries ``auto_phased`` first. Depends on M only through min(ring, blocks).
    cluster 2: the same rule on the pair orders (``schedule_for(cluster=2)``).
    """
    blocks = -(-M // tile_m)
    held = {g: min(schedule_for(M, P, hidden, N, grid, tile_m, tile_h, tile_n, group=g,
                                cluster=cluster).ring, blocks) for g in AUTO_GROUPS + (1,)}
    for cap in (ring_cap_blocks(M, hidden, N, tile_m), blocks // 2):
        for g in AUTO_GROUPS:
            if held[g] <= cap:
                return g
    fewest = min(held.values())
    for g in AUTO_GROUPS:  # group 1 reads the weights ~G times as often: only if much smaller
        if held[g] * 4 <= fewest * 5:
            return g
    return 1


def _smem_plan(tile_m, tile_n, stages, epi_n, epi_stages):
    """(ring stages, max stages): A tile tile_m x 64 + B tile tile_n x 64 per stage (bf16), the
    epilogue sub-tile buffers tile_m x epi_n x epi_stages, 1 KiB for barriers and alignment."""
    ab = (tile_m + tile_n) * TILE_K * 2
    epi = tile_m * epi_n * 2 * epi_stages
    max_stages = (_SMEM_CAPACITY_SM90 - 1024 - epi) // ab
    st = max_stages if stages is None else stages
    if st < 2 or st > max_stages:
        raise ValueError(f"stages={stages} does not fit in shared memory (2..{max_stages} with "
                         f"tile_m={tile_m}, tile_n={tile_n}, epi_stages={epi_stages})")
    return st, max_stages


# --------------------------------------------------------------------------------------------
# Host wrapper (the device kernel: ffn/compute_chained_sm90.py, imported when compiling)
# --------------------------------------------------------------------------------------------
def _get_kernel_class():
    from .compute_chained_sm90 import ChainedFFNKernel
    return ChainedFFNKernel


# the phased orders group="auto" considers first, as (group, ring in row blocks): lookahead one
# super-block, patch 1, split auto (bench/NOTES.md, session 17)
PHASED_ORDERS = ((8, 16), (6, 18))
PHASED_MIN_EFFICIENCY = 0.96  # simulate's efficiency a phased order must reach to be chosen


@functools.lru_cache(maxsize=256)
def auto_phased(M, P, hidden, N, grid, tile_m=128, tile_h=256, tile_n=256):
    """The phased order ``group="auto"`` runs where one fits, else None (then ``auto_group``):
    of PHASED_ORDERS whose ring is within ``ring_cap_blocks`` of M rows (the activation bound,
    or half of H), those that ``simulate`` runs at PHASED_MIN_EFFICIENCY or better, the most
    efficient (within SPLIT_TOLERANCE: the larger group, fewer weight reads), with
    ``auto_split``'s split. The simulations (~0.2-0.7 s) run once per bucket of row blocks, at
    the next power of two (``_phased_choice``), so that a call of a new M (the experts' rows
    change every step) costs only its tile list; at a power of two the bucket is M itself.

    Why (one H100 at the 700 W cap, the seven FFN slices at G = 2, 8192 and 32768 tokens, each
    path alone for 2 s; bench/NOTES.md, session 17): each step of the phased order runs its
    first GEMM1 super-tiles, then its GEMM2 super-tiles while the step's H and weight panels
    are still in L2, so a ring of two or three super-blocks keeps group 8's or 6's weight
    sharing: sustained 0.96-1.01x the library where ``auto_group``'s orders ran 0.82-0.96x
    (group 4 at 8192 tokens, within the bound: 0.82-0.91x), at 0.40-0.60x the in-place
    baseline's activation memory. Group 8 in 16 blocks loses where its steps leave CTAs idle
    (llama4-scout: simulate 0.84-0.94, measured 0.90-0.94x; group 6 in 18: 0.98x), which
    simulate's efficiency sees. Where the hidden slice has few column tiles (deepseek-v3-expert:
    4) a step has nothing to phase (simulate 0.57-0.68, measured 0.68-0.84x): ``auto_group``.
    At 4096 tokens no phased ring fits the bound on the wide slices."""
    cap = ring_cap_blocks(M, hidden, N, tile_m)
    candidates = tuple((g, r) for g, r in PHASED_ORDERS if r <= cap)
    if not candidates:
        return None
    blocks = -(-M // tile_m)
    choice = _phased_choice(1 << (blocks - 1).bit_length(), P, hidden, N, grid, tile_m, tile_h,
                            tile_n, candidates)
    if choice is None:
        return None
    group, ring, split = choice
    return schedule_for(M, P, hidden, N, grid, tile_m, tile_h, tile_n, group=group, ring=ring,
                        patch=1, lookahead=group, split=split)


@functools.lru_cache(maxsize=256)
def _phased_choice(blocks, P, hidden, N, grid, tile_m, tile_h, tile_n, candidates):
    """(group, ring, split) of ``auto_phased``'s rule over ``candidates`` ((group, ring) pairs)
    simulated at ``blocks`` row blocks, or None where none reaches PHASED_MIN_EFFICIENCY."""
    best = None
    for group, ring in candidates:
        s = schedule_for(blocks * tile_m, P, hidden, N, grid, tile_m, tile_h, tile_n,
                         group=group, ring=ring, patch=1, lookahead=group, split="auto")
        e = simulate(s).efficiency
        if e >= PHASED_MIN_EFFICIENCY and (best is None or e > best[0] + SPLIT_TOLERANCE):
            best = (e, (group, ring, s.base.split))
    return None if best is None else best[1]


class ChainedFFNCompute:
    """The chained FFN compute kernel (module docstring).

    ChainedFFNCompute(tile_m=128, tile_h=256, tile_n=256, stages=None, epi_n=32, epi_stages=4,
                      timeout_ms=2000, group="auto", patch="auto", cluster=1)
        tile_m = 128 (two consumer warpgroups); tile_h = tile_n = 256 (GEMM1 and GEMM2 tiles
        share the tiled MMA and the smem ring); stages: operand ring depth (None: as many as
        fit, 4); epi_n x epi_stages: epilogue sub-tile width and buffers; timeout_ms: bound of
        every cross-CTA wait; group: tile order on super-blocks of this many row blocks (module
        docstring; 1 = ``chained_schedule.derive``'s order), "auto" = ``auto_phased``'s order
        per shape where it gives one (with patch "auto", split None, cluster 1), else
        ``auto_group`` (their docstrings have the rules and the measurements behind them);
        patch: column tiles per run of the super-block order (``GroupedChainedSchedule.tiles``;
        1 = each super-tile's blocks side by side only), "auto" = the phased order's (1) or
        ``auto_patch`` of the group run. cluster: 1, or 2 for
        2-CTA clusters along M (``PairedChainedSchedule``): the two CTAs of a cluster run the
        same tile (kind, column) on adjacent row blocks 2 q, 2 q + 1 and load each weight tile
        once, half each, multicast to both (half the weight traffic from L2); dense calls only,
        group even (or 1 / "auto"); the grid is a whole number of clusters. split: None (each
        step's kinds interleaved), an int k or "auto": the phased step (``schedule_for``; only
        the host's tile list changes, the kernel is the same).

    __call__(x, w1, b1, w2, out=None, band_ready=None, epoch=None, act1="gelu", ccta=0,
             stream=None, h_ring=None) -> out
        x [M, P] bf16, w1 [P, hidden] bf16, b1 [hidden] float or None (bf16 read as it is,
        any other float through an fp32 copy per call: ``b1_read_dtype``), w2 [hidden, N] bf16,
        out [M, N] bf16 (allocated when None); band_ready int32 [>= ceil(M / tile_m)] and
        epoch int32 [1] (band flags for a following band all-reduce; a private pair when None);
        act1 in ACT1_CHAINED; ccta: SMs left free (grid = SMs - ccta); h_ring: the H ring
        [ring_rows(M, ...), hidden] bf16 (allocated per call when None: ``ring_bytes``).
        P % 64 == 0, hidden % tile_h == 0, N % tile_n == 0, any M >= 1. Never synchronizes;
        all checks raise before any launch. Device errors (a timed-out wait) are sticky until
        ``check()``, which synchronizes and raises RuntimeError with the error text.
    grouped(x, w1, b1, w2, out=None, band_ready=None, epoch=None, block_expert=None, ccta=0,
            act1="gelu", stream=None, h_ring=None, check_experts=False) -> out
        The same kernel over E experts (``ShardedExperts``; the argument order of
        ``FusedFFNCompute.grouped``): w1 [E, P, hidden], b1 [E, hidden] or None, w2 [E, hidden,
        N]; x holds the experts' rows with every expert's group padded to a multiple of tile_m,
        so that a row block belongs to one expert; block_expert int32 [>= ceil(M / tile_m)] on
        x's device: the expert of each row block. Its values are device data: checked by the
        kernel (out of range: the error word, raised by ``check()``), or on the host before
        the launch with ``check_experts=True`` (synchronizes). The tile order, ring, counters
        and band flags are the dense call's.
    Compile cache key: (tiles, stages, epilogue buffers, act1, b1 given, grouped, P, hidden, N,
    cluster);
    M, E, the tile table, the ring size, the flag capacity and the grid are runtime values.
    """

    _compiled = {}

    def __init__(self, tile_m=128, tile_h=256, tile_n=256, stages=None, epi_n=32, epi_stages=4,
                 timeout_ms=2000, group="auto", _test_ring=None,
                 _test_skip_slot_wait=False, patch="auto", _test_lookahead=None, cluster=1,
                 _test_cluster_fault=None, split=None):
        self.check_options(tile_m, tile_h, tile_n, stages, epi_n, epi_stages, timeout_ms,
                           cluster)
        if cluster == 2 and group != "auto" and group != 1 and group % 2:
            raise ValueError(f"group={group} with cluster=2: must be 1, \"auto\" or even (row "
                             f"blocks, taken in pairs)")
        self.cluster = cluster
        if group != "auto" and (isinstance(group, bool) or not isinstance(group, int)
                                or group < 1):
            raise ValueError(f"group must be \"auto\" or an int >= 1, got {group!r}")
        if group == "auto" and _test_ring is not None:
            raise ValueError("_test_ring needs an explicit group (it is in row blocks of that "
                             "group's order)")
        if patch != "auto" and (isinstance(patch, bool) or not isinstance(patch, int)
                                or patch < 1):
            raise ValueError(f"patch must be \"auto\" or an int >= 1, got {patch!r}")
        if split is not None and split != "auto" and (isinstance(split, bool)
                                                      or not isinstance(split, int) or split < 0):
            raise ValueError(f"split must be None, \"auto\" or an int >= 0, got {split!r}")
        self.group, self.patch, self.split = group, patch, split
        self.tile_m, self.tile_h, self.tile_n = tile_m, tile_h, tile_n
        self.stages, _ = _smem_plan(tile_m, tile_n, stages, epi_n, epi_stages)
        self.epi_n, self.epi_stages = epi_n, epi_stages
        self.timeout_ms = timeout_ms
        # private test switches (tests/test_chained_ffn_gpu.py, the bench's "GrR" variants): a
        # ring other than derived, and GEMM1 tiles that do not wait for their slot
        if _test_ring is not None and (not isinstance(_test_ring, int) or _test_ring < 1):
            raise ValueError(f"_test_ring must be an int >= 1, got {_test_ring!r}")
        self._test_ring = _test_ring
        self._test_lookahead = _test_lookahead  # schedule_for(lookahead=), the bench's "lL"
        self._test_skip_slot_wait = bool(_test_skip_slot_wait)
        # a fault of the first cluster (tests/test_chained_cluster_faults_gpu.py): ("stall_leader"
        # | "stop_peer", tile), compute_chained_sm90.ChainedFFNKernel.TEST_FAULTS
        if _test_cluster_fault is not None:
            if cluster != 2 or not isinstance(_test_cluster_fault, tuple) \
                    or len(_test_cluster_fault) != 2 \
                    or _test_cluster_fault[0] not in ("stall_leader", "stop_peer") \
                    or isinstance(_test_cluster_fault[1], bool) \
                    or not isinstance(_test_cluster_fault[1], int) or _test_cluster_fault[1] < 1:
                raise ValueError(f"_test_cluster_fault must be None or (\"stall_leader\" | "
                                 f"\"stop_peer\", tile >= 1) with cluster=2, got "
                                 f"{_test_cluster_fault!r}")
        self._test_cluster_fault = _test_cluster_fault
        self._bufs = {}
        self._tables = {}

    # ---------------------------------------------------------------- static checks
    @staticmethod
    def check_options(tile_m=128, tile_h=256, tile_n=256, stages=None, epi_n=32, epi_stages=4,
                      timeout_ms=2000, cluster=1):
        """Raises ValueError for an unsupported configuration (no GPU, no cutlass needed)."""
        if isinstance(cluster, bool) or cluster not in (1, 2):
            raise ValueError(f"cluster must be 1 or 2 (CTAs per cluster along M), got "
                             f"{cluster!r}")
        if tile_m != 128:
            raise ValueError(f"tile_m must be 128 (two consumer warpgroups), got {tile_m!r}")
        if tile_n != 256 or tile_h != tile_n:
            raise ValueError(f"tile_h and tile_n must both be 256 (one tiled MMA for both "
                             f"GEMMs), got tile_h={tile_h!r}, tile_n={tile_n!r}")
        if stages is not None and (isinstance(stages, bool) or not isinstance(stages, int)):
            raise ValueError(f"stages must be None or an int, got {stages!r}")
        if epi_n not in (32, 64):
            raise ValueError(f"epi_n must be 32 or 64, got {epi_n!r}")
        if isinstance(epi_stages, bool) or not isinstance(epi_stages, int) or epi_stages < 1:
            raise ValueError(f"epi_stages must be an int >= 1, got {epi_stages!r}")
        if not isinstance(timeout_ms, (int, float)) or timeout_ms <= 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms!r}")
        _smem_plan(tile_m, tile_n, stages, epi_n, epi_stages)

    @staticmethod
    def check_shapes(P, hidden, N, act1="gelu", tile_m=128, tile_h=256, tile_n=256):
        """Raises ValueError when (P, hidden, N, act1) cannot run on this kernel."""
        for name, v in (("P", P), ("hidden", hidden), ("N", N)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if P % TILE_K:
            raise ValueError(f"P={P} must be a multiple of {TILE_K} (the k tile)")
        if hidden % tile_h:
            raise ValueError(f"hidden={hidden} must be a multiple of tile_h={tile_h}")
        if N % tile_n:
            raise ValueError(f"N={N} must be a multiple of tile_n={tile_n}")
        if act1 not in ACT1_CHAINED:
            raise ValueError(f"act1={act1!r}: choose from {ACT1_CHAINED}")

    @staticmethod
    def can_implement(P, hidden, N, act1="gelu", tile_m=128, tile_h=256, tile_n=256,
                      stages=None, cluster=1, grouped=False) -> bool:
        """True when the configuration and shapes are supported (CUTLASS-style, no GPU);
        cluster=2 runs dense calls only (grouped=True is refused: the two blocks of a pair may
        belong to different experts, whose weight tiles cannot be one multicast)."""
        try:
            ChainedFFNCompute.check_options(tile_m, tile_h, tile_n, stages, cluster=cluster)
            ChainedFFNCompute.check_shapes(P, hidden, N, act1, tile_m, tile_h, tile_n)
        except ValueError:
            return False
        return not (grouped and cluster != 1)

    # ---------------------------------------------------------------- schedule, memory
    def phased_for(self, M, P, hidden, N, grid):
        """``auto_phased``'s order where this instance leaves the whole order to the rule
        (group and patch "auto", split None, cluster 1, no test ring or lookahead), else None."""
        if self.group != "auto" or self.patch != "auto" or self.split is not None \
                or self.cluster != 1 or self._test_lookahead is not None:
            return None
        return auto_phased(M, P, hidden, N, grid, self.tile_m, self.tile_h, self.tile_n)

    def group_for(self, M, P, hidden, N, grid) -> int:
        """The group this instance runs for the shape (when group="auto": the phased order's,
        ``phased_for``, else ``auto_group``)."""
        if self.group != "auto":
            return self.group
        phased = self.phased_for(M, P, hidden, N, grid)
        if phased is not None:
            return phased.group
        return auto_group(M, P, hidden, N, grid, self.tile_m, self.tile_h, self.tile_n,
                          self.cluster)

    def patch_for(self, M, P, hidden, N, grid) -> int:
        """The patch this instance runs for the shape (when patch="auto": the phased order's,
        else ``auto_patch`` of its group)."""
        if self.patch != "auto":
            return self.patch
        phased = self.phased_for(M, P, hidden, N, grid)
        if phased is not None:
            return phased.patch
        return auto_patch(self.group_for(M, P, hidden, N, grid))

    def schedule(self, M, P, hidden, N, grid):
        """The tile list this instance runs for M rows on ``grid`` CTAs (``phased_for``'s
        order, else ``schedule_for`` of the instance's options)."""
        phased = self.phased_for(M, P, hidden, N, grid)
        if phased is not None:
            return phased
        return schedule_for(M, P, hidden, N, grid, self.tile_m, self.tile_h, self.tile_n,
                            self.group_for(M, P, hidden, N, grid), self._test_ring,
                            self.patch_for(M, P, hidden, N, grid), self._test_lookahead,
                            self.cluster, self.split)

    def grid(self, M, hidden, N, device=None, ccta=0, sms=None):
        sms = num_sms(device) if sms is None else sms
        blocks = -(-M // self.tile_m)
        if self.cluster == 2:  # whole clusters, at most one per pair tile
            pair_tiles = -(-blocks // 2) * (hidden // self.tile_h + N // self.tile_n)
            g = 2 * min((sms - ccta) // 2, pair_tiles)
            if g < 2:
                raise ValueError(f"ccta={ccta} leaves no SM pair for the chained FFN kernel's "
                                 f"2-CTA clusters")
            return g
        tiles = blocks * (hidden // self.tile_h + N // self.tile_n)
        g = min(sms - ccta, tiles)
        if g < 1:
            raise ValueError(f"ccta={ccta} leaves no SM for the chained FFN kernel")
        return g

    def ring_rows(self, M, P, hidden, N, grid=132) -> int:
        return min(self.schedule(M, P, hidden, N, grid).ring, -(-M // self.tile_m)) * self.tile_m

    def ring_bytes(self, M, P, hidden, N, grid=132) -> int:
        """Bytes of the bf16 H ring one call allocates (its only activation memory besides out)."""
        return self.ring_rows(M, P, hidden, N, grid) * hidden * 2

    # ---------------------------------------------------------------- validation
    def check_args(self, x, w1, b1, w2, out, band_ready, epoch, act1, ccta, h_ring=None,
                   need_cuda=True):
        """All argument checks (TypeError / ValueError); returns (M, P, hidden, N)."""
        if act1 not in ACT1_CHAINED:
            raise ValueError(f"act1={act1!r}: choose from {ACT1_CHAINED}")
        tensors = dict(x=x, w1=w1, w2=w2)
        for name, t in (("b1", b1), ("out", out), ("band_ready", band_ready), ("epoch", epoch),
                        ("h_ring", h_ring)):
            if t is not None:
                tensors[name] = t
        check_tensors(tensors, x, need_cuda)
        for name in ("x", "w1", "w2", "out", "h_ring"):
            if name in tensors:
                if tensors[name].dtype != torch.bfloat16:
                    raise TypeError(f"{name} must be bfloat16, got {tensors[name].dtype}")
                if tensors[name].data_ptr() % 16:
                    raise ValueError(f"{name} must be 16-byte aligned (TMA)")
        if b1 is not None and not b1.is_floating_point():
            raise TypeError(f"b1 must be floating point, got {b1.dtype}")
        for name in ("band_ready", "epoch"):
            if name in tensors and tensors[name].dtype != torch.int32:
                raise TypeError(f"{name} must be int32, got {tensors[name].dtype}")
        if (band_ready is None) != (epoch is None):
            raise ValueError("give both band_ready and epoch, or neither")
        M, P, hidden, N = chained_gemm_dims(x, w1, w2)
        self.check_shapes(P, hidden, N, act1, self.tile_m, self.tile_h, self.tile_n)
        if b1 is not None and (b1.dim() != 1 or b1.numel() != hidden):
            raise ValueError(f"b1 must be [{hidden}], got {tuple(b1.shape)}")
        if out is not None and tuple(out.shape) != (M, N):
            raise ValueError(f"out must be [{M}, {N}], got {tuple(out.shape)}")
        blocks = -(-M // self.tile_m)
        if band_ready is not None and (band_ready.dim() != 1 or band_ready.numel() < blocks):
            raise ValueError(f"band_ready must be 1-D with >= ceil(M / tile_m) = {blocks} "
                             f"entries, got {tuple(band_ready.shape)}")
        if epoch is not None and epoch.numel() != 1:
            raise ValueError("epoch must have exactly one element")
        if isinstance(ccta, bool) or not isinstance(ccta, int) or ccta < 0:
            raise ValueError(f"ccta must be a non-negative int, got {ccta!r}")
        return M, P, hidden, N

    def check_grouped_args(self, x, w1, b1, w2, out, band_ready, epoch, block_expert, act1,
                           ccta, h_ring=None, need_cuda=True):
        """The grouped call's argument checks (TypeError / ValueError): ``check_args`` on expert
        0's slices, then the expert dimension and block_expert; returns (M, P, hidden, N, E)."""
        self._refuse_grouped_cluster(True)
        for name, t in (("w1", w1), ("w2", w2)):
            if not isinstance(t, torch.Tensor) or t.dim() != 3:
                raise ValueError(f"{name} must be a 3-D tensor [E, ...], got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
        E = w1.shape[0]
        if E < 1 or w2.shape[0] != E:
            raise ValueError(f"w1 has {E} experts, w2 {w2.shape[0]}")
        if b1 is not None and (not isinstance(b1, torch.Tensor) or b1.dim() != 2
                               or b1.shape[0] != E):
            raise ValueError(f"b1 must be [E={E}, hidden], got "
                             f"{tuple(b1.shape) if isinstance(b1, torch.Tensor) else b1!r}")
        for name, t in (("w1", w1), ("w2", w2), ("b1", b1)):
            if t is not None and not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        M, P, hidden, N = self.check_args(x, w1[0], None if b1 is None else b1[0], w2[0], out,
                                          band_ready, epoch, act1, ccta, h_ring, need_cuda)
        blocks = -(-M // self.tile_m)
        if not isinstance(block_expert, torch.Tensor):
            raise TypeError(f"block_expert must be an int32 tensor, got "
                            f"{type(block_expert).__name__}")
        if block_expert.dtype != torch.int32:
            raise TypeError(f"block_expert must be int32, got {block_expert.dtype}")
        if block_expert.dim() != 1 or block_expert.numel() < blocks:
            raise ValueError(f"block_expert must be 1-D with >= ceil(M / tile_m) = {blocks} "
                             f"entries, got {tuple(block_expert.shape)}")
        if block_expert.device != x.device:
            raise ValueError(f"block_expert is on {block_expert.device}, x on {x.device}")
        if not block_expert.is_contiguous():
            raise ValueError("block_expert must be contiguous")
        return M, P, hidden, N, E

    @staticmethod
    def check_block_experts(block_expert, E, blocks):
        """ValueError unless block_expert[:blocks] is in [0, E); reads the values on the host
        (synchronizes with a CUDA tensor)."""
        be = block_expert[:blocks]
        lo, hi = (int(v) for v in torch.stack([be.min(), be.max()]).tolist())
        if lo < 0 or hi >= E:
            bad = be[(be < 0) | (be >= E)]
            first = int((((be < 0) | (be >= E)).nonzero())[0])
            raise ValueError(f"block_expert must be in [0, {E}): row block {first} names "
                             f"expert {int(bad[0])} ({bad.numel()} of {blocks} blocks out of "
                             f"range)")

    # ---------------------------------------------------------------- compilation
    def _key(self, P, hidden, N, act1, has_b1, grouped=False, b1_dtype=torch.float32):
        return (self.tile_m, self.tile_n, self.stages, self.epi_n, self.epi_stages, act1,
                bool(has_b1), self._test_skip_slot_wait, bool(grouped), int(P), int(hidden),
                int(N), self.cluster, self._test_cluster_fault, b1_read_dtype(b1_dtype))

    def _kernel(self, P, hidden, act1, has_b1, grouped=False):
        self._refuse_grouped_cluster(grouped)
        return _get_kernel_class()(self.tile_m, self.tile_n, TILE_K, act1, bool(has_b1),
                                   self.stages, self.epi_n, self.epi_stages, P // TILE_K,
                                   hidden // TILE_K, self._test_skip_slot_wait, bool(grouped),
                                   self.cluster, self._test_cluster_fault)

    def _refuse_grouped_cluster(self, grouped):
        if grouped and self.cluster != 1:
            raise ValueError("cluster=2 runs dense calls only: the two row blocks of a pair may "
                             "belong to different experts, whose weight tiles cannot be one "
                             "multicast (use cluster=1 for grouped())")

    def compile(self, P, hidden, N, act1="gelu", has_b1=True, keep_ptx=False, grouped=False,
                b1_dtype=torch.float32):
        """Compiles from symbolic tensors (M, the table, the ring and the flags are runtime
        sizes; grouped: E too); needs no GPU with CUTE_DSL_ARCH=sm_90a. keep_ptx: keep
        ``fn.__ptx__`` and ``fn.__cubin__``. grouped: the kernel of ``grouped()``. b1_dtype:
        the dtype of the b1 a call passes (``b1_read_dtype``: bf16 is read as it is, anything
        else as fp32)."""
        self.check_shapes(P, hidden, N, act1, self.tile_m, self.tile_h, self.tile_n)
        self._refuse_grouped_cluster(grouped)
        key = ("fake", bool(keep_ptx)) + self._key(P, hidden, N, act1, has_b1, grouped,
                                                   b1_dtype)
        fn = ChainedFFNCompute._compiled.get(key)
        if fn is not None:
            return fn
        import cutlass
        import cutlass.cute as cute
        from cutlass.cute.runtime import make_fake_tensor
        from cutlass.runtime import make_fake_stream
        M, R, T, S, B = (cute.sym_int() for _ in range(5))
        bf16, f32, i32 = cutlass.BFloat16, cutlass.Float32, cutlass.Int32
        fb1 = bf16 if b1_read_dtype(b1_dtype) == torch.bfloat16 else f32
        if grouped:  # (hidden, P, E), (E, hidden), (N, hidden, E): MN-major views of [E, ...]
            E = cute.sym_int()
            weights = (make_fake_tensor(bf16, (hidden, P, E), (1, hidden, P * hidden),
                                        assumed_align=16),
                       make_fake_tensor(fb1, (E, hidden), (hidden, 1), assumed_align=16),
                       make_fake_tensor(bf16, (N, hidden, E), (1, N, hidden * N),
                                        assumed_align=16))
        else:
            weights = (make_fake_tensor(bf16, (hidden, P), (1, hidden), assumed_align=16),
                       make_fake_tensor(fb1, (hidden,), (1,), assumed_align=16),
                       make_fake_tensor(bf16, (N, hidden), (1, N), assumed_align=16))
        args = (make_fake_tensor(bf16, (M, P), (P, 1), assumed_align=16),
                *weights,
                make_fake_tensor(bf16, (R, hidden), (hidden, 1), assumed_align=16),
                make_fake_tensor(bf16, (M, N), (N, 1), assumed_align=16),
                make_fake_tensor(i32, (T,), (1,), assumed_align=4),
                make_fake_tensor(i32, (S,), (1,), assumed_align=4),
                make_fake_tensor(i32, (B,), (1,), assumed_align=4),
                make_fake_tensor(i32, (1,), (1,), assumed_align=4),
                make_fake_tensor(cutlass.Int64, (8,), (1,), assumed_align=8),
                cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(1), cutlass.Int64(1),
                cutlass.Int32(1), make_fake_stream())
        kernel = self._kernel(P, hidden, act1, has_b1, grouped)
        if keep_ptx:
            from ..kernels.compile import compile_keep
            fn = compile_keep(kernel, *args)
        else:
            fn = cute.compile(kernel, *args)
        ChainedFFNCompute._compiled[key] = fn
        return fn

    # ---------------------------------------------------------------- launch
    def _buffers(self, dev, blocks):
        """Per-device scratch: the sync words (tile counter, g1_done, g2_done: zeroed before
        every launch), the error word (sticky until check()), private band flags and epoch,
        a zero b1."""
        b = self._bufs.get(dev)
        if b is None or b["sync"].numel() < 1 + 2 * blocks:
            old_err = None if b is None else b["err"]
            n = max(1 + 2 * blocks, 1 + 2 * 64)
            b = dict(sync=torch.zeros(n, dtype=torch.int32, device=dev),
                     err=old_err if old_err is not None else torch.zeros(8, dtype=torch.int64,
                                                                         device=dev),
                     ready=torch.zeros(max(blocks, 64), dtype=torch.int32, device=dev),
                     epoch=torch.ones(1, dtype=torch.int32, device=dev))
            self._bufs[dev] = b
        return b

    def _table(self, s: ChainedSchedule, dev, grouped=False):
        """The flat tile table (int32 [3 * tiles]); grouped: with ``s.blocks`` more entries
        after it for the blocks' experts, written by each call before its launch (stream
        order, like the sync words)."""
        key = (dev, s, bool(grouped))
        t = self._tables.get(key)
        if t is None:
            t = s.tile_table(dev).reshape(-1).contiguous()
            if grouped:
                t = torch.cat([t, torch.zeros(s.blocks, dtype=torch.int32, device=dev)])
            self._tables[key] = t
        return t

    def _zero_b1(self, dev, hidden):
        """The zero fp32 b1 [hidden] a call without b1 passes (the kernel never reads it)."""
        zk = ("b1zero", hidden)
        b1f = self._bufs.get(zk)
        if b1f is None or b1f.device != dev:
            b1f = torch.zeros(hidden, dtype=torch.float32, device=dev)
            self._bufs[zk] = b1f
        return b1f

    def _cute_args(self, x, w1, b1f, w2, h_ring, out, table, sync, band_ready, epoch, err,
                   blocks, ring, grid, grouped=False, num_tiles=None):
        """torch -> cute arguments of the launch: M, the table, the sync words, the ring rows and
        the flag capacity are dynamic; P, hidden, N static (weights as MN-major views).
        grouped: w1 [E, P, hidden] / w2 [E, hidden, N] as (hidden, P, E) / (N, hidden, E) and
        b1f [E, hidden], E dynamic; num_tiles: the tile rows of the table (its tail is the
        blocks' experts)."""
        import cutlass
        from cutlass.cute.runtime import from_dlpack

        def dyn(t, align, mode=0):
            return from_dlpack(t, assumed_align=align).mark_compact_shape_dynamic(
                mode=mode, stride_order=t.dim_order())

        if grouped:
            weights = (dyn(w1.permute(2, 1, 0), 16, 2), dyn(b1f, 16),
                       dyn(w2.permute(2, 1, 0), 16, 2))
        else:
            weights = (from_dlpack(w1.t(), assumed_align=16), from_dlpack(b1f, assumed_align=16),
                       from_dlpack(w2.t(), assumed_align=16))
        args = (dyn(x, 16), *weights,
                dyn(h_ring, 16), dyn(out, 16), dyn(table, 4), dyn(sync, 4), dyn(band_ready, 4),
                from_dlpack(epoch.reshape(1), assumed_align=4), from_dlpack(err, assumed_align=8))
        nt = table.numel() // 3 if num_tiles is None else num_tiles
        ints = (cutlass.Int32(nt), cutlass.Int32(blocks), cutlass.Int32(ring),
                cutlass.Int64(int(self.timeout_ms * 1e6)), cutlass.Int32(grid))
        return args, ints

    def _compiled_for(self, args, ints, stream, P, hidden, N, act1, has_b1, grouped=False,
                      b1_dtype=torch.float32):
        import cutlass.cute as cute
        key = ("dlpack",) + self._key(P, hidden, N, act1, has_b1, grouped, b1_dtype)
        fn = ChainedFFNCompute._compiled.get(key)
        if fn is None:
            fn = cute.compile(self._kernel(P, hidden, act1, has_b1, grouped), *args, *ints,
                              stream)
            ChainedFFNCompute._compiled[key] = fn
        return fn

    def prepare(self, M, P, hidden, N, device, ccta=0, has_b1=True, grouped=False) -> int:
        """Makes everything a call for this shape would allocate on the host side (the tile
        table, the scratch words, the zero b1) so that the call itself allocates nothing but
        what it is not given (out, h_ring); returns the ring rows the call needs
        (``ring_rows``). The fused layer calls it before the launches of an overlapped call.
        grouped: for ``grouped()`` (its table with the experts' tail)."""
        self._refuse_grouped_cluster(grouped)
        dev = torch.device(device)
        grid = self.grid(M, hidden, N, dev, ccta)
        s = self.schedule(M, P, hidden, N, grid)
        self._buffers(dev, s.blocks)
        self._table(s, dev, grouped)
        if not has_b1:
            self._zero_b1(dev, hidden)
        return min(s.ring, s.blocks) * self.tile_m

    def error_word(self, device=None):
        """The device error word (int64[8]) of launches on ``device`` (made if needed; the same
        tensor for the object's lifetime: the scratch grows around it), for an asynchronous
        read-back (runtime.error_watch.ErrorWatch) and for a reset (zero it)."""
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
        b = self._bufs.get(dev)
        if b is None:
            b = self._buffers(dev, 1)
        return b["err"]

    def check(self, device=None):
        """Synchronizes and raises RuntimeError if a launch on ``device`` recorded an error
        (then clears it)."""
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else \
            torch.device(device)
        b = self._bufs.get(dev)
        if b is None:
            return
        torch.cuda.synchronize(dev)
        words = b["err"].tolist()
        msg = describe_chained_error(words)
        if msg:
            b["err"].zero_()
            raise RuntimeError(msg)

    def __call__(self, x, w1, b1, w2, out=None, band_ready=None, epoch=None, act1="gelu",
                 ccta=0, stream=None, h_ring=None):
        M, P, hidden, N = self.check_args(x, w1, b1, w2, out, band_ready, epoch, act1, ccta,
                                          h_ring)
        return self._launch(x, w1, b1, w2, out, band_ready, epoch, act1, ccta, stream, h_ring,
                            M, P, hidden, N, None)

    def grouped(self, x, w1, b1, w2, out=None, band_ready=None, epoch=None, block_expert=None,
                ccta=0, act1="gelu", stream=None, h_ring=None, check_experts=False):
        """One launch over E experts (class docstring): row block b of x runs through expert
        ``block_expert[b]``'s w1 [E, P, hidden], b1 [E, hidden] (or None), w2 [E, hidden, N].
        Returns out [M, N] bf16."""
        if block_expert is None:
            raise TypeError("grouped() needs block_expert (int32, the expert of each row "
                            "block)")
        M, P, hidden, N, E = self.check_grouped_args(x, w1, b1, w2, out, band_ready, epoch,
                                                     block_expert, act1, ccta, h_ring)
        if check_experts:
            self.check_block_experts(block_expert, E, -(-M // self.tile_m))
        return self._launch(x, w1, b1, w2, out, band_ready, epoch, act1, ccta, stream, h_ring,
                            M, P, hidden, N, block_expert)

    def _launch(self, x, w1, b1, w2, out, band_ready, epoch, act1, ccta, stream, h_ring,
                M, P, hidden, N, block_expert):
        """The launch of a checked call (block_expert None: dense; else grouped)."""
        grouped = block_expert is not None
        dev = x.device
        grid = self.grid(M, hidden, N, dev, ccta)
        s = self.schedule(M, P, hidden, N, grid)
        blocks = s.blocks
        R = min(s.ring, blocks)
        if h_ring is not None and tuple(h_ring.shape) != (R * self.tile_m, hidden):
            raise ValueError(f"h_ring must be [{R * self.tile_m}, {hidden}] (ring_rows), got "
                             f"{tuple(h_ring.shape)}")
        torch_stream = stream if stream is not None else torch.cuda.current_stream(dev)
        bufs = self._buffers(dev, blocks)
        table = self._table(s, dev, grouped)
        num_tiles = (table.numel() - blocks) // 3 if grouped else None
        with torch.cuda.stream(torch_stream):
            if out is None:
                out = torch.empty(M, N, dtype=torch.bfloat16, device=dev)
            if h_ring is None:
                h_ring = torch.empty(R * self.tile_m, hidden, dtype=torch.bfloat16, device=dev)
            b1f = None
            if b1 is not None:
                # bf16 and fp32 are read as they are (no copy per call); others as fp32
                b1f = b1 if b1.dtype == b1_read_dtype(b1.dtype) else b1.float()
                if b1f.data_ptr() % 16:
                    b1f = b1f.clone()
            sync = bufs["sync"][:1 + 2 * blocks]
            sync.zero_()  # one memset in stream order: graph-capturable
            if grouped:  # the blocks' experts after the tile rows, in stream order too
                table[3 * num_tiles:].copy_(block_expert[:blocks])
        if band_ready is None:
            band_ready, epoch = bufs["ready"], bufs["epoch"]
        if b1f is None:
            b1f = self._zero_b1(dev, hidden)
            if grouped:
                b1f = b1f.view(1, hidden)  # never read (has_b1 False); the rank the kernel takes
        args, ints = self._cute_args(x, w1, b1f, w2, h_ring, out, table, sync, band_ready,
                                     epoch, bufs["err"], blocks, s.ring, grid, grouped,
                                     num_tiles)
        import cuda.bindings.driver as cuda_drv
        cu_stream = cuda_drv.CUstream(torch_stream.cuda_stream)
        fn = self._compiled_for(args, ints, cu_stream, P, hidden, N, act1, b1 is not None,
                                grouped, b1f.dtype)
        fn(*args, *ints, cu_stream)
        return out
