"""The logit tile: the one piece of arithmetic every kernel of this package shares.

The math, once
--------------
For a row ``n`` (a token) and a class ``v``:

    a[n, v] = hidden[n] . weight[v] (+ bias[v])      fp32 accumulator, never rounded
    u[n, v] = logit_scale * a[n, v]
    z[n, v] = c * tanh(u / c) / T  if softcap c else u / T  (the logits the softmax sees;
                                                     T the temperature, 1 for the loss)

    lse[n]  = log sum_v exp(z[n, v])                 online: running max m and sum s,
                                                     s <- s * exp(m_old - m_new) + sum exp(z - m_new)
    loss[n] = lse[n] - z[n, t_n]                     for counted rows (t_n != ignore_index)

Backward with an upstream gradient g[n] per row (g = 0 on ignored rows, grad/count for "mean"):

    dz[n, v] = g[n] * (softmax(z)[n, v] - [v == t_n])
    da[n, v] = dz[n, v] * logit_scale / T * (1 - (z T / c)^2 if softcap else 1)
    grad_hidden = da @ weight,  grad_weight = da^T @ hidden,  grad_bias = sum_n da[n, :]

The loss variants (label smoothing, z-loss, class weights, a returned lse) generalise the backward to
``da = A p - B onehot - C w`` with per-row coefficients; ``losses.py`` holds those formulas. The
per-token outputs (``tokens.py``) add an entropy term ``- E p (z - S)``, S = sum_v p z.

On the kernels' side the temperature is folded into their float arguments (``Options.kernel_scales``):
without a softcap it joins the logit scale (``u / T = a * (logit_scale / T)``); with one it is
the output scale of the tanh, ``z = (c / T) tanh(u / c)``, and the derivative's ``t`` is
``z / (c / T)``; the chain's factor ``logit_scale / T`` multiplies da. At T = 1 every one of them is
the loss's own value, bit for bit.

Metrics ride along the same sweep: the argmax is carried with the running max (first index wins
on ties, as ``torch.argmax``), and the entropy ``lse - sum_v p z`` needs ``sum_v exp(z - m) z``,
which is rescaled by the same ``exp(m_old - m_new)`` as ``s``.
"""

import triton
import triton.language as tl


# Below this |x|, tanh is its odd Taylor polynomial through x^11 (the next term, 21844/6081075 x^13,
# is under 2^-27 of tanh there); above it, the exp form, whose 1 - exp(-2|x|) cancels less than one
# bit from here on. The exp form alone loses all of tanh's relative precision as x -> 0: a large
# softcap (x = u / c tiny) must still give z = u.
TANH_SERIES_BELOW = tl.constexpr(0.35)


@triton.jit
def tanh(x):
    """tanh to a few fp32 ulps at every |x| (no libdevice, so the interpreter runs it too): the
    Taylor polynomial near 0 (exact as x -> 0, where the exp form cancels to nothing), the exp form,
    stable at both tails, elsewhere."""
    ax = tl.abs(x)
    t = tl.exp(-2.0 * ax)
    y = (1.0 - t) / (1.0 + t)
    y = tl.where(x >= 0, y, -y)
    x2 = x * x
    p = 1382.0 / 155925.0
    p = p * x2 - 62.0 / 2835.0
    p = p * x2 + 17.0 / 315.0
    p = p * x2 - 2.0 / 15.0
    p = p * x2 + 1.0 / 3.0
    series = x - x * x2 * p
    return tl.where(ax < TANH_SERIES_BELOW, series, y)


@triton.jit
def softcap_grad(z, softcap):
    """dz/du of ``z = c tanh(u / c)`` from z: ``1 - (z / c)^2``, as ``(1 - t)(1 + t)``, whose
    factors are exact near |t| = 1 (where the softcap saturates and ``1 - t * t`` would add the
    rounding of ``t * t`` to a tiny result). ``t`` by a correctly rounded division (the GPU's
    default one is approximate: ``c / c`` may come out above 1), clamped to |t| <= 1, so a saturated
    logit (tanh = 1 in fp32) has derivative 0, as torch's ``1 - tanh^2``, never a negative one."""
    t = tl.minimum(tl.abs(tl.div_rn(z, softcap)), 1.0)
    return (1.0 - t) * (1.0 + t)


@triton.jit
def round_to(x, dtype: tl.constexpr, BF16_EMULATION: tl.constexpr):
    """Casts fp32 ``x`` to ``dtype`` rounding to nearest even, as the GPU's cvt.rn does.

    BF16_EMULATION (the interpreter with bf16 only): the interpreter's own fp32 -> bf16 cast
    truncates, so round here with integer arithmetic on the bits instead: add 0x7FFF plus the lowest
    kept bit, keep the top 16 bits. NaN is kept NaN explicitly (its low bits could carry into inf).
    """
    if BF16_EMULATION and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = tl.where(x != x, 0x7FC0, bits)  # canonical bf16 NaN
        return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def logit_tile(
    hidden_ptr,  # (N, H) fp32/bf16/fp16, any strides
    weight_ptr,  # (V, H) same dtype, any strides
    bias_ptr,  # (V,) same dtype, or a dummy when HAS_BIAS is False
    hidden_desc,  # TMA: tensor descriptor of hidden, blocks (BLOCK_N, BLOCK_H); else unused
    weight_desc,  # TMA: tensor descriptor of weight, blocks (BLOCK_V, BLOCK_H); else unused
    row0,  # TMA: the tile's first row (may pass N: rows past the end load as 0)
    col0,  # TMA: the tile's first class (likewise)
    rows,  # (BLOCK_N,) int64 row indices, already clamped into [0, N)
    cols,  # (BLOCK_V,) int64 class indices, already clamped into [0, V)
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_b,
    logit_scale,
    softcap,
    softcap_out,  # the tanh's output scale: softcap / temperature (softcap for the loss)
    HAS_BIAS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
    EVEN_H: tl.constexpr,
    BF16_EMULATION: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    TMA: tl.constexpr,
):
    """Returns z for a (BLOCK_N, BLOCK_V) tile as fp32.

    TMA (the launcher's choice where the layout allows it, ``device.tma_layout``): both operands
    come through tensor descriptors, which fill rows, classes and H columns past the end with 0
    (out-of-range lanes are masked by the caller). Else pointer loads: rows and columns come
    clamped, so the loads need no row/column masks (out-of-range lanes recompute a valid row);
    only a ragged H needs a mask. The same products either way.
    BF16_EMULATION upcasts the operands before ``tl.dot``: the launcher sets it under the Triton
    interpreter for bf16, whose ``tl.dot`` multiplies raw bits there (triton#11584). bf16 x bf16
    products are exact in fp32, so this computes what the tensor cores compute.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    if TMA:
        for k in range(0, tl.cdiv(H, BLOCK_H)):
            x = hidden_desc.load([row0, k * BLOCK_H])
            w = weight_desc.load([col0, k * BLOCK_H])
            if BF16_EMULATION:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w.T, acc, input_precision=INPUT_PRECISION)
    else:
        offs_h = tl.arange(0, BLOCK_H).to(tl.int64)
        x_base = hidden_ptr + rows[:, None] * stride_hn
        w_base = weight_ptr + cols[None, :] * stride_wv
        for k in range(0, tl.cdiv(H, BLOCK_H)):
            h = k * BLOCK_H + offs_h
            x_ptrs = x_base + h[None, :] * stride_hh
            w_ptrs = w_base + h[:, None] * stride_wh
            if EVEN_H:
                x = tl.load(x_ptrs)
                w = tl.load(w_ptrs)
            else:
                x = tl.load(x_ptrs, mask=h[None, :] < H, other=0.0)
                w = tl.load(w_ptrs, mask=h[:, None] < H, other=0.0)
            if BF16_EMULATION:
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_b).to(tl.float32)[None, :]
    acc = acc * logit_scale
    if HAS_SOFTCAP:
        acc = softcap_out * tanh(acc / softcap)
    return acc


@triton.jit
def grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Maps a 1-D program id to (pid_m, pid_n) in groups of GROUP_M row tiles (L2 reuse of the
    column operand; performance only)."""
    width = GROUP_M * num_pid_n
    group = pid // width
    first_m = group * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size
    return pid_m, pid_n


@triton.jit
def label_terms(d, coef_b, coef_c_ptrs, class_weight_ptr, offs_v, mask_v, SMOOTHING: tl.constexpr,
                HAS_CLASS_WEIGHT: tl.constexpr):
    """The terms of da every kernel that forms it adds after ``A p - B onehot``: NaN on a row whose
    target is outside [0, V) (the host marks it with B = NaN), and label smoothing's ``- C w``
    (w the class weights at ``offs_v``, or 1). (BLOCK_N, BLOCK_V) fp32 in and out."""
    d += tl.where(coef_b[:, None] != coef_b[:, None], float("nan"), 0.0)
    if SMOOTHING:
        coef_c = tl.load(coef_c_ptrs)
        if HAS_CLASS_WEIGHT:
            d -= coef_c[:, None] * tl.load(class_weight_ptr + offs_v, mask=mask_v, other=0.0)[None, :]
        else:
            d -= coef_c[:, None]
    return d


@triton.jit
def store_dlogits(d, out_ptrs, mask, mask_v, dbias_ptrs, BIAS_GRAD: tl.constexpr, BF16_EMULATION: tl.constexpr):
    """Stores the fp32 da tile rounded once to the output's dtype, and with BIAS_GRAD its column
    sums (fp32, from the unrounded values) to the tile's own row of the bias partial sums."""
    tl.store(out_ptrs, round_to(d, out_ptrs.dtype.element_ty, BF16_EMULATION), mask=mask)
    if BIAS_GRAD:
        tl.store(dbias_ptrs, tl.sum(tl.where(mask, d, 0.0), axis=0), mask=mask_v)
