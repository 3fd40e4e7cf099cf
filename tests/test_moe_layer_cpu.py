"""MoELayer on CPU ranks (gloo, the reference backend), split over W = 1, 2, 4 ranks (rank r owns
experts r * E / W ...), with ranks that route 0 tokens and a skewed routing in which only rank 0's
experts are chosen (the other ranks receive nothing):

(a) outputs and gradients (of the tokens and of every weight) equal a float64 MoE written plainly
    in one process from the full weights (tests/moe_truth.py, which shares no code with the
    library);
(b) outputs and gradients equal HuggingFace transformers' Qwen3-MoE sparse block
    (``Qwen3MoeSparseMoeBlock``) run in one process on all ranks' tokens with the same weights
    (its router ``gate`` and its experts' fused gate/up and down projections), float32, with and
    without ``norm_topk_prob``.

Each rank's loss is <out_r, cot_r>; the expert weights' gradients arrive on their owner (the
exchanges' backward), the replicated router's are each rank's share and are summed here."""
import pytest
import torch

from conftest import spawn_ranks
from moe_truth import plain_moe_grads

D, K, E, TOPK, T_MAX = 16, 12, 8, 2, 24
WEIGHTS = ("router", "w_gate", "w_up", "w_down")


def _case(W: int, sizes, skew: bool, norm: bool, dtype, seed: int) -> dict:
    """Full weights (x @ w: router [D, E], w_gate / w_up [E, D, K], w_down [E, K, D]), each rank's
    tokens [T_r, D] and output cotangent. skew: the tokens share a direction u that the router
    maps onto experts 0 .. TOPK - 1 (all on rank 0), so every token picks those."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=f64) * scale

    w = dict(router=randn(D, E, scale=D ** -0.5), w_gate=randn(E, D, K, scale=D ** -0.5),
             w_up=randn(E, D, K, scale=D ** -0.5), w_down=randn(E, K, D, scale=K ** -0.5))
    xs = [randn(T, D) for T in sizes]
    if skew:
        u = randn(D)
        u /= u.norm()
        w["router"][:, :TOPK] += 4 * u[:, None]
        xs = [x + 4 * u for x in xs]
    cots = [randn(T, D) for T in sizes]
    return dict(weights={n: t.to(dtype) for n, t in w.items()}, xs=[x.to(dtype) for x in xs],
                cots=[c.to(dtype) for c in cots], norm=norm, dtype=dtype, W=W)


def _cases(W: int, dtype, seed: int) -> list[dict]:
    uneven = [5 + 3 * r for r in range(W)]
    if W > 1:
        uneven[-1] = 0  # a rank with no tokens
    skewed = [7, 0, 9, 4][:W]
    out = [_case(W, uneven, skew=False, norm=False, dtype=dtype, seed=seed),
           _case(W, skewed, skew=True, norm=True, dtype=dtype, seed=seed + 1)]
    if W == 1:
        out.append(_case(W, [0], skew=False, norm=True, dtype=dtype, seed=seed + 2))
    return out


def _run_layer(rank, world, cases):
    """This rank's MoELayer from the full weights: output, gradients of its tokens, of its
    parameters (w_gate_up, w_down: its experts; router: its share)."""
    from moe_overlap import MoELayer
    res = []
    for c in cases:
        w = c["weights"]
        layer = MoELayer.from_full_weights(w["router"], w["w_gate"], w["w_up"], w["w_down"],
                                           topk=TOPK, max_tokens_per_rank=T_MAX, tile_m=64,
                                           backend="reference", norm_topk_prob=c["norm"])
        assert layer.w_gate_up.shape == (E // world, D, 2 * K)
        x = c["xs"][rank].clone().requires_grad_()
        out = layer(x)
        (out * c["cots"][rank]).sum().backward()
        grads = {n: (torch.zeros_like(p) if p.grad is None else p.grad)
                 for n, p in layer.named_parameters()}
        res.append(dict(out=out.detach(), x=x.grad, **grads))
    return res


def _rel(got, want) -> float:
    """Max abs error over the largest magnitude of the truth (0 for two empty tensors)."""
    assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
    if want.numel() == 0:
        return 0.0
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp(
        min=1e-30))


def _compare(res, truth_outs, truth_x, truth_w, W, tol, what):
    """Every rank's output and token gradients against the truth's slice, its experts' weight
    gradients against the truth's rows of those experts, the summed router gradient."""
    El = E // W
    for r in range(W):
        mine = slice(r * El, (r + 1) * El)
        got = res[r]
        errs = {"out": _rel(got["out"], truth_outs[r]), "grad x": _rel(got["x"], truth_x[r]),
                "grad w_gate_up": _rel(got["w_gate_up"], torch.cat(
                    [truth_w["w_gate"][mine], truth_w["w_up"][mine]], dim=2)),
                "grad w_down": _rel(got["w_down"], truth_w["w_down"][mine])}
        bad = {k: v for k, v in errs.items() if not v <= tol}
        assert not bad, f"{what}, rank {r} of {W}: {bad} > {tol}"
    router = sum(res[r]["router"] for r in range(W))
    err = _rel(router, truth_w["router"])
    assert err <= tol, f"{what}: grad router (summed over ranks) {err} > {tol}"


@pytest.mark.parametrize("W", [1, 2, 4])
def test_moe_layer_matches_a_plain_float64_moe_outputs_and_gradients(W):
    cases = _cases(W, torch.float64, seed=100 + W)
    results = spawn_ranks(_run_layer, W, cases, timeout_s=120, join_timeout_s=300)
    for i, c in enumerate(cases):
        outs, gx, gw, chosen = plain_moe_grads(c["xs"], c["cots"], c["weights"], TOPK, c["norm"])
        if c is cases[1]:  # the skewed case does what it says: only rank 0's experts chosen
            assert {e for ids in chosen for t in ids for e in t} <= set(range(E // W))
        _compare([res[i] for res in results], outs, gx, gw, W, 1e-10, f"case {i}")


@pytest.mark.parametrize("W", [2])
def test_moe_layer_init_is_the_same_global_layer_at_any_world_size(W):
    """MoELayer(seed=s) on W ranks holds the slices of the one-rank layer of the same seed."""
    from moe_overlap import MoELayer
    full = MoELayer(D, K, E, TOPK, T_MAX, seed=5, backend="reference", tile_m=64)
    res = spawn_ranks(_init_params, W, timeout_s=60, join_timeout_s=180)
    El = E // W
    for r, p in enumerate(res):
        assert torch.equal(p["router"], full.router.detach())
        assert torch.equal(p["w_gate_up"], full.w_gate_up.detach()[r * El:(r + 1) * El])
        assert torch.equal(p["w_down"], full.w_down.detach()[r * El:(r + 1) * El])


def _init_params(rank, world):
    from moe_overlap import MoELayer
    layer = MoELayer(D, K, E, TOPK, T_MAX, seed=5, backend="reference", tile_m=64)
    return {n: p.detach() for n, p in layer.named_parameters()}


def _bad_dtype_on_rank_1(rank, world):
    from moe_overlap import MoELayer
    from moe_overlap.combine import PeerInputError
    layer = MoELayer(D, K, E, TOPK, T_MAX, dtype=torch.float64, backend="reference", tile_m=64)
    x = torch.randn(3, D, dtype=torch.float32 if rank == 1 else torch.float64)
    try:
        layer(x)
    except (TypeError, PeerInputError) as e:
        return type(e).__name__, str(e)
    return None


def test_bad_input_on_one_rank_raises_on_every_rank():
    res = spawn_ranks(_bad_dtype_on_rank_1, 2, timeout_s=60, join_timeout_s=180)
    assert res[1][0] == "TypeError" and "float32" in res[1][1], res
    assert res[0][0] == "PeerInputError" and "rank 1" in res[0][1], res


def _both_dispatches(rank, world):
    from moe_overlap import MoEDispatch, MoELayer
    from moe_overlap.moe_layer import AllToAllDispatch
    dedup = MoELayer(D, K, E, TOPK, T_MAX, seed=3, backend="reference", tile_m=64)
    a2a = MoELayer(D, K, E, TOPK, T_MAX, seed=3, backend="reference", tile_m=64,
                   dispatch=AllToAllDispatch())
    x = torch.randn(7 + 5 * rank, D, generator=torch.Generator().manual_seed(40 + rank))
    return dict(default=type(dedup.dispatch) is MoEDispatch,
                equal=bool(torch.equal(dedup(x), a2a(x))))


def test_the_default_dispatch_sends_once_per_rank_and_gives_the_same_output():
    # MoEDispatch (each token once per owning rank) is the layer's dispatch; the per-assignment
    # all-to-all it replaced gives the same output, bitwise
    for r in spawn_ranks(_both_dispatches, 2, timeout_s=60, join_timeout_s=180):
        assert r == dict(default=True, equal=True), r


# ------------------------------------------------------------------ (b) transformers Qwen3-MoE
def _qwen3_block(c):
    """transformers' Qwen3-MoE sparse block with the case's full weights (nn.Linear weights are
    ours transposed): its router ``gate`` (weight [E, D]) and its experts, in either layout of
    the releases: transformers >= 5 keeps them fused (``experts.gate_up_proj`` [E, 2K, D], gate
    rows first, ``experts.down_proj`` [E, D, K]), 4.x as one Qwen3MoeMLP per expert
    (``experts[e].gate_proj`` / ``up_proj`` [K, D], ``down_proj`` [D, K])."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    cfg = Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=K, num_experts=E,
                         num_experts_per_tok=TOPK, norm_topk_prob=c["norm"], hidden_act="silu")
    cfg._experts_implementation = "eager"  # >= 5: transformers' own per-expert loop
    block = Qwen3MoeSparseMoeBlock(cfg).to(c["dtype"])
    w = c["weights"]
    with torch.no_grad():
        block.gate.weight.copy_(w["router"].T)
        if isinstance(block.experts, torch.nn.ModuleList):
            for e, mlp in enumerate(block.experts):
                mlp.gate_proj.weight.copy_(w["w_gate"][e].T)
                mlp.up_proj.weight.copy_(w["w_up"][e].T)
                mlp.down_proj.weight.copy_(w["w_down"][e].T)
        else:
            block.experts.gate_up_proj.copy_(
                torch.cat([w["w_gate"], w["w_up"]], 2).transpose(1, 2))
            block.experts.down_proj.copy_(w["w_down"].transpose(1, 2))
    return block


def _qwen3_grads(c):
    """The block on every rank's tokens as one [1, T, D] batch: outputs and token gradients per
    rank, weight gradients in our layout (x @ w)."""
    block = _qwen3_block(c)
    sizes = [x.shape[0] for x in c["xs"]]
    x = torch.cat(c["xs"]).unsqueeze(0).clone().requires_grad_()
    out = block(x)
    out = out[0] if isinstance(out, tuple) else out  # 4.x: (out, router_logits)
    (out.squeeze(0) * torch.cat(c["cots"])).sum().backward()

    def grad(p):  # an expert no token chose has none
        return torch.zeros_like(p) if p.grad is None else p.grad

    if isinstance(block.experts, torch.nn.ModuleList):
        gw = {n: torch.stack([grad(getattr(m, proj).weight).T for m in block.experts])
              for n, proj in (("w_gate", "gate_proj"), ("w_up", "up_proj"),
                              ("w_down", "down_proj"))}
    else:
        gate_up = grad(block.experts.gate_up_proj).transpose(1, 2)  # [E, D, 2K]
        gw = dict(w_gate=gate_up[..., :K], w_up=gate_up[..., K:],
                  w_down=grad(block.experts.down_proj).transpose(1, 2))
    gw["router"] = block.gate.weight.grad.T
    return (list(out.detach().squeeze(0).split(sizes)), list(x.grad.squeeze(0).split(sizes)), gw)


@pytest.mark.parametrize("W", [1, 2, 4])
def test_moe_layer_matches_transformers_qwen3_moe_block_split_over_ranks(W):
    # (a layer with no token at all is the float64 test's; the block then has no graph)
    cases = [c for c in _cases(W, torch.float32, seed=200 + W) if sum(map(len, c["xs"]))]
    cases += [_case(W, [6 + r for r in range(W)], skew=False, norm=True, dtype=torch.float32,
                    seed=300 + W)]
    assert {c["norm"] for c in cases} == {True, False}
    results = spawn_ranks(_run_layer, W, cases, timeout_s=120, join_timeout_s=300)
    for i, c in enumerate(cases):
        outs, gx, gw = _qwen3_grads(c)
        _compare([res[i] for res in results], outs, gx, gw, W, 2e-5, f"Qwen3-MoE case {i}")

