"""The backward's blocking plan (configs.plan_backward): which blocks, which fp32 accumulators."""

import pytest
import torch

from fused_linear_ce import configs

BLOCK_N, BLOCK_V = 16, 256


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_plane_when_it_fits(dtype):
    plan = configs.plan_backward(77, 500, 96, dtype, 77 * 500 * dtype.itemsize, BLOCK_N, BLOCK_V)
    assert (plan.rows, plan.cols, plan.dx_accumulator, plan.dw_accumulator) == (77, 500, False, False)


def test_token_chunks_when_the_vocabulary_block_would_be_too_narrow():
    plan = configs.plan_backward(77, 500, 96, torch.bfloat16, 16 * 500 * 2, BLOCK_N, BLOCK_V)
    assert (plan.rows, plan.cols, plan.dw_accumulator, plan.dx_accumulator) == (16, 500, True, False)


def test_vocabulary_chunks_when_their_accumulator_is_smaller():
    plan = configs.plan_backward(77, 500, 96, torch.bfloat16, 77 * 256 * 2, BLOCK_N, BLOCK_V)
    assert (plan.rows, plan.cols, plan.dx_accumulator, plan.dw_accumulator) == (77, 256, True, False)


def test_llama_shape_default_picks_vocabulary_chunks_within_budget():
    n, h, v = 8192, 4096, 128256
    plan = configs.plan_backward(n, v, h, torch.bfloat16, None, 128, 256)
    assert plan.rows == n and plan.cols < v
    assert plan.rows * plan.cols * 2 <= configs.DEFAULT_CHUNK_BYTES
    # N x H fp32 (128 MiB) instead of V x H fp32 (2 GiB)
    assert plan.extra_bytes(n, v, h, 2) <= configs.DEFAULT_CHUNK_BYTES + n * h * 4


def test_fp32_inputs_need_no_accumulator():
    plan = configs.plan_backward(77, 500, 96, torch.float32, 16 * 500 * 4, BLOCK_N, BLOCK_V)
    assert plan.extra_bytes(77, 500, 96, 4) == plan.rows * plan.cols * 4
