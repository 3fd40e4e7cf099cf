"""activation_ (in place) against activation: bitwise the same values in the input's own
storage for every name and dtype, so the reference backend and the baselines hold H once."""
import pytest
import torch

from moe_overlap.ffn.activations import ACTIVATIONS, activation, activation_


@pytest.mark.parametrize("name", ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_in_place_is_bitwise_the_out_of_place(name, dtype):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(64, 96, generator=g, dtype=torch.float64) * 4).to(dtype)
    want = activation(x, name)
    h = x.clone()
    ptr = h.data_ptr()
    got = activation_(h, name)
    assert got.data_ptr() == ptr and h.data_ptr() == ptr  # no second H
    assert torch.equal(got, want), name
    assert not torch.equal(got, x)  # the kernel ran


def test_none_returns_its_input():
    x = torch.randn(4, 4)
    assert activation_(x, "none") is x


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown activation"):
        activation_(torch.zeros(2), "tanh")
