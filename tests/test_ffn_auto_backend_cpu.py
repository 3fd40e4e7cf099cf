"""backend="auto" of FusedFFN / ShardedExperts (moe_overlap.ffn.tuning.choose_backend): the
reference where the model (or a measurement) says the fused backend is not faster, the fused
backend where the model says it is, a tune-cache entry over the model, the reason kept on the
layer, and clear errors for bad values."""
import json

import pytest
import torch

from moe_overlap.ffn import FusedFFN, ShardedExperts
from moe_overlap.ffn import layers as ffn_layers
from moe_overlap.ffn.projection import FFNRates
from moe_overlap.ffn.shapes import FFN_SHAPES
from moe_overlap.ffn.tuning import (AUTO_MIN_SPEEDUP, FFNTuneCache, choose_backend,
                                    ffn_tune_key)

H200 = "NVIDIA H200"


def _fast_reduce_rates():
    """Rates under which the reduce kernel would be 3x torch's compute and its all-reduce
    NCCL-fast on few SMs: the model says fused."""
    r = FFNRates()
    r.reduce_rel = {k: 3.0 for k in r.reduce_rel}
    r.ar_gbps_per_sm = 60.0
    return r


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("tokens", [8192, 32768])
def test_todays_rates_pick_the_reference_on_every_seed_shape(G, tokens, tmp_path):
    empty = FFNTuneCache(str(tmp_path / "none.json"))
    for name, (P, O) in FFN_SHAPES.items():
        b, why = choose_backend(P, O, P, G, tokens=tokens, device_name=H200, cache=empty)
        assert b == "reference", (name, why)
        # the rates of the seed shape with these dimensions (mixtral's expert = llama3-8b's)
        first = next(n for n, dims in FFN_SHAPES.items() if dims == (P, O))
        assert why.startswith("auto: modelled") and first in why and f"G={G}" in why
        speed = float(why.split("fused ")[1].split("x the reference")[0])
        assert speed < AUTO_MIN_SPEEDUP


def test_model_picks_fused_where_it_projects_a_gain(tmp_path):
    empty = FFNTuneCache(str(tmp_path / "none.json"))
    P, O = FFN_SHAPES["llama3-8b"]
    b, why = choose_backend(P, O, P, 2, device_name=H200, cache=empty, rates=_fast_reduce_rates())
    assert b == "fused", why
    assert float(why.split("fused ")[1].split("x the reference")[0]) >= AUTO_MIN_SPEEDUP
    # a shape outside the seed shapes gets the median rates, and says so
    b, why = choose_backend(1024, 4096, 1024, 2, device_name=H200, cache=empty)
    assert b == "reference" and "median" in why


def test_a_measurement_overrides_the_model(tmp_path):
    P, O = FFN_SHAPES["llama3-8b"]
    cache = FFNTuneCache(str(tmp_path / "tune.json"))
    cache.put(ffn_tune_key(H200, 2, P, O, P, False, 8192), fused_ms=1.40, reference_ms=1.56)
    cache = FFNTuneCache(cache.path)  # as read back from the file
    b, why = choose_backend(P, O, P, 2, tokens=8192, device_name=H200, cache=cache)
    assert b == "fused" and "measured" in why and "1.11x" in why
    # the bucket: 6000 tokens round up to 8192's entry, 9000 to another (none: the model)
    assert choose_backend(P, O, P, 2, tokens=6000, device_name=H200, cache=cache)[0] == "fused"
    assert choose_backend(P, O, P, 2, tokens=9000, device_name=H200, cache=cache)[0] == \
        "reference"
    # a measured loss beats a modelled gain
    fast = _fast_reduce_rates()
    assert choose_backend(P, O, P, 2, tokens=32768, device_name=H200, cache=cache,
                          rates=fast)[0] == "fused"
    cache.put(ffn_tune_key(H200, 2, P, O, P, False, 32768), fused_ms=1.0, reference_ms=0.9)
    b, why = choose_backend(P, O, P, 2, tokens=32768, device_name=H200, cache=cache, rates=fast)
    assert b == "reference" and "measured" in why
    # neither a measurement nor the model runs a backend that cannot run, or one rank
    b, why = choose_backend(P, O, P, 2, device_name=H200, cache=cache, cannot_run="no GPU")
    assert b == "reference" and "cannot run here (no GPU)" in why
    assert choose_backend(P, O, P, 1, device_name=H200, cache=cache)[0] == "reference"


def test_bad_tune_cache_is_a_clear_error(tmp_path):
    P, O = FFN_SHAPES["llama3-8b"]
    key = ffn_tune_key(H200, 2, P, O, P, False, 8192)
    path = tmp_path / "t.json"
    path.write_text(json.dumps({key: {"fused_ms": "fast", "reference_ms": 1.0}}))
    with pytest.raises(ValueError, match="fused_ms and reference_ms"):
        choose_backend(P, O, P, 2, device_name=H200, cache=FFNTuneCache(str(path)))
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        FFNTuneCache(str(path))


def test_auto_layer_on_cpu_is_the_reference_and_says_why():
    m = FusedFFN(64, 256, backend="auto")
    assert m.requested_backend == "auto" and m.backend == "reference"
    assert "one rank" in m.backend_reason and m.backend_reason in repr(m)
    assert m.w1.requires_grad  # the reference's parameters train
    ref = FusedFFN(64, 256, backend="reference")
    assert ref.backend_reason == "requested backend='reference'"
    assert "backend_reason" not in repr(ref) and "auto" not in repr(ref)
    torch.manual_seed(0)
    W1, b1, W2, b2 = (torch.randn(64, 256), torch.randn(256), torch.randn(256, 64),
                      torch.randn(64))
    a = FusedFFN.from_full_weights(W1, b1, W2, b2, backend="auto", dtype=torch.float32)
    r = FusedFFN.from_full_weights(W1, b1, W2, b2, backend="reference", dtype=torch.float32)
    x = torch.randn(5, 64)
    assert torch.equal(a(x), r(x))
    e = ShardedExperts(2, 64, 256, backend="auto", ccta=8)  # fused options kept, unused
    assert e.backend == "reference" and e.options.ccta == 8 and "one rank" in repr(e)


def _pretend_two_hopper_ranks(monkeypatch, made):
    """The decision as on a rank of 2 with a usable H200 (CPU tensors; the fused set-up is
    replaced by a recorder)."""
    monkeypatch.setattr(ffn_layers, "_group_world", lambda group: (0, 2))
    monkeypatch.setattr(ffn_layers, "_check_device_vs_group", lambda *a: None)
    monkeypatch.setattr(ffn_layers, "_fused_missing", lambda comm, device: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: H200)
    monkeypatch.setattr(ffn_layers._FusedBackend, "_init_fused",
                        lambda self, device: made.append(type(self).__name__))


def test_auto_layer_reads_the_tune_cache(monkeypatch, tmp_path):
    made = []
    _pretend_two_hopper_ranks(monkeypatch, made)
    path = tmp_path / "ffn_tune.json"
    monkeypatch.setenv("MOE_OVERLAP_FFN_TUNE_CACHE", str(path))
    P, O, N = 256, 1024, 256
    m = FusedFFN(P, O, N, backend="auto", dtype=torch.bfloat16, max_tokens=4096)
    assert m.backend == "reference" and "modelled" in m.backend_reason and made == []
    FFNTuneCache(str(path)).put(ffn_tune_key(H200, 2, P, O, N, False, 4096), fused_ms=0.5,
                                reference_ms=0.6)
    m = FusedFFN(P, O, N, backend="auto", dtype=torch.bfloat16, max_tokens=4096)
    assert m.backend == "fused" and "measured" in m.backend_reason and made == ["FusedFFN"]
    assert not m.w1.requires_grad  # fused: inference-only parameters
    # the grouped layer has its own bucket: no entry, the model
    e = ShardedExperts(4, P, O, N, backend="auto", max_tokens=4096)
    assert e.backend == "reference" and made == ["FusedFFN"]
    # dtype and shapes the fused kernels cannot take: the reference, whatever the cache says
    m = FusedFFN(P, O, N, backend="auto", dtype=torch.float32, max_tokens=4096)
    assert m.backend == "reference" and "bfloat16" in m.backend_reason
    m = FusedFFN(P + 32, O, N, backend="auto", dtype=torch.bfloat16, max_tokens=4096)
    assert m.backend == "reference" and "in_features % 64" in m.backend_reason


@pytest.mark.parametrize("kw, err, match", [
    (dict(backend="fastest"), ValueError, "'auto'"),
    (dict(backend="auto", ccta=0), ValueError, "ccta"),
    (dict(backend="auto", comm="carrier-pigeon"), ValueError, "comm"),
    (dict(backend="auto", tile_m=96), ValueError, "tile_m"),
    (dict(backend="auto", max_tokens=0), ValueError, "max_tokens"),
])
def test_bad_values_are_refused_before_any_work(kw, err, match):
    with pytest.raises(err, match=match):
        FusedFFN(64, 256, **kw)
    with pytest.raises(err, match=match):
        ShardedExperts(2, 64, 256, **kw)


def test_the_decision_is_for_the_compute_kernel_asked_for(tmp_path):
    # a measurement of compute="reduce" says nothing of compute="chained" (and back), and the
    # model is asked about the kernel the layer will run
    P, O = FFN_SHAPES["llama3-8b"]
    cache = FFNTuneCache(str(tmp_path / "tune.json"))
    cache.put(ffn_tune_key(H200, 2, P, O, P, False, 8192, "reduce"), fused_ms=1.40,
              reference_ms=1.56)
    cache = FFNTuneCache(cache.path)
    b, why = choose_backend(P, O, P, 2, tokens=8192, device_name=H200, cache=cache,
                            compute="reduce")
    assert b == "fused" and "measured" in why
    b, why = choose_backend(P, O, P, 2, tokens=8192, device_name=H200, cache=cache,
                            compute="chained")
    assert why.startswith("auto: modelled") and "compute='chained'" in why
    from moe_overlap.ffn.projection import layer_speedup
    sp = layer_speedup(P, O, P, 8192, 2, "chained")["speedup"]
    assert (b == "fused") == (sp >= AUTO_MIN_SPEEDUP), (b, sp, why)
    assert f"{sp:.2f}x" in why
    with pytest.raises(ValueError, match="compute='split'"):
        choose_backend(P, O, P, 2, device_name=H200, cache=cache, compute="split")


def _two_ranks_with_a_dense_chained_entry(monkeypatch, tmp_path, P, O, N):
    """Two pretended Hopper ranks and a tune cache whose one entry measures the dense chained
    layer of (P, O, N) at 4096 tokens faster than the reference; returns (the layers' record of
    fused backends made, the cache path)."""
    made = []
    _pretend_two_hopper_ranks(monkeypatch, made)
    path = tmp_path / "ffn_tune.json"
    monkeypatch.setenv("MOE_OVERLAP_FFN_TUNE_CACHE", str(path))
    FFNTuneCache(str(path)).put(ffn_tune_key(H200, 2, P, O, N, False, 4096, "chained"),
                                fused_ms=0.5, reference_ms=0.6)
    return made, path


def test_auto_layer_decides_for_the_compute_keyword(monkeypatch, tmp_path):
    # compute= as a keyword reaches the decision as it does through options=
    P, O, N = 256, 1024, 256
    made, path = _two_ranks_with_a_dense_chained_entry(monkeypatch, tmp_path, P, O, N)
    m = FusedFFN(P, O, N, backend="auto", dtype=torch.bfloat16, max_tokens=4096,
                 compute="chained")
    assert m.backend == "fused" and "measured" in m.backend_reason and "chained" in \
        m.backend_reason, m.backend_reason
    m = FusedFFN(P, O, N, backend="auto", dtype=torch.bfloat16, max_tokens=4096)
    assert "compute='reduce'" in m.backend_reason  # the reduce bucket has no entry: the model


def test_auto_experts_layer_decides_for_chained(monkeypatch, tmp_path):
    # ShardedExperts(compute="chained") as FusedFFN: its own bucket (experts, chained) is read,
    # and a chained entry of the dense layer does not decide for the experts layer
    P, O, N = 256, 1024, 256
    made, path = _two_ranks_with_a_dense_chained_entry(monkeypatch, tmp_path, P, O, N)
    e = ShardedExperts(4, P, O, N, backend="auto", max_tokens=4096, compute="chained")
    assert e.backend == "reference" and "modelled" in e.backend_reason \
        and "compute='chained'" in e.backend_reason and made == [], e.backend_reason
    FFNTuneCache(str(path)).put(ffn_tune_key(H200, 2, P, O, N, True, 4096, "chained"),
                                fused_ms=0.5, reference_ms=0.6)
    e = ShardedExperts(4, P, O, N, backend="auto", max_tokens=4096, compute="chained")
    assert e.backend == "fused" and "measured" in e.backend_reason and made == ["ShardedExperts"]
