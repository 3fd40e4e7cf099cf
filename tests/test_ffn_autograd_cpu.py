"""Autograd contract of FusedFFN / ShardedExperts (issue 15) on CPU ranks (gloo):

- reference backend: the backward across 1, 2 and 3 ranks matches single-process autograd of the
  unsplit layer in float64 (x.grad in full on every rank, each rank's weight slices, the
  replicated b2 / b_out), with no warning (torch warns when autograd meets the bare c10d
  all-reduce), one all-reduce in forward and one in backward (of dX, only when X requires grad);
- under torch.no_grad() / inference_mode the forward takes the plain path: no autograd wrapper,
  one in-place all-reduce, no graph;
- fused backend: a forward that autograd would record is refused before any kernel or
  communication, with a message naming backend='reference'.
"""
import pytest
import torch

import moe_overlap.ffn.layers as layers
import moe_overlap.ffn.reference as reference
from moe_overlap.ffn import FusedFFN, ShardedExperts
from moe_overlap.ffn.activations import ACTIVATIONS
from moe_overlap.ffn.layers import check_fused_inference
from moe_overlap.ffn.reference import experts_truth, ffn_truth, rel_err
from moe_overlap.ffn.validation import _case_inputs, _count_all_reduce, check_grad_cases
from conftest import spawn_ranks

TOL = 1e-10  # float64 on both sides; the sums differ only in their order


def _cases(world):
    cases = []
    for i, act1 in enumerate(ACTIVATIONS):
        act2 = [None, "silu", "relu", "gelu_tanh"][i]
        cases.append(dict(P=12, O=4 * world * (i + 1), N=10 if i % 2 else 12, T=5 + 2 * i,
                          act1=act1, act2=act2, seed=50 * world + i))
    cases.append(dict(P=8, O=4 * world, N=6, T=7, act1="gelu", act2="silu", bias=False,
                      seed=5))
    cases.append(dict(P=8, O=4 * world, N=6, T=6, act1="silu", x_grad=False, seed=6))
    cases.append(dict(P=8, O=4 * world, N=6, T=0, act1="relu", seed=7))
    rows = [3, 0, 5, 1]  # expert 1 has no rows; 2 rows past the experts' rows
    cases.append(dict(experts=True, E=4, rows=rows, P=8, O=4 * world, N=10, T=sum(rows) + 2,
                      act1="silu", bias=True, seed=8))
    cases.append(dict(experts=True, E=4, rows=rows, P=8, O=8 * world, N=6, T=sum(rows),
                      act1="gelu", bias=False, seed=9))
    cases.append(dict(experts=True, E=3, rows=[0, 4, 2], P=8, O=4 * world, N=6, T=7,
                      act1="relu", bias=True, x_grad=False, seed=10))
    return cases


def _inference_paths(rank, world):
    """no_grad / inference_mode on parameters and an input that require grad: the plain path
    (one all-reduce, no autograd wrapper, no graph) and the right output."""
    import torch.distributed as dist

    def refuse(*a, **k):
        raise AssertionError("autograd wrapper used with autograd off")
    reference.copy_to_group = reference.reduce_from_group = refuse
    group = dist.group.WORLD if world > 1 else None
    ffn_case = dict(P=8, O=4 * world, N=6, T=5, act1="silu", act2="gelu", dtype="float64",
                    seed=3)
    x, w1, b1, w2, b2 = _case_inputs(ffn_case)
    exp_case = dict(experts=True, E=3, rows=[2, 0, 3], P=8, O=4 * world, N=6, T=6,
                    act1="silu", bias=True, dtype="float64", seed=4)
    xe, rows, w_in, w_out, b_in, b_out = _case_inputs(exp_case)
    ffn = FusedFFN.from_full_weights(w1, b1, w2, b2, group=group, act1="silu", act2="gelu")
    exp = ShardedExperts.from_full_weights(w_in, w_out, b_in, b_out, group=group,
                                           activation="silu")
    ffn_truth_y = ffn_truth(x, w1, b1, w2, b2, "silu", "gelu")
    exp_truth_y = experts_truth(xe, rows, w_in, w_out, b_in, b_out, "silu")
    out = []
    for mode in (torch.no_grad, torch.inference_mode):
        for run, truth in ((lambda: ffn(x.clone().requires_grad_()), ffn_truth_y),
                           (lambda: exp(xe.clone().requires_grad_(), rows), exp_truth_y)):
            with _count_all_reduce() as calls, mode():
                y = run()
            out.append(dict(mode=mode.__name__, grad_fn=y.grad_fn is not None,
                            requires_grad=y.requires_grad, calls=calls.n,
                            err=rel_err(y, truth)))
    return out


def _worker(rank, world, cases):  # module level: spawn pickles it by name
    return check_grad_cases(rank, world, cases), _inference_paths(rank, world)


def _check_grads(results, cases, world):
    for case, r in zip(cases, results):
        assert max(r["errs"].values()) <= TOL, (case, r)
        assert r["warnings"] == [], (case, r)  # e.g. c10d's "no autograd kernel" warning
        assert r["fwd_all_reduce"] == (1 if world > 1 else 0), (case, r)
        # the backward's only collective is the all-reduce of dX, and only when X needs it
        want_bwd = 1 if world > 1 and case.get("x_grad", True) else 0
        assert r["bwd_all_reduce"] == want_bwd, (case, r)


def _check_inference(results, world):
    assert len(results) == 4
    for r in results:
        assert not r["grad_fn"] and not r["requires_grad"], r
        assert r["calls"] == (1 if world > 1 else 0), r
        assert r["err"] <= TOL, r


@pytest.mark.parametrize("world", [2, 3])
def test_reference_backward_matches_single_process_autograd(world):
    cases = _cases(world)
    per_rank = spawn_ranks(_worker, world, cases)
    assert len(per_rank) == world
    for grads, inference in per_rank:
        assert len(grads) == len(cases)
        _check_grads(grads, cases, world)
        _check_inference(inference, world)


def test_reference_backward_single_process():
    cases = _cases(1)
    _check_grads(check_grad_cases(0, 1, cases), cases, 1)
    _check_inference(_inference_paths_in_process(), 1)


def _inference_paths_in_process():
    saved = reference.copy_to_group, reference.reduce_from_group
    try:
        return _inference_paths(0, 1)
    finally:
        reference.copy_to_group, reference.reduce_from_group = saved


def test_gradient_check_can_fail():
    """The comparison notices a missing or a per-rank partial gradient."""
    from moe_overlap.ffn.validation import _grad_err
    g = torch.randn(4, 3, dtype=torch.float64)
    assert _grad_err(None, g) == float("inf")
    assert _grad_err(g / 2, g) > 0.4  # a rank's half of dX
    assert _grad_err(None, torch.zeros(2)) == 0.0
    assert _grad_err(g, g) == 0.0


# ---------------------------------------------------------------- fused backend: refused
def _names(**kw):
    return kw


def test_check_fused_inference_refuses_recorded_forward():
    w = torch.zeros(2, requires_grad=True)
    x = torch.zeros(2)
    with pytest.raises(RuntimeError, match=r"inference-only.*w1 requires grad.*"
                                           r"backend='reference'"):
        check_fused_inference("FusedFFN", _names(X=x, w1=w, b1=None))
    with pytest.raises(RuntimeError, match=r"X, w1 require grad"):
        check_fused_inference("FusedFFN", _names(X=x.requires_grad_(), w1=w, b1=None))
    with torch.no_grad():
        check_fused_inference("FusedFFN", _names(X=x, w1=w))
    with torch.inference_mode():
        check_fused_inference("FusedFFN", _names(X=x, w1=w))
    check_fused_inference("FusedFFN", _names(X=torch.zeros(2), w1=torch.zeros(2), b1=None))


class _KernelReached(Exception):
    pass


def _fused_on_cpu(monkeypatch, cls, *args, **kw):
    """A fused layer built on this CPU machine: the hardware check is skipped and the overlapped
    call (kernels + communication) raises _KernelReached, so a test sees whether the forward
    got that far."""
    monkeypatch.setattr(layers, "_fused_requirements", lambda *a, **k: None)
    monkeypatch.setattr(layers, "num_sms", lambda device: 132)  # the SM count bounds ccta

    def reached(self, *a, **k):
        raise _KernelReached
    monkeypatch.setattr(layers._FusedBackend, "_fused_call", reached)
    return cls(*args, backend="fused", dtype=torch.bfloat16, **kw)


@pytest.mark.parametrize("which", ["ffn", "experts"])
def test_fused_forward_refuses_autograd_before_the_kernel(monkeypatch, which):
    if which == "ffn":
        m = _fused_on_cpu(monkeypatch, FusedFFN, 64, 256, 128, act1="gelu")
        x = torch.zeros(4, 64, dtype=torch.bfloat16)
        call = lambda x: m(x)  # noqa: E731
        what = "FusedFFN"
    else:
        m = _fused_on_cpu(monkeypatch, ShardedExperts, 2, 64, 256, 128, bias=True)
        x = torch.zeros(4, 64, dtype=torch.bfloat16)
        call = lambda x: m(x, [3, 1])  # noqa: E731
        what = "ShardedExperts"
    # the fused layer's parameters are inference-only: nothing to differentiate by default
    assert not any(p.requires_grad for p in m.parameters())
    with pytest.raises(_KernelReached):
        call(x)  # grad mode on, nothing requires grad: reaches the kernel
    # an input or a parameter that requires grad with grad mode on: refused before the kernel
    with pytest.raises(RuntimeError, match=rf"{what}\(backend='fused'\) is inference-only.*"
                                           r"backend='reference'"):
        call(x.clone().requires_grad_())
    with pytest.raises(RuntimeError, match=r"\bx\b|\bX\b"):
        call(x.clone().requires_grad_())
    # inference: the check lets it through to the kernel
    with torch.no_grad(), pytest.raises(_KernelReached):
        call(x.clone().requires_grad_())
    m.requires_grad_(True)
    with pytest.raises(RuntimeError, match="inference-only"):
        call(x)
    with torch.inference_mode(), pytest.raises(_KernelReached):
        call(x)


def test_reference_accepts_float64_fused_does_not():
    assert FusedFFN(4, 8, dtype=torch.float64).w1.dtype == torch.float64
    with pytest.raises(TypeError, match="bfloat16"):
        FusedFFN(64, 256, 128, dtype=torch.float64, backend="fused")
