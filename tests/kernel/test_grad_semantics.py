"""Gradient semantics: accumulation into existing ``.grad``, gradients (and their products)
only for inputs that require them, forward-only under ``no_grad`` / ``inference_mode``, and a clear
error on double backward. Spies on ``sweep``, ``recompute``, ``chunked`` and ``products`` record which kernels and products actually run."""

import pytest
import torch

from cases import Case, make_inputs
from conftest import DEVICE, KernelSpy
from fused_linear_ce import chunked, fused_linear_cross_entropy, gemm, products, recompute, sweep

LEAVES = ("hidden", "weight", "bias")


def _leaves(case, requires=LEAVES):
    hidden, weight, bias, targets = make_inputs(case)
    leaves = {k: t.clone().requires_grad_(k in requires) for k, t in zip(LEAVES, (hidden, weight, bias))}
    return leaves, targets


def _loss(leaves, targets, case, **kw):
    kw = dict(case.extra, **kw)
    return fused_linear_cross_entropy(leaves["hidden"], leaves["weight"], targets, leaves["bias"],
                                      reduction=case.reduction, chunk_bytes=case.chunk_bytes, **kw)


@pytest.mark.tier
@pytest.mark.parametrize("case", [
    Case(33, 40, 300, torch.float32, "mean", bias=True, ignored=0.2),  # chunked (auto: the plane fits)
    Case(33, 40, 300, torch.float16, "sum", bias=True, ignored=0.2, extra=dict(strategy="chunked")),
    Case(33, 40, 300, torch.bfloat16, "sum", bias=True, ignored=0.2, chunk_bytes=16 * 300 * 2),  # token blocks
    Case(33, 40, 300, torch.float16, "none", bias=True, chunk_bytes=33 * 256 * 2),  # vocabulary blocks
], ids=lambda c: c.id + "-" + c.extra.get("strategy", "auto"))
def test_second_backward_accumulates_into_existing_grad(case):
    """Two backward passes into .grad that already holds values: each adds its gradient, in the
    leaf's dtype, exactly as autograd's own accumulation does (bit for bit)."""
    leaves, targets = _leaves(case)
    g = torch.Generator().manual_seed(7)
    fresh = {k: torch.autograd.grad(_loss(leaves, targets, case).sum(), t)[0] for k, t in leaves.items()}
    init = {k: torch.randn(t.shape, generator=g).to(t.dtype).to(DEVICE) for k, t in leaves.items()}
    for k, t in leaves.items():
        t.grad = init[k].clone()
    _loss(leaves, targets, case).sum().backward()
    _loss(leaves, targets, case).sum().backward()
    for k, t in leaves.items():
        expected = init[k].clone()
        expected += fresh[k]
        expected += fresh[k]
        assert t.grad.dtype == case.dtype and torch.equal(t.grad, expected), k


@pytest.fixture
def spies(monkeypatch):
    """Records which gradient product runs ("dx": da @ weight, "dw": da^T @ hidden) and each launch
    of the kernels that form da (the recompute path's dlogits, the chunked path's in-place one)
    with its BIAS_GRAD flag."""
    dlogits = KernelSpy(recompute.dlogits_kernel)
    in_place = KernelSpy(chunked.softmax_gradient_kernel)
    monkeypatch.setattr(chunked, "softmax_gradient_kernel", in_place)

    def spy(module, name):  # every product entry point records its second operand's storage
        real = getattr(module, name)

        def run(a, b, *args, **kwargs):
            products_run.append(b.untyped_storage().data_ptr())
            return real(a, b, *args, **kwargs)

        monkeypatch.setattr(module, name, run)

    products_run = []
    for module, name in ((gemm, "matmul"), (products, "product"), (products, "accumulate"), (products, "rows_product")):
        spy(module, name)
    monkeypatch.setattr(recompute, "dlogits_kernel", dlogits)
    return products_run, dlogits, in_place


GRAD_SUBSETS = [("hidden",), ("weight",), ("bias",), ("hidden", "weight"), ("weight", "bias"), LEAVES]


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("chunk_bytes", [None, 16 * 300 * 2], ids=["whole", "blocked"])
@pytest.mark.parametrize("requires", GRAD_SUBSETS, ids=lambda r: "+".join(r))
def test_only_inputs_that_require_grad_get_one_and_only_their_products_run(requires, chunk_bytes, strategy, spies):
    products, recompute, in_place = spies
    dlogits = recompute if strategy == "recompute" else in_place
    other = in_place if strategy == "recompute" else recompute
    case = Case(40, 40, 300, torch.bfloat16, "mean", bias=True, chunk_bytes=chunk_bytes, extra=dict(strategy=strategy))
    leaves, targets = _leaves(case, requires)
    _loss(leaves, targets, case).backward()
    for k, t in leaves.items():
        assert (t.grad is not None) == (k in requires), k
        if t.grad is not None:
            assert t.grad.shape == t.shape and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0
    by = {"dx": leaves["weight"].untyped_storage().data_ptr(), "dw": leaves["hidden"].untyped_storage().data_ptr()}
    assert set(products) <= set(by.values()), "a product ran on an unexpected operand"
    assert (by["dx"] in products) == ("hidden" in requires)
    assert (by["dw"] in products) == ("weight" in requires)
    assert dlogits.launches, "the gradient of the logits should run"
    assert not other.launches, "the other path's kernel should not run"
    assert {kw["BIAS_GRAD"] for kw in dlogits.launches} == {"bias" in requires}


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_no_input_requiring_grad_gives_a_loss_without_graph(strategy, spies):
    products, dlogits, in_place = spies
    case = Case(20, 40, 300, torch.float32, bias=True, extra=dict(strategy=strategy))
    leaves, targets = _leaves(case, requires=())
    loss = _loss(leaves, targets, case)
    assert loss.grad_fn is None and not loss.requires_grad
    assert not products and not dlogits.launches and not in_place.launches


@pytest.fixture
def forward_only(monkeypatch):
    """Counts forward sweeps; fails the test if the backward is entered."""
    calls = []
    real_forward = sweep.forward

    def forward(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the backward ran under no_grad / inference_mode")

    monkeypatch.setattr(sweep, "forward", forward)
    monkeypatch.setattr(recompute, "backward", refuse)
    return calls


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_no_grad_and_inference_mode_run_the_forward_sweep_only(mode, forward_only):
    case = Case(20, 40, 300, torch.bfloat16, "mean", bias=True, ignored=0.2)
    leaves, targets = _leaves(case)
    with torch.enable_grad():  # the value with grad enabled, for comparison (forward only too)
        loss_grad, metrics_grad, lse_grad = _loss(leaves, targets, case, return_metrics=True, return_lse=True)
    assert loss_grad.grad_fn is not None and lse_grad.grad_fn is not None
    with mode():
        loss, metrics, lse = _loss(leaves, targets, case, return_metrics=True, return_lse=True)
    assert len(forward_only) == 2, "one forward sweep per call"
    for got, want in [(loss, loss_grad), (lse, lse_grad)] + [(metrics[k], metrics_grad[k]) for k in metrics]:
        assert got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, want.detach())
    with pytest.raises(RuntimeError):
        loss.backward()


DOUBLE_BACKWARD = r"no autograd formula was registered|differentiate twice|double backward"


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_double_backward_raises_a_clear_error(dtype, strategy):
    """create_graph=True still gives the right first-order gradient; differentiating that gradient
    again (a gradient penalty) raises instead of silently treating it as a constant."""
    case = Case(12, 40, 100, dtype, bias=True, extra=dict(strategy=strategy))
    leaves, targets = _leaves(case)
    expected = torch.autograd.grad(_loss(leaves, targets, case), leaves["hidden"])[0]
    grad, = torch.autograd.grad(_loss(leaves, targets, case), leaves["hidden"], create_graph=True)
    assert torch.equal(grad.detach(), expected)
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        grad.float().square().sum().backward()
    grad, = torch.autograd.grad(_loss(leaves, targets, case), leaves["hidden"], create_graph=True)
    penalized = _loss(leaves, targets, case) + grad.float().square().sum()
    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        penalized.backward()


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_no_grad_with_strategy_chunked_computes_no_gradients(mode, monkeypatch):
    """strategy="chunked" computes gradients in the forward only when one will be wanted: under
    no_grad / inference_mode it is the forward sweep alone, with the same loss bit for bit."""
    case = Case(20, 40, 300, torch.bfloat16, "mean", bias=True, ignored=0.2, extra=dict(strategy="chunked"))
    leaves, targets = _leaves(case)
    with_grad = _loss(leaves, targets, case)
    assert with_grad.grad_fn is not None

    def refuse(*args, **kwargs):
        raise AssertionError("the chunked forward (with gradients) ran under no_grad / inference_mode")

    monkeypatch.setattr(chunked, "forward", refuse)
    with mode():
        loss = _loss(leaves, targets, case)
    assert loss.grad_fn is None
    # The same value; not bit for bit: the chunked sweep merges one split per vocabulary tile.
    torch.testing.assert_close(loss, with_grad.detach(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_a_loss_that_uses_only_the_lse_gets_its_gradient(reduction):
    """Outputs without a gradient reach the backward as None (no materialised zero gradients of the
    chunked path's gradient-sized outputs): a loss of the lse alone still gets the lse's gradient,
    the same as the loss times zero plus the lse."""
    case = Case(33, 40, 300, torch.float32, reduction, bias=True, ignored=0.2)
    leaves, targets = _leaves(case)
    loss, lse = _loss(leaves, targets, case, return_lse=True)
    only = torch.autograd.grad((lse * lse).sum(), list(leaves.values()))
    loss, lse = _loss(leaves, targets, case, return_lse=True)
    both = torch.autograd.grad((loss * 0).sum() + (lse * lse).sum(), list(leaves.values()))
    for a, b in zip(only, both):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)
