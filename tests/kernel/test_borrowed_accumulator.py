"""The borrowed accumulator (``backward_passes.plan_passes``, ``BackwardPlan.borrowed``): grad_hidden's fp32 sum
over vocabulary blocks lives in the last bytes of grad_weight's own memory. These check the layout
that makes it safe: the view lies inside grad_weight, aligned, past the first row it reports; the
block order covers the vocabulary once, writes no clear block over the accumulator, and ends with
a whole block. The numbers themselves are checked against the float64 reference in
test_correctness.py / test_variants.py (cases that take this plan, with and without blocks whose
grad_weight waits for grad_hidden)."""

import pytest
import torch

from fused_linear_ce import backward_passes, recompute


@pytest.mark.parametrize("n,h,v", [(77, 96, 500), (160, 96, 1000), (3, 5, 7), (8, 33, 17)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_view_lies_in_the_last_bytes_of_grad_weight_aligned(n, h, v, dtype):
    assert backward_passes.borrows_weight_grad(n, v, dtype)
    grad_weight = torch.zeros((v, h), dtype=dtype)
    acc, first_row = recompute._borrow_accumulator(grad_weight, n, h)
    assert acc.dtype == torch.float32 and acc.shape == (n, h) and acc.is_contiguous()
    begin = acc.data_ptr() - grad_weight.data_ptr()
    assert begin % 16 == 0 and begin >= 0
    assert begin + acc.numel() * 4 <= grad_weight.numel() * dtype.itemsize
    assert first_row == begin // (h * dtype.itemsize)
    # Writing the accumulator touches grad_weight's rows from first_row on (first_row itself too),
    # and none before.
    acc.fill_(1.0 + 2.0**-20)  # both 16-bit halves of its bits are non-zero
    touched = (grad_weight != 0).any(dim=1).nonzero().flatten()
    assert touched.min() == first_row


@pytest.mark.parametrize("v,cols,first", [(500, 256, 346), (1000, 256, 680), (1000, 256, 0), (256, 256, 100),
                                          (128256, 4096, 128256 - 16384), (7, 3, 5)])
def test_block_order_covers_the_vocabulary_once_and_ends_whole(v, cols, first):
    clear, over = backward_passes.borrowed_order(v, cols, first)
    blocks = clear + over
    covered = torch.zeros(v, dtype=torch.int32)
    for col0, c in blocks:
        assert 0 < c <= cols
        covered[col0 : col0 + c] += 1
    assert bool((covered == 1).all())
    assert over and over[-1] == (v - min(cols, v), min(cols, v))  # the last block is whole, at the end
    assert all(col0 + c <= first for col0, c in clear)  # written while the accumulator is live
    assert all(col0 + c > first for col0, c in over)
