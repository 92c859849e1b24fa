"""Launch configurations: block sizes, warps, stages, the vocabulary split, and the backward chunk.

Fixed tuned defaults per shape bucket (``tiles``); autotuning for the exact shape is opt-in
(``autotune.py``), so tests never pay for tuning and importing never touches the GPU. The GPU values
were measured on an H200 (see ``benchmarks/NOTES.md``); the interpreter values only keep CPU tests
quick.
"""

import functools
from dataclasses import dataclass, replace

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
    resident: int = 1  # programs of these tiles one SM holds at once (shared memory, registers)
    tma: bool = True  # operands through TMA tensor descriptors where the layout allows (``tma_layout``)


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_p: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    tma: bool = True  # operands through TMA tensor descriptors where the layout allows (``tma_layout``)


# Interpreter: every program runs in numpy, so fewer, larger tiles are faster; tl.dot needs >= 16.
_CPU_SWEEP = TileConfig(block_n=16, block_v=256, block_h=64, group_m=4, num_warps=1, num_stages=1)
_CPU_MATMUL = MatmulConfig(block_m=64, block_p=64, block_k=256, group_m=4, num_warps=1, num_stages=1)

# GPU: 128 x 256 logit tiles over 64-wide H steps (H200: 15.2 ms vs 19.9 ms for 128 x 128 at S1);
# 3 stages of 48 KB of operands: one program per SM. Operands through TMA descriptors (H200, bf16,
# S1 evaluation forward 13.0-13.5 ms against 14.1-14.2 with pointer loads; NOTES v11).
_GPU_SWEEP = TileConfig(block_n=128, block_v=256, block_h=64, group_m=8, num_warps=8, num_stages=3, resident=1)
# fp32: 3 stages of 16 KB; two per SM assumed (not measured: fp32 is not a tuned case). Pointer
# loads: with TMA descriptors the fp32 sweep was slower (H200, 2048 x 1024 x 32000, TF32 off:
# evaluation forward 12.7 ms against 9.9).
_GPU_SWEEP_FP32 = TileConfig(block_n=64, block_v=64, block_h=32, group_m=8, num_warps=4, num_stages=3, resident=2,
                             tma=False)
# The chunked path's sweep, one tile a program in a 1-D grid grouped by group_m row blocks (a wave
# shares fewer rows and weight tiles): 128 x 128 tiles with one warpgroup, 3 stages (128 KB of shared
# memory with the descriptor store's buffer: one program per SM), groups of 16. H200, bf16, chunked
# path in one chunk, interleaved medians: S1 42.4 ms fwd+bwd against 44.4 for 256 x 128 tiles with
# 8 warps, S2 50.5 against 51.3, S3 52.0 against 54.0 (NOTES v13; 256 x 128 had beaten 128 x 256 in
# the 2-D grid, v3).
_GPU_CHUNKED_SWEEP = TileConfig(block_n=128, block_v=128, block_h=64, group_m=16, num_warps=4, num_stages=3)
# The recompute backward's dlogits kernel (one tile a program; its tiles also cut the backward plan):
# the sweep's. 128 x 128 tiles with 4 warps (two programs per SM), 4 stages, 128-wide H steps were all
# slower (H200, S1-S3 at 64 MiB: +0.5 to +3.7 ms fwd+bwd; NOTES v13).
_GPU_DLOGITS = _GPU_SWEEP
# The Triton matmul (products with a factor in the epilogue): TMA loads reach cuBLAS's rate where
# pointer loads took 1.23x (H200, S1 grad_weight blocks, M=4096 K=8192 P=4096: 0.38 ms against 0.47,
# cuBLAS 0.38; NOTES v12). fp32 keeps pointer loads, as the fp32 sweep.
_GPU_MATMUL = MatmulConfig(block_m=128, block_p=256, block_k=64, group_m=8, num_warps=8, num_stages=3)
_GPU_MATMUL_FP32 = MatmulConfig(block_m=64, block_p=64, block_k=32, group_m=8, num_warps=4, num_stages=3,
                                tma=False)

# The forward's vocabulary split: the fewest splits whose programs fill the GPU's waves to at least
# this share (``vocab_splits``).
_WAVE_EFFICIENCY = 0.95
# Splits on the interpreter: more than one, so every run exercises the merge of partial statistics.
_CPU_SPLITS = 3
# Default budget for the backward's da chunk (bytes): the memory knob's default setting.
DEFAULT_CHUNK_BYTES = 256 << 20


# The tuned tiles of the three logit kernels per shape bucket, for 16-bit inputs on the GPU: per role,
# (largest H of the bucket or None for the rest, the name of the config in this module) in ascending
# H. The bucket is the hidden size: H is the length of each tile's product loop, against which the
# tile's softmax epilogue is a fixed cost. Names, not objects, so that experiments patch the
# module's configs. One bucket so far: the H200 at H = 640 to 4096 gave no second one that held up
# side by side (NOTES v13-v14); ``autotune`` tunes for the exact shape where that matters.
_TUNED = {
    "sweep": ((None, "_GPU_SWEEP"),),
    "chunked": ((None, "_GPU_CHUNKED_SWEEP"),),
    "dlogits": ((None, "_GPU_DLOGITS"),),
}
ROLES = tuple(_TUNED)


def tiles(role: str, dtype: torch.dtype, h: int | None = None) -> TileConfig:
    """The tuned tiles of one logit kernel (``role``: "sweep" the forward's vocabulary sweep,
    "chunked" the chunked path's sweep and its in-place gradient kernel, "dlogits" the recompute
    backward's) for hidden size ``h`` (None: the largest bucket). The interpreter and fp32 have one
    configuration each."""
    if interpreted():
        return _CPU_SWEEP
    if dtype == torch.float32:
        return _GPU_SWEEP_FP32
    for h_max, name in _TUNED[role]:
        if h_max is None or (h is not None and h <= h_max):
            return globals()[name]
    raise AssertionError(f"no bucket of {role!r} takes h={h}")  # the last bucket is open-ended


def candidates(role: str, dtype: torch.dtype, h: int | None = None) -> tuple[TileConfig, ...]:
    """What opt-in autotuning (``autotune``) times for ``role``: the tuned tiles first, then their
    neighbours (the variants of NOTES v13 that ran; a candidate that does not fit a GPU's shared
    memory is skipped there). fp32 keeps its one configuration; the interpreter gets three (narrower
    and taller tiles), so that CPU tests exercise the choice."""
    base = tiles(role, dtype, h)
    if interpreted():
        return (base, replace(base, block_v=base.block_v // 2), replace(base, block_n=2 * base.block_n))
    if dtype == torch.float32:
        return (base,)
    wide = dict(block_n=128, block_v=256, num_warps=8, num_stages=3, resident=1)
    square = dict(block_n=128, block_v=128, num_warps=4, num_stages=3, resident=1)
    variants = {
        "sweep": (dict(num_stages=4), dict(block_n=256, block_v=128), dict(square, resident=2),
                  dict(block_n=64, num_warps=4)),
        "chunked": (dict(num_stages=4), dict(block_n=256, block_v=128, num_warps=8), dict(wide),
                    dict(group_m=32)),
        "dlogits": (dict(num_stages=4), dict(square), dict(block_v=128)),
    }[role]
    out = [base]
    for change in variants:
        cfg = replace(base, **change)
        if cfg not in out:
            out.append(cfg)
    return tuple(out)


def sweep_config(dtype: torch.dtype, *, chunked: bool = False, h: int | None = None) -> TileConfig:
    """The sweep's tiles; ``chunked``: the chunked path's (its in-place gradient kernel uses the
    same tiles, one tile max per row of each). ``h``: the hidden size (``tiles``)."""
    return tiles("chunked" if chunked else "sweep", dtype, h)


def dlogits_config(dtype: torch.dtype, *, h: int | None = None) -> TileConfig:
    """The recompute backward's tiles: its dlogits kernel's, and the granularity of its plan's blocks
    (``plan_passes``) and bias partial sums."""
    return tiles("dlogits", dtype, h)


@functools.lru_cache(maxsize=None)
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def tma_hardware(device: torch.device) -> bool:
    """Whether ``device`` loads through TMA tensor descriptors in hardware: CUDA compute capability
    9.0 and up (Hopper, Blackwell). Older GPUs keep the pointer loads, the path they were measured
    and tested on; the interpreter runs the descriptors too (so the CPU tests cover them)."""
    if device.type != "cuda":
        return interpreted()
    return torch.version.hip is None and _capability(_index(device))[0] >= 9


def tma_layout(t: torch.Tensor) -> bool:
    """Whether a 2-D operand can go through a TMA tensor descriptor: contiguous rows, a row stride
    and a base address that are multiples of 16 bytes, no empty dimension. Elsewhere the kernels
    load through pointers (the same products; ``logits.logit_tile``)."""
    return (t.dim() == 2 and t.shape[0] > 0 and t.shape[1] > 0 and t.stride(1) == 1
            and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0)


def matmul_config(dtype: torch.dtype) -> MatmulConfig:
    if interpreted():
        return _CPU_MATMUL
    return _GPU_MATMUL_FP32 if dtype == torch.float32 else _GPU_MATMUL


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _index(device: torch.device) -> int:
    """A CUDA device's index (the current device when it has none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device``."""
    return _sm_count(_index(device))


def vocab_splits(n_row_blocks: int, n_vocab_tiles: int, device: torch.device, *, resident: int = 1) -> int:
    """How many programs share one row block's vocabulary sweep (each a contiguous range of tiles).

    The sweep takes about (waves) x (tiles per program), where a wave is the SMs x ``resident``
    programs that run at once; the work is row blocks x tiles. This takes the fewest splits whose
    waves are at least ``_WAVE_EFFICIENCY`` full, else the fullest (fewer splits: fewer partial
    statistics, and the programs that run together share more of the weight in L2). H200, bf16,
    evaluation forward (``benchmarks/results/borrowed/experiment_splits.json``): S1 2 splits 13.9 ms
    against 15.8 for the 5 of the earlier rule (2 programs per SM), S3 1 split 18.7 against 23.1."""
    if interpreted() or device.type != "cuda":
        return max(1, min(_CPU_SPLITS, n_vocab_tiles))
    sms = sm_count(device)
    return _fewest_full_splits(max(1, n_row_blocks), max(1, n_vocab_tiles), sms * resident)


@functools.lru_cache(maxsize=256)
def _fewest_full_splits(row_blocks: int, tiles: int, slots: int) -> int:
    best, best_eff = 1, 0.0
    for splits in range(1, tiles + 1):
        per = triton.cdiv(tiles, splits)
        if splits > 1 and triton.cdiv(tiles, splits - 1) == per:
            continue  # the same ranges as fewer splits
        waves = triton.cdiv(row_blocks * triton.cdiv(tiles, per), slots)
        eff = row_blocks * tiles / (waves * per * slots)
        if eff >= _WAVE_EFFICIENCY:
            return splits
        if eff > best_eff:
            best, best_eff = splits, eff
    return best


@dataclass(frozen=True)
class BackwardPlan:
    """How the backward cuts the (N, V) plane: blocks of ``rows`` x ``cols`` da at a time."""

    rows: int
    cols: int
    dx_accumulator: bool  # grad_hidden summed over column blocks in an fp32 (N, H) buffer
    dw_accumulator: bool  # grad_weight summed over row blocks in an fp32 (V, H) buffer
    rows_grads: bool = True  # this pass computes grad_hidden and grad_bias (when wanted)
    weight_grad: bool = True  # this pass computes grad_weight (when wanted)
    # The (N, H) fp32 accumulator lives in the last bytes of grad_weight's own memory (not extra):
    # the vocabulary blocks that overlap it get their grad_weight after grad_hidden is final.
    borrowed: bool = False

    def extra_bytes(self, n: int, v: int, h: int, itemsize: int) -> int:
        """The da block, the fp32 accumulators, and a rows-only pass's fp32 (rows, H) product."""
        return self.rows * self.cols * itemsize + 4 * h * (
            n * (self.dx_accumulator and not self.borrowed) + v * self.dw_accumulator
            + self.rows * (not self.weight_grad)
        )


def _token_rows(units: int, per_row: int, block_n: int) -> int:
    """How many rows of ``per_row`` units each (a whole vocabulary row's elements or bytes) ``units``
    hold, in row blocks, at least one."""
    return max(block_n, (units // per_row) // block_n * block_n)


def _vocab_cols(elems: int, n: int, block_v: int) -> int:
    """Columns of all N rows that ``elems`` elements hold, in vocabulary tiles (may be 0)."""
    return (elems // max(n, 1)) // block_v * block_v


def plan_backward(n, v, h, dtype, chunk_bytes, block_n, block_v) -> BackwardPlan:
    """The backward's blocking for a da buffer of at most ``chunk_bytes`` (default
    DEFAULT_CHUNK_BYTES). Whole when it fits; otherwise whole rows of the vocabulary in token chunks
    or whole columns of the batch in vocabulary chunks, whichever needs the smaller fp32
    accumulator (V x H for token chunks, N x H for vocabulary chunks). fp32 inputs accumulate in
    their own gradients and need neither."""
    elems = max(1, chunk_budget(chunk_bytes) // dtype.itemsize)
    fp16ish = dtype != torch.float32
    if n * v <= elems:
        return BackwardPlan(n, v, False, False)
    token = BackwardPlan(_token_rows(elems, v, block_n), v, False, fp16ish)
    vocab_cols = _vocab_cols(elems, n, block_v)
    if vocab_cols < block_v:
        return token
    vocab = BackwardPlan(n, vocab_cols, fp16ish, False)
    itemsize = dtype.itemsize
    return min((vocab, token), key=lambda p: p.extra_bytes(n, v, h, itemsize))


def plan_passes(n, v, h, dtype, chunk_bytes, block_n, block_v, need_rows, need_dw) -> tuple[BackwardPlan, ...]:
    """The recompute backward's passes, so that its extra memory (da blocks and fp32 accumulators)
    stays within ``chunk_bytes`` at any N. ``need_rows``: grad_hidden or grad_bias is wanted.

    - The whole plane when it fits; fp32 inputs: ``plan_backward`` (no accumulator).
    - Only grad_hidden/grad_bias: token blocks of whole vocabulary rows, each row's gradient
      complete in one product. Only grad_weight: vocabulary blocks of all N rows, likewise.
    - Both, in one pass, when an fp32 accumulator (N x H for vocabulary blocks, else V x H) takes
      at most half the budget; the da block gets the rest.
    - Else, when grad_weight's own memory holds the N x H fp32 accumulator (V >= 2N for 16-bit
      inputs), one pass of vocabulary blocks with the accumulator borrowed from grad_weight's last
      rows (``borrows_weight_grad``): the budget is all da block. The blocks over those rows but the
      last get their grad_weight after grad_hidden is final, from their logits recomputed once
      more: (2N - cols) / V of a product more.
    - Otherwise two passes, each without an accumulator: token blocks for grad_hidden and
      grad_bias, then vocabulary blocks for grad_weight. The logits are recomputed once more
      (5 products instead of 4), and the memory stays flat in N.
    """
    budget = chunk_budget(chunk_bytes)
    item = dtype.itemsize
    elems = max(1, budget // item)
    if n * v <= elems or dtype == torch.float32:
        return (plan_backward(n, v, h, dtype, chunk_bytes, block_n, block_v),)

    rows_only = _token_rows(budget, v * item + 4 * h, block_n)  # da rows + their fp32 product
    rows_pass = BackwardPlan(rows_only, v, False, False, True, False)
    all_cols = _vocab_cols(elems, n, block_v)
    dw_pass = BackwardPlan(n, all_cols, False, False, False, True) if all_cols >= block_v else None
    if not need_dw:
        return (rows_pass,)
    if not need_rows and dw_pass is not None:
        return (dw_pass,)
    acc_x, acc_w = 4 * n * h, 4 * v * h
    cols = _vocab_cols(max(0, budget - acc_x) // item, n, block_v)
    if acc_x <= budget // 2 and cols >= block_v:
        return (BackwardPlan(n, cols, True, False),)
    if acc_w <= budget // 2:
        return (BackwardPlan(_token_rows((budget - acc_w) // item, v, block_n), v, False, True),)
    if dw_pass is not None and borrows_weight_grad(n, v, dtype):
        return (BackwardPlan(n, all_cols, True, False, borrowed=True),)
    if dw_pass is not None:
        return (rows_pass, dw_pass)
    return (plan_backward(n, v, h, dtype, chunk_bytes, block_n, block_v),)  # N too large for whole columns


def borrows_weight_grad(n: int, v: int, dtype: torch.dtype) -> bool:
    """Whether grad_weight's (V, H) memory in ``dtype`` holds an (N, H) fp32 accumulator: V >= 2N
    for 16-bit inputs (fp32 inputs need no accumulator)."""
    return dtype != torch.float32 and v * dtype.itemsize >= 4 * n


def chunk_budget(chunk_bytes: int | None) -> int:
    """The memory knob's value in bytes: ``chunk_bytes``, or DEFAULT_CHUNK_BYTES when None."""
    return DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes


def chunk_rows(n: int, v: int, dtype: torch.dtype, chunk_bytes: int | None, block_n: int) -> int:
    """Rows per chunk of the chunked path: as many whole vocabulary rows of the (R, V) buffer (the
    input dtype) as ``chunk_bytes`` holds, in whole row blocks, at least one row block; all N when
    they fit."""
    rows = chunk_budget(chunk_bytes) // max(1, v * dtype.itemsize)
    if rows >= n:
        return max(n, 1)
    return max(block_n, rows // block_n * block_n)


def fp_fusion(dtype: torch.dtype) -> bool:
    """Whether kernels that compute logits may contract multiply-adds (``enable_fp_fusion``): no.

    A contraction of ``scale * acc - m`` into one fma skips the rounding of the logit, so the
    recomputing backward's z - m differed from the forward's by up to half an ulp of z (6e-5 at
    |z| ~ 2e3), which showed in p at large logits (issue 3: fp32 with logit_scale 1e3, hidden error
    9.5e-5 against plain torch's 2.4e-7 on the H200; the interpreter never contracts, so CPU passed).
    Off for every dtype: on the H200 at S1 bf16 it costs nothing measurable (recompute 60.6 ms off
    against 60.5-66.6 on, chunked 49.8 against 49.0-51.7; benchmarks/NOTES.md)."""
    return False


def input_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's matmul precision setting (tf32 only when torch allows it)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"
