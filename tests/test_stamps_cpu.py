"""The device stamps' host side (moe_overlap/kernels/stamps.py) on the CPU: the reference's rows
per call (the first stamp advances the count, a ring of ``rows``), ``last_calls`` giving the
last calls oldest first and refusing calls it no longer holds, and the clock-step estimate."""
import pytest
import torch

from moe_overlap.kernels import stamps as S


def _cpu_stamps(monkeypatch, rows, slots, clock):
    """A DeviceStamps on the CPU whose kernel is the reference reading clock()."""
    monkeypatch.setattr(S.DeviceStamps, "stamp", lambda self, slot, first=False, stream=None:
                        S.stamp_reference(self.table, self.counter, slot, first, clock()))
    return S.DeviceStamps(rows, slots, "cpu")


def test_calls_land_in_a_ring_and_the_last_ones_come_back_in_order(monkeypatch):
    t = iter(range(100, 10**6, 7))
    st = _cpu_stamps(monkeypatch, 3, 2, lambda: next(t))
    for _ in range(5):  # calls 1..5 into rows 0, 1, 2, 0, 1
        st.stamp(0, first=True)
        st.stamp(1)
    assert st.calls() == 5
    last = st.last_calls(3)  # calls 3, 4, 5
    assert last.tolist() == [[128, 135], [142, 149], [156, 163]]
    assert st.last_calls(1).tolist() == [[156, 163]]
    for n in (0, 4):  # nothing asked, or call 2 (overwritten by call 5)
        with pytest.raises(ValueError):
            st.last_calls(n)


def test_a_slot_outside_the_table_is_refused_before_any_launch():
    st = S.DeviceStamps(2, 3, "cpu")
    for slot in (-1, 3):
        with pytest.raises(ValueError):
            st.stamp(slot)
    with pytest.raises(ValueError):
        S.DeviceStamps(0, 3, "cpu")


def test_a_stamp_before_any_first_lands_in_the_last_row_and_counts_no_call(monkeypatch):
    st = _cpu_stamps(monkeypatch, 4, 1, lambda: 5)
    st.stamp(0)
    assert st.calls() == 0 and st.table[:, 0].tolist() == [0, 0, 0, 5]
    with pytest.raises(ValueError):
        st.last_calls(1)


def test_timer_step_is_the_gcd_of_the_differences():
    assert S.timer_step_ns([1000, 3000, 0, 6000, 3000]) == 1000  # zeros (unstamped) ignored
    assert S.timer_step_ns([10**12 + 32 * k for k in (0, 3, 7, 8)]) == 32
    assert S.timer_step_ns([5, 5, 0]) is None
    assert S.timer_step_ns(torch.tensor([2048, 4096, 5120]).tolist()) == 1024
