"""The device stamp kernel (moe_overlap/kernels/stamps.py) compiled for sm_90a (no GPU needed):
one thread, the timer read before any memory access (the stamp is the moment the kernel runs,
not after its loads), one 64-bit store of it, the call counter stored only on a call's first
stamp. Then its PTX run on the host (tests/ptx_emulator.py, whose %globaltimer advances per
read) over a sequence of stamps, first and not, across the ring's wrap: table and counter equal
``stamp_reference`` fed the same clock values."""
import os
import re

import pytest
import torch

pytestmark = pytest.mark.compile

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is imported (read at import)
cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

from conftest import compile_ptx, ptx_body  # noqa: E402
from ptx_emulator import Emulator  # noqa: E402
from moe_overlap.kernels.stamps import (build_stamp, stamp_example_args,  # noqa: E402
                                        stamp_reference)

_PTX = []


def _ptx():
    if not _PTX:
        _PTX.append(compile_ptx(build_stamp(), *stamp_example_args()))
    return _PTX[0]


def test_one_thread_reads_the_timer_first_and_stores_it():
    body = ptx_body(_ptx())
    assert re.search(r"\.reqntid\s+1,\s*1,\s*1", body)
    timer = body.index("%globaltimer")
    loads = [m.start() for m in re.finditer(r"\bld\.global", body)]
    stores = [m.start() for m in re.finditer(r"\bst\.global", body)]
    assert loads and timer < loads[0] and timer < stores[0]
    s64 = [m for m in re.finditer(r"st\.global\.s64 \[[^\]]+\], (%rd\d+);", body)]
    assert len(s64) == 1  # the stamp, once
    reg = re.search(r"mov\.u64\s+(%rd\d+), %globaltimer;", body).group(1)
    assert s64[0].group(1) == reg  # the timer's value, not a value derived from it
    s32 = [m.start() for m in re.finditer(r"st\.global\.s32", body)]
    assert len(s32) == 1  # the counter, behind the first-stamp branch
    branch = re.search(r"@%p\d+ bra", body)
    assert branch and branch.start() < s32[0]
    assert ".local" not in body and not re.search(r"\bcall", body)


def test_emulated_stamps_equal_the_reference():
    rows, slots = 3, 3
    base, step = 0x1000, 1000
    emu = Emulator(_ptx(), global_bytes=base + 4096, timer_step_ns=step,
                   valid=[(base, base + rows * slots * 8), (base + 2048, base + 2052)])
    table_addr, counter_addr = base, base + 2048
    emu.write_words(table_addr, [0] * (rows * slots), bits=64)
    emu.write_words(counter_addr, [0], bits=32)
    table = torch.zeros(rows, slots, dtype=torch.int64)
    counter = torch.zeros(1, dtype=torch.int32)
    # five calls (the ring of three wraps): start first, then the two ends in either order
    seq = []
    for call in range(5):
        seq += [(0, True)] + ([(2, False), (1, False)] if call % 2 else [(1, False), (2, False)])
    for slot, first in seq:
        emu.launch(1, 1, [table_addr, counter_addr, rows, slots, slot, int(first)])
        stamp_reference(table, counter, slot, first, emu.clock)  # the value the kernel read
    assert emu.read_words(counter_addr, 1, bits=32) == counter.tolist() == [5]
    got = emu.read_words(table_addr, rows * slots, bits=64)
    assert got == table.reshape(-1).tolist()
    # call 5 (row 1) and call 4 (row 0) are the last two: their stamps increase within a call
    last = torch.tensor(got).view(rows, slots)
    assert last[1, 0] < last[1, 1] < last[1, 2] and last[0, 0] < last[0, 2] < last[0, 1]
