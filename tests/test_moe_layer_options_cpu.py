"""CPU checks of MoELayer's overlap wiring that need no GPU (issue 39 items 2-3): the layer's
options resolved once (``resolve_layer``: "auto" falls back, "overlap" refuses with the reason),
the SwiGLU weight layout stored once (interleaved for the kernel, the reference path reading the
same parameter), and MoEDispatch's signal_arrival option refused off the overlap backend."""
import pytest
import torch

from moe_overlap import MoEDispatch, MoELayer
from moe_overlap.combine.grouped_gemm import (deinterleave_gate_up, interleave_gate_up,
                                              split_gate_up)
from moe_overlap import moe_layer
from moe_overlap.moe_layer import MoELayerOptions, resolve_layer

D, K, E, TOPK, T_MAX = 128, 128, 8, 2, 16
OK = (True, "")


def _resolve(backend="auto", options=None, **kw):
    facts = dict(world_size=2, dtype=torch.bfloat16, hidden_size=D, intermediate_size=K,
                 tile_m=128, transport="nvlink", overlap_ok=OK)
    facts.update(kw)
    return resolve_layer(backend, options, **facts)


def test_auto_stays_on_the_reference_until_the_overlap_layer_ran_on_a_gpu():
    # the overlapped dispatch and gated up-projection have not run on a GPU: "auto" must not
    # pick them even where they could run; "overlap" asked still resolves to them
    assert moe_layer.AUTO_PICKS_OVERLAP is False
    backend, o = _resolve()
    assert (backend, o.weight_layout, o.up_ccta) == ("reference", "halves", 0)
    assert _resolve("overlap")[0] == "overlap"


def test_auto_resolves_to_overlap_only_where_it_runs_and_once(monkeypatch):
    monkeypatch.setattr(moe_layer, "AUTO_PICKS_OVERLAP", True)
    backend, o = _resolve()
    assert backend == "overlap"
    # nothing left to resolve: the kernel's layout and the SMs left to the dispatch's kernels
    assert o.weight_layout == "interleaved" and o.up_ccta == o.send_ctas == 8
    assert _resolve(options=MoELayerOptions(send_ctas=3))[1].up_ccta == 3
    assert _resolve(options=MoELayerOptions(up_ccta=5))[1].up_ccta == 5
    assert _resolve(options=MoELayerOptions(up_stream="same"))[1].up_ccta == 0
    # without a usable device, at W = 1, or with another dtype: the reference, gate half first
    for kw in (dict(overlap_ok=(False, "CUDA is not available")), dict(world_size=1),
               dict(dtype=torch.float32)):
        backend, o = _resolve(**kw)
        assert (backend, o.weight_layout, o.up_ccta) == ("reference", "halves", 0), kw
    # W = 1 asked explicitly: the overlap path runs (one rank's own arrivals)
    assert _resolve("overlap", world_size=1)[0] == "overlap"
    # "reference" keeps a layout asked for (a converted checkpoint read on the CPU)
    ref = _resolve("reference", MoELayerOptions(weight_layout="interleaved"))
    assert ref == ("reference", MoELayerOptions(weight_layout="interleaved", up_ccta=0,
                                                counts_exchange="host"))


def test_counts_exchange_resolves_to_the_device_on_the_overlap_backend_only():
    """The overlap backend exchanges the counts through its CommBuffer unless "host" is asked;
    the reference backend (no CommBuffer) always on the host; a bad value is refused."""
    assert _resolve("overlap")[1].counts_exchange == "device"
    assert _resolve("overlap", MoELayerOptions(counts_exchange="host"))[1].counts_exchange \
        == "host"
    for asked in ("auto", "device", "host"):
        o = _resolve("reference", MoELayerOptions(counts_exchange=asked))[1]
        assert o.counts_exchange == "host", asked
    with pytest.raises(ValueError, match="counts_exchange='nccl'"):
        MoELayerOptions(counts_exchange="nccl").validate()


@pytest.mark.parametrize("kw, exc, words", [
    (dict(overlap_ok=(False, "needs a Hopper (sm_90) GPU")), RuntimeError, "Hopper"),
    (dict(dtype=torch.float16), TypeError, "bfloat16"),
    (dict(hidden_size=96), ValueError, "hidden_size=96 must be a multiple of 64"),
    (dict(intermediate_size=96), ValueError, "intermediate_size=96 must be a multiple of 64"),
    (dict(intermediate_size=64), ValueError, "up_tile_n / 2 = 128"),
    (dict(tile_m=256), ValueError, "tile_m=256"),
    (dict(options=MoELayerOptions(weight_layout="halves")), ValueError, "interleaved layout"),
    (dict(custom_dispatch=True), ValueError, "dispatch= seam"),
    (dict(options=MoELayerOptions(up_ccta=0)), ValueError, "up_ccta=0"),
])
def test_overlap_asked_where_it_cannot_run_says_why_and_auto_falls_back(kw, exc, words,
                                                                         monkeypatch):
    monkeypatch.setattr(moe_layer, "AUTO_PICKS_OVERLAP", True)
    options = kw.pop("options", None)
    with pytest.raises(exc, match=words.replace("(", r"\(").replace(")", r"\)")):
        _resolve("overlap", options, **kw)
    if "up_ccta" not in repr(options):  # a bad option value is no fallback: it raises anyway
        assert _resolve("auto", options, **kw)[0] == "reference"


def test_overlap_runs_over_either_transport_of_the_combine(monkeypatch):
    """The layer's dispatch sends over the CommBuffer it shares with the combine, of the
    combine's transport: nvshmem resolves to the overlap layer as nvlink does (it was refused
    while the dispatch had no NVSHMEM send); an unknown transport raises."""
    monkeypatch.setattr(moe_layer, "AUTO_PICKS_OVERLAP", True)
    assert _resolve("overlap", transport="nvshmem") == _resolve("overlap")
    assert _resolve("auto", transport="nvshmem")[0] == "overlap"
    with pytest.raises(ValueError, match="transport='ib'"):
        _resolve("overlap", transport="ib")


@pytest.mark.parametrize("bad, words", [
    (dict(send_ctas=0), "send_ctas"), (dict(up_stream="next"), "up_stream"),
    (dict(arrival_timeout_s=-1), "arrival_timeout_s"), (dict(up_tile_n=96), "up_tile_n"),
    (dict(weight_layout="gate_first"), "weight_layout"), (dict(up_ccta="many"), "up_ccta"),
    (dict(expand_wait="each"), "expand_wait"), (dict(up_tile_fetch="atomic"), "up_tile_fetch"),
])
def test_bad_option_values_are_refused_on_every_backend(bad, words):
    for backend in ("reference", "auto", "overlap"):
        with pytest.raises((ValueError, TypeError), match=words):
            _resolve(backend, MoELayerOptions(**bad))
    with pytest.raises(TypeError, match="MoELayerOptions"):
        _resolve("auto", {"send_ctas": 8})


def test_layer_refuses_overlap_without_a_gpu_before_any_collective():
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        MoELayer(D, K, E, TOPK, T_MAX, dtype=torch.bfloat16, backend="overlap")
    layer = MoELayer(D, K, E, TOPK, T_MAX, dtype=torch.bfloat16)  # auto: the reference here
    assert layer.backend == "reference" and layer.options.weight_layout == "halves"
    assert "backend='reference'" in repr(layer)
    # the combine kept its own "auto" (the reference on this CPU); "reference" asked: everywhere
    assert layer.combine.requested_backend == "auto"
    ref = MoELayer(D, K, E, TOPK, T_MAX, dtype=torch.bfloat16, backend="reference")
    assert ref.combine.requested_backend == "reference" and ref.comm_buffer is None


def test_dispatch_signal_arrival_is_an_overlap_option():
    with pytest.raises(ValueError, match="backend='overlap'"):
        MoEDispatch(E, D, TOPK, T_MAX, backend="reference", signal_arrival=True)
    with pytest.raises(TypeError, match="bool"):
        MoEDispatch(E, D, TOPK, T_MAX, backend="reference", signal_arrival=1)
    ref = MoEDispatch(E, D, TOPK, T_MAX, backend="reference")
    from moe_overlap.combine import exchange_counts
    from moe_overlap.combine.plan import plan_combine
    ids = torch.tensor([[0, 5], [3, 1]])
    counts = exchange_counts(ids, E)
    with pytest.raises(ValueError, match="consumer="):
        ref(torch.zeros(2, D), ids, plan_combine(counts, 0, tile_m=64), counts,
            consumer=lambda out: None)


def test_the_per_source_expand_is_bounded_to_the_sms_the_gemm_leaves():
    from moe_overlap.moe_layer import expand_ctas
    _, o = _resolve("overlap", MoELayerOptions(send_ctas=6))
    assert o.expand_wait == "per_source" and expand_ctas(o) == 12  # 2 CTAs on each of 6 SMs
    _, o = _resolve("overlap", MoELayerOptions(up_ccta=3))
    assert expand_ctas(o) == 6
    # no GEMM beside it (same stream) or the two-kernel path: no bound
    assert expand_ctas(_resolve("overlap", MoELayerOptions(up_stream="same"))[1]) is None
    assert expand_ctas(_resolve("overlap", MoELayerOptions(expand_wait="all"))[1]) is None
    for kw, words in ((dict(expand_wait="per_source"), "backend='overlap'"),
                      (dict(expand_wait="each"), "expand_wait"),
                      (dict(expand_ctas=4), "backend='overlap'")):
        with pytest.raises(ValueError, match=words):
            MoEDispatch(E, D, TOPK, T_MAX, backend="reference", **kw)


# ------------------------------------------------------------------------- the weight layout
@pytest.mark.parametrize("tile_n", [64, 128, 256])
def test_interleave_round_trip_and_split_read_the_same_columns(tile_n):
    g = torch.Generator().manual_seed(tile_n)
    w = torch.randint(-8, 8, (3, 16, 2 * 384), generator=g).float()
    wi = interleave_gate_up(w, tile_n)
    assert not torch.equal(wi, w)  # the layout does move columns
    assert torch.equal(deinterleave_gate_up(wi, tile_n), w)
    assert torch.equal(interleave_gate_up(deinterleave_gate_up(wi, tile_n), tile_n), wi)
    # x @ (interleaved w) split by the interleaved layout = x @ w split in halves (exact:
    # small integers in float32)
    x = torch.randint(-4, 4, (5, 16), generator=g).float()
    for e in range(3):
        a = split_gate_up(x @ w[e])
        b = split_gate_up(x @ wi[e], tile_n)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    with pytest.raises(ValueError, match="multiple of tile_n"):
        deinterleave_gate_up(w[..., :-2], tile_n)


def test_layer_stores_the_kernel_layout_once_and_the_reference_reads_it():
    kw = dict(seed=4, backend="reference", tile_m=64, dtype=torch.float64)
    halves = MoELayer(D, K, E, TOPK, T_MAX, **kw)
    inter = MoELayer(D, K, E, TOPK, T_MAX, **kw,
                     layer_options=MoELayerOptions(weight_layout="interleaved", up_tile_n=128))
    assert inter.gate_up_tile_n == 128 and halves.gate_up_tile_n is None
    assert torch.equal(inter.w_gate_up.detach(),
                       interleave_gate_up(halves.w_gate_up.detach(), 128))
    assert torch.equal(inter.gate_up_halves().detach(), halves.w_gate_up.detach())
    assert halves.gate_up_halves() is halves.w_gate_up  # no copy in the reference layout
    # from_full_weights writes the layer's layout too
    g = torch.Generator().manual_seed(9)
    full = [torch.randn(*s, generator=g, dtype=torch.float64) for s in
            ((D, E), (E, D, K), (E, D, K), (E, K, D))]
    a = MoELayer.from_full_weights(*full, TOPK, T_MAX, backend="reference", tile_m=64)
    b = MoELayer.from_full_weights(*full, TOPK, T_MAX, backend="reference", tile_m=64,
                                   layer_options=MoELayerOptions(weight_layout="interleaved"))
    assert torch.equal(b.gate_up_halves().detach(), torch.cat(full[1:3], dim=2))
    assert torch.equal(a.w_gate_up.detach(), torch.cat(full[1:3], dim=2))
    # the same layer either way: outputs and gradients (the reference reads the parameter)
    x = torch.randn(11, D, generator=g, dtype=torch.float64)
    outs, grads = [], []
    for layer in (halves, inter):
        out = layer(x)
        out.square().sum().backward()
        outs.append(out.detach())
        gw = layer.w_gate_up.grad
        grads.append(gw if layer.gate_up_tile_n is None else
                     deinterleave_gate_up(gw, layer.gate_up_tile_n))
    assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-12)
    assert torch.allclose(grads[0], grads[1], rtol=0, atol=1e-10)


def test_up_order_is_kept_by_both_backends_and_checked():
    for backend in ("overlap", "reference"):
        for order in ("arrival", "expert"):
            assert _resolve(backend, MoELayerOptions(up_order=order))[1].up_order == order
    assert MoELayerOptions().up_order == "arrival"
    with pytest.raises(ValueError, match="up_order='band'"):
        _resolve("overlap", MoELayerOptions(up_order="band"))
