"""CPU checks of the producer GEMM's device bounds (issue 21, validate=False plans): the error
code and its text, the host mirror of the kernel's per-band checks (``band_faults``), the torch
reference that skips what the kernel skips, and the wrapper's checks of its ``err`` / ``rank``
arguments. No GPU, no CuTe DSL."""
import pytest
import torch

from moe_overlap.combine.grouped_gemm import GroupedGemm, band_faults, grouped_gemm_reference
from moe_overlap.kernels import errors as E

i32 = dict(dtype=torch.int32)


def _tables(nb=4, cap=6, tile_m=4, experts=2):
    """A valid plan of nb bands of tile_m rows (band b: rows [b tile_m, (b + 1) tile_m), expert
    b % experts), scheduled in reverse, padded with -1 to cap."""
    be = torch.full((cap,), -1, **i32)
    bs = torch.full((cap,), -1, **i32)
    sched = torch.full((cap,), -1, **i32)
    be[:nb] = torch.arange(nb) % experts
    bs[:nb] = torch.arange(nb) * tile_m
    sched[:nb] = torch.arange(nb - 1, -1, -1)
    return be, bs, sched, torch.tensor([nb], **i32)


def test_producer_code_is_new_and_named():
    assert E.ERR_PRODUCER_BOUNDS not in (E.ERR_CONSUMER_TIMEOUT, E.ERR_SCALE_TIMEOUT,
                                         E.ERR_COPY_TIMEOUT, E.ERR_EPOCH_MISMATCH,
                                         E.ERR_PLAN_BOUNDS, E.ERR_SCALE_BAD_ROW)
    assert E.ERR_PRODUCER_BOUNDS in E.ERR_NAMES
    assert sorted(E.PRODUCER_FIELDS) == [E.PRF_NUM_BANDS, E.PRF_SCHEDULE, E.PRF_EXPERT,
                                         E.PRF_SRC_ROW, E.PRF_GROUP_FIRST,
                                         E.PRF_GROUP_END] == list(range(6))


@pytest.mark.parametrize("field,index,needle", [
    (E.PRF_NUM_BANDS, -1, "num_bands outside [0, band capacity]"),
    (E.PRF_SCHEDULE, 3, "schedule entry (band id) outside [0, num_bands)"),
    (E.PRF_EXPERT, 3, "band_expert outside [0, experts of w)"),
    (E.PRF_SRC_ROW, 3, "band_src_row")])
def test_describe_producer_error(field, index, needle):
    word = [E.ERR_PRODUCER_BOUNDS, 1, index, field, 900, 512, 0, 0]
    m = E.describe_error(word)
    assert m.startswith("producer GEMM refused a band entry outside its buffers: rank 1")
    assert needle in m and "value 900, bound 512" in m and "NaN" in m
    assert ("rank 1, num_bands:" in m) == (index < 0)
    assert ("schedule position 3" in m) == (index >= 0)


def test_band_faults_valid_plan_is_clean():
    be, bs, sched, nb = _tables()
    assert band_faults(be, bs, sched, nb, tile_m=4, x_rows=16, n_experts=2) == []
    # the last band ends exactly at the last row: still in bounds
    assert band_faults(be, bs, sched, nb, tile_m=4, x_rows=16, n_experts=2, y_rows=16) == []


@pytest.mark.parametrize("nb", [7, -1, 1 << 30])
def test_band_faults_num_bands_outside_capacity(nb):
    be, bs, sched, _ = _tables()
    f = band_faults(be, bs, sched, torch.tensor([nb], **i32), 4, 16, 2)
    assert f == [(-1, E.PRF_NUM_BANDS, nb, 6)]


def test_band_faults_num_bands_at_capacity_checks_the_padding():
    """num_bands == capacity is allowed as a count; the -1 padding it then covers fails per
    band (schedule entries outside [0, num_bands))."""
    be, bs, sched, _ = _tables()
    f = band_faults(be, bs, sched, torch.tensor([6], **i32), 4, 16, 2)
    assert f == [(4, E.PRF_SCHEDULE, -1, 6), (5, E.PRF_SCHEDULE, -1, 6)]


@pytest.mark.parametrize("table,i,v,want", [
    ("sched", 1, 4, (1, E.PRF_SCHEDULE, 4, 4)),  # schedule 3, 2, 1, 0: position 1 -> band 4
    ("sched", 0, -2, (0, E.PRF_SCHEDULE, -2, 4)),
    ("expert", 2, 2, (1, E.PRF_EXPERT, 2, 2)),  # band 2 is at position 1
    ("expert", 0, -1, (3, E.PRF_EXPERT, -1, 2)),
    ("rows", 3, 16, (0, E.PRF_SRC_ROW, 16, 16)),  # past x
    ("rows", 3, 13, (0, E.PRF_SRC_ROW, 13, 16)),  # its last rows past x, and misaligned
    ("rows", 3, -4, (0, E.PRF_SRC_ROW, -4, 16)),
    ("rows", 1, 2, (2, E.PRF_SRC_ROW, 2, 16))])  # inside x but not a multiple of tile_m
def test_band_faults_each_field(table, i, v, want):
    be, bs, sched, nb = _tables()
    {"sched": sched, "expert": be, "rows": bs}[table][i] = v
    assert band_faults(be, bs, sched, nb, 4, 16, 2) == [want]


def test_band_faults_priority_and_y_rows():
    be, bs, sched, nb = _tables()
    be[3], bs[3] = 5, 99  # band 3 (position 0): expert and rows bad: the expert is named
    assert band_faults(be, bs, sched, nb, 4, 16, 2) == [(0, E.PRF_EXPERT, 5, 2)]
    be, bs, sched, nb = _tables()
    # y shorter than x: rows are checked against both
    assert band_faults(be, bs, sched, nb, 4, 16, 2, y_rows=12) == [(0, E.PRF_SRC_ROW, 12, 12)]


def test_reference_skips_what_the_kernel_skips():
    tile_m = 4
    x = torch.randn(16, 8)
    w = torch.randn(2, 8, 6)
    be, bs, sched, nb = _tables(tile_m=tile_m)
    be[1] = 7  # band 1 (schedule position 2): expert outside w
    sched[0] = 9  # position 0 (band 3) replaced by an id outside [0, num_bands)
    y = torch.full((16, 6), float("nan"))
    ready = torch.zeros(6, **i32)
    grouped_gemm_reference(x, w, y, be, bs, sched, nb, tile_m, ready, torch.tensor([5], **i32))
    torch.testing.assert_close(y[0:4], x[0:4] @ w[0])  # band 0
    torch.testing.assert_close(y[8:12], x[8:12] @ w[0])  # band 2
    assert torch.isnan(y[4:8]).all() and torch.isnan(y[12:16]).all()  # bands 1, 3: skipped
    assert ready.tolist() == [5, 0, 5, 0, 0, 0]
    # num_bands outside the tables: nothing computed, no flag
    y = torch.full((16, 6), float("nan"))
    ready.zero_()
    grouped_gemm_reference(x, w, y, *_tables(tile_m=tile_m)[:3], torch.tensor([7], **i32),
                           tile_m, ready, torch.tensor([5], **i32))
    assert torch.isnan(y).all() and not ready.any()


def test_wrapper_checks_err_and_rank_before_launch():
    g = GroupedGemm(tile_m=128, tile_n=256)
    x = torch.zeros(256, 512, dtype=torch.bfloat16)
    w = torch.zeros(2, 512, 1024, dtype=torch.bfloat16)
    y = torch.zeros(256, 1024, dtype=torch.bfloat16)
    v = torch.zeros(4, **i32)
    one = torch.zeros(1, **i32)
    args = [x, w, y, v, v, v, one, v, one]
    chk = lambda **k: g._check(*args, band_counter=None, ccta=0, need_cuda=False, **k)
    chk()
    chk(err=torch.zeros(E.ERR_WORDS, dtype=torch.int64), rank=3)
    for bad in (torch.zeros(E.ERR_WORDS, dtype=torch.int32), torch.zeros(4, dtype=torch.int64),
                torch.zeros(2 * E.ERR_WORDS, dtype=torch.int64)[::2], "err"):
        with pytest.raises(ValueError, match="err must be"):
            chk(err=bad)
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="rank"):
            chk(rank=bad)
