"""CombineOptions / FFNOptions: one default per option across the layers, one meaning of "auto",
bad values raise in one place, the tuner passes options instead of writing attributes, and the
diagnostics live in one private debug object. CPU only."""
import dataclasses
import inspect
import json
from types import SimpleNamespace

import pytest
import torch

from moe_overlap.combine import MoECombine
from moe_overlap.combine.options import CombineFacts, CombineOptions
from moe_overlap.combine.overlap import OverlapCombine
from moe_overlap.combine.tuning import TuneCache, analytic_choice
from conftest import spawn_ranks
from moe_overlap.diagnostics import CombineDebug, debug_scope
from moe_overlap.ffn import FusedFFN, ShardedExperts
from moe_overlap.ffn.options import FFNFacts, FFNOptions

COMBINE_FIELDS = {f.name for f in dataclasses.fields(CombineOptions)}
FFN_FIELDS = {f.name for f in dataclasses.fields(FFNOptions)}


# ------------------------------------------------------------------------ one default each
@pytest.mark.parametrize("layer,fields,all_fields", [
    (MoECombine, {"ccta", "mgb", "transport", "local_copy", "copy", "layout"}, COMBINE_FIELDS),
    # layout and order are the plan's (MoECombine.plan), not the overlap backend's keywords
    (OverlapCombine, COMBINE_FIELDS - {"layout", "order"}, COMBINE_FIELDS),
    (FusedFFN, FFN_FIELDS, FFN_FIELDS), (ShardedExperts, FFN_FIELDS, FFN_FIELDS)])
def test_layers_take_every_option_and_default_none(layer, fields, all_fields):
    """The layers' option keywords are options fields defaulting to None (= "not given"), so
    the only defaults are the options object's; every layer also takes options=."""
    params = inspect.signature(layer.__init__).parameters
    assert "options" in params and params["options"].default is None
    opt_params = {n for n in params if n in all_fields}
    assert fields <= opt_params, fields - opt_params
    for name in opt_params:
        assert params[name].default is None, (layer.__name__, name, params[name].default)


def test_moe_combine_resolves_the_default_options(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_OVERLAP_TUNE_CACHE", str(tmp_path / "tune.json"))  # empty cache
    layer = MoECombine(8, 64, 32, 2, 100, tile_m=64, backend="reference")
    assert layer.options == CombineOptions().resolve(layer.facts)
    assert layer.options.is_resolved
    # the same layer built from an options object, and keywords overriding one of its fields
    same = MoECombine(8, 64, 32, 2, 100, tile_m=64, backend="reference",
                      options=CombineOptions())
    assert same.options == layer.options
    over = MoECombine(8, 64, 32, 2, 100, tile_m=64, backend="reference",
                      options=CombineOptions(ccta=5, transport="nvshmem"), ccta=7)
    assert (over.ccta, over.transport, over.local_copy, over.copy) == (7, "nvshmem", True, "ldst")


def test_consumer_variant_default_follows_the_transport():
    assert CombineOptions().consumer_variant() == (False, "tma")
    assert CombineOptions(transport="nvshmem").consumer_variant() == (True, "ldst")
    assert CombineOptions(local_copy=True, copy="ldst").consumer_variant() == (True, "ldst")
    assert CombineOptions(local_copy=None, copy=None) == CombineOptions()  # None reads as auto


# ------------------------------------------------------------------------ one meaning of auto
FACTS = CombineFacts(world_size=4, hidden_size=2048, out_features=4096, experts_per_rank=8,
                     tile_m=128, rows=8192, device_name="FakeGPU", num_sms=132)


def test_auto_is_the_tuned_value_else_the_analytic_choice(tmp_path):
    cache = TuneCache(str(tmp_path / "t.json"))
    rows = FACTS.rows
    want = analytic_choice(rows, rows * 3 // 4, FACTS.out_features, FACTS.hidden_size, 128)
    got = CombineOptions().resolve(FACTS, cache=cache)
    assert (got.ccta, got.mgb) == want
    cache.put(CombineOptions().tune_key(FACTS), 20, 4)
    got = CombineOptions().resolve(FACTS, cache=TuneCache(cache.path))
    assert (got.ccta, got.mgb) == (20, 4)
    # explicit values win over the cache; an explicit half keeps the tuned other half
    got = CombineOptions(ccta=6).resolve(FACTS, cache=TuneCache(cache.path))
    assert (got.ccta, got.mgb) == (6, 4)
    # a cached ccta from a larger GPU is clamped to this one
    small = dataclasses.replace(FACTS, num_sms=16)
    cache.put(CombineOptions().tune_key(small), 20, 1)
    assert CombineOptions().resolve(small, cache=TuneCache(cache.path)).ccta == 15


def test_a_pair_tuned_for_one_path_is_not_read_for_another(tmp_path):
    """The tune key holds the options that move the best (ccta, mgb): transport, scale, layout,
    consumer variant, producer. A pair cached for one of them leaves the others analytic."""
    cache = TuneCache(str(tmp_path / "t.json"))
    rows = FACTS.rows
    want = analytic_choice(rows, rows * 3 // 4, FACTS.out_features, FACTS.hidden_size, 128)
    assert want != (20, 4)
    base = CombineOptions(producer="torch", order="remote_first")
    cache.put(base.tune_key(FACTS), 20, 4)
    others = [base.replace(transport="nvshmem"), base.replace(scale="ordered"),
              base.replace(layout="packed"), base.replace(copy="ldst"),
              base.replace(order="expert"), base.replace(order="auto"),
              base.replace(producer="grouped_gemm")]
    keys = {base.tune_key(FACTS)} | {o.tune_key(FACTS) for o in others}
    assert len(keys) == 1 + len(others)
    for o in others:
        got = o.resolve(FACTS, cache=TuneCache(cache.path))
        assert (got.ccta, got.mgb) == want, o
    # "auto" and its resolved value name one path: the key is the same either way
    got = base.resolve(FACTS, cache=TuneCache(cache.path))
    assert (got.ccta, got.mgb) == (20, 4)
    assert got.tune_key(FACTS) == base.tune_key(FACTS)


def _fake_cuda(monkeypatch, name="FakeGPU", sms=132):
    """Enough of torch.cuda / torch.distributed for OverlapCombine's constructor to reach the
    options resolution on a CPU machine; NVSHMEM then stops it with a sentinel."""
    import moe_overlap.combine.overlap as ov_mod
    import moe_overlap.combine.layer as layer_mod

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    for mod in (torch.cuda,):
        monkeypatch.setattr(mod, "is_available", lambda: True)
        monkeypatch.setattr(mod, "current_device", lambda: 0)
        monkeypatch.setattr(mod, "get_device_name", lambda *a: name)
        monkeypatch.setattr(mod, "get_device_properties",
                            lambda *a: SimpleNamespace(multi_processor_count=sms))
    monkeypatch.setattr(ov_mod.dist, "get_rank", lambda g=None: 0)
    monkeypatch.setattr(ov_mod.dist, "get_world_size", lambda g=None: 4)
    monkeypatch.setattr(layer_mod, "world", lambda g=None: (0, 4))
    import moe_overlap.runtime.nvshmem as nv
    monkeypatch.setattr(nv.NvshmemRuntime, "get", staticmethod(stop))
    monkeypatch.setenv("CUDA_MODULE_LOADING", "EAGER")
    return Stop


@pytest.mark.parametrize("cached", [None, (24, 1)])
def test_both_combine_layers_resolve_auto_alike(tmp_path, monkeypatch, cached):
    """OverlapCombine("auto") and MoECombine("auto") give the same ccta (and consumer variant)
    for the same shape: the tuned value where cached, else the analytic choice (it used to be a
    fixed 16 / 2 in OverlapCombine)."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("MOE_OVERLAP_TUNE_CACHE", str(path))
    Stop = _fake_cuda(monkeypatch)
    shape = dict(num_experts=32, hidden_size=2048, out_features=4096, topk=4,
                 max_tokens_per_rank=2048, tile_m=128)
    moe = MoECombine(shape["num_experts"], shape["hidden_size"], shape["out_features"],
                     shape["topk"], shape["max_tokens_per_rank"], tile_m=128,
                     backend="reference")
    if cached:
        TuneCache(str(path)).put(moe.tune_key, *cached)
        moe = MoECombine(shape["num_experts"], shape["hidden_size"], shape["out_features"],
                         shape["topk"], shape["max_tokens_per_rank"], tile_m=128,
                         backend="reference")
        assert (moe.ccta, moe.mgb) == cached
    seen = []
    real = CombineOptions.resolve

    def spy(self, facts, cache=None):
        out = real(self, facts, cache)
        seen.append((facts, out))
        return out

    monkeypatch.setattr(CombineOptions, "resolve", spy)
    with pytest.raises(Stop):
        OverlapCombine(**shape)
    (facts, got), = seen
    assert facts == moe.facts
    assert got == moe.options
    assert got.ccta != 16 or moe.ccta == 16


# ------------------------------------------------------------------------ bad values raise
@pytest.mark.parametrize("kw,exc,msg", [
    (dict(ccta=-1), ValueError, "ccta"), (dict(ccta=2.0), ValueError, "ccta"),
    (dict(mgb=True), ValueError, "mgb"), (dict(mgb="fast"), ValueError, "mgb"),
    (dict(transport="pigeon"), ValueError, "transport"),
    (dict(transport="nvshmem", copy="tma"), ValueError, "copy"),
    (dict(copy="memcpy"), ValueError, "copy"),
    (dict(layout="tight"), ValueError, "layout"),
    (dict(local_copy="yes"), ValueError, "local_copy"),
    (dict(consumer_piece_rows=-1), ValueError, "consumer_piece_rows"),
    (dict(consumer_stages=0), ValueError, "consumer_stages"),
    (dict(consumer_threads=None), ValueError, "consumer_threads"),
    (dict(producer="cublas"), ValueError, "producer"),
    (dict(timeout_s=0), ValueError, "timeout_s"),
    (dict(gemm_options=[("cluster_n", 1)]), TypeError, "gemm_options"),
])
def test_combine_options_bad_values(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        CombineOptions(**kw)


def test_combine_options_device_checks_and_frozen():
    with pytest.raises(ValueError, match=r"ccta=132 must be an int in \[1, 131\]"):
        CombineOptions(ccta=132).resolve(FACTS)
    with pytest.raises(ValueError, match="stages"):  # the consumer's own ring check
        CombineOptions(consumer_stages=40, consumer_chunk=16384).resolve(FACTS)
    o = CombineOptions(gemm_options={"cluster_n": 1})
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.ccta = 4
    with pytest.raises(TypeError):
        o.gemm_options["cluster_n"] = 2  # a read-only copy
    with pytest.raises(TypeError, match="CombineOptions"):
        MoECombine(4, 8, 6, 2, 16, options={"ccta": 4})
    with pytest.raises(ValueError, match="cluster_n"):  # the producer GEMM's own check
        MoECombine(4, 8, 6, 2, 16, tile_m=64,
                   options=CombineOptions(gemm_options={"cluster_n": 3}))
    assert CombineOptions().consumer_lookahead == \
        CombineOptions(consumer_stages=12).consumer_lookahead


@pytest.mark.parametrize("kw,exc,msg", [
    (dict(comm="carrier-pigeon"), ValueError, "comm"),
    (dict(ccta=0), ValueError, "ccta"), (dict(ccta=True), ValueError, "ccta"),
    (dict(tile_m=96), ValueError, "tile_m"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(allreduce_band_rows=48), ValueError, "divisor of tile_m=128"),
    (dict(compute_options={"tile_m": 64}), ValueError, "unknown or reserved"),
    (dict(compute_options=[("h_pair", True)]), TypeError, "must be a dict"),
])
def test_ffn_options_bad_values(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        FFNOptions(**kw)


def test_ffn_options_resolve_once():
    from moe_overlap.ffn.layers import (fused_default_allreduce_band_rows, fused_default_ccta)
    for O in (1024, 2048, 7168):
        r = FFNOptions().resolve(FFNFacts(local_hidden=O, num_sms=132))
        assert r.ccta == fused_default_ccta(O)
        assert r.allreduce_band_rows == fused_default_allreduce_band_rows(O, 128)
        assert r.is_resolved and "h_pair" in r.compute_options
        assert r.resolve(FFNFacts(local_hidden=O, num_sms=132)) == r  # resolving is idempotent
    with pytest.raises(ValueError, match=r"ccta=200 must be an int in \[1, 131\]"):
        FFNOptions(ccta=200).resolve(FFNFacts(local_hidden=1024, num_sms=132))
    with pytest.raises(ValueError, match="cluster_m=2 applies to FusedFFN only"):
        FFNOptions(compute_options=dict(cluster_m=2)).resolve(
            FFNFacts(local_hidden=1024, grouped=True))


def test_reference_ffn_refuses_fused_options():
    FusedFFN(8, 16, dtype=torch.float32, options=FFNOptions())  # the defaults are fine
    with pytest.raises(ValueError, match="backend='fused' only"):
        FusedFFN(8, 16, dtype=torch.float32, options=FFNOptions(ccta=8))
    with pytest.raises(ValueError, match="backend='fused' only"):
        ShardedExperts(2, 8, 16, dtype=torch.float32, tile_m=64)
    with pytest.raises(TypeError, match="FFNOptions"):
        FusedFFN(8, 16, dtype=torch.float32, options=dict(ccta=8))


# ------------------------------------------------------------------------ the tuner
class _FakeImpl:
    """Stands in for OverlapCombine in autotune: records what each timed call is passed and
    refuses attribute writes after construction."""
    num_sms = 132

    def __init__(self):
        object.__setattr__(self, "calls", [])

    def __setattr__(self, name, value):
        raise AssertionError(f"the tuner wrote the attribute {name!r}")

    def prepare(self, plan, topk_ids):
        return ("routes", plan)

    def forward(self, h, w_down, plan, topk_ids, topk_weights, routes=None, **kw):
        assert routes == ("routes", plan)
        self.calls.append((kw.get("ccta"), plan.mgb))

    def check_errors(self):
        pass


def test_autotune_passes_candidates_and_writes_no_attribute(tmp_path, monkeypatch):
    import moe_overlap.timing as timing
    layer = MoECombine(4, 16, 8, 2, 8, tile_m=64, backend="reference", ccta=4, mgb=2)
    fake = _FakeImpl()
    monkeypatch.setattr(layer, "_overlap_impl", lambda device: fake)

    def time_calls(fn, reps=1, replays=1, barrier=None, graph=True):
        fn()
        c, m = fake.calls[-1]
        return (abs(c - 12) + m, "graph", [])  # fastest at ccta 12, mgb 1

    monkeypatch.setattr(timing, "time_calls", time_calls)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (8, 2), generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=4)[None]
    plan = layer.plan(counts)
    h = torch.randn(int(plan.total_rows), 16, generator=g)
    w = torch.randn(4, 16, 8, generator=g)
    gates = torch.rand(8, 2, generator=g)
    cache = TuneCache(str(tmp_path / "t.json"))
    assert layer.autotune(h, w, counts, ids, gates, cache=cache) == (12, 1)
    assert (layer.ccta, layer.mgb) == (12, 1) and layer.options.ccta == 12
    assert all(c is not None for c, _ in fake.calls)  # every timed call was passed its ccta
    assert {c for c, m in fake.calls if m == 2} >= {4, 8, 12, 16}  # the ccta scan at mgb 2
    assert {m for c, m in fake.calls if c == 12} == {1, 2, 4}  # then mgb at the best ccta
    assert json.load(open(cache.path))[layer.tune_key]["ccta"] == 12
    with pytest.raises(AttributeError):
        layer.ccta = 3  # read-only: the options change through autotune only
    assert layer.plan(counts).mgb == 1  # the tuned mgb reaches the plans


# ------------------------------------------------------------------------ diagnostics
def test_debug_scope_sets_and_restores_one_object():
    layer = SimpleNamespace(_debug=CombineDebug())
    before = layer._debug
    marks = []
    with debug_scope(layer, CombineDebug(timeline=marks, skip_scale=True)) as d:
        assert layer._debug is d and d.timeline is marks and d.skip_scale
    assert layer._debug is before and before.timeline is None and not before.skip_scale
    with pytest.raises(KeyError):
        with debug_scope(layer, CombineDebug(skip_scale=True)):
            raise KeyError("boom")
    assert layer._debug is before  # restored on errors too


def test_ffn_layers_have_one_debug_object():
    m = FusedFFN(8, 16, dtype=torch.float32)
    assert m._debug.timeline is None
    ev = []
    with m.diagnostics(timeline=ev):
        assert m._debug.timeline is ev
    assert m._debug.timeline is None
    assert not [k for k in vars(m) if k.startswith("_diag")]


class _FakeOrderImpl(_FakeImpl):
    def forward(self, h, w_down, plan, topk_ids, topk_weights, routes=None, **kw):
        assert routes == ("routes", plan)
        self.calls.append((kw.get("ccta"), plan.mgb, plan.order))


def _tune_inputs(layer):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4, (8, 2), generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=4)[None]
    h = torch.randn(int(layer.plan(counts).total_rows), 16, generator=g)
    return (h, torch.randn(4, 16, 8, generator=g), counts, ids, torch.rand(8, 2, generator=g))


def test_autotune_order_auto_times_both_orders_and_caches_the_faster(tmp_path, monkeypatch):
    import moe_overlap.timing as timing
    fake = _FakeOrderImpl()

    def time_calls(fn, reps=1, replays=1, barrier=None, graph=True):
        fn()
        c, m, order = fake.calls[-1]
        # expert order faster at its best pair (ccta 8, mgb 4) than remote_first anywhere
        return ((abs(c - 8) + abs(m - 4) + 0.5) if order == "expert" else abs(c - 12) + m + 1.0,
                "graph", [])

    monkeypatch.setattr(timing, "time_calls", time_calls)
    cache = TuneCache(str(tmp_path / "t.json"))
    layer = MoECombine(4, 16, 8, 2, 8, tile_m=64, backend="reference", ccta=4, mgb=2,
                       options=CombineOptions(order="auto"))
    assert layer.options.order == "remote_first"  # untuned, one rank: analytic_order
    assert "|order=auto|" in layer.tune_key  # the requested order keys the entry
    monkeypatch.setattr(layer, "_overlap_impl", lambda device: fake)
    assert layer.autotune(*_tune_inputs(layer), cache=cache) == (8, 4)
    assert layer.options.order == "expert" and layer.plan(_tune_inputs(layer)[2]).order == "expert"
    assert {o for _, _, o in fake.calls} == {"remote_first", "expert"}  # both searched
    assert {c for c, _, o in fake.calls if o == "expert"} >= {4, 8, 12, 16}  # each its own scan
    entry = json.load(open(cache.path))[layer.tune_key]
    assert (entry["ccta"], entry["mgb"], entry["order"]) == (8, 4, "expert")
    assert "|order=auto|" in layer.tune_key  # unchanged by the tuned copy of the options
    # a new layer of the same bucket resolves order="auto" (and ccta / mgb) from the entry
    resolved = CombineOptions(order="auto").resolve(layer.facts, cache=cache)
    assert (resolved.ccta, resolved.mgb, resolved.order) == (8, 4, "expert")
    # an explicit order is its own bucket and times only that order
    fake.calls.clear()
    fixed = MoECombine(4, 16, 8, 2, 8, tile_m=64, backend="reference", ccta=4, mgb=2,
                       options=CombineOptions(order="remote_first"))
    monkeypatch.setattr(fixed, "_overlap_impl", lambda device: fake)
    assert fixed.autotune(*_tune_inputs(fixed), cache=cache) == (12, 1)
    assert {o for _, _, o in fake.calls} == {"remote_first"} and fixed.options.order == "remote_first"
    assert "order" not in json.load(open(cache.path))[fixed.tune_key]


def test_order_auto_refuses_a_cache_entry_with_a_bad_order(tmp_path):
    cache = TuneCache(str(tmp_path / "t.json"))
    layer = MoECombine(4, 16, 8, 2, 8, tile_m=64, backend="reference",
                       options=CombineOptions(order="auto"))
    cache.put(layer.tune_key, 8, 2, order="sideways")
    with pytest.raises(ValueError, match="order='sideways'"):
        CombineOptions(order="auto").resolve(layer.facts, cache=cache)
    with pytest.raises(ValueError, match="order='sideways'; choose from"):
        CombineOptions(order="sideways")


def _autotune_two_ranks(rank, W, folder):
    """Each rank reads its own tune cache (as on two nodes), holding different entries for the
    layer's key: autotune makes every rank run rank 0's entry (a hit: nothing timed)."""
    import os
    from moe_overlap.combine import exchange_counts
    os.environ["MOE_OVERLAP_TUNE_CACHE"] = os.path.join(folder, f"rank{rank}.json")
    layer = MoECombine(4, 16, 8, 2, 8, tile_m=64, backend="reference", ccta=4, mgb=2,
                       options=CombineOptions(order="auto"))
    cache = TuneCache(os.path.join(folder, f"rank{rank}.json"))
    mine = {0: (8, 2, "expert"), 1: (16, 4, "remote_first")}[rank]
    cache.put(layer.tune_key, mine[0], mine[1], order=mine[2])
    fake = _FakeOrderImpl()
    object.__setattr__(layer, "_overlap_impl", lambda device: fake)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 4, (8, 2), generator=g)
    counts = exchange_counts(ids, 4)
    h = torch.randn(int(layer.plan(counts).total_rows), 16, generator=g)
    got = layer.autotune(h, torch.randn(2, 16, 8, generator=g), counts, ids,
                         torch.rand(8, 2, generator=g), cache=cache)
    return got, layer.options.order, len(fake.calls)


def test_autotune_ranks_run_rank0s_entry():
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        res = spawn_ranks(_autotune_two_ranks, 2, folder)
    assert res == [((8, 2), "expert", 0)] * 2


def test_autotune_reads_a_cached_entry_as_construction_does(tmp_path, monkeypatch):
    """A hit is capped at the GPU's SM count - 1 and its order checked, as options.resolve does."""
    layer = MoECombine(4, 16, 8, 2, 8, tile_m=64, backend="reference", ccta=4, mgb=2,
                       options=CombineOptions(order="auto"))
    fake = _FakeOrderImpl()
    monkeypatch.setattr(layer, "_overlap_impl", lambda device: fake)
    cache = TuneCache(str(tmp_path / "t.json"))
    cache.put(layer.tune_key, 500, 2, order="expert")  # tuned on a part with more SMs
    assert layer.autotune(*_tune_inputs(layer), cache=cache) == (131, 2)
    assert layer.options.order == "expert" and not fake.calls
    cache.put(layer.tune_key, 8, 2, order="sideways")
    with pytest.raises(ValueError, match="sideways"):
        layer.autotune(*_tune_inputs(layer), cache=cache)
