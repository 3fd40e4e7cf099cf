"""CPU smoke test of bench/bench_plan.py (--device cpu): it runs the planner, prepare and the
ordered scale's device tables (the GPU timing's code path), writes its JSON, and its check of
the ordered tables against the host reference catches a wrong table."""
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "bench"))

import bench_plan as BP  # noqa: E402


def _doc(tmp_path):
    (f,) = os.listdir(tmp_path)
    assert f == "plan_cpu_smoke.json"
    return json.load(open(tmp_path / f))


def test_smoke_run_writes_plan_and_ordered_rows(tmp_path):
    BP.main(["--device", "cpu", "--out", str(tmp_path), "--order", "remote_first", "expert"])
    doc = _doc(tmp_path)
    assert doc["device"] == "cpu" and "smoke" in doc["method"] and doc["impls"] == ["torch"]
    assert len(doc["rows"]) == len(BP.SMOKE_CASES) * 2 * 3 * 2  # orders x layouts x capacities
    o = doc["ordered_rows"]
    assert [(r["world_size"], r["order"]) for r in o] == [
        (W, order) for W, *_ in BP.SMOKE_CASES for order in ("remote_first", "expert")]
    assert all(r["equal_to_reference"] and r["ordered_us"] > 0 for r in o)


def test_ordered_only_and_the_last_rank(tmp_path):
    BP.main(["--device", "cpu", "--out", str(tmp_path), "--what", "ordered", "--rank", "-1"])
    doc = _doc(tmp_path)
    assert doc["rows"] == [] and doc["what"] == ["ordered"]
    assert [r["rank"] for r in doc["ordered_rows"]] == [W - 1 for W, *_ in BP.SMOKE_CASES]
    assert BP.ORDERED_WORLDS == (2, 8, 64)
    assert {W for W, *_ in BP.CASES} >= set(BP.ORDERED_WORLDS)  # the model shapes it times


def test_a_wrong_ordered_table_fails_the_run(tmp_path, monkeypatch):
    good = BP.ordered_fn

    def broken(ids, counts, plan, impl, rows=None):
        fn = good(ids, counts, plan, impl, rows)

        def run():
            o = fn()
            o.tables["order"] = o.tables["order"].flip(0)  # a valid permutation, not the order
            return o
        return run
    monkeypatch.setattr(BP, "ordered_fn", broken)
    with pytest.raises(SystemExit, match="differs from the host reference"):
        BP.main(["--device", "cpu", "--out", str(tmp_path), "--what", "ordered"])
    assert not any(r["equal_to_reference"] for r in _doc(tmp_path)["ordered_rows"])


def test_arguments_are_checked():
    for bad in (["--what", "scale"], ["--device", "gpu"], ["--impl", "cuda"]):
        with pytest.raises(SystemExit) as e:
            BP.main(bad)
        assert e.value.code == 2
