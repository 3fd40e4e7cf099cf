"""End-to-end MoE combine on CPU ranks (gloo) against the sequential baseline and a float64 truth."""
import pytest
import torch

from moe_overlap import MoECombine, plan_combine
from moe_overlap.combine import dispatch_to_plan, grouped_matmul
from moe_overlap.routing import ROUTER_MODES
from moe_overlap.combine.validation import LayerCase, check_layers, passed, run_layer


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_reference_backend_matches_baseline_every_router_mode(world_size):
    cases = [LayerCase(mode=m, seed=11 * world_size + i, tile_m=64 if i % 2 else 128, mgb=1 + i)
             for i, m in enumerate(ROUTER_MODES)]
    cases.append(LayerCase(mode="stress_skew", dtype="bfloat16", seed=5, topk=3, tokens=77))
    for case, res in zip(cases, check_layers(world_size, cases)):
        assert passed(res), (case, [(r["rel_err"], r["rel_err_f64"]) for r in res])
        assert len(res) == world_size


def test_single_process_without_process_group():
    res = run_layer(0, 1, LayerCase(mode="moderate_skew", tokens=50))
    assert passed([res]), res
    assert res["stats"]["remote_rows"] == 0


def test_wrong_result_is_detected(monkeypatch):
    """The check can fail: a combine that drops one assignment's contribution is caught."""
    import moe_overlap.combine.layer as combine

    real = combine.reference_combine

    def dropping(h, w_down, plan, topk_ids, topk_weights, group=None, **kw):
        gates = topk_weights.clone()
        gates[0, 0] = 0
        return real(h, w_down, plan, topk_ids, gates, group, **kw)

    monkeypatch.setattr(combine, "reference_combine", dropping)
    res = run_layer(0, 1, LayerCase())
    assert not passed([res]) and res["rel_err"] > 1e-4 and res["rel_err_f64"] > 1e-4


def _layer(world=1, **kw):
    args = dict(num_experts=4, intermediate_size=8, out_features=6, topk=2, max_tokens_per_rank=16,
                tile_m=64, backend="reference")
    args.update(kw)
    return MoECombine(**args)


def _inputs(T=5, K=8, N=6, El=4, E=4, dtype=torch.float32):
    ids = torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    counts = torch.bincount(ids.reshape(-1), minlength=E).unsqueeze(0)
    plan = plan_combine(counts, 0, tile_m=64)
    rows = int(plan.total_rows)
    return (torch.randn(rows, K, dtype=dtype), torch.randn(El, K, N, dtype=dtype), plan, ids,
            torch.rand(T, 2))


@pytest.mark.parametrize("mutate,exc,msg", [
    (lambda a: a.update(h=a["h"][:, :7]), ValueError, "hidden_size"),
    (lambda a: a.update(w_down=a["w_down"][:3]), ValueError, "w_down"),
    (lambda a: a.update(w_down=a["w_down"].double()), TypeError, "dtype"),
    (lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError, "int32 or int64"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:, :1]), ValueError, "topk"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:4]), ValueError, "shape"),
    (lambda a: a.update(topk_ids=a["topk_ids"] + 10), ValueError, "expert ids"),
    (lambda a: a.update(topk_ids=torch.zeros(17, 2, dtype=torch.long),
                        topk_weights=torch.ones(17, 2)), ValueError, "capacity"),
    (lambda a: a.update(plan=plan_combine(torch.ones(2, 4, dtype=torch.long), 1)), ValueError,
     "world size"),
    (lambda a: a.update(plan="plan"), TypeError, "CombinePlan"),
    (lambda a: a.update(w_down=a["w_down"].to("meta")), ValueError, "one device"),
    (lambda a: a.update(plan=a["plan"].to("meta")), ValueError, "one device"),
    (lambda a: a.update(h=a["h"][:10]), ValueError, "rows"),
])
def test_forward_rejects_bad_input(mutate, exc, msg):
    h, w, plan, ids, gates = _inputs()
    args = dict(h=h, w_down=w, plan=plan, topk_ids=ids, topk_weights=gates)
    mutate(args)
    with pytest.raises(exc, match=msg):
        _layer()(**args)


@pytest.mark.parametrize("num_experts", [4, 3])  # 3 experts on 1 rank: no power of two needed
def test_forward_on_good_input_matches_a_float64_truth(num_experts):
    """One rank, reference backend: out[t] = sum_k gate[t, k] * x[t] @ w_up[e] @ w_down[e],
    e = ids[t, k], summed token by token in float64 (no plan, no grouped GEMM)."""
    g = torch.Generator().manual_seed(3)
    T, D, K, N, E = 5, 7, 8, 6, num_experts
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])
    gates = torch.rand(T, 2, generator=g)
    x = torch.randn(T, D, generator=g)
    w_up, w_down = torch.randn(E, D, K, generator=g), torch.randn(E, K, N, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=E).unsqueeze(0)
    layer = _layer(num_experts=E)
    plan = layer.plan(counts)
    h = grouped_matmul(dispatch_to_plan(x, ids, plan, counts), w_up, plan.expert_rows.tolist())
    out = layer(h, w_down, plan, ids, gates)
    truth = torch.zeros(T, N, dtype=torch.float64)
    for t in range(T):
        for j in range(2):
            e = int(ids[t, j])
            truth[t] += float(gates[t, j]) * (x[t].double() @ w_up[e].double() @ w_down[e].double())
    assert out.dtype == torch.float32 and out.shape == (T, N)
    torch.testing.assert_close(out.double(), truth, rtol=1e-5, atol=1e-5)


def test_prepare_on_the_reference_backend():
    """prepare() is per routing; the reference backend needs nothing from it (None), forward takes
    routes=None or its result alike, and a bad routing fails clearly."""
    h, w, plan, ids, gates = _inputs()
    layer = _layer()
    routes = layer.prepare(plan, ids)
    assert routes is None
    assert torch.equal(layer(h, w, plan, ids, gates, routes=routes), layer(h, w, plan, ids, gates))
    with pytest.raises(ValueError, match="topk"):
        layer.prepare(plan, ids[:, :1])
    with pytest.raises(TypeError, match="CombinePlan"):
        layer.prepare("plan", ids)


@pytest.mark.parametrize("kw,msg", [
    (dict(tile_m=100), "tile_m"),
    (dict(topk=5), "topk"),
    (dict(max_tokens_per_rank=0), "max_tokens_per_rank"),
])
def test_constructor_rejects_bad_sizes(kw, msg):
    with pytest.raises(ValueError, match=msg):
        _layer(**kw)


def test_constructor_rejects_bad_backend_and_mgb():
    with pytest.raises(ValueError, match="backend"):
        MoECombine(4, 8, 6, 2, 16, backend="fast")
    with pytest.raises(ValueError, match="mgb"):
        MoECombine(4, 8, 6, 2, 16, mgb=0)
    with pytest.raises(ValueError, match="ccta"):
        MoECombine(4, 8, 6, 2, 16, ccta=-1)
    with pytest.raises(ValueError, match="ccta=0 must be an int >= 1 .0, no consumer"):
        MoECombine(4, 8, 6, 2, 16, ccta=0, local_copy=True)  # the consumer copies local rows
    with pytest.raises(ValueError, match="transport"):
        MoECombine(4, 8, 6, 2, 16, transport="pigeon")
    with pytest.raises(ValueError, match="copy"):
        MoECombine(4, 8, 6, 2, 16, transport="nvshmem", copy="tma")


def test_overlap_backend_without_gpu_raises_clearly():
    h, w, plan, ids, gates = _inputs()
    layer = MoECombine(4, 8, 6, 2, 16, tile_m=64, backend="overlap")
    with pytest.raises(RuntimeError, match="overlap"):
        layer(h, w, plan, ids, gates)


def test_plan_shape_mismatch():
    with pytest.raises(ValueError, match="expert_counts"):
        _layer().plan(torch.ones(1, 5, dtype=torch.long))
