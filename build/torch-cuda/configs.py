"""Launch configurations: block sizes, warps, stages, the vocabulary split, and the backward chunk.

Fixed defaults, no autotuning (tests never pay for tuning; importing never touches the GPU). The GPU
values are starting points measured on an H200 (see ``benchmarks/NOTES.md``); the interpreter values
only keep CPU tests quick.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from .forward_kernels import lse_sweep_kernel


def interpreted() -> bool:
    """True when the kernels were built by the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(lse_sweep_kernel, InterpretedFunction)


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_v: int
    block_h: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_p: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


# Interpreter: every program runs in numpy, so fewer, larger tiles are faster; tl.dot needs >= 16.
_CPU_SWEEP = TileConfig(block_n=16, block_v=256, block_h=64, group_m=4, num_warps=1, num_stages=1)
_CPU_MATMUL = MatmulConfig(block_m=64, block_p=64, block_k=256, group_m=4, num_warps=1, num_stages=1)

# GPU: 128 x 256 logit tiles over 64-wide H steps (H200: 15.2 ms vs 19.9 ms for 128 x 128 at S1).
_GPU_SWEEP = TileConfig(block_n=128, block_v=256, block_h=64, group_m=8, num_warps=8, num_stages=3)
_GPU_SWEEP_FP32 = TileConfig(block_n=64, block_v=64, block_h=32, group_m=8, num_warps=4, num_stages=3)
_GPU_MATMUL = MatmulConfig(block_m=128, block_p=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
_GPU_MATMUL_FP32 = MatmulConfig(block_m=64, block_p=64, block_k=32, group_m=8, num_warps=4, num_stages=3)

# Programs per SM the forward aims for when it splits the vocabulary among programs (occupancy).
_PROGRAMS_PER_SM = 2
# Splits on the interpreter: more than one, so every run exercises the merge of partial statistics.
_CPU_SPLITS = 3
# Default budget for the backward's da chunk (bytes): the memory knob's default setting.
DEFAULT_CHUNK_BYTES = 256 << 20


def sweep_config(dtype: torch.dtype) -> TileConfig:
    if interpreted():
        return _CPU_SWEEP
    return _GPU_SWEEP_FP32 if dtype == torch.float32 else _GPU_SWEEP


def matmul_config(dtype: torch.dtype) -> MatmulConfig:
    if interpreted():
        return _CPU_MATMUL
    return _GPU_MATMUL_FP32 if dtype == torch.float32 else _GPU_MATMUL


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def vocab_splits(n_row_blocks: int, n_vocab_tiles: int, device: torch.device) -> int:
    """How many programs share one row block's vocabulary sweep: enough to fill the GPU."""
    if interpreted() or device.type != "cuda":
        return max(1, min(_CPU_SPLITS, n_vocab_tiles))
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    wanted = triton.cdiv(_PROGRAMS_PER_SM * sms, max(1, n_row_blocks))
    return max(1, min(wanted, n_vocab_tiles))


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward cuts the (N, V) plane: blocks of ``rows`` x ``cols`` da at a time."""

    rows: int
    cols: int
    dx_accumulator: bool  # grad_hidden summed over column blocks in an fp32 (N, H) buffer
    dw_accumulator: bool  # grad_weight summed over row blocks in an fp32 (V, H) buffer

    def extra_bytes(self, n: int, v: int, h: int, itemsize: int) -> int:
        return self.rows * self.cols * itemsize + 4 * h * (
            n * self.dx_accumulator + v * self.dw_accumulator
        )


def plan_backward(n, v, h, dtype, chunk_bytes, block_n, block_v) -> BackwardPlan:
    """The backward's blocking for a da buffer of at most ``chunk_bytes`` (default
    DEFAULT_CHUNK_BYTES). Whole when it fits; otherwise whole rows of the vocabulary in token chunks
    or whole columns of the batch in vocabulary chunks, whichever needs the smaller fp32
    accumulator (V x H for token chunks, N x H for vocabulary chunks). fp32 inputs accumulate in
    their own gradients and need neither."""
    budget = DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    elems = max(1, budget // dtype.itemsize)
    fp16ish = dtype != torch.float32
    if n * v <= elems:
        return BackwardPlan(n, v, False, False)
    token = BackwardPlan(max(block_n, (elems // v) // block_n * block_n), v, False, fp16ish)
    vocab_cols = (elems // max(n, 1)) // block_v * block_v
    if vocab_cols < block_v:
        return token
    vocab = BackwardPlan(n, vocab_cols, fp16ish, False)
    itemsize = dtype.itemsize
    return min((vocab, token), key=lambda p: p.extra_bytes(n, v, h, itemsize))


def input_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's matmul precision setting (tf32 only when torch allows it)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
