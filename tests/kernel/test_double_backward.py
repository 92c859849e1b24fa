"""Several backwards through one graph (``retain_graph=True``: a gradient norm logged before the real
step, two optimisers on one loss): each adds the first backward's gradients again, as torch does, so
``.grad`` ends at k times them; or, where the gradients cannot be had again without a cost to every
single backward, a clear error before anything is written.

- The loss, "recompute" (any reduction): every backward recomputes, bit for bit the same.
- The loss, "chunked" ("auto" takes it at these sizes, checked): the forward computes the gradients.
  fp16's are kept in fp32 and scaled into new tensors, so they serve any number of backwards (bit for
  bit). bf16, fp32 and an fp32 master weight's are scaled in place into the leaves' gradients by the
  first backward; a second raises, naming strategy="recompute" (recomputing them would need hidden,
  which that path does not keep: N x H bytes more for every single backward).
- Per token, "chunked": the first backward turns the saved exponentials into da in place; a later one
  takes the recompute path's backward from the inputs and statistics the forward keeps anyway (the
  same gradients to rounding: one rounding fewer on the non-target entries).
- The first backward's gradients are never written by a later one (autograd may hand the very tensor
  to ``.grad`` or to ``torch.autograd.grad``'s caller).
- Under ``torch.compile`` the compiled backward leaves the saved buffers as they are: several
  backwards give the first's gradients on both paths.

bf16 on the CPU: the kernels' BF16_EMULATION switch (tests/kernel/test_bf16_emulation.py proves it
faithful) computes what the GPU computes; the bf16 cases run on both.
"""

import pytest
import torch

from conftest import CAP, DEVICE, ON_GPU, KernelSpy, reference, rel_err
from fused_linear_ce import chunked, fused_linear_cross_entropy, fused_linear_logprobs, recompute

N, H, V = 37, 32, 200
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UPSTREAM = 0.3  # the loss's upstream gradient: not a power of two, so scaling twice would show
BACKWARDS = 3
# Per token, the later backwards' recompute rounds the non-target entries of da once where the first
# (chunked) rounded them twice: the sums differ from k times the first by about one rounding.
TOKEN_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
SPENT = r'second backward through the same graph \(retain_graph=True\) on the chunked path.*strategy="recompute"'


def _problem(dtype, bias=True, weight_dtype=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.25
    targets = torch.randint(0, V, (N,), generator=g)
    targets[3:8] = -100
    b = torch.randn(V, generator=g) if bias else None
    cast = lambda t, d=dtype: None if t is None else t.to(d).to(DEVICE)  # noqa: E731
    return cast(hidden), cast(weight, weight_dtype or dtype), targets.to(DEVICE), cast(b)


def _leaves(problem):
    hidden, weight, _, bias = problem
    return [t.clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]


def _row_upstream(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)


ROWS = _row_upstream()  # per-row upstream gradients (log-probs or "none" rows, entropy)


def _loss(leaves, targets, reduction, strategy, autocast=None):
    """The scalar to backward: the loss times UPSTREAM, or with "none" its rows times a random upstream."""
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        loss = fused_linear_cross_entropy(leaves[0], leaves[1], targets, *leaves[2:], reduction=reduction,
                                          strategy=strategy)
    return (loss * ROWS[0]).sum() if reduction == "none" else loss * UPSTREAM


def _loss64(problem, reduction):
    hidden, weight, targets, bias = problem
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    loss = reference.linear_cross_entropy(leaves[0], leaves[1], targets, *leaves[2:], reduction=reduction)
    ((loss * ROWS[0].double()).sum() if reduction == "none" else loss * UPSTREAM).backward()
    return [t.grad for t in leaves]


def _tokens(leaves, targets, strategy, outputs, autocast=None):
    with torch.autocast(DEVICE.type, dtype=autocast, enabled=autocast is not None):
        out = fused_linear_logprobs(leaves[0], leaves[1], targets, *leaves[2:], outputs=outputs, strategy=strategy)
    g_lp, g_ent = ROWS
    total = (out["log_probs"] * g_lp).sum()
    return total + (out["entropy"] * g_ent).sum() if "entropy" in outputs else total


def _tokens64(problem, outputs):
    hidden, weight, targets, bias = problem
    leaves = [t.detach().double().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    z = leaves[0] @ leaves[1].T + (leaves[2] if len(leaves) > 2 else 0)
    lp = torch.log_softmax(z, -1)
    counted = targets != -100
    g_lp, g_ent = (g.double() for g in ROWS)
    total = (torch.where(counted, lp.gather(1, targets.clamp(min=0)[:, None])[:, 0], 0.0) * g_lp).sum()
    if "entropy" in outputs:
        total = total + (torch.where(counted, -(lp.exp() * lp).sum(-1), 0.0) * g_ent).sum()
    total.backward()
    return [t.grad for t in leaves]


def _accumulated(grads, k):
    """k copies of ``grads`` summed into a leaf's ``.grad`` the way autograd does (in its dtype)."""
    out = [g.clone() for g in grads]
    for _ in range(k - 1):
        for o, g in zip(out, grads):
            o += g
    return out


@pytest.fixture
def launches(monkeypatch):
    """Counts the launches of the kernels that form da: the chunked path's in-place one and the
    recompute path's dlogits."""
    spies = {"in_place": KernelSpy(chunked.softmax_gradient_kernel), "dlogits": KernelSpy(recompute.dlogits_kernel)}
    monkeypatch.setattr(chunked, "softmax_gradient_kernel", spies["in_place"])
    monkeypatch.setattr(recompute, "dlogits_kernel", spies["dlogits"])
    return lambda: {name: len(spy.launches) for name, spy in spies.items()}


@pytest.mark.parametrize("strategy,reduction,dtype", [
    ("recompute", "mean", "fp32"), ("recompute", "none", "bf16"), ("chunked", "sum", "fp16"), ("auto", "mean", "fp16"),
])
def test_loss_backwards_add_the_first_gradients_again(strategy, reduction, dtype, launches):
    """k backwards give .grad = k times one backward's gradients, bit for bit (the recompute path
    recomputes them the same way; fp16's chunked unit gradients stay as the forward left them), and
    one backward of a retained graph gives what one of a freed graph gives."""
    dtype = DTYPES[dtype]
    problem = _problem(dtype)
    targets = problem[2]
    once = _leaves(problem)
    _loss(once, targets, reduction, strategy).backward()
    single = [t.grad for t in once]
    for ours, exact in zip(single, _loss64(problem, reduction)):
        assert rel_err(ours, exact) < CAP[dtype]
    leaves = _leaves(problem)
    before = launches()
    loss = _loss(leaves, targets, reduction, strategy)
    for k in range(1, BACKWARDS + 1):
        loss.backward(retain_graph=k < BACKWARDS)
        for t, expected in zip(leaves, _accumulated(single, k)):
            assert t.grad.dtype == t.dtype and torch.equal(t.grad, expected), k
    after = launches()
    took_chunked = after["in_place"] > before["in_place"]
    assert took_chunked == (strategy != "recompute")  # "auto" took the chunked path here
    # the chunked path's backwards all used the forward's gradients; the recompute path's recomputed
    assert (after["dlogits"] == before["dlogits"]) == took_chunked


@pytest.mark.parametrize("case", ["chunked-fp32", "auto-bf16", "auto-master-bf16"])
def test_loss_second_backward_of_spent_gradients_raises_and_writes_nothing(case):
    """bf16 / fp32 gradients and an fp32 master weight's, scaled in place by the first backward: the
    second raises before anything is written, so the first's gradients (``torch.autograd.grad``'s,
    or ``.grad``, which may be that very tensor) stay as they were; strategy="recompute" backwards
    the same graph any number of times."""
    strategy, *rest = case.split("-")
    master = "master" in rest  # bf16 autocast: hidden's gradient bf16, the weight's fp32, both in place
    dtype = DTYPES[rest[-1]]
    problem = _problem(torch.float32 if master else dtype)
    targets = problem[2]
    autocast = dtype if master else None
    leaves = _leaves(problem)
    loss = _loss(leaves, targets, "mean", strategy, autocast)
    first = torch.autograd.grad(loss, leaves, retain_graph=True)
    kept = [g.clone() for g in first]
    with pytest.raises(RuntimeError, match=SPENT) as error:
        torch.autograd.grad(loss, leaves, retain_graph=True)
    assert "scaled those of hidden and weight in place" in str(error.value)
    assert all(torch.equal(g, k) for g, k in zip(first, kept))
    # .grad: the first backward's gradient (autograd keeps the returned tensor itself where it can)
    leaves = _leaves(problem)
    loss = _loss(leaves, targets, "mean", strategy, autocast)
    loss.backward(retain_graph=True)
    assert all(torch.equal(t.grad, k) for t, k in zip(leaves, kept))  # retained: the same as once
    with pytest.raises(RuntimeError, match=SPENT):
        loss.backward()
    assert all(torch.equal(t.grad, k) for t, k in zip(leaves, kept))
    # the setting the message names
    leaves = _leaves(problem)
    loss = _loss(leaves, targets, "mean", "recompute", autocast)
    loss.backward(retain_graph=True)
    once = [t.grad.clone() for t in leaves]
    loss.backward()
    assert all(torch.equal(t.grad, e) for t, e in zip(leaves, _accumulated(once, 2)))


def test_loss_backward_of_a_freed_graph_keeps_autograds_error():
    """Without retain_graph=True the second backward is autograd's own error, not the spent one."""
    problem = _problem(torch.float32)
    leaves = _leaves(problem)
    loss = _loss(leaves, problem[2], "mean", "chunked")
    loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


def test_loss_after_a_create_graph_backward():
    """Under create_graph=True the first backward scales out of place: the gradients are not spent."""
    problem = _problem(torch.float32)
    leaves = _leaves(problem)
    loss = _loss(leaves, problem[2], "sum", "chunked")
    first = [g.detach().clone() for g in torch.autograd.grad(loss, leaves, create_graph=True)]
    loss.backward()
    assert all(torch.equal(t.grad, g) for t, g in zip(leaves, first))


@pytest.mark.parametrize("dtype,strategy,outputs", [
    ("fp32", "chunked", "lp+entropy"), ("fp16", "chunked", "lp+entropy"), ("bf16", "chunked", "lp"),
    ("fp16", "auto", "lp"), ("fp32", "recompute", "lp+entropy"),
])
def test_logprobs_backwards_add_the_first_gradients_again(dtype, strategy, outputs, launches):
    """Per token: the chunked path's first backward spends its exponentials, the later ones
    recompute; k backwards give k times one backward's gradients (to the rounding the two paths
    differ by; bit for bit on the recompute path), against float64 too, and the first backward's
    gradients are not written by the later ones."""
    dtype = DTYPES[dtype]
    outputs = ("log_probs", "entropy") if outputs == "lp+entropy" else ("log_probs",)
    problem = _problem(dtype)
    targets = problem[2]
    once = _leaves(problem)
    _tokens(once, targets, strategy, outputs).backward()
    single = [t.grad for t in once]
    exact = _tokens64(problem, outputs)
    for ours, e in zip(single, exact):
        assert rel_err(ours, e) < TOKEN_TOL[dtype]
    leaves = _leaves(problem)
    total = _tokens(leaves, targets, strategy, outputs)
    first = torch.autograd.grad(total, leaves, retain_graph=True)
    kept = [g.clone() for g in first]
    assert all(torch.equal(g, s) for g, s in zip(first, single))  # a retained graph's first backward
    counts = [launches()]
    for k in range(2, BACKWARDS + 1):
        again = torch.autograd.grad(total, leaves, retain_graph=k < BACKWARDS)
        counts.append(launches())
        for g, s, e in zip(again, single, exact):
            assert rel_err(g, s) < TOKEN_TOL[dtype] and rel_err(g, e) < TOKEN_TOL[dtype], k
            if strategy == "recompute":
                assert torch.equal(g, s)
    assert all(torch.equal(g, k) for g, k in zip(first, kept))
    chunked_first = strategy != "recompute"  # "auto": the exponentials fit
    assert (counts[0]["in_place"] > 0) == chunked_first
    assert all(c["in_place"] == counts[0]["in_place"] for c in counts)  # later backwards: recomputed
    assert all(b["dlogits"] > a["dlogits"] for a, b in zip(counts, counts[1:]))


@pytest.mark.parametrize("dtype", ["fp16"])
def test_logprobs_grad_ends_at_k_times_one_backward(dtype):
    """``.grad`` after three ``backward`` calls through one chunked graph: three times one backward's
    gradients (the stolen first gradient is not written by the later backwards)."""
    dtype = DTYPES[dtype]
    problem = _problem(dtype)
    targets = problem[2]
    outputs = ("log_probs", "entropy")
    once = _leaves(problem)
    _tokens(once, targets, "chunked", outputs).backward()
    leaves = _leaves(problem)
    total = _tokens(leaves, targets, "chunked", outputs)
    for k in range(1, BACKWARDS + 1):
        total.backward(retain_graph=k < BACKWARDS)
        for t, s in zip(leaves, once):
            assert rel_err(t.grad, k * s.grad.double()) < TOKEN_TOL[dtype], k
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):  # freed now
        total.backward()


def test_logprobs_master_weight_backwards_twice():
    """An fp32 master weight under autocast, per token: the later backward recomputes with the
    weight cast again, and its fp32 gradient adds the first's."""
    problem = _problem(torch.float32)
    targets = problem[2]
    once = _leaves(problem)
    _tokens(once, targets, "chunked", ("log_probs",), autocast=torch.bfloat16).backward()
    leaves = _leaves(problem)
    total = _tokens(leaves, targets, "chunked", ("log_probs",), autocast=torch.bfloat16)
    total.backward(retain_graph=True)
    total.backward()
    assert leaves[1].grad.dtype == torch.float32
    for t, s in zip(leaves, once):
        assert rel_err(t.grad, 2 * s.grad) < TOKEN_TOL[torch.bfloat16]


@pytest.mark.parametrize("per_token", [False, True], ids=["loss", "per-token"])
def test_compiled_backwards_twice(per_token):
    """``torch.compile``: the compiled backward leaves the saved buffers as they are (the ops' declared
    mutations are functionalised), so a second backward of the compiled step gives the first's
    gradients on both paths; never scaled twice."""
    backend = "inductor" if ON_GPU else "aot_eager"
    problem = _problem(torch.float32, bias=False)
    targets = problem[2]

    def step(hidden, weight):
        if per_token:
            return _tokens([hidden, weight], targets, "chunked", ("log_probs", "entropy"))
        return _loss([hidden, weight], targets, "mean", "chunked")

    once = _leaves(problem)
    step(*once).backward()
    torch._dynamo.reset()
    leaves = _leaves(problem)
    total = torch.compile(step, fullgraph=True, backend=backend)(*leaves)
    total.backward(retain_graph=True)
    total.backward()
    for t, s in zip(leaves, once):
        torch.testing.assert_close(t.grad, 2 * s.grad, rtol=1e-5, atol=1e-7)
