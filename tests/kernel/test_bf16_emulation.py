"""How bf16 is covered on CPU, and the proof that the cover is faithful.

The Triton interpreter gets bf16 wrong in two places: ``tl.dot`` multiplies the raw bits of bf16
operands (triton#11584, closed as unsupported), and its fp32 -> bf16 cast truncates instead of
rounding to nearest even. The kernels take a BF16_EMULATION switch, set only for bf16 under the
interpreter, that (1) upcasts bf16 tiles to fp32 just before ``tl.dot`` — exact, since a product of
two bf16 values fits in fp32's mantissa, which is what the tensor cores compute before their fp32
accumulation — and (2) rounds fp32 -> bf16 with integer arithmetic on the bits, the GPU's cvt.rn.
These tests pin both: the interpreter defect is still there (so the switch is still needed), and the
rounding equals torch's bf16 cast bit for bit, NaN and infinities included. On a GPU the rounding
helper is checked in both settings against torch as well.
"""

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from fused_linear_ce import configs
from fused_linear_ce.logits import round_to


@triton.jit
def _round_kernel(x_ptr, y_ptr, n, EMULATE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, round_to(x, tl.bfloat16, EMULATE), mask=mask)


@triton.jit
def _dot_kernel(a_ptr, b_ptr, c_ptr, UPCAST: tl.constexpr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    b = tl.load(b_ptr + r[:, None] * 16 + r[None, :])
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    tl.store(c_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b))


def _hard_floats():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=g) * torch.logspace(-40, 38, 4096).flip(0)
    bits = torch.randint(0, 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = (torch.randint(0, 2**15, (512,), generator=g, dtype=torch.int32) << 16) | 0x8000  # exact halves
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), 3.3895314e38, -3.3895314e38, 1e-45, 1.0 + 2**-8])
    return torch.cat([x, bits.view(torch.float32), ties.view(torch.float32), -ties.view(torch.float32), special])


@pytest.mark.parametrize("emulate", [True, False] if DEVICE.type == "cuda" else [True])
def test_rounding_to_bf16_matches_torch_bit_for_bit(emulate):
    x = _hard_floats().to(DEVICE)
    x = x[~torch.isnan(x)]
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), EMULATE=emulate, BLOCK=1024)
    want = x.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_rounding_keeps_nan():
    x = torch.tensor([float("nan"), 1.0], device=DEVICE)
    x = torch.cat([x, torch.tensor([0x7F800001, -1], dtype=torch.int32).view(torch.float32).to(DEVICE)])
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=DEVICE)
    _round_kernel[(1,)](x, y, x.numel(), EMULATE=True, BLOCK=16)
    assert torch.isnan(y[[0, 2, 3]]).all() and y[1].item() == 1.0


@pytest.mark.skipif(not configs.interpreted(), reason="documents a defect of the Triton interpreter")
def test_interpreter_bf16_dot_is_still_wrong_so_the_upcast_is_needed():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(16, 16, generator=g).bfloat16()
    b = torch.randn(16, 16, generator=g).bfloat16()
    want = a.float() @ b.float()
    raw, upcast = torch.empty(16, 16), torch.empty(16, 16)
    _dot_kernel[(1,)](a, b, raw, UPCAST=False)
    _dot_kernel[(1,)](a, b, upcast, UPCAST=True)
    torch.testing.assert_close(upcast, want, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(raw, want, rtol=1e-2, atol=1e-2), "interpreter bf16 tl.dot fixed: drop the upcast"


def test_emulation_switch_is_set_exactly_for_bf16_under_the_interpreter():
    from fused_linear_ce import device

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        flag = device.dot_flags(dtype)["BF16_EMULATION"]
        assert flag == (configs.interpreted() and dtype == torch.bfloat16)
