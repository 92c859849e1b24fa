"""The package's Triton matmul and its launcher: c (+)= (a @ b) [* unscale], fp32 accumulation and the
factor applied in its epilogue before the one rounding; TMA loads where the GPU and the layouts allow
(cuBLAS's rate on the H200), else pointer loads. Which product runs here and which on cuBLAS:
``products.py``.

- ``matmul``: the launcher (the config, the TMA descriptors where the layouts allow, the grid). Its
  epilogue writes a 16-bit or fp32 result (or adds into it), sums into a compensated pair (``lo``;
  the pair's arithmetic: ``pairs.py``), or with ``split`` 2 adds half of the K reduction into an
  fp32 buffer.
- ``few_tiles``: whether its output has too few tiles for one program a tile to fill the GPU
  (``products.product`` then takes cuBLAS); ``fills_one_wave``: whether it has a tile per SM.
- ``split_k``: whether the K reduction in two halves fills the GPU's waves markedly better.

The kernel: ``matmul_kernel``; ``load_block`` reads an operand's block through its descriptor.
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import configs, device
from .logits import grouped_tile, round_to
from .pairs import pair_of, pair_through_descriptors, pair_value


def _transposed(t: torch.Tensor):
    """False when ``t``'s storage has a layout TMA takes (``device.tma_layout``), True when its
    transpose's has, None when neither."""
    if device.tma_layout(t):
        return False
    return True if device.tma_layout(t.t()) else None


def _tma_layouts(a: torch.Tensor, b: torch.Tensor, cfg: configs.MatmulConfig):
    """When ``matmul`` loads a and b through TMA descriptors (the config, the GPU and both layouts
    allow it): whether each is read through its transpose's storage (``_transposed``); else None."""
    if not (cfg.tma and a.shape[1] > 0 and device.tma_hardware(a.device)):
        return None
    layouts = (_transposed(a), _transposed(b))
    return None if None in layouts else layouts


def _descriptor(t: torch.Tensor, block_rows: int, block_cols: int, transposed: bool):
    """A TMA descriptor over ``t``'s storage: over ``t`` itself, or over its transpose when
    ``transposed`` (``_transposed(t)``)."""
    if transposed:
        return TensorDescriptor.from_tensor(t.t(), [block_cols, block_rows])
    return TensorDescriptor.from_tensor(t, [block_rows, block_cols])


def output_tiles(m: int, p: int, dtype: torch.dtype, where: torch.device) -> int:
    """``matmul``'s output tiles for an (m, p) result on ``where`` (its family's config's block_m x
    block_p: the same product has more tiles where the family's tiles are smaller)."""
    cfg = configs.matmul_config(dtype, where=where)
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(p, cfg.block_p)


def _output_tiles(a: torch.Tensor, b: torch.Tensor) -> int:
    """``matmul``'s output tiles for a @ b."""
    return output_tiles(a.shape[0], b.shape[1], a.dtype, a.device)


def few_tiles(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``matmul``'s output (one program a tile, the whole K reduction in each) has fewer tiles
    than half the GPU's SMs: most of the one wave idle behind long K loops. The chunked path's
    grad_hidden of a few hundred rows by the whole vocabulary is one (S2 at 256 MiB: 36 tiles of
    128 x 256 for 132 SMs, 106 ms against 88 on cuBLAS). Never on the interpreter."""
    if a.device.type != "cuda":
        return False
    return 2 * _output_tiles(a, b) < device.sm_count(a.device)


def fills_one_wave(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``matmul``'s output has at least one tile per SM (always on the interpreter). The
    divergence's grad_hidden of a group of rows (D2: 1056 rows, 72 tiles of 128 x 256 for 132 SMs,
    K = 128256) otherwise takes cuBLAS, which splits the K reduction."""
    if a.device.type != "cuda":
        return True
    return _output_tiles(a, b) >= device.sm_count(a.device)


# ``split_k``: each half of a split K reduction at least this many K steps (the fp32 partial's atomic
# epilogue against its products).
MIN_SPLIT_STEPS = 64


def split_k(a: torch.Tensor, b: torch.Tensor) -> int:
    """2 where ``matmul``'s output tiles fill the GPU's waves markedly worse (by 5 points or more)
    than twice as many would, and K is long enough to halve (``MIN_SPLIT_STEPS``); else 1. The
    chunk's grad_hidden at S2 (8192 x 2304, K = V = 256000): 576 tiles of 128 x 256 are 4.4 waves
    of 132 SMs (87% full), 1152 are 8.7 (97%). Never on the interpreter."""
    if a.device.type != "cuda":
        return 1
    tiles = _output_tiles(a, b)
    sms = device.sm_count(a.device)

    def fill(t):
        return t / (triton.cdiv(t, sms) * sms)

    long_k = triton.cdiv(a.shape[1], configs.matmul_config(a.dtype, where=a.device).block_k) >= 2 * MIN_SPLIT_STEPS
    return 2 if long_k and fill(2 * tiles) >= fill(tiles) + 0.05 else 1


def matmul(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, accumulate: bool, unscale=None,
           lo: torch.Tensor | None = None, role: str = "product", split: int = 1) -> None:
    """c = (a @ b) * unscale (+ c), fp32 accumulation inside the kernel; a, b in the input dtype, any
    strides; ``unscale`` an optional fp32 (1,) device tensor. The operands load through TMA
    descriptors where the config, the GPU and both layouts allow it, else through pointers.

    With ``lo`` (a 16-bit buffer with c's shape and strides; ``products.compensated``): c and lo are a
    compensated pair, s = (a @ b) * unscale (+ c + lo) split into c = s rounded and lo = the rest
    rounded. ``role``: ``configs.matmul_config``'s. ``split`` 2 (``split_k``): c an fp32 buffer of
    zeros to which the two halves of the K reduction are added (no factor, no pair)."""
    m, k = a.shape
    p = b.shape[1]
    if m == 0 or p == 0:
        return
    # A sum into a pair has its own config where the family's table names one (``configs.matmul_config``).
    cfg = configs.matmul_config(a.dtype, role="compensated" if lo is not None and role == "product" else role,
                                where=a.device)
    layouts = _tma_layouts(a, b, cfg)
    tma = layouts is not None
    a_t, b_t = layouts if tma else (False, False)
    a_desc = _descriptor(a, cfg.block_m, cfg.block_k, a_t) if tma else a
    b_desc = _descriptor(b, cfg.block_k, cfg.block_p, b_t) if tma else b
    flags = device.dot_flags(a.dtype, a.device)
    c_tma = False
    assert split == 1 or (c.dtype == torch.float32 and lo is None and unscale is None and not accumulate)
    if split > 1:  # atomic adds through a descriptor where the layout allows, in column halves (the
        # interpreter has no descriptor reductions: pointers there)
        c_tma = (c.device.type == "cuda" and cfg.tma and device.tma_hardware(c.device) and device.tma_layout(c)
                 and c.is_contiguous())
        flags["ATOMIC_SEM"] = device.atomic_sem(c.device)
    elif lo is None:  # a plain result through a descriptor: the config's choice, contiguous buffers only
        c_tma = (cfg.tma and cfg.c_tma and device.tma_hardware(c.device) and device.tma_layout(c)
                 and c.is_contiguous())
    else:
        # A bf16 result under the interpreter rounds through round_to's emulation (an fp16 hi's lo).
        flags["BF16_EMULATION"] = any(device.bf16_emulation(t.dtype) for t in (a, c, lo))
        # The pair through descriptors where the layouts allow: a 2-D tile of pointers spills.
        # Contiguous buffers only: on the H200 the pair stored through descriptors over a view of
        # 70 of 80 columns changed the columns past the view (tests/kernel/test_compensated.py);
        # every pair the package sums into is a whole gradient.
        c_tma = (cfg.tma and device.tma_hardware(c.device) and device.tma_layout(c)
                 and device.tma_layout(lo) and c.is_contiguous() and lo.is_contiguous())
    split_pair = c_tma and lo is not None and cfg.split_pair
    c_block = [cfg.block_m, cfg.block_p // 2 if split_pair or split > 1 else cfg.block_p]
    packed = lo is not None and lo.dtype == torch.uint8  # two 4-bit remainders a byte: half the columns
    lo_block = [c_block[0], c_block[1] // 2] if packed else c_block
    c_desc = TensorDescriptor.from_tensor(c, c_block) if c_tma else c
    lo_desc = TensorDescriptor.from_tensor(lo, lo_block) if c_tma and lo is not None else c
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(p, cfg.block_p) * split,)
    matmul_kernel[grid](
        a, b, c, lo if lo is not None else c, unscale if unscale is not None else c, a_desc, b_desc,
        c_desc, lo_desc, m, p, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
        lo.stride(0) if packed else 0,
        ACCUMULATE=accumulate, HAS_SCALE=unscale is not None,
        BLOCK_M=cfg.block_m, BLOCK_P=cfg.block_p, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        EVEN_M=m % cfg.block_m == 0, EVEN_P=p % cfg.block_p == 0, EVEN_K=k % cfg.block_k == 0,
        TMA=tma, A_T=a_t, B_T=b_t, COMPENSATED=lo is not None, C_TMA=c_tma, SPLIT_PAIR=split_pair,
        SPLIT_K=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )


@triton.jit
def load_block(desc, row0, col0, TRANSPOSED: tl.constexpr):
    """The block at (row0, col0) of a matrix whose descriptor is over it (or over its transpose when
    TRANSPOSED: the stored block at (col0, row0), transposed)."""
    if TRANSPOSED:
        return desc.load([col0, row0]).T
    else:
        return desc.load([row0, col0])


@triton.jit
def matmul_kernel(
    a_ptr,  # (M, K) any strides
    b_ptr,  # (K, P) any strides
    c_ptr,  # (M, P) out; fp32 when ACCUMULATE (but COMPENSATED)
    lo_ptr,  # COMPENSATED: (M, P) 16-bit or int8, c's strides, the pair's remainder (uint8: (M, ceil(P / 2))
    # bytes of two 4-bit remainders each, row stride stride_lm); else unused
    scale_ptr,  # (1,) fp32: multiplies A @ B when HAS_SCALE (undoes the fp16 da scaling)
    a_desc,  # TMA: tensor descriptor of A as stored (of A^T when A_T), else unused
    b_desc,  # TMA: tensor descriptor of B as stored (of B^T when B_T), else unused
    c_desc,  # C_TMA: tensor descriptor of C, blocks (BLOCK_M, BLOCK_P); else unused
    lo_desc,  # C_TMA: tensor descriptor of LO, likewise; else unused
    M,
    P,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bp,
    stride_cm,
    stride_cp,
    stride_lm,  # a uint8 LO's row stride (its columns contiguous); else unused
    ACCUMULATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_P: tl.constexpr,
    EVEN_K: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr = False,
    A_T: tl.constexpr = False,
    B_T: tl.constexpr = False,
    COMPENSATED: tl.constexpr = False,
    C_TMA: tl.constexpr = False,
    SPLIT_PAIR: tl.constexpr = False,
    SPLIT_K: tl.constexpr = 1,
    ATOMIC_SEM: tl.constexpr = "acq_rel",  # the split-K partial sums' ordering (``device.atomic_sem``)
):
    """C = A @ B (+ C when ACCUMULATE), fp32 accumulation, one (BLOCK_M, BLOCK_P) tile a program.

    1-D grouped grid over cdiv(M, BLOCK_M) x cdiv(P, BLOCK_P). The whole K reduction stays in the
    program's fp32 accumulator; ACCUMULATE adds an fp32 C read back (no atomics: one writer per tile).
    TMA (the launcher's choice, ``matmul``): both operands through tensor descriptors over
    their row-major storage; an operand stored transposed (da^T is da read by columns) loads its
    (K, M) or (P, K) block and transposes it in shared memory. Blocks past an edge load as 0.
    Else pointer loads, ragged edges masked, not clamped: clamping hides the contiguity of an
    operand whose M or P dimension is its contiguous one (da^T, weight), and the loads then lose
    their vector width.
    COMPENSATED (``products.compensated``): C (16-bit) and LO a compensated pair: s = acc (+ C + LO
    when ACCUMULATE, C + LO first: exact in fp32 but for a remainder under 2^-24 of C), then
    C = round(s), LO = round(s - C) (s - C exact; 0 where C overflowed to inf). C_TMA: C (and LO)
    read and written through tensor descriptors, blocks past the edges read as 0 and not written;
    a 2-D tile of pointers spills (offline sm_90, ``scripts/registers.py``: the pair accumulating
    3128 bytes of stack against 0; a plain result 88 against 0, an fp32 sum 1696 against 0). The
    pair takes it wherever the layout allows, a plain result where the config's ``c_tma`` says.
    SPLIT_PAIR (the config's ``split_pair``; the pair through descriptors whose blocks are
    (BLOCK_M, BLOCK_P // 2)): the pair's epilogue runs on the two column halves of the tile in turn,
    the same arithmetic per element (offline sm_90: 104 bytes of stack against 0 with an int8 lo).
    SPLIT_K = 2 (``split_k``): twice the programs, each over half of the K steps (the second half's
    programs after all of the first's, so that a wave shares operands as without), adding its fp32
    partial product into C (fp32, zeroed by the host) by atomics: 0 + x is exact and x + y = y + x,
    so the two halves' sum is the same bits in either order. With C_TMA a reduction through the
    descriptor (blocks (BLOCK_M, BLOCK_P // 2), the tile's column halves in turn), else through
    pointers (a tile of pointers: 560 bytes of stack offline). No factor, no pair.
    """
    pid = tl.program_id(0)
    n_steps = tl.cdiv(K, BLOCK_K)
    k_lo = 0
    k_hi = n_steps
    if SPLIT_K > 1:
        n_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(P, BLOCK_P)
        per = tl.cdiv(n_steps, SPLIT_K)
        k_lo = (pid // n_tiles) * per
        k_hi = tl.minimum(n_steps, k_lo + per)
        pid = pid % n_tiles
    pid_m, pid_p = grouped_tile(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(P, BLOCK_P), GROUP_M)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_p = pid_p.to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_m = offs_m < M
    mask_p = offs_p < P
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    a_base = a_ptr + offs_m[:, None] * stride_am
    b_base = b_ptr + offs_p[None, :] * stride_bp
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    for k in range(k_lo, k_hi):
        if TMA:
            a = load_block(a_desc, pid_m * BLOCK_M, k * BLOCK_K, A_T)
            b = load_block(b_desc, k * BLOCK_K, pid_p * BLOCK_P, B_T)
        else:
            kk = k * BLOCK_K + offs_k
            a_ptrs = a_base + kk[None, :] * stride_ak
            b_ptrs = b_base + kk[:, None] * stride_bk
            if EVEN_M and EVEN_K:
                a = tl.load(a_ptrs)
            else:
                a = tl.load(a_ptrs, mask=mask_m[:, None] & (kk[None, :] < K), other=0.0)
            if EVEN_P and EVEN_K:
                b = tl.load(b_ptrs)
            else:
                b = tl.load(b_ptrs, mask=(kk[:, None] < K) & mask_p[None, :], other=0.0)
        if BF16_EMULATION:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    mask = mask_m[:, None] & mask_p[None, :]
    row0 = pid_m * BLOCK_M
    col0 = pid_p * BLOCK_P
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr)
    if SPLIT_K > 1 and C_TMA:  # a reduction through the descriptor (blocks (BLOCK_M, BLOCK_P // 2)), per half
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_P // 2)), (0, 2, 1)))
        c_desc.atomic_add([row0, col0], left)
        c_desc.atomic_add([row0, col0 + BLOCK_P // 2], right)
    elif SPLIT_K > 1:
        tl.atomic_add(c_ptr + offs_m[:, None] * stride_cm + offs_p[None, :] * stride_cp, acc, mask=mask,
                      sem=ATOMIC_SEM)
    elif COMPENSATED and C_TMA:  # rows and columns past the end are neither read nor written
        if SPLIT_PAIR:  # two column halves, one after the other: fewer live registers
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_P // 2)), (0, 2, 1)))
            pair_through_descriptors(left, c_desc, lo_desc, row0, col0, ACCUMULATE, BF16_EMULATION)
            pair_through_descriptors(right, c_desc, lo_desc, row0, col0 + BLOCK_P // 2, ACCUMULATE,
                                     BF16_EMULATION)
        else:
            pair_through_descriptors(acc, c_desc, lo_desc, row0, col0, ACCUMULATE, BF16_EMULATION)
    elif COMPENSATED:
        offs_c = offs_m[:, None] * stride_cm + offs_p[None, :] * stride_cp
        if lo_ptr.dtype.element_ty == tl.uint8:  # byte j of a row: columns 2j and 2j + 1
            offs_j = pid_p.to(tl.int64) * (BLOCK_P // 2) + tl.arange(0, BLOCK_P // 2)
            offs_lo = offs_m[:, None] * stride_lm + offs_j[None, :]
            mask_lo = mask_m[:, None] & (2 * offs_j < P)[None, :]
        else:
            offs_lo = offs_c  # c's strides
            mask_lo = mask
        if ACCUMULATE:
            acc = pair_value(tl.load(c_ptr + offs_c, mask=mask, other=0.0),
                             tl.load(lo_ptr + offs_lo, mask=mask_lo, other=0)) + acc
        hi, lo = pair_of(acc, c_ptr.dtype.element_ty, lo_ptr.dtype.element_ty, BF16_EMULATION)
        tl.store(c_ptr + offs_c, hi, mask=mask)
        tl.store(lo_ptr + offs_lo, lo, mask=mask_lo)
    elif C_TMA:  # rows and columns past the end are neither read nor written
        if ACCUMULATE:
            acc += c_desc.load([row0, col0]).to(tl.float32)
        c_desc.store([row0, col0], round_to(acc, c_desc.dtype, BF16_EMULATION))
    else:
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_p[None, :] * stride_cp
        if ACCUMULATE:
            acc += tl.load(c_ptrs, mask=mask, other=0.0)
        tl.store(c_ptrs, round_to(acc, c_ptr.dtype.element_ty, BF16_EMULATION), mask=mask)
