"""CPU checks of the device counts exchange's host side (combine/counts_exchange.py,
CommBuffer's counts table, exchange_counts(comm_buffer=), MoEDispatch.exchange_counts): the
table is sized by counts_table_words and allocated zeroed at attach (the most experts of any
layer; a larger E grows it with the buffer, collectively), reset() zeroes it and the exchange's
epoch (a flag left from before would pass the restarted epoch), heap_report counts it as the
CommBuffer allocates it, and the checks before any launch: no table, a table too small, counts of
another dtype, a buffer of another group. Symmetric memory: tests/fake_symmetric.py. The kernels
themselves: tests/test_counts_exchange_emulated.py (emulated ranks) and
tests/test_counts_exchange_gpu.py."""
import pytest
import torch

from fake_symmetric import fake_runtime
from moe_overlap.combine import exchange_counts
from moe_overlap.combine.comm_buffer import CommBuffer, CommBufferError, LayerShape, heap_report
from moe_overlap.combine.counts_exchange import counts_table_bytes, counts_table_words


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(CommBuffer, "_shared", {})


class _Layer:
    def _clear_band_flags(self):
        pass


def _buffer(monkeypatch, log=None):
    rt = fake_runtime(monkeypatch, log)
    return CommBuffer(None, "nvlink", runtime=rt), rt


def test_table_words_are_two_parities_of_flags_and_rows():
    assert counts_table_words(4, 8) == 2 * 4 + 2 * 4 * 8
    assert counts_table_bytes(2, 3) == 8 * (2 * 2 + 2 * 2 * 3)


def test_attach_allocates_the_table_zeroed_and_a_larger_e_grows_it(monkeypatch):
    log = []
    buf, rt = _buffer(monkeypatch, log)
    buf.attach(_Layer(), 8, 32)  # a layer without a counts exchange: no table
    assert buf.counts_table is None and buf.counts_experts == 0
    W = rt.world_size
    buf.attach(_Layer(), 8, 32, counts_experts=6)  # grows: the table is part of the memory
    assert buf.growths == 1 and buf.counts_experts == 6
    assert buf.counts_table.numel() == counts_table_words(W, 6) and not buf.counts_table.any()
    assert buf.counts_peers.numel() == W
    assert buf.counts_peers[rt.rank] == buf.counts_table.data_ptr()
    assert rt.allocated_bytes() == buf.heap_bytes()
    buf.counts_table.fill_(7)
    buf.counts_epoch.fill_(5)
    log.clear()
    buf.attach(_Layer(), 8, 32, counts_experts=4)  # fits: nothing allocated
    assert [e for e in log if e != "barrier"] == []
    buf.attach(_Layer(), 8, 32, counts_experts=10)
    assert buf.growths == 2 and buf.counts_table.numel() == counts_table_words(W, 10)
    assert not buf.counts_table.any()  # new flags 0: below any next epoch
    assert int(buf.counts_epoch) == 5  # kept, as the combine's epoch
    assert rt.allocated_bytes() == buf.heap_bytes()  # the old table was freed


def test_reset_zeroes_the_table_and_its_epoch(monkeypatch):
    buf, _ = _buffer(monkeypatch)
    buf.attach(_Layer(), 8, 32, counts_experts=4)
    buf.counts_table.fill_(3)
    buf.counts_epoch.fill_(3)
    buf.reset()
    assert not buf.counts_table.any() and int(buf.counts_epoch) == 0


def test_heap_report_counts_the_table_as_the_buffer_allocates_it(monkeypatch):
    buf, rt = _buffer(monkeypatch)
    W = rt.world_size
    buf.attach(_Layer(), 16, 64 * 2, counts_experts=8)
    r = heap_report([LayerShape(16, 1, 64, counts_experts=8), LayerShape(4, 1, 64,
                                                                           counts_experts=2)], W)
    assert r["counts_bytes"] == counts_table_bytes(W, 8)
    assert r["shared_bytes"] == buf.heap_bytes()
    assert heap_report([(16, 1, 64)], W)["counts_bytes"] == 0
    with pytest.raises(ValueError, match="counts_experts=-1"):
        heap_report([LayerShape(16, 1, 64, counts_experts=-1)], W)


def test_exchange_refuses_before_any_launch(monkeypatch):
    buf, _ = _buffer(monkeypatch)
    counts = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(CommBufferError, match="counts table of 0 experts.*needs 4"):
        buf.exchange_counts(counts)
    buf.attach(_Layer(), 8, 32, counts_experts=2)
    with pytest.raises(CommBufferError, match="counts table of 2 experts.*needs 4"):
        buf.exchange_counts(counts)
    with pytest.raises(ValueError, match="int64"):
        buf.exchange_counts(counts.to(torch.int32))
    with pytest.raises(ValueError, match="CommBuffer of this process group"):
        exchange_counts(torch.zeros(3, 2, dtype=torch.int64), 4, group=object(),
                        validate=False, comm_buffer=buf)
