"""How each stage cuts its work, from shapes alone (no kernels, no tensors): the forward sweep's
vocabulary split, the chunked path's chunk of rows, the recompute backward's passes and blocks, all
within the memory knob ``chunk_bytes``. The public names are re-exported by ``configs``.
"""

import functools
from dataclasses import dataclass

import torch
import triton

from . import device as _device

# The memory knob's default on the recompute path (bytes): its backward's da blocks and fp32
# accumulators. 192 MiB: at 8192 x 4096 and 16384 x 2048 (N H = 32 Mi) the one-pass plan's da blocks
# are those that an unhosted fp32 accumulator would leave beside it in 256 MiB, the accumulator's
# first half being hosted in grad_hidden (``BackwardPlan.hosted``).
DEFAULT_CHUNK_BYTES = 192 << 20
# The memory knob's default on the chunked path: one chunk's buffer of rows. 256 MiB: each chunk adds
# the weight gradient's V x H sum once more, and a master weight's default step measured 6-7% slower
# in 192 MiB chunks (H200, S1 52.8 against 49.8 ms, S4 411 against 383; benchmarks/results/ab/).
DEFAULT_CHUNKED_BYTES = 256 << 20
# The chunked path's default for an fp32 master weight in several chunks (not hosted whole in its
# gradient): the fp32 gradient is the sum's own accumulator, so the chunk is nearly all the extra
# memory. 504 MiB, a 512 MiB budget less the statistics: at S4 (65536 x 4096 x 128256) a hosted head of
# 8192 rows, then 2048-row chunks (501 MiB), 350.4 / 348.9 ms random / peaked against 361.3 / 360.1
# in 448 MiB's 1792-row chunks and torch.compile's 332.0 / 329.4 under the same autocast, 503.8 MiB
# beyond autocast's bf16 weight copy (H200, benchmarks/results/hosted/).
DEFAULT_MASTER_BYTES = 504 << 20
# The divergence's memory knob (``fused_linear_divergence``): one chunk's two fp32 (R, V) logit
# buffers and the (M, V) da of its group (R x V x LOGIT_PAIR_BYTES + M x V x da's bytes;
# ``plan_divergence_chunks``). With bf16 grad_weight's 4-bit remainder (V x H_s / 2 bytes,
# ``divergence.REMAINDER``) 794 MiB at D1 (8192 x 2048 x 151936): 7 groups of 1184 rows.
DEFAULT_DIVERGENCE_BYTES = 640 << 20
# The default budget of the paired plan (``plan_passes``): long context, where no fp32 accumulator
# fits and one pass with grad_hidden summed as a bf16 + int8 pair replaces two passes.
DEFAULT_PAIRED_BYTES = 512 << 20
# The long-context chunked plan (``lean_chunk_bytes``): the fewest rows a chunk may have. Each chunk adds
# the V x H pair's epilogue (H200, S4 = 65536 x 4096 x 128256, bf16: 1024-row chunks with an int8
# remainder 428 ms a step against 357 in 4096-row chunks and 478 for the paired recompute plan, so
# ~1.5 ms a chunk; at 512 rows the chunks' overhead would pass the recompute plan's).
LEAN_MIN_ROWS = 1024
# The chunked path's buffer hosted in grad_weight (``hosted_slab_rows``): the fewest vocabulary rows of
# a slab of grad_weight computed at a time (a 1024 x 4096 product still fills the H200's 132 SMs with
# 128 x 256 tiles; a multiple of 16, as every slab's first row must be for TMA).
HOSTED_MIN_ROWS = 1024
# The forward's vocabulary split: the fewest splits whose programs fill the GPU's waves to at least
# this share (``vocab_splits``).
_WAVE_EFFICIENCY = 0.95
# Splits on the interpreter: more than one, so every run exercises the merge of partial statistics.
_CPU_SPLITS = 3


def chunk_budget(chunk_bytes: int | None, *, chunked: bool = False) -> int:
    """The memory knob's value in bytes: ``chunk_bytes``, or when None the default of the recompute
    path (DEFAULT_CHUNK_BYTES) or, ``chunked``, of the chunked path (DEFAULT_CHUNKED_BYTES)."""
    if chunk_bytes is not None:
        return chunk_bytes
    return DEFAULT_CHUNKED_BYTES if chunked else DEFAULT_CHUNK_BYTES


def chunk_rows(n: int, v: int, dtype: torch.dtype, chunk_bytes: int | None, block_n: int) -> int:
    """Rows per chunk of the chunked path: as many whole vocabulary rows of the (R, V) buffer (the
    input dtype) as ``chunk_bytes`` holds, in whole row blocks, at least one row block; all N when
    they fit."""
    rows = chunk_budget(chunk_bytes, chunked=True) // max(1, v * dtype.itemsize)
    if rows >= n:
        return max(n, 1)
    return max(block_n, rows // block_n * block_n)


def lean_chunk_bytes(v: int, h: int, dtype: torch.dtype, chunk_bytes: int | None = None) -> int | None:
    """The chunk budget of the long-context chunked plan: ``chunk_bytes`` (default
    DEFAULT_PAIRED_BYTES) less grad_weight's 4-bit remainder (V x ceil(H / 2) bytes,
    ``pairs.compensation_buffer(hi, torch.uint8)``), or None when that leaves fewer than
    LEAN_MIN_ROWS rows of the (R, V) buffer. At 128256 x 4096: 250.5 MiB of remainder, 1024-row
    chunks by default, 4096 in 1.25 GiB. Which calls take it: ``chunked.long_context_budget``."""
    budget = (DEFAULT_PAIRED_BYTES if chunk_bytes is None else chunk_bytes) - v * triton.cdiv(h, 2)
    return budget if budget // max(1, v * dtype.itemsize) >= LEAN_MIN_ROWS else None


def hosted_slab_rows(n: int, v: int, h: int, dtype: torch.dtype, dw_dtype: torch.dtype,
                     chunk_bytes: int | None) -> int | None:
    """The chunked path in one chunk of all N rows whose (N, V) buffer lives in grad_weight's own
    memory: the vocabulary rows of each slab of grad_weight computed at a time (into a slab-sized
    buffer within ``chunk_bytes``, then copied over the buffer's spent rows), or None where it does
    not apply. The buffer is class-major, its class v in grad_weight's row v: N elements of
    ``dtype`` must fit in a row of H of ``dw_dtype`` (N <= H for bf16, N <= 2H for an fp32 master
    weight's gradient), and a slab of at least HOSTED_MIN_ROWS rows (or all V) in ``chunk_bytes``
    (default DEFAULT_CHUNKED_BYTES). At 8192 x 4096 x 128256 with an fp32 master weight: three
    products in one chunk instead of 2048-row chunks each summing into the 2 GiB gradient, the 2 GiB
    buffer in it, a 256 MiB slab beside it (``chunked.forward``)."""
    row_bytes = h * dw_dtype.itemsize
    if n * dtype.itemsize > row_bytes or n == 0:
        return None
    return _slab_rows(chunk_budget(chunk_bytes, chunked=True), v, row_bytes)


def hosted_head(n: int, v: int, h: int, dtype: torch.dtype, dw_dtype: torch.dtype, rows: int,
                block_n: int) -> tuple[int, int] | None:
    """(head rows, slab rows) when the chunked path, in chunks of ``rows`` rows, runs its first chunk
    larger and in grad_weight's own memory, else None. Before the first chunk's product grad_weight
    holds nothing, so its (head, V) buffer can live there class-major as a whole hosted chunk's does
    (``hosted_slab_rows``): head = the most whole row blocks of the input dtype a row of grad_weight
    (``dw_dtype``) holds, taken when it is at least two chunks and less than N (else the whole call is
    one hosted chunk or none). Its grad_weight is computed a slab at a time into the chunk buffer's
    own memory (``rows`` x V of ``dtype``: slab = the rows of ``dw_dtype`` that holds, a multiple of 16,
    at least HOSTED_MIN_ROWS or all V), so nothing is allocated beyond the chunked path's. Each chunk
    sums its dW into grad_weight once more (a master weight's fp32 sum, the bf16 pair's epilogue),
    so fewer chunks are faster: at 65536 x 4096 x 128256 an fp32 master weight's first 8192 rows in
    one chunk instead of 4.6 of 1792, the bf16 long-context default's 4096 instead of 4 of 1024."""
    head = (h * dw_dtype.itemsize // dtype.itemsize) // block_n * block_n
    if head >= n or head < 2 * rows:
        return None
    slab = _slab_rows(rows * v * dtype.itemsize, v, h * dw_dtype.itemsize)
    return (head, slab) if slab is not None else None


def _slab_rows(buffer_bytes: int, v: int, row_bytes: int) -> int | None:
    """The rows of grad_weight (``row_bytes`` each) a slab buffer of ``buffer_bytes`` holds, a
    multiple of 16 and at most V, or None under HOSTED_MIN_ROWS (or all V)."""
    rows = min(v, buffer_bytes // max(1, row_bytes) // 16 * 16)
    return rows if rows >= min(v, HOSTED_MIN_ROWS) and rows > 0 else None


def vocab_splits(n_row_blocks: int, n_vocab_tiles: int, device: torch.device, *, resident: int = 1) -> int:
    """How many programs share one row block's vocabulary sweep (each a contiguous range of tiles).

    The sweep takes about (waves) x (tiles per program), where a wave is the SMs x ``resident``
    programs that run at once; the work is row blocks x tiles. This takes the fewest splits whose
    waves are at least ``_WAVE_EFFICIENCY`` full, else the fullest (fewer splits: fewer partial
    statistics, and the programs that run together share more of the weight in L2). H200, bf16,
    evaluation forward (``benchmarks/results/borrowed/experiment_splits.json``): S1 2 splits 13.9 ms
    against 15.8 for the 5 that a fixed 2 programs per SM gives, S3 1 split 18.7 against 23.1."""
    if _device.interpreted() or device.type != "cuda":
        return max(1, min(_CPU_SPLITS, n_vocab_tiles))
    sms = _device.sm_count(device)
    return _fewest_full_splits(max(1, n_row_blocks), max(1, n_vocab_tiles), sms * resident)


def tile_ranges(n_row_blocks: int, n_vocab_tiles: int, device: torch.device, *, resident: int = 1) -> tuple[int, int]:
    """(splits, tiles per split) of a vocabulary sweep: ``vocab_splits``' count, with the tiles cut
    into equal contiguous ranges and no split left without tiles."""
    per = triton.cdiv(n_vocab_tiles, vocab_splits(n_row_blocks, n_vocab_tiles, device, resident=resident))
    return triton.cdiv(n_vocab_tiles, per), per


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


# The divergence's chunks (``divergence.py``). A chunk row's two fp32 logit rows: bytes a class.
LOGIT_PAIR_BYTES = 8
# Row counts at least this large are rounded down to whole multiples of DIVERGENCE_ROW_ALIGN
# (tile-friendly).
DIVERGENCE_ROW_ALIGN = 16
# The rows of a chunk whose da goes to a buffer of its own (``plan_divergence_chunks``): on the GPU a
# chunk's logit products stream both weights once (2 x V x H bytes) for R x V x H products, so R sets
# their arithmetic intensity; on the interpreter, a few rows (several chunks a group at the tests'
# sizes).
DIVERGENCE_GROUP_CHUNK_ROWS = 256
INTERPRETED_DIVERGENCE_GROUP_CHUNK_ROWS = 8


@dataclass(frozen=True)
class DivergenceChunks:
    """How the divergence's rows go through its buffers: ``rows`` (R) a chunk of logits, ``group``
    (M) the rows whose gradient products run together; ``own_da``: da in an (M, V) buffer of its own
    (M > R), else over the teacher's logit buffer (M = R)."""

    rows: int
    group: int

    @property
    def own_da(self) -> bool:
        return self.group > self.rows


def _divergence_aligned(rows: int) -> int:
    return rows // DIVERGENCE_ROW_ALIGN * DIVERGENCE_ROW_ALIGN if rows >= DIVERGENCE_ROW_ALIGN else rows


def divergence_chunk_rows(n: int, v: int, chunk_bytes: int | None) -> int:
    """The divergence's rows per chunk with da over the teacher's buffer: as many as two fp32 (R, V)
    buffers within ``chunk_bytes`` hold (default DEFAULT_DIVERGENCE_BYTES), at least 1, in multiples
    of DIVERGENCE_ROW_ALIGN from there on; all N when they fit."""
    budget = DEFAULT_DIVERGENCE_BYTES if chunk_bytes is None else chunk_bytes
    rows = max(1, budget // (LOGIT_PAIR_BYTES * v))
    return n if rows >= n else _divergence_aligned(rows)


def plan_divergence_chunks(n: int, v: int, chunk_bytes: int | None, da_bytes: int | None = None) -> DivergenceChunks:
    """The divergence's chunks and gradient groups within ``chunk_bytes``. Values only (``da_bytes``
    None) or all rows in one chunk: ``divergence_chunk_rows`` rows, da (if any) over the teacher's
    buffer. Else, with R = ``DIVERGENCE_GROUP_CHUNK_ROWS`` (at most what fits in place), the rest of
    the budget is da's own buffer, M rows of ``da_bytes`` per class (all N rows when they fit, and
    then any budget left widens the chunks): taken where M exceeds the in-place rows, so that fewer
    groups pay the gradient products' fixed costs."""
    budget = DEFAULT_DIVERGENCE_BYTES if chunk_bytes is None else chunk_bytes
    in_place = divergence_chunk_rows(n, v, budget)
    if da_bytes is None or in_place >= n:
        return DivergenceChunks(in_place, in_place)
    interpreted = _device.interpreted()
    rows = min(INTERPRETED_DIVERGENCE_GROUP_CHUNK_ROWS if interpreted else DIVERGENCE_GROUP_CHUNK_ROWS, in_place)
    group = _divergence_aligned((budget - LOGIT_PAIR_BYTES * rows * v) // (da_bytes * v))
    if group >= n:
        group = n
        rows = max(rows, min(n, _divergence_aligned((budget - da_bytes * n * v) // (LOGIT_PAIR_BYTES * v))))
    return DivergenceChunks(rows, group) if group > in_place else DivergenceChunks(in_place, in_place)
