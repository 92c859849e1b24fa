"""Corners of the domain where ``F.linear`` + ``F.cross_entropy`` define the answer, checked against
them in float64: class weights of any sign, an empty hidden size, int32 targets with an ignore_index
beyond int32, softcaps and logit scales over many orders of magnitude, and the softcap's tanh itself
(held to fp32 ``torch.tanh`` accuracy at every argument)."""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from conftest import CAP, DEVICE, rel_err
from fused_linear_ce import fused_linear_cross_entropy
from fused_linear_ce.logits import tanh

STRATEGIES = ["recompute", "chunked"]


def _problem(n=24, h=16, v=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE), targets.to(DEVICE)


def _ours(hidden, weight, targets, bias=None, **kwargs):
    leaves = [t.clone().requires_grad_(True) if t is not None else None for t in (hidden, weight, bias)]
    loss = fused_linear_cross_entropy(leaves[0], leaves[1], targets, leaves[2], **kwargs)
    loss.backward()
    return loss.detach(), [t.grad if t is not None else None for t in leaves]


def _torch64(hidden, weight, targets, bias=None, softcap=None, logit_scale=1.0, **kwargs):
    leaves = [t.detach().double().clone().requires_grad_(True) if t is not None else None
              for t in (hidden, weight, bias)]
    z = F.linear(leaves[0], leaves[1], leaves[2]) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    cw = kwargs.pop("class_weight", None)
    loss = F.cross_entropy(z, targets, weight=None if cw is None else cw.double(), **kwargs)
    loss.backward()
    return loss.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_class_weights_of_any_sign_divide_the_mean_by_their_signed_sum(strategy, dtype):
    """Random-normal class weights (as PyTorch's own OpInfo samples draw them): the weighted mean
    divides by the sum of the counted rows' weights whatever its sign, and so do the gradients."""
    hidden, weight, targets = _problem(dtype=dtype)
    g = torch.Generator().manual_seed(3)
    cw = torch.randn(weight.shape[0], generator=g).to(DEVICE)
    cw[targets] = -cw[targets].abs()  # the counted rows' weights sum below zero
    assert cw[targets].sum() < 0
    loss, grads = _ours(hidden, weight, targets, class_weight=cw, strategy=strategy)
    want, want_grads = _torch64(hidden, weight, targets, class_weight=cw)
    assert rel_err(loss, want) < 1e-5
    for got, exp in zip(grads[:2], want_grads[:2]):
        assert got.abs().amax() > 0
        assert rel_err(got, exp) < CAP[dtype]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_class_weights_summing_to_zero_give_non_finite_gradients_like_cross_entropy(strategy):
    """Counted rows whose weights cancel exactly (non-zero elsewhere): F.cross_entropy divides by
    zero, an infinite loss and non-finite gradients; never a finite answer that looks right."""
    hidden, weight, targets = _problem()
    targets = torch.tensor([0, 1] * 12, device=DEVICE)
    cw = torch.ones(weight.shape[0], device=DEVICE)
    cw[1] = -1.0
    loss, grads = _ours(hidden, weight, targets, class_weight=cw, strategy=strategy)
    want, want_grads = _torch64(hidden, weight, targets, class_weight=cw)
    assert not torch.isfinite(want) and not torch.isfinite(loss)
    for got, exp in zip(grads[:2], want_grads[:2]):
        assert not torch.isfinite(exp).all() and not torch.isfinite(got).all()


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_empty_hidden_size_gives_the_bias_logits(strategy, bias):
    """H = 0: every logit is the bias (or 0), as F.linear gives; the weight and hidden gradients
    are empty and the bias gets softmax - onehot."""
    hidden, weight, targets = _problem(h=0)
    b = torch.randn(weight.shape[0], device=DEVICE) if bias else None
    loss, grads = _ours(hidden, weight, targets, b, strategy=strategy)
    want, want_grads = _torch64(hidden, weight, targets, b)
    assert rel_err(loss, want) < 1e-6
    assert grads[0].shape == (24, 0) and grads[1].shape == (40, 0)
    if bias:
        assert rel_err(grads[2], want_grads[2]) < 1e-5


@pytest.mark.parametrize("ignore_index", [2**32 + 5, -(2**32) + 5, 2**62], ids=["2^32+5", "-2^32+5", "2^62"])
def test_int32_targets_compare_with_ignore_index_in_int64(ignore_index):
    """An ignore_index beyond int32 matches no int32 target: a target of 5 must not wrap onto
    2^32 + 5 and drop its row."""
    hidden, weight, targets = _problem()
    targets[:6] = 5
    got, _ = _ours(hidden, weight, targets.to(torch.int32), ignore_index=ignore_index, reduction="sum")
    want, _ = _torch64(hidden, weight, targets, reduction="sum")
    assert rel_err(got, want) < 1e-5


def test_ignore_index_beyond_int64_raises():
    hidden, weight, targets = _problem()
    with pytest.raises(ValueError, match="int64"):
        fused_linear_cross_entropy(hidden, weight, targets, ignore_index=2**63)


CAPS = [1e-3, 0.5, 30.0, 1e3, 1e5, 1e8, 1e30]


def _torch32_grads(hidden, weight, targets, softcap):
    leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
    z = F.linear(*leaves)
    F.cross_entropy(softcap * torch.tanh(z / softcap), targets).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("softcap", CAPS, ids=lambda c: f"cap{c:g}")
def test_softcap_at_any_magnitude_matches_float64(strategy, softcap):
    """fp32 inputs: loss and gradients within fp32 rounding of the float64 softcapped loss, from a
    cap that crushes the logits to one that leaves them alone. Where the cap saturates (1e-3 here),
    the derivative ``1 - tanh^2`` of a rounded tanh is what limits fp32 (plain torch: 4e-5): held
    to twice plain fp32 torch's own error, which rounds one step fewer (its tanh is kept before the
    multiplication by the cap)."""
    hidden, weight, targets = _problem()
    loss, grads = _ours(hidden, weight, targets, softcap=softcap, strategy=strategy)
    want, want_grads = _torch64(hidden, weight, targets, softcap=softcap)
    torch32 = _torch32_grads(hidden, weight, targets, softcap)
    assert rel_err(loss, want) < 1e-6
    for got, exp, plain in zip(grads[:2], want_grads[:2], torch32):
        assert rel_err(got, exp) < max(2e-6, 2 * rel_err(plain, exp))


def test_a_huge_softcap_is_no_softcap():
    hidden, weight, targets = _problem()
    capped, capped_grads = _ours(hidden, weight, targets, softcap=1e8)
    plain, plain_grads = _ours(hidden, weight, targets)
    assert rel_err(capped, plain) < 1e-6
    for a, b in zip(capped_grads[:2], plain_grads[:2]):
        assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("logit_scale", [1e-6, 1e-3, 0.3, 7.0, 300.0], ids=lambda s: f"scale{s:g}")
def test_logit_scale_at_any_magnitude_matches_float64(strategy, logit_scale):
    hidden, weight, targets = _problem()
    loss, grads = _ours(hidden, weight, targets, logit_scale=logit_scale, strategy=strategy)
    want, want_grads = _torch64(hidden, weight, targets, logit_scale=logit_scale)
    assert rel_err(loss, want) < 1e-5
    for got, exp in zip(grads[:2], want_grads[:2]):
        assert rel_err(got, exp) < 1e-4


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tanh(tl.load(x_ptr + offs, mask=mask, other=0.0)), mask=mask)


def test_softcap_tanh_is_as_accurate_as_torch_tanh_at_every_magnitude():
    """The kernels' tanh (``logits.tanh``) against float64, in units of the fp32 result's ulp,
    from 1e-30 to 30 of both signs; fp32 ``torch.tanh`` is the yardstick (within 2 ulps here)."""
    mags = torch.logspace(-30, 1.5, 4000, dtype=torch.float64)
    x64 = torch.cat([mags, -mags, torch.linspace(-1, 1, 2001, dtype=torch.float64)])
    x = x64.float()
    want = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().clamp_min(torch.finfo(torch.float32).tiny)
    y = torch.empty_like(x)
    xd, yd = x.to(DEVICE), y.to(DEVICE)
    _tanh_kernel[(triton.cdiv(x.numel(), 1024),)](xd, yd, x.numel(), BLOCK=1024)
    ours = ((yd.cpu().double() - want).abs() / ulp).max().item()
    theirs = ((torch.tanh(x).double() - want).abs() / ulp).max().item()
    assert theirs <= 2.0
    assert ours <= 4.0, f"tanh off by {ours:.1f} ulps (torch.tanh {theirs:.1f})"
