"""The whole layer's projection (issue 39 goal 4): its dispatch bytes are `dispatch_wire_bytes`'
and the counted file's, an overlapped stage never beats the stages it overlaps nor loses to
running them one after another, more bandwidth never makes anything slower, the IB-bound limit
is the byte ratio, a planted defect in a stage moves the result, every input is named, and the
tracked JSON is what the code gives."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest

from moe_overlap.combine.dispatch_dedup import dispatch_wire_bytes
from moe_overlap.combine.projection import PRODUCER_FILE, Fabric, ProducerRates
from moe_overlap.combine.projection_layer import (UPPROJ_FILE, LayerRates, UpRates,
                                                  best_layer, check_bytes, draw_ids,
                                                  format_table, gemm_finish, layer_rows,
                                                  predict_layer, project_layer, summary,
                                                  window_order)
from moe_overlap.combine.shapes import MODELS
from moe_overlap.combine.tuning import CostModel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
MODEL = "qwen3-30b-a3b"  # the smallest model shape: quick routings and plans


def _load(name):
    with open(os.path.join(RESULTS, name)) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def rates():
    prod = ProducerRates.from_doc(_load(PRODUCER_FILE))
    ours, lib = prod.cost_models(MODEL, 1024, CostModel())
    return ours, lib, LayerRates.from_results(ROOT)


@pytest.fixture(scope="module")
def rows16():
    """W = 16 over two nodes of 8: every link class has rows."""
    return layer_rows(MODEL, 16, 512, fabric=Fabric())


def test_dispatch_bytes_are_dispatch_wire_bytes_for_every_rank():
    W, T, f = 4, 128, Fabric(gpus_per_node=2)  # 1 local, 1 NVLink, 2 IB peers per rank
    E, k, _, D = MODELS[MODEL]
    ids = draw_ids(MODEL, W, T)
    wire = dispatch_wire_bytes(ids, E // W, D, 2)
    recv = 0
    for r in range(W):
        lr = layer_rows(MODEL, W, T, fabric=f, rank=r, ids=ids)
        assert lr["once_sent_nvlink"] > 0 and lr["once_sent_ib"] > 0
        assert 2 * D * (lr["once_sent_nvlink"] + lr["once_sent_ib"]) == wire[r].once
        assert 2 * D * (lr["assign_sent_nvlink"] + lr["assign_sent_ib"]) == wire[r].per_assignment
        assert lr["once_sent_nvlink"] + lr["once_sent_ib"] == wire[r].tokens
        recv += lr["once_recv_nvlink"] + lr["once_recv_ib"]
        # the tokens a rank receives from each source, summed, are its off-rank receipts
        assert sum(v for s, v in enumerate(lr["once_recv_by_source"]) if s != r) == (
            lr["once_recv_nvlink"] + lr["once_recv_ib"])
    assert recv == sum(w.tokens for w in wire)  # what leaves the ranks is what arrives


def test_bytes_equal_the_counted_file():
    rows = project_layer(models=("qwen3-235b-a22b",), worlds=(2, 8), tokens=(4096,))
    chk = check_bytes(rows, _load("dispatch_bytes_1bbb111.json"))
    assert chk["points"] == 2 and chk["equal"], chk
    bad = [dict(r, rows=dict(r["rows"], once_sent_nvlink=r["rows"]["once_sent_nvlink"] + 1))
           for r in rows]
    assert not check_bytes(bad, _load("dispatch_bytes_1bbb111.json"))["equal"]


@pytest.mark.parametrize("W", [2, 16])
@pytest.mark.parametrize("arrival", ["designed", "built"])
def test_overlap_between_its_stages_max_and_sum(rates, W, arrival):
    ours, lib, lrates = rates
    lr = layer_rows(MODEL, W, 512)
    for dctas in (4, 12, 32):
        p = predict_layer(lr, MODEL, ours, lib, Fabric(), lrates, dctas=dctas, ccta=8,
                          arrival=arrival)
        stages = (p["t_up"], p["t_arrive_nvlink"], p["t_arrive_ib"])
        assert p["t_dispatch_up"] >= max(stages) - 1e-12
        assert p["t_dispatch_up"] <= p["t_send"] + p["t_expand"] + p["t_up"] + 1e-9
        assert p["t_layer"] >= p["t_dispatch_up"] + max(p["t_down"], p["t_comm"])
        assert p["t_seq"] > p["t_a2a_dispatch"] + p["t_up_lib"] + p["t_down_lib"] + p[
            "t_a2a_combine"]
    d = predict_layer(lr, MODEL, ours, lib, Fabric(), lrates, arrival="designed")
    b = predict_layer(lr, MODEL, ours, lib, Fabric(), lrates, arrival="built")
    assert d["t_dispatch_up"] <= b["t_dispatch_up"]


def test_more_bandwidth_is_never_slower(rates, rows16):
    ours, lib, lrates = rates
    last = None
    for ib in (6.25, 12.5, 25.0, 50.0, 100.0, 400.0):
        r = best_layer(rows16, MODEL, ours, lib, Fabric(ib_gbps=ib), lrates)
        now = (r["t_layer"], r["t_seq"], r["t_combine_only"])
        if last:
            assert all(n <= p + 1e-12 for n, p in zip(now, last)), (ib, now, last)
        last = now
    assert last[0] < best_layer(rows16, MODEL, ours, lib, Fabric(ib_gbps=6.25), lrates)["t_layer"]
    last = None
    for scale in (0.5, 1.0, 2.0):
        o = dataclasses.replace(ours, copy_gbps={c: v * scale for c, v in ours.copy_gbps.items()})
        t = best_layer(layer_rows(MODEL, 8, 512), MODEL, o, lib, Fabric(), lrates)["t_layer"]
        assert last is None or t <= last + 1e-12
        last = t


def test_ib_bound_limit_is_the_byte_ratio(rates, rows16):
    """With IB far slower than everything else, both the layer and the sequential baseline are
    the IB bytes over the IB rate: the speedup is (per-assignment + combine) / (once + combine
    + the combine's last band, which the combine model sends after its stream) IB bytes, a
    number of the routing alone."""
    ours, lib, lrates = rates
    f = Fabric(ib_gbps=0.05, ib_latency_us=0.0)
    r = best_layer(rows16, MODEL, ours, lib, f, lrates)
    D, k = MODELS[MODEL][3], MODELS[MODEL][1]
    lr = rows16
    once = max(lr["once_sent_ib"], lr["once_recv_ib"]) * (2 * D + 4 * k)
    pa = max(lr["assign_sent_ib"], lr["assign_recv_ib"]) * 2 * D
    comb = lr["assign_recv_ib"] * 2 * D
    tail = min(128, lr["assign_recv_nvlink"] + lr["assign_recv_ib"]) * 2 * D
    assert r["speedup_vs_seq"] == pytest.approx((pa + comb) / (once + comb + tail), rel=0.01)
    assert r["speedup_vs_seq"] > 1.0


def test_a_planted_defect_in_a_stage_moves_the_result(rates, rows16):
    ours, lib, lrates = rates
    good = predict_layer(rows16, MODEL, ours, lib, Fabric(), lrates)
    # the dispatch sending per assignment instead of once per rank
    bad = dict(rows16, once_sent_ib=rows16["assign_sent_ib"],
               once_recv_ib=rows16["assign_recv_ib"])
    worse = predict_layer(bad, MODEL, ours, lib, Fabric(), lrates)
    assert worse["t_arrive_ib"] > good["t_arrive_ib"]
    assert worse["t_layer"] > good["t_layer"]
    assert worse["t_seq"] == pytest.approx(good["t_seq"])  # the baseline never used them
    # the up-projection at half its rate: the layer slows, the baselines (library) do not
    slow = predict_layer(rows16, MODEL, dataclasses.replace(ours, gemm_tflops=ours.gemm_tflops / 2),
                         lib, Fabric(), lrates)
    assert slow["t_up"] == pytest.approx(2 * good["t_up"])
    assert slow["t_dispatch_up"] > good["t_dispatch_up"]
    assert slow["t_seq"] == pytest.approx(good["t_seq"])


@pytest.mark.parametrize("layout", ["aligned", "packed"])
@pytest.mark.parametrize("W,window", [(2, 1), (2, 2), (4, 1), (4, 2), (8, 3), (8, 8)])
def test_window_order_is_the_labs_schedule(W, window, layout):
    """window_order, from the groups' rows and starts as the projection has them, walks the
    plan's bands as bench/lab_upproj_window.py's window_schedule (from the plan's bands)."""
    import torch
    from conftest import load_bench
    from moe_overlap.combine.plan import plan_combine
    lab = load_bench("lab_upproj_window")
    El, tm = 3, 64
    g = torch.Generator().manual_seed(W * 10 + window)
    for trial in range(3):
        counts = torch.randint(0, 150, (W, El * W), generator=g)
        if trial == 1:
            counts = counts * (torch.rand(W, El * W, generator=g) < 0.3)
        for r in (0, W - 1):
            p = plan_combine(counts, r, tile_m=tm, layout=layout)
            n, rows = int(p.num_bands), int(p.total_rows)
            assert n == -(-rows // tm)
            starts = p.expert_row_start[:, None] + p.group_row_start
            got = window_order(starts, counts[:, r * El:(r + 1) * El].T, r, rows, tm, window)
            assert got.tolist() == lab.window_schedule(p, counts, window)[:n].tolist()
    with pytest.raises(ValueError, match="window"):
        window_order(starts, counts[:, :El].T, 0, rows, tm, 0)


def test_a_static_band_walk_is_never_faster_than_the_ready_order(rates, rows16):
    """gemm_finish in a static order is the ready order's finish where the order is the ready
    order and never earlier otherwise; predict_layer's window moves the dispatch half only."""
    import torch
    g = torch.Generator().manual_seed(0)
    ready = torch.rand(50, generator=g, dtype=torch.float64)
    assert gemm_finish(ready, 0.01, ready.argsort()) == pytest.approx(gemm_finish(ready, 0.01))
    for _ in range(20):
        perm = torch.randperm(50, generator=g)
        assert gemm_finish(ready, 0.01, perm) >= gemm_finish(ready, 0.01) - 1e-15
    assert gemm_finish(ready, 0.01, ready.argsort(descending=True)) == pytest.approx(
        float(ready.max()) + 50 * 0.01)  # the last-ready band first: every band after it
    ours, lib, lrates = rates
    base = predict_layer(rows16, MODEL, ours, lib, Fabric(), lrates)
    W = len(rows16["source_class"])
    for w in (1, 4, W):
        win = predict_layer(rows16, MODEL, ours, lib, Fabric(), lrates, window=w)
        assert str(w) in win["expand_order"]
        # the same rates: no static walk beats the better of the ready order and "built"
        assert win["t_dispatch_up"] >= base["t_dispatch_up"] - 1e-12
        for k in ("t_up", "t_expand", "t_combine", "t_seq", "t_combine_only", "t_send"):
            assert win[k] == pytest.approx(base[k], rel=1e-12), k
    # the expert order (one window of every source) waits for the farthest source first
    one = predict_layer(rows16, MODEL, ours, lib, Fabric(), lrates, window=1)
    every = predict_layer(rows16, MODEL, ours, lib, Fabric(), lrates, window=W)
    assert every["t_dispatch_up"] > one["t_dispatch_up"]
    with pytest.raises(ValueError, match="designed"):
        predict_layer(rows16, MODEL, ours, lib, Fabric(), lrates, arrival="built", window=2)


def test_the_fastest_measured_band_window_is_taken(rates, tmp_path):
    """up_windows: one UpRates per lab file (its lab_window), every window tried at its own
    measured rate, the fastest layer kept; a window 4x faster wins; window 1's static walk is
    never faster than up_measured's ready order at the same rates; files of two windows do not
    mix."""
    doc = _load(UPPROJ_FILE)
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    for w, speed in ((1, 1.0), (2, 4.0)):
        d = json.loads(json.dumps(doc))
        d["lab_window"] = w
        for q in d["points"]:
            q["ms"] /= speed
        (res / f"w{w}.json").write_text(json.dumps(d))
    u1, u2 = (UpRates.from_files(str(tmp_path), (f"w{w}.json",)) for w in (1, 2))
    assert (u1.window, u2.window) == (1, 2)
    with pytest.raises(ValueError, match="windows"):
        UpRates.from_files(str(tmp_path), ("w1.json", "w2.json"))
    prod = ProducerRates.from_doc(_load(PRODUCER_FILE))
    rows = project_layer(models=(MODEL,), worlds=(8,), tokens=(1024,), producer=prod,
                         up=UpRates.from_doc(doc), up_windows=(u1, u2))
    (r,) = rows
    uw = r["up_window"]
    assert uw["window"] == 2 and set(uw["by_window"]) == {"1", "2"}
    assert uw["by_window"]["2"] > uw["by_window"]["1"]
    assert uw["speedup_vs_combine_only"] == pytest.approx(uw["by_window"]["2"], abs=1e-4)
    assert r["up_measured"]["speedup_vs_combine_only"] >= uw["by_window"]["1"] - 1e-4
    assert "win" in format_table(rows) and 8 in summary(rows)[f"{MODEL}@1024"]["up_window"][
        "vs_combine_only"]
    assert "up_window" not in project_layer(models=(MODEL,), worlds=(8,), tokens=(1024,),
                                            producer=prod)[0]
    # every rate the windows' rows use is a named input: ours and the library's, per window
    from moe_overlap.combine.projection_layer import input_sources
    inputs = input_sources(None, CostModel(), Fabric(), LayerRates(), None, up_windows=(u1, u2))
    for w, u in ((1, u1), (2, u2)):
        for key, j in ((f"up_window_{w}_tflops", 0), (f"up_window_{w}_library_tflops", 1)):
            got = inputs[key]["value"]
            assert got and got == {f"{m}@{t}/W{ww}/{r}": v[j]
                                   for (m, t, ww, r), v in u.points.items()}, key
            assert f"windows of {w} " in inputs[key]["what"]


def test_measured_up_rates_are_the_files_times_and_change_only_the_up_projection(rates, rows16,
                                                                                 tmp_path):
    """UpRates reads the up-projection file's times back (ours: the plan's rows on its grid's
    SMs; the library: the valid rows on every SM), picks the routing before W before tokens,
    and in predict_layer moves the up-projection stages and nothing of the combine."""
    ours, lib, lr = rates
    doc = _load(UPPROJ_FILE)
    up = UpRates.from_doc(doc)
    pts = [p for p in doc["points"] if p["world_size"] > 1]
    assert pts and len(up.points) == len(pts)
    assert UpRates.from_files(ROOT).points == up.points
    # precedence: a second file's points add where the first has none, and lose where both do
    res = tmp_path / "bench" / "results"
    res.mkdir(parents=True)
    (res / "a.json").write_text(json.dumps(doc))
    other = json.loads(json.dumps(doc))
    for q in other["points"]:
        q["ms"] *= 2.0
    added = dict(other["points"][-1], tokens=12345, label="added")
    other["points"].append(added)
    (res / "b.json").write_text(json.dumps(other))
    both = UpRates.from_files(str(tmp_path), ("a.json", "b.json"))
    assert both.files == ("a.json", "b.json")
    add_key = (added["model"], 12345, added["world_size"], added["routing"])
    assert set(both.points) == set(up.points) | {add_key} and both.source[add_key] == "b.json"
    for p in pts:
        key = (p["model"], p["tokens"], p["world_size"], p["routing"])
        assert both.points[key] == up.points[key] and both.source[key] == "a.json"
        o, b, label = up.points[key]
        assert label == p["label"]
        flops = 2.0 * p["D"] * p["two_k"]
        # the time back from the rate, as CostModel.gemm_s runs it on the grid's SMs
        assert flops * p["plan_rows"] / (o * 1e12 * p["grid"] / p["num_sms"]) * 1e3 == \
            pytest.approx(p["ms"], rel=1e-12)
        assert flops * p["valid_rows"] / (b * 1e12) * 1e3 == pytest.approx(
            p["base_gemm_alone_ms"], rel=1e-12)
    table = UpRates({("m", 4096, 8, "skewed"): (1.0, 1.0, "a"),
                     ("m", 4096, 2, "balanced"): (2.0, 2.0, "b"),
                     ("m", 16384, 8, "balanced"): (3.0, 3.0, "c")})
    assert table.nearest("m", 4096, 8, "balanced")[2] == "c"  # the routing first
    assert table.nearest("m", 4096, 4, "skewed")[2] == "a"
    assert table.nearest("m", 4096, 4, "balanced")[2] == "b"  # then W: 2 and 8 tie on log, b
    assert table.nearest("other", 4096, 8, "balanced") is None
    table.points[("m", 4096, 8, "balanced")] = (4.0, 4.0, "d")
    assert table.nearest("m", 4096, 4, "balanced")[2] == "d"  # W 2 and 8 tie: the larger
    assert table.nearest("m", 4096, 3, "balanced")[2] == "b"  # 2 is nearer in log scale
    # the down-projection's own rates given as up_rates: the same prediction
    same = predict_layer(rows16, MODEL, ours, lib, Fabric(), lr,
                         up_rates=(ours.gemm_tflops, lib.gemm_tflops))
    base = predict_layer(rows16, MODEL, ours, lib, Fabric(), lr)
    for k, v in base.items():
        if k.startswith("t_"):
            assert same[k] == pytest.approx(v, rel=1e-12), k
    half = predict_layer(rows16, MODEL, ours, lib, Fabric(), lr,
                         up_rates=(ours.gemm_tflops / 2, lib.gemm_tflops / 2))
    assert half["t_up"] == pytest.approx(2 * base["t_up"])
    assert half["t_up_lib"] == pytest.approx(2 * base["t_up_lib"])
    for k in ("t_down", "t_combine", "t_a2a_dispatch", "t_down_lib"):
        assert half[k] == pytest.approx(base[k], rel=1e-12), k


def test_the_up_projection_file_is_the_reports_headline():
    from moe_overlap.report import HEADLINE
    assert HEADLINE["upproj"][1] == (UPPROJ_FILE,)


def test_cli_names_every_input(tmp_path):
    out = tmp_path / "p" / "layer.json"
    r = subprocess.run([sys.executable, "-m", "moe_overlap", "project", "--layer", "--models",
                        MODEL, "--world-sizes", "2,16", "--tokens", "256", "--out", str(out)],
                       capture_output=True, text=True, cwd=str(tmp_path), timeout=600)
    assert r.returncode == 0, r.stderr
    doc = json.load(open(out))
    assert doc["meta"]["kind"] == "projection" and doc["meta"]["device"] == "model"
    assert [x["world_size"] for x in doc["rows"]] == [2, 16]
    for name, e in doc["inputs"].items():
        src = e["source"]
        if src.get("file"):
            assert src["card"] in ("H100", "H200") and src["date"] and src["commit"] or (
                src["file"].endswith("consumer_run3_fastlaunch.json")), (name, src)
        else:
            assert src.get("stated"), name
    # the stages never run on a GPU say what they assume
    for name in ("up_tflops", "up_measured_tflops", "dispatch_send_gbps", "dispatch_ib",
                 "expand_gbps_per_sm"):
        assert doc["inputs"][name].get("assumption"), name
    assert "not a measurement" in doc["assumptions_text"]


def test_tracked_result_is_what_the_code_gives():
    doc = _load("projection_layer.json")
    assert doc["bytes_check"]["equal"] and doc["bytes_check"]["points"] >= 4
    row = next(r for r in doc["rows"] if r["model"] == "qwen3-235b-a22b"
               and r["world_size"] == 2 and r["tokens_per_rank"] == 4096)
    prod = ProducerRates(doc["inputs"]["producer_tflops"]["value"],
                         doc["inputs"]["library_tflops"]["value"])
    cost = dict(doc["cost_model"])
    cost["copy_gbps"] = {int(c): v for c, v in cost["copy_gbps"].items()}  # JSON keys: text
    again = project_layer(models=("qwen3-235b-a22b",), worlds=(2,), tokens=(4096,),
                          mode=doc["meta"]["mode"], cost=CostModel(**cost),
                          fabric=Fabric(**doc["fabric"]), rates=LayerRates(**doc["rates"]),
                          producer=prod)[0]
    for k in ("t_layer", "t_seq", "t_combine_only", "t_dispatch_up"):
        assert again[k] == pytest.approx(row[k], rel=1e-9), k
