"""ccta/mgb choice: the analytic model's properties and the autotune cache."""
import pytest

from moe_overlap.combine.tuning import (CostModel, TuneCache, analytic_choice, coordinate_search,
                                predict, shape_key)


def test_more_remote_bytes_need_no_fewer_consumer_sms():
    choices = [analytic_choice(16384, remote, 8192, 2048)[0]
               for remote in (0, 2048, 8192, 16384)]
    assert choices == sorted(choices)
    assert choices[-1] > choices[0]


def test_predicted_overlap_is_at_least_each_part():
    p = predict(CostModel(), 16384, 8192, 8192, 2048, 128, ccta=16, mgb=2)
    assert p["t_overlap"] >= max(p["t_gemm"], p["t_comm"])


def test_gemm_time_grows_as_sms_are_reserved():
    m = CostModel()
    assert m.gemm_s(1e12, 24) > m.gemm_s(1e12, 8) > m.gemm_s(1e12, 0)
    assert m.gemm_s(1e12, 0) == pytest.approx(1e12 / (m.gemm_tflops * 1e12))


def test_copy_bandwidth_interpolates_and_caps_at_the_link():
    m = CostModel(copy_gbps={4: 100.0, 16: 300.0, 32: 500.0}, link_gbps=380.0)
    assert m.copy_bw(16) == pytest.approx(300e9)
    assert m.copy_bw(10) == pytest.approx(200e9)
    assert m.copy_bw(2) == pytest.approx(50e9)
    assert m.copy_bw(128) == pytest.approx(380e9)  # capped at the link


def test_coordinate_search_scans_ccta_then_mgb():
    calls = []

    def fake_time(c, m):  # best at ccta 24 (not a neighbour of the first guess), mgb 2
        calls.append((c, m))
        return abs(c - 24) + abs(m - 2) * 0.5 + (0.1 if c == 4 else 0)

    best, times = coordinate_search(fake_time, (8, 1))
    assert best == (24, 2)
    assert {c for c, m in calls if m == 1} == {4, 8, 12, 16, 20, 24, 32}
    assert {(24, 2), (24, 4)} <= set(calls) and len(calls) == len(set(calls)) == 9
    assert times[best] == min(times.values())


def test_tune_cache_round_trip(tmp_path):
    key = shape_key("H200", 2, 8192, 2048, 16, 128, 16000)
    cache = TuneCache(str(tmp_path / "t.json"))
    assert cache.get(key) is None
    cache.put(key, 24, 2, ms=1.0)
    assert TuneCache(str(tmp_path / "t.json")).get(key) == (24, 2)


def test_shape_key_buckets_rows_by_power_of_two():
    assert shape_key("d", 2, 1, 1, 1, 128, 9000) == shape_key("d", 2, 1, 1, 1, 128, 16384)
    assert shape_key("d", 2, 1, 1, 1, 128, 9000) != shape_key("d", 2, 1, 1, 1, 128, 17000)
