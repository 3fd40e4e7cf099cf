"""README.md's "Using it in an MoE layer" snippet runs as written on 2 gloo ranks (every name it
uses defined by itself) and computes the MoE layer a plain loop computes: out[t] = sum_j w[t, j] *
silu(tokens[t] @ w_up[e]) @ w_down[e] over the token's top-k experts e = topk_ids[t, j]. Also
the constructor's names for the widths (intermediate_size; hidden_size deprecated)."""
import pathlib
import warnings

import pytest
import torch

from conftest import spawn_ranks

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def readme_snippet() -> str:
    section = README.read_text().split("## Using it in an MoE layer\n", 1)[1]
    return section.split("```python\n", 1)[1].split("\n```", 1)[0]


def _hand_written_moe(tokens, topk_ids, topk_weights, w_up_all, w_down_all):
    f64 = torch.float64
    out = torch.zeros(tokens.shape[0], w_down_all.shape[2], dtype=f64)
    for t in range(tokens.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            hidden = torch.nn.functional.silu(tokens[t].to(f64) @ w_up_all[e].to(f64))
            out[t] += float(topk_weights[t, j]) * (hidden @ w_down_all[e].to(f64))
    return out


def _run_snippet(rank, world, code):
    ns = {"__name__": "readme_snippet"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the snippet uses no deprecated name
        exec(compile(code, "README.md", "exec"), ns)
    E, D, K, N, T, k = (ns[n] for n in ("E", "D", "K", "N", "T", "k"))
    assert tuple(ns["w_up"].shape) == (E // world, D, K)
    assert tuple(ns["w_down"].shape) == (E // world, K, N)
    assert tuple(ns["h"].shape) == (int(ns["plan"].total_rows), K)
    out = ns["out"]
    assert tuple(out.shape) == (T, N) and ns["combine"].backend_for(out.device) == "reference"
    want = _hand_written_moe(ns["tokens"], ns["topk_ids"], ns["topk_weights"], ns["w_up_all"],
                             ns["w_down_all"])
    err = ((out.double() - want).norm() / want.norm()).item()
    return {"rank": rank, "T": T, "rel_err": err}


def test_readme_snippet_runs_on_two_ranks_and_matches_a_hand_written_moe():
    res = spawn_ranks(_run_snippet, 2, readme_snippet(), timeout_s=120)
    assert [r["T"] for r in res] == [10, 13]  # ranks route different token counts
    for r in res:
        assert r["rel_err"] < 1e-5, res


def _layer(**kw):
    from moe_overlap import MoECombine
    return MoECombine(num_experts=4, out_features=6, topk=2, max_tokens_per_rank=16, tile_m=64,
                      backend="reference", **kw)


def test_intermediate_size_names_the_experts_width_and_hidden_size_is_deprecated():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        layer = _layer(intermediate_size=8)
    assert layer.intermediate_size == layer.hidden_size == 8 and layer.out_features == 6
    with pytest.warns(DeprecationWarning, match="intermediate_size"):
        old = _layer(hidden_size=8)
    assert old.intermediate_size == 8
    with pytest.raises(TypeError, match="intermediate_size only"):
        _layer(intermediate_size=8, hidden_size=8)
    with pytest.raises(ValueError, match="intermediate_size must be a positive int"):
        _layer()


def readme_layer_snippet() -> str:
    """The section's MoELayer block ("the layer in five lines"), after the six-call snippet."""
    section = README.read_text().split("## Using it in an MoE layer\n", 1)[1].split("\n## ", 1)[0]
    blocks = [b.split("\n```", 1)[0] for b in section.split("```python\n")[1:]]
    found = [b for b in blocks if "MoELayer(" in b]
    assert len(found) == 1, "README: one MoELayer block in 'Using it in an MoE layer'"
    return found[0]


def _run_layer_snippet(rank, world, code):
    """Runs the block, then checks its output against tests/moe_truth.py's plain float64 MoE of
    the layer's full weights (all-gathered from the ranks) on every rank's tokens, and that the
    backward reached every weight."""
    import torch.distributed as dist

    from moe_truth import plain_moe
    ns = {"__name__": "readme_layer_snippet"}
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        exec(compile(code, "README.md", "exec"), ns)
    layer, tokens, out = ns["layer"], ns["tokens"], ns["out"]
    assert layer.combine.backend_for(out.device) == "reference"
    assert tuple(out.shape) == tuple(tokens.shape) == (10 + 3 * rank, 64)
    missing = [n for n, p in layer.named_parameters() if p.grad is None]

    def gathered(t):
        parts = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(parts, t.detach().contiguous())
        return torch.cat(parts)

    K = layer.intermediate_size
    gate_up, w_down = gathered(layer.w_gate_up), gathered(layer.w_down)
    f64 = torch.float64
    want, _ = plain_moe(tokens.to(f64), layer.router.detach().to(f64), gate_up[..., :K].to(f64),
                        gate_up[..., K:].to(f64), w_down.to(f64), layer.topk,
                        layer.norm_topk_prob)
    err = ((out.detach().double() - want).norm() / want.norm()).item()
    return {"rel_err": err, "missing_grads": missing, "experts": tuple(layer.w_down.shape)}


def test_readme_layer_snippet_runs_on_two_ranks_and_matches_a_plain_moe():
    res = spawn_ranks(_run_layer_snippet, 2, readme_layer_snippet(), timeout_s=120)
    for r in res:
        assert r["rel_err"] < 1e-5 and r["missing_grads"] == [], res
        assert r["experts"] == (4, 128, 64), res  # each rank holds its 4 of the 8 experts
