"""The pure parts of bench/bench_producer_models.py (issue 36's producer measurement), on the CPU:
its points, the skewed routings' property, the options it times (the library's resolution), the
goal evaluation, the run's verdict and the result's name and fields."""
import json
import math

import pytest

from conftest import load_bench
from moe_overlap.combine.shapes import MODELS
from moe_overlap.combine.tuning import TuneCache

B = load_bench("bench_producer_models")


def test_points_cover_every_model_tokens_world_and_routing():
    points, skipped = B.make_points()
    labels = [p["label"] for p in points]
    assert len(labels) == len(set(labels))
    want = {(m, T, W, r) for m in MODELS for T in (4096, 16384) for W in (1, 2, 8, 16)
            for r in ("balanced", "skewed")}
    got = {(p["model"], p["tokens"], p["world_size"], p["routing"]) for p in points}
    bad = {w for w in want if MODELS[w[0]][0] % w[2]}
    assert got == want - bad and len(bad) == 4  # mixtral's 8 experts over 16 ranks
    assert sorted(skipped) == sorted(B.point_label(dict(model=m, tokens=T, world_size=W,
                                                        routing=r)) for m, T, W, r in bad)
    for p in points:
        E, topk, K, N = MODELS[p["model"]]
        assert (p["E"], p["topk"], p["K"], p["N"]) == (E, topk, K, N)
    sel = B.select_points(points, "deepseek-v3@4096/*", "*/W16/*")
    assert {(p["world_size"], p["routing"]) for p in sel} == {
        (W, r) for W in (1, 2, 8) for r in ("balanced", "skewed")}
    assert all(p["model"] == "deepseek-v3" and p["tokens"] == 4096 for p in sel)
    assert B.select_points(points, "", "") == points


@pytest.mark.parametrize("model", sorted(MODELS))
def test_skewed_routing_puts_a_3x_expert_on_rank_0(model):
    E = MODELS[model][0]
    w_max = max(w for w in B.WORLDS if E % w == 0)
    counts, info = B.routing_counts_for(model, 256, "skewed", w_max)
    assert tuple(counts.shape) == (w_max, E)
    loads = counts.sum(0)
    assert info["skew"] == pytest.approx(float(loads.max() / loads.float().mean()))
    assert info["skew"] >= 3.0, info
    assert int(loads.argmax()) < E // w_max, info  # rank 0 owns it at every W
    bal, binfo = B.routing_counts_for(model, 256, "balanced", w_max)
    assert binfo["skew"] < 1.5, binfo
    assert int(bal.sum()) == int(counts.sum()) == w_max * 256 * MODELS[model][1]


def test_ours_are_the_options_the_library_resolves(tmp_path):
    cache = TuneCache(str(tmp_path / "t.json"))
    points, _ = B.make_points(models=["qwen3-235b-a22b"], tokens=[4096], routings=["skewed"])
    default = B.parse_variants("default")[0]
    by_w = {p["world_size"]: B.resolve(p, default, 132, "FakeGPU", cache) for p in points}
    assert by_w[1][1].ccta == 0  # one rank: no consumer, every SM
    assert all(1 <= by_w[w][1].ccta < 132 for w in (2, 8, 16))
    assert not any(t for _, _, t, _ in by_w.values())
    assert all(tm == 128 for *_, tm in by_w.values())  # MoECombine's default band height
    expert = B.parse_variants("order=expert+band_group=4")[0]
    req, got, _, _ = B.resolve(points[1], expert, 132, "FakeGPU", cache)
    assert got.order == "expert" and dict(got.gemm_options) == {"band_group": 4}
    cache.put(req.tune_key(B.CombineFacts(
        world_size=2, hidden_size=1536, out_features=4096, experts_per_rank=64, tile_m=128,
        rows=4096 * 8, device_name="FakeGPU", num_sms=132)), 20, 4)
    _, tuned, hit, _ = B.resolve(points[1], expert, 132, "FakeGPU", TuneCache(cache.path))
    assert hit and (tuned.ccta, tuned.mgb) == (20, 4)


def test_variants_and_options_parse_and_bad_ones_stop_before_the_gpu(tmp_path):
    vs = B.parse_variants("default,band_group=2+cluster_n=1,ccta=12+order=expert",
                          {"band_group": 4})
    assert [v["name"] for v in vs] == ["default", "band_group=2+cluster_n=1",
                                       "ccta=12+order=expert"]
    assert vs[0] == dict(name="default", options={}, gemm_options={"band_group": 4}, tile_m=128)
    assert vs[1]["gemm_options"] == {"band_group": 2, "cluster_n": 1} and not vs[1]["options"]
    assert vs[2]["options"] == {"ccta": 12, "order": "expert"}
    small = B.parse_variants("tile_m=64+band_group=2")[0]  # the layer's band height, not a
    assert small["tile_m"] == 64 and small["gemm_options"] == {"band_group": 2}  # GEMM keyword
    assert B.resolve(B.make_points(models=["qwen3-30b-a3b"], tokens=[4096], worlds=[1],
                                   routings=["skewed"])[0][0], small, 132, "FakeGPU",
                     TuneCache(str(tmp_path / "u.json")))[3] == 64
    for bad in ("default,default", "band_group", "", "tile_m=96"):
        with pytest.raises(ValueError):
            B.parse_variants(bad)
    with pytest.raises(SystemExit) as e:  # an option the GEMM does not have
        B.main(["--variants", "default,no_such_option=3", "--out", "unused"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        B.main(["--points", "nothing-matches*", "--out", "unused"])


def test_goal_evaluation():
    assert B.scaled_ratio(0.9, 132, 8) == pytest.approx(0.9 * 132 / 124)
    assert B.scaled_ratio(0.9, 132, 0) == 0.9
    ok = B.evaluate_goals({"a": 0.96, "b": 1.2})
    assert ok["met"] and ok["every_point"] and ok["geomean"] and ok["below"] == []
    assert ok["geomean_scaled"] == pytest.approx(math.sqrt(0.96 * 1.2))
    one_low = B.evaluate_goals({"a": 0.94, "b": 2.0})
    assert not one_low["met"] and one_low["below"] == ["a"] and one_low["geomean"]
    low_mean = B.evaluate_goals({"a": 0.96, "b": 0.99})
    assert not low_mean["met"] and low_mean["every_point"] and not low_mean["geomean"]
    assert not B.evaluate_goals({"a": float("nan")})["met"]
    assert not B.evaluate_goals({})["met"]


def _doc(ratios, correct=True, variants=("default",)):
    points, _ = B.make_points(models=["qwen3-30b-a3b"], tokens=[4096], worlds=[1, 8],
                              routings=["skewed"])
    doc = dict(variants=[dict(name=v, options={}, gemm_options={}) for v in variants],
               points=[])
    for p, rs in zip(points, ratios):
        doc["points"].append(dict(p, correct=correct, variants={
            v: dict(scaled_ratio=r, ratio=r, ccta=0) for v, r in zip(variants, rs)}))
    return doc


def test_run_verdict_and_json_fields():
    doc = B.summarize(_doc([(1.0,), (1.05,)]))
    assert not doc["failed"] and doc["all_correct"] and doc["ours_variant"] == "default"
    json.dumps(doc)  # the result is JSON as it stands
    assert B.summarize(_doc([(1.0,), (1.05,)], correct=False))["failed"]  # wrong output
    # the launch MoECombine makes misses the goal: failed, whatever another variant does
    two = B.summarize(_doc([(0.9, 1.2), (1.1, 1.2)], variants=("default", "band_group=2")))
    assert two["failed"] and two["goals"]["band_group=2"]["met"]
    assert not two["goals"]["default"]["met"] and two["goals"]["default"]["below"] == [
        two["points"][0]["label"]]
    first = B.summarize(_doc([(1.2, 0.5), (1.2, 0.5)], variants=("band_group=2", "x=1")))
    assert first["ours_variant"] == "band_group=2" and not first["failed"]
    assert B.card_of("NVIDIA H100 80GB HBM3") == "h100"
    assert B.card_of("NVIDIA H200") == "h200"
    assert B.result_name("NVIDIA H200", "abc1234") == "producer_models_h200_abc1234.json"
    assert B.result_name("NVIDIA H100 80GB HBM3", "abc1234", "t4096") == \
        "producer_models_h100_abc1234_t4096.json"


def gpu_stand_ins(monkeypatch, bench, kernel=None):
    """A bench's CUDA parts swapped for plain CPU calls: the grouped GEMM's launch by
    ``kernel`` (default: ``grouped_gemm_reference``, which sets the flags the kernel sets),
    ``bench.DEVICE`` by "cpu", CUDA graphs by plain calls, synchronize by a no-op and the
    device by one of 132 SMs. The clock stays each test's own."""
    import torch
    from types import SimpleNamespace
    from moe_overlap.combine import grouped_gemm as gg

    def reference_call(self, x, w, y, be, bs, sched, nb, ready, epoch, ccta=0, err=None, **kw):
        return gg.grouped_gemm_reference(x, w, y, be, bs, sched, nb, self.tile_m,
                                         band_ready=ready if self.signal else None, epoch=epoch)
    monkeypatch.setattr(gg.GroupedGemm, "__call__", kernel or reference_call)
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr("moe_overlap.timing.graphed", lambda fn: SimpleNamespace(replay=fn))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda *a: SimpleNamespace(multi_processor_count=132))


def test_one_point_on_the_cpu_with_stand_ins(monkeypatch):
    """run_point end to end on the CPU: the producer kernel replaced by its torch reference
    (``grouped_gemm_reference``, which sets the flags the kernel sets), CUDA graphs and the
    clock by plain calls and fixed times. Checks what a record holds: both baselines, each
    variant's resolved options, plan and GEMM options, correctness fields, the ratios."""
    from moe_overlap import timing
    from moe_overlap.routing import routing_counts
    gpu_stand_ins(monkeypatch, B)
    ms = {"base:grouped_mm": 2.0, "base:mm_loop": 1.0, "default": 1.25, "band_group=2": 0.8,
          "tile_m=64": 1.1}

    def fake_time(fns, rounds, **kw):
        for f in fns.values():
            f()
        return {k: dict(median_ms=ms[k], p10_ms=ms[k], p90_ms=ms[k], times=[ms[k]] * rounds)
                for k in fns}
    monkeypatch.setattr(timing, "time_interleaved", fake_time)
    point = dict(model="tiny", tokens=96, world_size=2, routing="skewed", E=8, topk=2, K=64,
                 N=256, label="tiny@96/W2/skewed")
    counts = routing_counts(2, 96, 8, 2, "moderate_skew", 1)
    cache = TuneCache("/nonexistent/moe-overlap-test/tune.json")  # read only, empty
    variants = B.parse_variants("default,band_group=2,tile_m=64")
    resolved = {v["name"]: B.resolve(point, v, 132, "FakeGPU", cache) for v in variants}
    rec = B.run_point(point, counts, resolved, rounds=3, seed=0)
    small = rec["variants"]["tile_m=64"]  # 64-row bands: its own plan, less padding
    assert small["gemm"]["tile_m"] == 64 and small["flags_ok"]
    assert rec["valid_rows"] <= small["plan_rows"] <= rec["variants"]["default"]["plan_rows"]
    assert small["plan_rows"] % 64 == 0 and small["bands"] * 64 == small["plan_rows"]
    json.dumps(rec)
    assert rec["correct"], rec
    assert rec["valid_rows"] == int(counts[:, :4].sum())
    assert rec["base"] == "mm_loop" and rec["base_ms"] == 1.0
    d, g = rec["variants"]["default"], rec["variants"]["band_group=2"]
    assert d["ccta"] == resolved["default"][1].ccta >= 1  # W = 2: a consumer beside it
    assert d["gemm"]["cluster_n"] == 1 and d["gemm"]["signal"] and d["flags_ok"]
    assert g["gemm"]["band_group"] == 2 and g["bitwise_vs_first_variant"]
    assert d["grid"] == 132 - d["ccta"]
    assert d["ratio"] == pytest.approx(1.0 / 1.25)
    assert d["scaled_ratio"] == pytest.approx(0.8 * 132 / (132 - d["ccta"]))
    assert d["plan_rows"] >= rec["valid_rows"] and d["padding"] >= 1.0
    # W = 1: no consumer, every SM, no flags written (the ready words stay 0)
    one = dict(point, world_size=1, label="tiny@96/W1/skewed")
    res1 = {v["name"]: B.resolve(one, v, 132, "FakeGPU", cache) for v in variants}
    r1 = B.run_point(one, counts, res1, rounds=3, seed=0)
    d1 = r1["variants"]["default"]
    assert r1["correct"] and d1["ccta"] == 0 and d1["grid"] == 132, d1
    assert not d1["gemm"]["signal"] and d1["flags_ok"]
    assert d1["scaled_ratio"] == d1["ratio"]


def _stamp_clock(n, slot):
    """The stand-in device clock (ns) of call n's stamp in ``slot``: call n starts at 1e12 +
    n x 100 ms; its producer takes n ms, its consumer ends 0.5 ms after that."""
    start = 10**12 + n * 10**8
    return {B.STAMP_START: start, B.STAMP_PRODUCER_END: start + n * 10**6,
            B.STAMP_CONSUMER_END: start + n * 10**6 + 5 * 10**5}[slot]


def _cpu_stand_ins(monkeypatch, ms, clock=_stamp_clock):
    """The producer kernel by its torch reference, graphs by plain calls, the event clock by
    the fixed times ``ms`` (keys: timing names; each fn called 3 warm-up times then once per
    round, as time_interleaved does), the stamp kernel by ``stamp_reference`` reading
    ``clock(call number, slot)``, streams by no-ops."""
    import contextlib
    import torch
    from types import SimpleNamespace
    from moe_overlap import timing
    from moe_overlap.kernels import stamps as st

    def reference_stamp(self, slot, first=False, stream=None):
        n = int(self.counter[0]) + (1 if first else 0)
        st.stamp_reference(self.table, self.counter, slot, first, clock(n, slot))
    monkeypatch.setattr(st.DeviceStamps, "stamp", reference_stamp)

    gpu_stand_ins(monkeypatch, B)
    no_stream = SimpleNamespace(wait_stream=lambda s: None)
    monkeypatch.setattr(B, "side_stream", lambda dev: no_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: no_stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    called = []

    def fake_time(fns, rounds, warmup=3, **kw):
        for _ in range(warmup + rounds):
            for f in fns.values():
                f()
        called.append(sorted(fns))
        return {k: dict(median_ms=ms[k], p10_ms=ms[k], p90_ms=ms[k], times=[ms[k]] * rounds)
                for k in fns}
    monkeypatch.setattr(timing, "time_interleaved", fake_time)
    return called


def _reference_consumer(monkeypatch, plant=None):
    """Consumer.launch replaced by a plain shipper (the loopback buffers found through the
    bench's loopback_comm_buffer): each valid segment whose bands' flags equal the epoch goes
    to its destination's slot, with its arrival, the call marker and the tag, as the kernel
    does. plant="row": the first segment's first row arrives wrong."""
    from moe_overlap.combine import consumer as C
    from moe_overlap.combine import loopback as L
    from moe_overlap.kernels.errors import call_tag, epoch_tag_word
    bufs, launches = [], []
    make = L.loopback_comm_buffer

    def recording(*a, **k):
        bufs.append(make(*a, **k))
        return bufs[-1]
    monkeypatch.setattr(L, "loopback_comm_buffer", recording)

    def launch(self, *, y, plan, band_ready, epoch, recv_peers, ctr_peers, recv_sym, ctr_sym,
               err, ccta, slot_bytes, piece_rows=0, stream=None):
        buf = next(b for b in bufs if b.buffers.recv_peers is recv_peers)
        cp = L.loopback_copies(buf)
        W, rank, e, n_w = plan.world_size, plan.rank, int(epoch[0]), y.shape[1]
        launches.append(dict(ccta=ccta, piece_rows=piece_rows, epoch=e, copy=self.copy))
        rows = slot_bytes // (2 * n_w)
        for d in range(W):
            cp["block"][d][epoch_tag_word(W, e & 1, rank)] = call_tag(
                e, int(plan.counts_fingerprint[0]))
            cp["block"][d][rank] += 1
        for s in range(int(plan.num_segments[0])):
            a, nb = int(plan.segment_start[s]), int(plan.segment_bands[s])
            assert all(int(band_ready[int(b)]) == e for b in plan.schedule[a:a + nb])
            d, src, dst, n = (int(t[s]) for t in (plan.segment_dest, plan.segment_src_row,
                                                   plan.segment_dest_row, plan.segment_rows))
            slot = cp["recv"][d][(e & 1) * rows * n_w:((e & 1) + 1) * rows * n_w].view(rows, n_w)
            slot[dst:dst + n] = y[src:src + n]
            if plant == "row" and s == 0:
                slot[dst] = y[src] + 1
            cp["block"][d][rank] += n
    monkeypatch.setattr(C.Consumer, "launch", launch)
    return launches


def _tiny():
    from moe_overlap.routing import routing_counts
    point = dict(model="tiny", tokens=96, world_size=2, routing="skewed", E=8, topk=2, K=64,
                 N=256, label="tiny@96/W2/skewed")
    return point, routing_counts(2, 96, 8, 2, "moderate_skew", 1)


@pytest.mark.parametrize("plant", [None, "row"])
def test_one_point_beside_the_consumer_on_the_cpu(monkeypatch, plant):
    """--beside consumer end to end on the CPU, the consumer kernel replaced by a plain
    shipper: per variant of ccta > 0 a call of the combine's order into loopback peers,
    checked (rows, counters, tags, flags, error word), timed under its own key; a planted
    wrong row makes the point wrong. W = 1 (ccta 0): nothing beside, nothing timed."""
    ms = {"base:grouped_mm": 2.0, "base:mm_loop": 1.0, "default": 1.25, "cluster_n=2": 1.2,
          "default" + B.BESIDE_KEY: 1.5, "cluster_n=2" + B.BESIDE_KEY: 1.8}
    called = _cpu_stand_ins(monkeypatch, ms)
    launches = _reference_consumer(monkeypatch, plant)
    point, counts = _tiny()
    cache = TuneCache("/nonexistent/moe-overlap-test/tune.json")  # read only, empty
    variants = B.parse_variants("default,cluster_n=2")
    resolved = {v["name"]: B.resolve(point, v, 132, "FakeGPU", cache) for v in variants}
    rec = B.run_point(point, counts, resolved, rounds=3, seed=0, beside="consumer")
    json.dumps(rec)
    assert called[-1] == sorted(ms)  # both launches of both variants in the same rounds
    d, c2 = rec["variants"]["default"], rec["variants"]["cluster_n=2"]
    assert d["gemm"]["cluster_n"] == 1 and c2["gemm"]["cluster_n"] == 2
    ccta, pr = resolved["default"][1].ccta, resolved["default"][1].consumer_piece_rows
    # the resolved ccta and piece rows, a new epoch per call (warm-up, check, graph warm-up..)
    assert all(x["ccta"] == ccta and x["piece_rows"] == pr and x["copy"] == "tma"
               for x in launches)
    epochs = [x["epoch"] for x in launches]
    assert epochs == sorted(set(epochs))
    chk = d["beside_consumer_check"]
    assert chk["shipped_rows"] == int(counts[1, :4].sum()) > 0  # rank 1's rows of rank 0
    assert chk["consumer"]["ccta"] == ccta and chk["flags_ok"]
    assert rec["beside_loopback"]["world_size"] == 2
    if plant is None:
        assert rec["correct"] and chk["ok"] and c2["beside_consumer_check"]["ok"], chk
        assert d["bitwise_beside_vs_alone"]
        assert d["ms"] == 1.25 and d["beside_consumer_ms"] == 1.5
        assert d["beside_consumer_over_alone"] == pytest.approx(1.5 / 1.25)
        assert d["beside_consumer_ratio"] == pytest.approx(1.0 / 1.5)
        # stamped (_stamp_clock: call n's producer n ms, its consumer end 0.5 ms later): the
        # check call is call 1, time_interleaved's 3 warm-ups calls 2-4, the 3 timed ones 5-7
        for r, ms_alone in ((d, 1.25), (c2, 1.2)):
            assert r["beside_stamps"]["valid"] and r["beside_stamps"]["bad_rounds"] == []
            assert r["beside_stamps"]["producer_ms"] == [5.0, 6.0, 7.0]
            assert (r["beside_producer_ms"], r["beside_producer_p10_ms"],
                    r["beside_producer_p90_ms"]) == (6.0, 5.0, 7.0)
            assert r["beside_consumer_end_ms"] == 6.5
            assert r["beside_producer_over_alone"] == pytest.approx(6.0 / ms_alone)
        assert rec["stamps_valid"] and rec["stamp_step_ns"] == 5 * 10**5
        assert "producer itself 6.000 ms" in B.stamped_text(d)
    else:
        assert not rec["correct"] and not chk["ok"] and not chk["rows_ok"], chk
        assert chk["untouched_ok"] and chk["counters_ok"] and chk["tags_ok"]
    # W = 1: ccta 0, no consumer beside, only the alone launches timed
    one = dict(point, world_size=1, label="tiny@96/W1/skewed")
    res1 = {v["name"]: B.resolve(one, v, 132, "FakeGPU", cache) for v in variants}
    n = len(launches)
    r1 = B.run_point(one, counts, res1, rounds=3, seed=0, beside="consumer")
    assert r1["correct"] and len(launches) == n and called[-1] == sorted(
        ["base:grouped_mm", "base:mm_loop", "default", "cluster_n=2"])
    assert "beside_consumer_ms" not in r1["variants"]["default"]
    assert "beside_stamps" not in r1["variants"]["default"] and "stamps_valid" not in r1


def test_a_stamp_out_of_order_makes_the_stamped_times_invalid(monkeypatch):
    """A timed replay whose producer-end stamp is before its start (call 6: the second timed
    one): the variant's stamped times are invalid, recorded with the round, not summarized;
    the makespan and the output check stand."""
    def clock(n, slot):
        t = _stamp_clock(n, slot)
        return t - 2 * n * 10**6 if (n, slot) == (6, B.STAMP_PRODUCER_END) else t
    ms = {"base:grouped_mm": 2.0, "base:mm_loop": 1.0, "default": 1.25,
          "default" + B.BESIDE_KEY: 1.5}
    _cpu_stand_ins(monkeypatch, ms, clock)
    _reference_consumer(monkeypatch)
    point, counts = _tiny()
    res = {"default": B.resolve(point, B.parse_variants("default")[0], 132, "FakeGPU",
                                TuneCache("/nonexistent/moe-overlap-test/tune.json"))}
    rec = B.run_point(point, counts, res, rounds=3, seed=0, beside="consumer")
    json.dumps(rec)
    d = rec["variants"]["default"]
    assert rec["correct"] and d["beside_consumer_ms"] == 1.5
    assert not rec["stamps_valid"] and not d["beside_stamps"]["valid"]
    assert d["beside_stamps"]["bad_rounds"] == [1]
    assert d["beside_stamps"]["producer_ms"] == [5.0, -6.0, 7.0]  # kept for a look
    assert "beside_producer_ms" not in d and "beside_producer_over_alone" not in d
    assert "INVALID" in B.stamped_text(d)
    doc = B.summarize(dict(beside="consumer", variants=[dict(name="default")], points=[
        dict(rec, label=point["label"])]))
    s = doc["beside_consumer"]["default"]
    assert s["points"] == 1 and s["stamps_invalid"] == [point["label"]]
    assert s["producer_points"] == 0 and s["geomean_producer_over_alone"] is None


def test_stamp_intervals_check_every_replay():
    import torch
    ok = B.stamp_intervals(torch.tensor([[10**12, 10**12 + 2 * 10**6, 10**12 + 3 * 10**6]]))
    assert ok == dict(valid=True, bad_rounds=[], producer_ms=[2.0], consumer_end_ms=[3.0])
    t0 = 10**12
    rows = torch.tensor([[t0, t0 + 10, t0 + 20],  # fine
                         [t0, t0, t0 + 20],  # producer end not after the start
                         [t0, t0 + 10, t0],  # consumer end not after the start
                         [0, t0 + 10, t0 + 20],  # the start never stamped
                         [t0, t0 + 10, t0 + 20]])
    bad = B.stamp_intervals(rows)
    assert not bad["valid"] and bad["bad_rounds"] == [1, 2, 3]
    assert not B.stamp_intervals(torch.zeros(0, 3, dtype=torch.int64))["valid"]
    r = B.add_stamped_times(dict(ms=2.0), B.stamp_intervals(torch.tensor(
        [[t0, t0 + k * 10**6, t0 + (k + 1) * 10**6] for k in (3, 1, 2, 4, 5, 6, 7, 8, 9, 10)])))
    assert (r["beside_producer_ms"], r["beside_producer_p10_ms"],
            r["beside_producer_p90_ms"]) == (5.5, 2.0, 10.0)
    assert r["beside_producer_over_alone"] == 5.5 / 2.0 and r["beside_consumer_end_ms"] == 6.5


def test_beside_consumer_that_does_not_fit_is_recorded(monkeypatch):
    ms = {"base:grouped_mm": 2.0, "base:mm_loop": 1.0, "default": 1.25}
    _cpu_stand_ins(monkeypatch, ms)
    launches = _reference_consumer(monkeypatch)
    point, counts = _tiny()
    res = {"default": B.resolve(point, B.parse_variants("default")[0], 132, "FakeGPU",
                                TuneCache("/nonexistent/moe-overlap-test/tune.json"))}
    need = B.loopback_bytes(B.loopback_layers(point, res).values(), 2)
    monkeypatch.setattr(B, "free_device_bytes", lambda dev: need + B.LOOPBACK_HEADROOM - 1)
    rec = B.run_point(point, counts, res, rounds=3, seed=0, beside="consumer")
    assert "GiB" in rec["beside_skipped"] and not launches and rec["correct"]
    assert "beside_consumer_ms" not in rec["variants"]["default"]
    doc = B.summarize(dict(beside="consumer", variants=[dict(name="default")], points=[
        dict(rec, label=point["label"])]))
    assert doc["beside_consumer"]["default"] == dict(
        points=0, not_timed=[point["label"]], geomean_over_alone=None, max_over_alone=None,
        worst=None, producer_points=0, stamps_invalid=[], geomean_producer_over_alone=None,
        max_producer_over_alone=None, worst_producer=None)


def test_beside_summary_and_arguments():
    pts = [dict(label=lab, variants={"default": dict(beside_consumer_over_alone=v,
                                                     beside_producer_over_alone=u,
                                                     beside_stamps=dict(valid=True))})
           for lab, v, u in (("a", 1.0, 1.8), ("b", 1.21, 1.25))] + [dict(label="c", variants={
               "default": dict(ccta=0)})]
    s = B.beside_summary(pts, "default")
    assert s["points"] == 2 and s["not_timed"] == ["c"] and s["worst"] == "b"
    assert s["geomean_over_alone"] == pytest.approx(1.1) and s["max_over_alone"] == 1.21
    assert s["producer_points"] == 2 and s["worst_producer"] == "a"
    assert s["geomean_producer_over_alone"] == pytest.approx(1.5)
    assert s["max_producer_over_alone"] == 1.8 and s["stamps_invalid"] == []
    assert "beside_consumer" not in B.summarize(_doc([(1.0,), (1.05,)]))  # off by default
    # the loopback ships nvlink only: an nvshmem variant stops before any GPU work
    for argv in (["--beside", "consumer", "--variants", "transport=nvshmem"],
                 ["--beside", "pigeon"]):
        with pytest.raises(SystemExit) as e:
            B.main(argv + ["--out", "unused"])
        assert e.value.code == 2
    o = B.variant_options(B.parse_variants("transport=nvshmem")[0])
    assert B.check_beside(o, "none", "x") is o
    with pytest.raises(ValueError):
        B.check_beside(o, "consumer", "x")
    assert set(B.TIME_FIELDS["consumer"]) >= {
        "ms", "beside_consumer_ms", "beside_producer_ms", "beside_producer_over_alone",
        "beside_consumer_end_ms"}
    assert "%globaltimer" in B.TIME_FIELDS["consumer"]["beside_producer_ms"]


def _run(ratios, commit="abc1234", partial=None):
    """One run's document as main writes it (or its .partial), the points of _doc."""
    doc = dict(_doc(ratios), device="NVIDIA H100 80GB HBM3", git_commit=commit, rounds=5,
               beside="none", date=f"2026-12-07T0{len(ratios)}:00:00", skipped_points=[],
               routings={f"r{len(ratios)}": {}})
    if partial is not None:
        doc["partial"] = partial
    return doc


def test_merged_runs_are_summarized_over_all_their_points():
    a = _run([(1.2,)])  # qwen3-30b-a3b@4096/W1/skewed
    b = _run([(1.2,), (0.5,)], partial=dict(done=2, of=3))
    b["points"] = b["points"][1:]  # W8 alone: the two runs split the grid
    merged = B.merge_runs([a, b], ["a.json", "b.json.partial"])
    assert [p["label"] for p in merged["points"]] == [p["label"] for p in _doc([(1,), (1,)])[
        "points"]]
    g = merged["goals"]["default"]
    assert g["points"] == 2 and g["min_scaled"] == 0.5 and not g["met"]
    assert math.isclose(g["geomean_scaled"], math.sqrt(1.2 * 0.5))
    assert merged["failed"] and "partial" not in merged
    assert merged["merged_from"][1] == dict(name="b.json.partial", points=1,
                                            partial=dict(done=2, of=3))
    assert merged["date"] == b["date"] and set(merged["routings"]) == {"r1", "r2"}


def test_runs_of_other_commits_or_with_a_common_point_are_not_merged():
    with pytest.raises(ValueError, match="differ"):
        B.merge_runs([_run([(1.0,)]), _run([(1.0,)], commit="def5678")], ["a", "b"])
    with pytest.raises(ValueError, match="in two runs"):
        B.merge_runs([_run([(1.0,)]), _run([(1.0,)])], ["a", "b"])


def test_merge_command_writes_one_file(tmp_path):
    a, b = _run([(1.0,), (1.1,)]), _run([(1.0,)])
    a["points"] = a["points"][1:]
    paths = []
    for name, d in (("a.json", a), ("b.json", b)):
        paths.append(str(tmp_path / name))
        json.dump(d, open(paths[-1], "w"))
    out = tmp_path / "m.json"
    assert B.main(["merge", *paths, "--out", str(out)]) == 0
    assert len(json.load(open(out))["points"]) == 2
