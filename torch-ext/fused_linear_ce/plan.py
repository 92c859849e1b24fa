"""The plan of a call: which mode it takes and within which budgets, decided once from shapes,
dtypes and options (no kernels, no tensors), where every rule for it is written.

Each public call asks once (``plan_loss``, ``plan_tokens``, ``plan_divergence``) and carries the
frozen answer into its ops as their arguments (``opargs``); the ops, their fake implementations and
their autograd read it. The modes, one mechanism each:

- VALUES: no gradient is wanted; the forward sweep alone.
- RECOMPUTE: the forward keeps the per-row lse; the backward recomputes the logits block by block in
  ``passes`` (``backward_passes.plan_passes``).
- CHUNKED: the loss's gradients are formed in the forward, ``rows`` rows a chunk (the first
  ``head_rows`` of them hosted in grad_weight's memory, computed ``slab_rows`` of grad_weight at a
  time); a bf16 grad_weight summed across chunks as a bf16 + int8 pair.
- HOSTED: CHUNKED in one chunk of all N rows whose (N, V) buffer lives in grad_weight's own memory.
- LONG_CONTEXT: CHUNKED with grad_weight summed across chunks as a bf16 + 4-bit pair, its remainder
  within the budget ("auto" at long context, ``lean_chunk_bytes``).
- EXPONENTIALS: the per-token outputs' forward keeps the (N, V) exponentials; its backward turns
  them into the gradient in place (a second backward takes ``passes``).
The divergence takes CHUNKED (its gradients formed in the forward), RECOMPUTE or VALUES, each with
its chunks of rows (``DivergenceChunks``).

Three words, one meaning each across the package: "chunked" is the gradients formed in the forward
(the public strategy="chunked" of the per-token function takes EXPONENTIALS, its one way to save a
product); "hosted" is a temporary in the memory of the gradient it becomes or is the input of (the
recompute backward's N x H accumulator, half in grad_hidden: ``BackwardPlan.hosted``; HOSTED's
(N, V) buffer and a head's, in grad_weight); "borrowed" is a temporary in the memory of another
gradient, free until that one is written (the N x H accumulator in grad_weight's last rows:
``BackwardPlan.borrowed``; the chunked sweep's per-tile statistics in the chunk's rows of
grad_hidden).
"""

from dataclasses import dataclass

import torch
import triton

from . import configs
from . import device as _device
from .backward_passes import DEFAULT_CHUNK_BYTES, DEFAULT_PAIRED_BYTES, BackwardPlan, plan_passes
from .validate import Options, chunked_unsupported

VALUES, RECOMPUTE, CHUNKED, HOSTED, LONG_CONTEXT, EXPONENTIALS = (
    "values", "recompute", "chunked", "hosted", "long_context", "exponentials")
# The modes whose forward forms the loss's gradients (``chunked.forward``).
GRADIENTS_IN_FORWARD = (CHUNKED, HOSTED, LONG_CONTEXT)

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
# The long-context chunked plan (``lean_chunk_bytes``): the fewest rows a chunk may have. Each chunk adds
# the V x H pair's epilogue (H200, S4 = 65536 x 4096 x 128256, bf16: 1024-row chunks with an int8
# remainder 428 ms a step against 357 in 4096-row chunks and 478 for the paired recompute plan, so
# ~1.5 ms a chunk; at 512 rows the chunks' overhead would pass the recompute plan's).
LEAN_MIN_ROWS = 1024
# The chunked path's buffer hosted in grad_weight (``hosted_slab_rows``): the fewest vocabulary rows of
# a slab of grad_weight computed at a time (a 1024 x 4096 product still fills the H200's 132 SMs with
# 128 x 256 tiles; a multiple of 16, as every slab's first row must be for TMA).
HOSTED_MIN_ROWS = 1024


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
    chunks by default, 4096 in 1.25 GiB. Which calls take it: ``_long_context_budget``."""
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


@dataclass(frozen=True)
class Plan:
    """A loss or per-token call's plan (module docstring): its mode and what its executors cut by.
    Frozen; made by ``plan_loss`` / ``plan_tokens`` only."""

    mode: str
    budget: int | None = None  # the gradients-in-forward modes: one chunk's buffer (None: the default)
    rows: int = 0  # the gradients-in-forward modes: rows of a chunk (all N for HOSTED)
    head_rows: int = 0  # a first, larger chunk hosted in grad_weight's memory (0: none)
    slab_rows: int = 0  # HOSTED or a head: rows of grad_weight computed at a time
    passes: tuple[BackwardPlan, ...] = ()  # RECOMPUTE, EXPONENTIALS (a second backward): the backward's
    borrowed: bool = False  # the one pass's grad_hidden accumulator lives in grad_weight's memory


def _tiles(dtype, h, where, softcap: bool, bias: bool):
    """(the chunked path's row block, the recompute backward's tiles): the tables' (``configs``),
    which the plan's chunks and blocks are cut in."""
    chunked = configs.chunked_epilogue(configs.tiles("chunked", dtype, h, where=where), softcap, bias)
    return chunked.block_n, configs.dlogits_config(dtype, h=h, where=where)


def _whole_fits(opts: Options, n: int, v: int, dtype: torch.dtype) -> bool:
    """Whether the whole (N, V) buffer fits in ``chunk_bytes`` beside the gradients (one chunk)."""
    return n * v * dtype.itemsize <= chunk_budget(opts.chunk_bytes, chunked=True)


def _grad_weight_dtype(dtype: torch.dtype, master: bool) -> torch.dtype:
    """The chunked path's grad_weight dtype (``chunked.weight_grad_dtype``)."""
    return torch.float32 if master or dtype == torch.float16 else dtype


def hosted_chunk(opts, n, v, h, dtype, need_dw: bool, master: bool) -> int | None:
    """The slab rows when the call runs in one chunk whose (N, V) buffer lives in grad_weight's
    memory (``hosted_slab_rows``): grad_weight wanted and the whole buffer not within ``chunk_bytes``."""
    if not need_dw or _whole_fits(opts, n, v, dtype):
        return None
    return hosted_slab_rows(n, v, h, dtype, _grad_weight_dtype(dtype, master), opts.chunk_bytes)


def _long_context_budget(opts, n, v, h, dtype, needs, master, sharded, dlogits) -> int | None:
    """The chunk budget when "auto" takes LONG_CONTEXT, else None: bf16 (not an fp32 master weight,
    not a vocabulary shard), options the chunked path takes, more than one chunk, and a shape at
    which the recompute path's default holds no fp32 accumulator (``plan_passes`` at the default
    budget gives the paired plan or two passes: V < 2N and N x H past the hosted plan's budget, as at
    65536 x 4096 x 128256). There grad_weight is summed across chunks as a bf16 + 4-bit pair in the
    rest of ``chunk_bytes`` (default DEFAULT_PAIRED_BYTES; ``lean_chunk_bytes``, None where fewer
    than LEAN_MIN_ROWS rows fit): three products instead of four, faster with more memory (H200, S4:
    404 ms in 512 MiB, 349 in 1.25 GiB, against 442 for the recompute path's fp32 accumulator in 1 GiB)."""
    if (opts.strategy != "auto" or dtype != torch.bfloat16 or master or sharded
            or chunked_unsupported(opts) is not None or _whole_fits(opts, n, v, dtype)):
        return None
    need_dx, need_dw, need_db = needs
    passes = plan_passes(n, v, h, dtype, None, dlogits.block_n, dlogits.block_v, need_dx or need_db, need_dw,
                         may_pair=True)
    if len(passes) == 1 and not passes[0].paired:
        return None
    return lean_chunk_bytes(v, h, dtype, opts.chunk_bytes)


def _recompute(mode, opts, n, v, h, dtype, needs, master, sharded, dlogits) -> Plan:
    """``mode`` with the recompute backward's passes: pairs where there is no bias gradient and no
    vocabulary shard; an fp32 master weight's gradient is its own accumulator."""
    need_dx, need_dw, need_db = needs
    passes = plan_passes(n, v, h, dtype, opts.chunk_bytes, dlogits.block_n, dlogits.block_v, need_dx or need_db,
                         need_dw, may_pair=not sharded and not need_db, fp32_weight_grad=master)
    borrowed = bool(len(passes) == 1 and passes[0].borrowed and need_dx and need_dw and n > 0)
    return Plan(mode, passes=passes, borrowed=borrowed)


def plan_loss(opts: Options, n: int, v: int, h: int, dtype: torch.dtype, needs, *, master: bool = False,
              sharded: bool = False, bias: bool = False, where=None) -> Plan:
    """The loss's plan (``needs``: grad_hidden, grad_weight, grad_bias wanted; ``master``: an fp32
    master weight; ``sharded``: a vocabulary shard; ``bias``: a bias is given; ``where``: the
    device, whose family's tiles cut the chunks and blocks).

    "auto" takes the gradients-in-forward modes when the options allow them (``chunked_unsupported``)
    and the whole (N, V) buffer fits in ``chunk_bytes`` (one chunk), or the weight is an fp32 master
    weight (its fp32 gradient is the accumulator: any number of chunks costs only the chunk's
    buffer), or the buffer fits in grad_weight's memory (HOSTED), or at long context (LONG_CONTEXT);
    else RECOMPUTE. "chunked" always takes them, "recompute" never."""
    if not any(needs):
        return Plan(VALUES)
    block_n, dlogits = _tiles(dtype, h, where, opts.softcap is not None, bias)
    master = master and dtype != torch.float32
    lean = _long_context_budget(opts, n, v, h, dtype, needs, master, sharded, dlogits)
    slab = None if lean is not None else hosted_chunk(opts, n, v, h, dtype, needs[1], master)
    takes = opts.strategy == "chunked" or (
        opts.strategy == "auto" and chunked_unsupported(opts) is None
        and (master or _whole_fits(opts, n, v, dtype) or slab is not None or lean is not None))
    if not takes:
        return _recompute(RECOMPUTE, opts, n, v, h, dtype, needs, master, sharded, dlogits)
    mode = LONG_CONTEXT if lean is not None else HOSTED if slab is not None else CHUNKED
    if n == 0:
        return Plan(mode)
    budget = opts.chunk_bytes if lean is None else lean
    if budget is None and master and slab is None:
        budget = DEFAULT_MASTER_BYTES
    rows = n if slab is not None else chunk_rows(n, v, dtype, budget, block_n)
    head = (hosted_head(n, v, h, dtype, _grad_weight_dtype(dtype, master), rows, block_n)
            if slab is None and needs[1] and rows < n else None)
    return Plan(mode, budget, rows, head[0] if head else 0, slab or (head[1] if head else 0))


def exponentials_unsupported(opts: Options, n: int, v: int, dtype: torch.dtype) -> str | None:
    """Why EXPONENTIALS cannot take this per-token call, or None."""
    if opts.softcap is not None and "entropy" in opts.outputs:
        return ("a softcap together with the entropy (the buffer's exponentials carry the softcap's "
                "derivative, and the entropy's gradient needs z back from them)")
    need = n * v * dtype.itemsize
    budget = chunk_budget(opts.chunk_bytes, chunked=True)
    if need > budget:
        return (f"N x V = {n} x {v} exponentials ({need} bytes in {dtype}) held from the forward to the backward "
                f"beyond chunk_bytes={budget}")
    return None


def plan_tokens(opts: Options, n: int, v: int, h: int, dtype: torch.dtype, needs, *, master: bool = False,
                sharded: bool = False, where=None) -> Plan:
    """The per-token call's plan: EXPONENTIALS with strategy="chunked" (validated beforehand), or
    "auto" where the exponentials fit (``exponentials_unsupported``); else RECOMPUTE (VALUES without
    a gradient). Both carry the recompute backward's passes: EXPONENTIALS for a second backward."""
    if not any(needs):
        return Plan(VALUES)
    keeps = opts.strategy != "recompute" and n > 0 and (
        opts.strategy == "chunked" or exponentials_unsupported(opts, n, v, dtype) is None)
    _, dlogits = _tiles(dtype, h, where, False, False)
    master = master and dtype != torch.float32
    return _recompute(EXPONENTIALS if keeps else RECOMPUTE, opts, n, v, h, dtype, needs, master, sharded, dlogits)


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
    own_da: bool = False


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
    if group <= in_place:
        return DivergenceChunks(in_place, in_place)
    return DivergenceChunks(rows, group, bool(group > rows))


@dataclass(frozen=True)
class DivergencePlan:
    """The divergence call's plan: CHUNKED (the gradients formed in the forward), RECOMPUTE or
    VALUES; the forward's chunks and the backward's (a recompute of the gradients; on CHUNKED the
    log-prob term's alone), None without a gradient."""

    mode: str
    forward: DivergenceChunks
    backward: DivergenceChunks | None


def plan_divergence(strategy: str, reduction: str, n: int, v: int, dtype: torch.dtype, chunk_bytes: int | None,
                    needs) -> DivergencePlan:
    """"auto" takes CHUNKED for "mean" / "sum" (one upstream scalar), RECOMPUTE for "none"; either is
    VALUES without a gradient. CHUNKED's forward forms da, so its chunks leave room for da's buffer."""
    resolved = strategy if strategy != "auto" else ("recompute" if reduction == "none" else "chunked")
    mode = VALUES if not any(needs) else CHUNKED if resolved == "chunked" else RECOMPUTE
    forward = plan_divergence_chunks(n, v, chunk_bytes, dtype.itemsize if mode == CHUNKED else None)
    backward = plan_divergence_chunks(n, v, chunk_bytes, dtype.itemsize) if mode != VALUES else None
    return DivergencePlan(mode, forward, backward)
