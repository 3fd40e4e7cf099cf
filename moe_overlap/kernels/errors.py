"""The overlapped combine's error word and communication-block layout: one definition for the
kernels (consumer.py, scale.py, through kernels/primitives.py) and the host (describe_error).

Pure Python (no CuTe DSL, no CUDA): the host can decode an error word on any machine.

Error word (``int64[ERR_WORDS]`` per combine, on the device, zeroed by the host; the first
writer wins through ``atom.cas`` on word 0, the rest is written by that thread only). The
combine's word is a symmetric allocation of its own (``CommBuffer.err``, beside the
communication block, not in it) with a peer address table (``CommBuffer.err_peers``): the
scale's arrival wait polls the code word of the source it waits for (ld.relaxed.sys), so a rank
whose peer has recorded an error stops waiting at once and records ERR_PEER_ERROR:

====  ==========================================================================================
word  meaning
====  ==========================================================================================
0     code (0 = ok, one of ``ERR_*`` below)
1     rank that recorded it
2     index: segment (consumer; -1 = a local cell), source rank (scale; ERR_PEER_ERROR: the
      peer whose error word was set), assignment t * topk + k (bad row), token tile (ordered
      scale), schedule position (producer; -1 = num_bands)
3     band / stage index; ERR_SCALE_TIMEOUT, ERR_PEER_ERROR: this rank's epoch;
      ERR_EPOCH_MISMATCH: the source rank again; ERR_TILE_SEGMENT_TIMEOUT: source << 32 |
      segment; ERR_PLAN_BOUNDS: which field (``PLAN_FIELDS``); ERR_SCALE_BAD_ROW: 1 for a y
      row (y_src), 0 for a slot row; ERR_PRODUCER_BOUNDS: which field (``PRODUCER_FIELDS``)
4     observed value (band flag, counter, the bad row index; ERR_EPOCH_MISMATCH: the source's
      epoch tag, ``call_tag``; ERR_PEER_ERROR: the peer's code)
5     expected value (epoch, expected count, the valid row bound; ERR_EPOCH_MISMATCH: this
      rank's epoch tag; ERR_PEER_ERROR: the arrival counter of that peer when the wait stopped)
6     elapsed ns since the kernel started (timeouts), else 0
7     unused (0)
====  ==========================================================================================

Sticky: a kernel that finds word 0 non-zero at its start does no work that could read a receive
slot or write a peer (the consumer ships nothing and posts no call marker, so the peers' scales
time out instead of reading a slot it might have overwritten; the scale writes NaN rows), until
the host zeroes the word again (a collective reset, see docs/CONTRACTS.md). The consumer's band
waits also poll the word: an error recorded while it waits (the producer GEMM refusing a band, so
that band's flag never comes) ends the wait at once instead of at the timeout.

Communication block of rank d (``int64``, symmetric; ``NvshmemRuntime.buffers(...).counters`` is
a view of its first W words, ``.block`` the whole of it):

- ``[0, W)``: arrival counter of source s (rows + one call marker per call, monotone);
- ``[W + p * W + s]`` for parity p in {0, 1}: the epoch tag of the call with which source s's
  consumer last wrote receive slot p of rank d, ``call_tag(epoch, fingerprint)``: the plan's
  counts fingerprint (combine/plan.py, the same on every rank for one call: every rank plans
  from the same exchanged counts) in the high word, the epoch's 32 bits in the low word; written
  once per call at consumer start, before its call marker (same thread, the marker's release
  covers it). The epoch alone counts calls: a rank that skipped call c makes its next call at
  the epoch the others make c at; the fingerprint tells the two routings apart.
"""
from __future__ import annotations

ERR_WORDS = 8

ERR_CONSUMER_TIMEOUT = 1  # consumer waited too long for band_ready[b] == epoch
ERR_SCALE_TIMEOUT = 2  # owner's scale waited too long for a source's arrival counter
ERR_COPY_TIMEOUT = 3  # consumer (copy="tma") waited too long for a bulk load into shared memory
ERR_EPOCH_MISMATCH = 4  # the source's epoch tag of the slot is not this rank's (epoch, counts)
ERR_PLAN_BOUNDS = 5  # consumer: a plan entry outside its buffer (validate=False input)
ERR_SCALE_BAD_ROW = 6  # scale: an assignment's row outside the receive slot / y
ERR_TILE_BAND_TIMEOUT = 7  # ordered scale: a token tile waited too long for a local band flag
ERR_TILE_SEGMENT_TIMEOUT = 8  # ordered scale: a token tile waited too long for a segment's rows
ERR_PRODUCER_BOUNDS = 9  # producer GEMM: a band entry outside its tables / x, y, w
ERR_PEER_ERROR = 10  # scale: the source rank it waited for has an error recorded (its word 0)
ERR_DISPATCH_TIMEOUT = 31  # dispatch expand waited too long for a source's tokens (its markers)
ERR_DISPATCH_BAD_ROUTE = 32  # dispatch expand: received tokens disagree with the counts / plan
ERR_ARRIVAL_TIMEOUT = 33  # arrival-gated GEMM waited too long for a band's arrival flag
ERR_COUNTS_TIMEOUT = 34  # device counts exchange waited too long for a source's row (its flag)

ERR_NAMES = {ERR_CONSUMER_TIMEOUT: "consumer timed out waiting for a band flag",
             ERR_SCALE_TIMEOUT: "scale timed out waiting for a source's rows to arrive",
             ERR_COPY_TIMEOUT: "consumer timed out waiting for a bulk (TMA) load of y",
             ERR_EPOCH_MISMATCH: "ranks out of step: a source's epoch tag (epoch, routing "
                                 "fingerprint) differs from this rank's",
             ERR_PLAN_BOUNDS: "consumer refused a plan entry outside its buffer",
             ERR_SCALE_BAD_ROW: "scale refused a row index outside the receive slot / y",
             ERR_TILE_BAND_TIMEOUT: "ordered scale timed out waiting for a local band of y",
             ERR_TILE_SEGMENT_TIMEOUT: "ordered scale timed out waiting for a segment's rows",
             ERR_PRODUCER_BOUNDS: "producer GEMM refused a band entry outside its buffers",
             ERR_PEER_ERROR: "scale stopped waiting: the source rank recorded an error",
             ERR_DISPATCH_TIMEOUT: "dispatch timed out waiting for a source's tokens to arrive",
             ERR_DISPATCH_BAD_ROUTE: "dispatch refused received tokens that disagree with the "
                                     "counts / plan",
             ERR_ARRIVAL_TIMEOUT: "up-projection GEMM timed out waiting for a band's rows to "
                                  "arrive (its arrival flag)",
             ERR_COUNTS_TIMEOUT: "counts exchange timed out waiting for a source's routing "
                                 "counts (its flag)"}

# what word 3 of ERR_DISPATCH_BAD_ROUTE names (combine/dispatch_expand.py DF_*)
DISPATCH_FIELDS = {0: "the source's token count outside [0, max_tokens_per_rank]",
                   1: "a row at or past its (expert, source) group's size in counts",
                   2: "fewer rows for an (expert, source) group than counts says",
                   3: "a row outside the output's rows"}

# what word 3 of ERR_PLAN_BOUNDS names
PLAN_FIELDS = {0: "num_segments > segment capacity", 1: "num_local_cells > cell capacity",
               2: "segment destination rank outside [0, W)",
               3: "segment source rows outside y", 4: "segment destination rows outside the slot",
               5: "segment bands outside the schedule / band id outside band_ready",
               6: "local cell source rows outside y",
               7: "local cell destination rows outside the slot",
               8: "ordered scale: dependency band id outside band_ready",
               9: "ordered scale: dependency (source, segment) outside the arrival table"}


def segment_word(source: int, segment: int) -> int:
    """Word 3 of ERR_TILE_SEGMENT_TIMEOUT: source rank and segment in one int64."""
    return (int(source) << 32) | (int(segment) & 0xFFFFFFFF)


# what word 3 of ERR_PRODUCER_BOUNDS names (the grouped GEMM's checks, combine/grouped_gemm.py
# band_faults is their host mirror); word 2 is the schedule position (-1: num_bands itself)
PRF_NUM_BANDS, PRF_SCHEDULE, PRF_EXPERT, PRF_SRC_ROW, PRF_GROUP_FIRST, PRF_GROUP_END = range(6)
PRODUCER_FIELDS = {PRF_NUM_BANDS: "num_bands outside [0, band capacity]",
                   PRF_SCHEDULE: "schedule entry (band id) outside [0, num_bands)",
                   PRF_EXPERT: "band_expert outside [0, experts of w)",
                   PRF_SRC_ROW: "band_src_row: the band's tile_m rows outside x / y, or not a "
                                "multiple of tile_m",
                   # group_by="expert": the position's band group table entry
                   PRF_GROUP_FIRST: "group_first outside [0, schedule position]",
                   PRF_GROUP_END: "group_first + group_size outside (schedule position, "
                                  "num_bands]"}


def comm_block_words(world: int) -> int:
    """int64 words of one rank's communication block (counters + epoch tags)."""
    return 3 * world


def epoch_tag_word(world: int, parity: int, source: int) -> int:
    """Index (int64 words) of source's epoch tag of receive slot ``parity``."""
    return world + parity * world + source


def call_tag(epoch: int, fingerprint: int) -> int:
    """The epoch tag of a call as the kernels write it (signed int64, the error word's type):
    the counts fingerprint's 32 bits in the high word, the epoch's 32 bits in the low word (so an
    int32 epoch is the same tag across its 2^31 wrap)."""
    u = ((int(fingerprint) & 0xFFFFFFFF) << 32) | (int(epoch) & 0xFFFFFFFF)
    return u - (1 << 64) if u >> 63 else u


def split_call_tag(tag: int) -> tuple[int, int]:
    """(epoch as int32, fingerprint as uint32) of a call tag."""
    t = int(tag) & 0xFFFFFFFFFFFFFFFF
    lo = t & 0xFFFFFFFF
    return (lo - (1 << 32) if lo >> 31 else lo), t >> 32


def call_tags_differ(observed: int, expected: int) -> bool:
    """Host mirror of the scales' check: the two 64-bit tags differ."""
    return (int(observed) ^ int(expected)) & 0xFFFFFFFFFFFFFFFF != 0


def describe_error(err_host) -> str | None:
    """Human-readable text of a combine error word read back to the host (None when clear)."""
    code = int(err_host[0])
    if code == 0:
        return None
    what = ERR_NAMES.get(code, f"device error code {code}")
    rank, index, band, obs, exp, el = (int(v) for v in err_host[1:7])
    if code == ERR_CONSUMER_TIMEOUT:
        return (f"{what}: rank {rank}, segment {index}, band {band}: band_ready={obs}, epoch={exp}"
                f" after {el / 1e6:.1f} ms (producer stalled, not launched, or plan/epoch mismatch)")
    if code == ERR_COPY_TIMEOUT:
        return (f"{what}: rank {rank}, segment {index} (-1: local band), stage {band} after "
                f"{el / 1e6:.1f} ms (bulk copy engine stalled or bad address)")
    if code == ERR_SCALE_TIMEOUT:
        return (f"{what}: rank {rank} at epoch {band}, source rank {index}: counter={obs}, "
                f"expected>={exp} after "
                f"{el / 1e6:.1f} ms (a peer's consumer did not run, timed out, refused after an "
                "error of its own, or sent fewer rows)")
    if code == ERR_DISPATCH_TIMEOUT:
        return (f"{what}: rank {rank} at epoch {band}, source rank {index}: counter={obs}, "
                f"expected>={exp} after {el / 1e6:.1f} ms (rank {index} did not make this "
                "dispatch call, its send did not run, or it refused after an error of its own); "
                "the output rows are NaN")
    if code == ERR_COUNTS_TIMEOUT:
        return (f"{what}: rank {rank} at epoch {band}, source rank {index}: flag={obs}, "
                f"expected>={exp} after {el / 1e6:.1f} ms (rank {index} did not make this "
                "counts exchange, its post did not run, or it refused after an error of its "
                "own); the exchanged counts are zero")
    if code == ERR_DISPATCH_BAD_ROUTE:
        field = DISPATCH_FIELDS.get(band, f"field {band}")
        return (f"{what}: rank {rank}, source rank {index}: {field}: value {obs}, bound {exp} "
                "(topk_ids, counts and plan of another call, or validate=False input)")
    if code == ERR_ARRIVAL_TIMEOUT:
        return (f"{what}: rank {rank}, band {index}: band_arrived={obs}, epoch={exp} after "
                f"{el / 1e6:.1f} ms (the dispatch's expand did not run, did not finish the "
                "band's expert, or ran at another epoch); no output tile was stored after it")
    if code == ERR_TILE_BAND_TIMEOUT:
        return (f"{what}: rank {rank}, tile {index}, band {band}: band_ready={obs}, epoch={exp} "
                f"after {el / 1e6:.1f} ms (producer stalled, or tiles prepared for another plan)")
    if code == ERR_TILE_SEGMENT_TIMEOUT:
        src, seg = band >> 32, band & 0xFFFFFFFF
        return (f"{what}: rank {rank}, tile {index}, source rank {src}, segment {seg}: "
                f"arrived rows={obs}, expected>={exp} after {el / 1e6:.1f} ms (the source's "
                "consumer did not run, timed out, refused after an error of its own, or its "
                "plan differs from the one this rank derived)")
    if code == ERR_EPOCH_MISMATCH:
        (e_src, f_src), (e_own, f_own) = split_call_tag(obs), split_call_tag(exp)
        if e_src == e_own:
            why = ("the same call count, another routing: a rank skipped a call and made the next "
                   "one, or the ranks planned from different counts")
        else:
            why = "a rank made a call the others did not, or was reset alone"
        return (f"{what}: rank {rank} is at epoch {e_own} (routing fingerprint {f_own:#010x}), "
                f"source rank {index} wrote this call's receive slot at its epoch {e_src} "
                f"(routing fingerprint {f_src:#010x}) ({why}); the slot was not read")
    if code == ERR_PLAN_BOUNDS:
        field = PLAN_FIELDS.get(band, f"field {band}")
        return (f"{what}: rank {rank}, entry {index}: {field}: value {obs}, bound {exp} "
                "(a plan built with validate=False or for another buffer); nothing was shipped "
                "from that entry on")
    if code == ERR_PRODUCER_BOUNDS:
        field = PRODUCER_FIELDS.get(band, f"field {band}")
        where = "num_bands" if index < 0 else f"schedule position {index}"
        return (f"{what}: rank {rank}, {where}: {field}: value {obs}, bound {exp} (a plan built "
                "with validate=False or for other buffers); the band was not computed and its "
                "flag never set (num_bands: no band was), the consumer stopped shipping at this "
                "error (the peers' scales time out) and this rank's scale writes NaN rows")
    if code == ERR_PEER_ERROR:
        peer = ERR_NAMES.get(obs, f"device error code {obs}")
        via = (" (itself one that saw another rank's error: that rank's own word names it)"
               if obs == ERR_PEER_ERROR else "")
        return (f"rank {rank} saw rank {index}'s error (code {obs}: {peer}){via} while waiting "
                f"at epoch {band} for its rows (arrival counter {exp}); it stopped waiting after "
                f"{el / 1e6:.1f} ms instead of at the timeout, and its scale writes NaN rows")
    if code == ERR_SCALE_BAD_ROW:
        where = "y row" if band else "receive-slot row"
        return (f"{what}: rank {rank}, assignment {index} (t * topk + k): {where} {obs} not in "
                f"[0, {exp}) (routes prepared for another plan/buffer, or validate=False input); "
                "its token's output row is NaN")
    return f"{what}: {list(err_host)}"
