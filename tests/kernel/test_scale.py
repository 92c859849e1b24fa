"""Sizes past int32 and odd shapes on the GPU, in bf16 (and fp16 for the odd shapes).

- N*H and N*V past 2^31 elements: N = 266243 (2^18 + 4099, a multiple of no block size), H = 8192,
  V = 16384: hidden is 4.1 GiB and its last rows sit past element 2^31; the (N, V) plane is 4.4e9.
- A Gemma-3-sized vocabulary: V = 262144 with N = 32768, H = 2048 (N*V = 8.6e9), with a bias.
Both against ``reference.chunked_linear_cross_entropy`` in fp32 (IEEE: TF32 off), at the default
``chunk_bytes`` and with one block for the whole (N, V) plane, whose index runs past 2^31 itself.
Every 5th row is ignored; reduction "sum" (with "mean" over a count that is not a power of two, the
bf16 rounding of da's -1/count target entries is the same on every row, a systematic error of up to
2^-9 on top of the ~1.7e-3 random one, too close to the 3e-3 bound).
- N = 4099, H = 1030 (rows of 2060 bytes: not 16-byte aligned), V = 50257, bf16 and fp16, against
float64 with ``cases.check_three_way``; and the same through storage offsets of one element.

Memory (estimated, peak of each test; the H200 has 141 GB): past-int32 ~27 GiB, Gemma-3 ~22 GiB, odd
shapes ~15 GiB (float64 logits of 1.6 GB, several temporaries). Time: ~20-40 s, ~15-25 s, ~5 s each.
"""

import math

import pytest
import torch

from cases import Case, check_three_way, make_inputs
from conftest import ON_GPU, rel_err
from fused_linear_ce import fused_linear_cross_entropy
from fused_linear_ce.reference import chunked_linear_cross_entropy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU (sizes past int32)")]

GiB = 1 << 30
INT32 = 2**31


@pytest.fixture(autouse=True)
def ieee_fp32_and_empty_cache():
    """The fp32 reference's matmuls in IEEE fp32, and each test starts and ends with an empty cache."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.cuda.empty_cache()
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.cuda.empty_cache()


def _randn_bf16(rows, cols, std, generator, block=16384):
    """(rows, cols) bf16 normal values, drawn in fp32 one block of rows at a time (no 2x fp32 copy)."""
    out = torch.empty(rows, cols, device="cuda", dtype=torch.bfloat16)
    for r in range(0, rows, block):
        m = min(block, rows - r)
        out[r : r + m] = torch.randn(m, cols, device="cuda", generator=generator) * std
    return out


def _inputs(n, h, v, bias=False, seed=0):
    """bf16 hidden (std 1) and weight (std sqrt(4/H)): logits of std ~2; every 5th row ignored."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = _randn_bf16(n, h, 1.0, g)
    weight = _randn_bf16(v, h, (4.0 / h) ** 0.5, g)
    b = torch.randn(v, device="cuda", generator=g).bfloat16() if bias else None
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    targets[::5] = -100
    return hidden, weight, b, targets


def _big_rel_err(got, want, rows=16384):
    """Frobenius relative error in float64 on the GPU, a block of rows at a time (``rel_err`` copies
    to the host in float64: 17 GiB for a 2^31-element tensor). NaN or inf fails."""
    assert got.shape == want.shape, (got.shape, want.shape)
    num = torch.zeros((), dtype=torch.float64, device="cuda")
    den = torch.zeros((), dtype=torch.float64, device="cuda")
    for r in range(0, got.shape[0], rows):
        a, b = got[r : r + rows].double(), want[r : r + rows].double()
        num += (a - b).square().sum()
        den += b.square().sum()
    num, den = num.item(), den.item()
    assert math.isfinite(num) and math.isfinite(den) and den > 0, (num, den)
    return math.sqrt(num / den)


def _check_against_chunked_fp32(n, h, v, bias, chunk_rows, chunk_settings):
    hidden, weight, b, targets = _inputs(n, h, v, bias)
    total, _, ref_dx, ref_dw, ref_db = chunked_linear_cross_entropy(
        hidden, weight, targets, b, chunk=chunk_rows, compute_dtype=torch.float32
    )
    ref_loss = total.item()
    torch.cuda.empty_cache()
    leaves = [t.requires_grad_(True) for t in (hidden, weight, b) if t is not None]
    for chunk_bytes in chunk_settings:
        for leaf in leaves:
            leaf.grad = None
        loss = fused_linear_cross_entropy(hidden, weight, targets, b, reduction="sum", chunk_bytes=chunk_bytes)
        loss.backward()
        assert math.isfinite(loss.item()) and abs(loss.item() - ref_loss) <= 1e-5 * abs(ref_loss), (
            chunk_bytes, loss.item(), ref_loss)
        for name, leaf, ref in zip(("hidden", "weight", "bias"), leaves, (ref_dx, ref_dw, ref_db)):
            assert leaf.grad.dtype == torch.bfloat16
            err = _big_rel_err(leaf.grad, ref) if leaf.grad.ndim == 2 else rel_err(leaf.grad, ref)
            assert err < 3e-3, f"chunk_bytes={chunk_bytes}: {name} error {err:.2e}"
        del loss
        torch.cuda.empty_cache()


@pytest.mark.tier
def test_hidden_and_plane_past_int32_elements():
    """N*H = 2.18e9 and N*V = 4.36e9 elements. Default blocks: 8192-row token chunks (33, the last
    ragged) with a V x H fp32 accumulator; 9 GiB: the whole 8.1 GiB plane in one da block."""
    n, h, v = 266243, 8192, 16384
    assert n * h > INT32 and n * v > INT32
    _check_against_chunked_fp32(n, h, v, bias=False, chunk_rows=4096, chunk_settings=(None, 9 * GiB))


def test_gemma3_vocabulary_262144():
    """V = 262144, N*V = 8.6e9: default blocks of 4096 vocabulary columns (64) with an N x H fp32
    accumulator; 16 GiB: the whole plane (2^33 elements) in one da block. With a bias."""
    n, h, v = 32768, 2048, 262144
    assert n * v > INT32
    _check_against_chunked_fp32(n, h, v, bias=True, chunk_rows=1024, chunk_settings=(None, 16 * GiB))


ODD = []
for dtype in (torch.bfloat16, torch.float16):
    ODD += [
        Case(4099, 1030, 50257, dtype, "mean", ignored=0.2, bias=True),  # 2 vocabulary blocks
        Case(4099, 1030, 50257, dtype, "none", ignored=0.2, chunk_bytes=1 << 20),  # 33 token blocks
    ]


@pytest.mark.tier_if(lambda case: case.chunk_bytes == 1 << 20)
@pytest.mark.parametrize("case", ODD, ids=lambda c: c.id)
def test_odd_shapes_match_float64(case):
    check_three_way(case)
    torch.cuda.empty_cache()


def _offset_by_one(t):
    """The same values through a view one element into its storage: a pointer not 16-byte aligned."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


@pytest.mark.tier_if(lambda dtype: dtype == torch.bfloat16)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_misaligned_pointers_give_the_aligned_result(dtype):
    case = Case(4099, 1030, 50257, dtype, "mean", ignored=0.2, bias=True)
    hidden, weight, bias, targets = make_inputs(case)
    results = []
    for h, w in ((hidden, weight), (_offset_by_one(hidden), _offset_by_one(weight))):
        leaves = [h.detach().requires_grad_(True), w.detach().requires_grad_(True), bias.clone().requires_grad_(True)]
        loss = fused_linear_cross_entropy(leaves[0], leaves[1], targets, leaves[2])
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for got, want in zip(*results):  # the same arithmetic; only the loads' vector width may differ
        assert rel_err(got, want) < (1e-6 if got.dtype == torch.float32 else 1e-3)
