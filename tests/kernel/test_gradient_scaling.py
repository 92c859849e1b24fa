"""The chunked path's backward multiplies the saved unit gradients by the upstream gradient in one
kernel (``products.scale``): fp32 arithmetic, one rounding to the leaf's dtype, every element."""

import pytest
import torch

from conftest import DEVICE
from fused_linear_ce import products


@pytest.mark.parametrize("src_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
                                                 (torch.float32, torch.float32), (torch.float32, torch.bfloat16)])
def test_scale_is_one_fp32_multiply_and_one_rounding(src_dtype, out_dtype):
    g = torch.Generator(device=DEVICE).manual_seed(0)
    src = (torch.randn(3, 70001, generator=g, device=DEVICE) * 1e-3).to(src_dtype)  # not a multiple of the block
    upstream = torch.tensor(1.0 / 3.0, device=DEVICE)  # not a power of two: the product rounds
    got = products.scale(src, upstream, out_dtype)
    want = (src.float() * upstream).to(out_dtype)
    assert got.dtype == out_dtype and got.shape == src.shape
    assert torch.equal(got, want)


def test_scale_of_an_empty_gradient_is_empty():
    out = products.scale(torch.empty(0, device=DEVICE), torch.tensor(2.0, device=DEVICE), torch.bfloat16)
    assert out.shape == (0,) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("factor", [1.0, 1.0 / 3.0, float("nan")], ids=["one", "third", "nan"])
def test_scale_in_place_and_into_another_buffer(factor):
    """In place, a factor of 1 moves nothing (every value is already its product); any other factor,
    NaN included, multiplies every element, and into another buffer a factor of 1 still copies."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    src = torch.randn(2, 70001, generator=g, device=DEVICE).bfloat16()
    upstream = torch.tensor([factor], device=DEVICE)
    want = (src.float() * upstream).bfloat16()
    inplace = src.clone()
    assert products.scale(inplace, upstream, out=inplace) is inplace
    assert torch.equal(inplace, want) or (factor != factor and inplace.isnan().all())
    other = torch.full_like(src, 7.0)
    products.scale(src, upstream, out=other)
    assert torch.equal(other, want) or (factor != factor and other.isnan().all())
