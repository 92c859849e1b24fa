"""How the recompute backward cuts the (N, V) plane within its budget, from shapes alone: its passes
(``BackwardPlan``: blocks of rows x columns, where the fp32 accumulators live). ``plan.py`` asks
``plan_passes`` once per call and carries the passes to ``recompute.py``.
"""

from dataclasses import dataclass

import torch

# The memory knob's default on the recompute path (bytes): its backward's da blocks and fp32
# accumulators. 192 MiB: at 8192 x 4096 and 16384 x 2048 (N H = 32 Mi) the one-pass plan's da blocks
# are those that an unhosted fp32 accumulator would leave beside it in 256 MiB, the accumulator's
# first half being hosted in grad_hidden (``BackwardPlan.hosted``).
DEFAULT_CHUNK_BYTES = 192 << 20
# The default budget of the paired plan (``plan_passes``): long context, where no fp32 accumulator
# fits and one pass with grad_hidden summed as a bf16 + int8 pair replaces two passes.
DEFAULT_PAIRED_BYTES = 512 << 20


def recompute_budget(chunk_bytes: int | None) -> int:
    """The recompute backward's budget in bytes: ``chunk_bytes``, or DEFAULT_CHUNK_BYTES when None."""
    return DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes


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
    # grad_hidden is summed over the vocabulary blocks as a pair: itself (bf16) and an int8 (N, H)
    # remainder (``gemm.matmul``'s pair epilogue), N x H bytes instead of an fp32 N x H.
    paired: bool = False
    # The (N, H) fp32 accumulator's first rows live in grad_hidden's own 16-bit memory (N x H x
    # itemsize bytes: half of it), the rest in an extra buffer; at the end the hosted rows are
    # copied into the free da block before grad_hidden is written (so cols >= H).
    hosted: bool = False

    def extra_bytes(self, n: int, v: int, h: int, itemsize: int) -> int:
        """The da block, the accumulators (fp32, or the pair's int8 remainder), and a rows-only
        pass's fp32 (rows, H) product."""
        dx_acc = self.dx_accumulator and not self.borrowed and not self.paired
        return self.rows * self.cols * itemsize + n * h * self.paired + 4 * h * (
            n * dx_acc + v * self.dw_accumulator + self.rows * (not self.weight_grad)
        ) - hosted_rows(n, itemsize) * h * 4 * (dx_acc and self.hosted)


def hosted_rows(n: int, itemsize: int) -> int:
    """How many rows of an (n, H) fp32 accumulator an (n, H) gradient of ``itemsize`` bytes holds."""
    return n * itemsize // 4


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
    elems = max(1, recompute_budget(chunk_bytes) // dtype.itemsize)
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


def plan_passes(n, v, h, dtype, chunk_bytes, block_n, block_v, need_rows, need_dw, *,
                may_pair=False, fp32_weight_grad=False) -> tuple[BackwardPlan, ...]:
    """The recompute backward's passes, so that its extra memory (da blocks and fp32 accumulators)
    stays within ``chunk_bytes`` at any N. ``need_rows``: grad_hidden or grad_bias is wanted.

    - The whole plane when it fits; fp32 inputs: ``plan_backward`` (no accumulator).
    - Only grad_hidden/grad_bias: token blocks of whole vocabulary rows, each row's gradient
      complete in one product. Only grad_weight: vocabulary blocks of all N rows, likewise.
    - Both, in one pass, when an fp32 accumulator (N x H for vocabulary blocks, else V x H) takes
      at most half the budget; the da block gets the rest. The N x H one is hosted
      (``BackwardPlan.hosted``): grad_hidden's own memory holds half of it (16-bit), so only the
      other half counts, and the da block (then at least H columns) takes its copy at the end.
    - Else, when grad_weight's own memory holds the N x H fp32 accumulator (V >= 2N for 16-bit
      inputs), one pass of vocabulary blocks with the accumulator borrowed from grad_weight's last
      rows (``borrows_weight_grad``): the budget is all da block. The blocks over those rows but the
      last get their grad_weight after grad_hidden is final, from their logits recomputed once
      more: (2N - cols) / V of a product more.
    - Else, when ``may_pair`` (bf16, no bias gradient, no vocabulary shard) and an int8 (N, H)
      remainder leaves room for blocks of at least one tile: one pass of vocabulary blocks with
      grad_hidden summed as a bf16 + int8 pair (``BackwardPlan.paired``), four products. Its budget
      when ``chunk_bytes`` is None is DEFAULT_PAIRED_BYTES (the remainder is N x H bytes: 256 MiB at
      N = 65536, H = 4096), else ``chunk_bytes``.
    - Else, when ``fp32_weight_grad`` (an fp32 master weight: grad_weight is fp32 and its own
      accumulator), one pass of token blocks of whole vocabulary rows, grad_weight summed over them
      in place: four products, the budget all da block (``dw_accumulator`` False: no other buffer).
    - Otherwise two passes, each without an accumulator: token blocks for grad_hidden and
      grad_bias, then vocabulary blocks for grad_weight. The logits are recomputed once more
      (5 products instead of 4), and the memory stays flat in N.
    """
    budget = recompute_budget(chunk_bytes)
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
    acc_x, acc_w = 4 * n * h - 4 * h * hosted_rows(n, item), 4 * v * h  # acc_x: the part not hosted
    cols = _vocab_cols(max(0, budget - acc_x) // item, n, block_v)
    if acc_x <= budget // 2 and cols >= max(block_v, h):
        return (BackwardPlan(n, cols, True, False, hosted=True),)
    if acc_w <= budget // 2:
        return (BackwardPlan(_token_rows((budget - acc_w) // item, v, block_n), v, False, True),)
    if dw_pass is not None and borrows_weight_grad(n, v, dtype):
        return (BackwardPlan(n, all_cols, True, False, borrowed=True),)
    if may_pair and dtype == torch.bfloat16:
        paired_budget = DEFAULT_PAIRED_BYTES if chunk_bytes is None else budget
        cols = _vocab_cols(max(0, paired_budget - n * h) // item, n, block_v)
        if cols >= block_v:
            return (BackwardPlan(n, cols, True, False, paired=True),)
    if fp32_weight_grad:
        return (BackwardPlan(_token_rows(elems, v, block_n), v, False, False),)
    if dw_pass is not None:
        return (rows_pass, dw_pass)
    return (plan_backward(n, v, h, dtype, chunk_bytes, block_n, block_v),)  # N too large for whole columns


def borrows_weight_grad(n: int, v: int, dtype: torch.dtype) -> bool:
    """Whether grad_weight's (V, H) memory in ``dtype`` holds an (N, H) fp32 accumulator: V >= 2N
    for 16-bit inputs (fp32 inputs need no accumulator)."""
    return dtype != torch.float32 and v * dtype.itemsize >= 4 * n


def borrowed_order(v: int, cols: int, first_borrowed_row: int):
    """The borrowed plan's column blocks (col0, c), laid out from the end so that the last block is
    whole: those clear of the accumulator first, then those over it, the last block last."""
    blocks = [(max(0, end - cols), end - max(0, end - cols)) for end in range(v, 0, -cols)][::-1]
    clear = [b for b in blocks if b[0] + b[1] <= first_borrowed_row]
    return clear, blocks[len(clear) :]
