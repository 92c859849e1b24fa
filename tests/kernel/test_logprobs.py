"""fused_linear_logprobs: every per-token field and the gradients of log_probs and entropy against
float64, on both paths, in every dtype; what runs (and what does not) in each direction.

bf16 on the CPU: the kernels' BF16_EMULATION switch (tests/kernel/test_bf16_emulation.py proves it
faithful) upcasts bf16 tiles before ``tl.dot`` and rounds fp32 -> bf16 to nearest even, so these
cases compute what the GPU computes.
"""

import pytest
import torch

from conftest import DEVICE, ON_GPU, KernelSpy, rel_err
from fused_linear_ce import chunked, fused_linear_logprobs, recompute, sweep_kernels, tokens

FIELDS = tokens.FIELDS
# The errors allowed against float64. The fields are fp32 from fp32 logits of inputs exact in every
# dtype: fp32 rounding only (log_sum_sq_probs of a peaked row is the log of a sum near 1, so its
# error is absolute, ~1e-7, on values ~1e-6). The gradients are rounded once into the dtype, twice on
# the chunked path's non-target entries.
FIELD_TOL = 1e-5
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1.5e-3, torch.bfloat16: 8e-3}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

SIZES = (53, 96, 1000) if ON_GPU else (37, 32, 300)


def _inputs(dtype, n=None, bias=True, seed=0, peaked=False):
    n_, h, v = SIZES
    n = n_ if n is None else n
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.25
    targets = torch.randint(0, v, (n,), generator=g)
    if peaked:  # a trained model: the target logit ~12 above its background at any H (p_t ~ 0.7-0.99);
        # far more and the log-probs fall below fp32's resolution of log(1 + tiny), ~1e-7 absolute
        weight[targets] += 12.0 * hidden / hidden.norm(dim=1, keepdim=True) ** 2
    targets[3:4] = -100
    targets[5:9] = -100
    b = torch.randn(v, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(hidden), cast(weight), targets.to(DEVICE), cast(b)


def _reference(hidden, weight, targets, bias, temperature=1.0, logit_scale=1.0, softcap=None):
    """float64 fields (0 on ignored rows) with the leaves they are differentiable in."""
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    z = leaves[0] @ leaves[1].T
    if bias is not None:
        z = z + leaves[2]
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    lp = torch.log_softmax(z, -1)
    p = lp.exp()
    counted = targets != -100
    zero = torch.zeros((), dtype=torch.float64, device=z.device)
    out = {
        "log_probs": torch.where(counted, lp.gather(1, targets.clamp(min=0)[:, None])[:, 0], zero),
        "entropy": torch.where(counted, -(p * lp).sum(-1), zero),
        "log_sum_sq_probs": torch.where(counted, torch.log((p * p).sum(-1)), zero),
        "mean_logits": torch.where(counted, z.mean(-1), zero),
        "is_top1": counted & (z.argmax(-1) == targets),
    }
    return out, leaves


def _leaves(hidden, weight, bias):
    return [t.clone().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]


def _upstream(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)


VARIANTS = {  # name: (kwargs, outputs)
    "plain": (dict(), FIELDS),
    "temp0.7-scale1.3": (dict(temperature=0.7, logit_scale=1.3), FIELDS),
    "cap5-temp0.7": (dict(softcap=5.0, temperature=0.7), FIELDS),
}


@pytest.mark.tier_if(lambda dtype: dtype == "bf16")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fields_and_gradients_match_float64(dtype, strategy, variant):
    dtype = DTYPES[dtype]
    kwargs, outputs = VARIANTS[variant]
    if strategy == "chunked" and "softcap" in kwargs:  # not with the entropy (plan.exponentials_unsupported)
        outputs = tuple(f for f in outputs if f != "entropy")
    hidden, weight, targets, bias = _inputs(dtype, peaked=True)
    leaves = _leaves(hidden, weight, bias)
    out = fused_linear_logprobs(*leaves[:2], targets, leaves[2], outputs=outputs, strategy=strategy, **kwargs)
    assert tuple(out) == outputs
    ref, ref_leaves = _reference(hidden, weight, targets, bias, **kwargs)
    for name in outputs:
        if name == "is_top1":
            assert out[name].dtype == torch.bool and torch.equal(out[name], ref[name]), name
        else:
            assert out[name].dtype == torch.float32, name
            assert rel_err(out[name], ref[name]) < FIELD_TOL, name
    g_lp, g_ent = _upstream(targets.shape[0])
    loss = (out["log_probs"] * g_lp).sum()
    ref_loss = (ref["log_probs"] * g_lp.double()).sum()
    if "entropy" in outputs:
        loss = loss + (out["entropy"] * g_ent).sum()
        ref_loss = ref_loss + (ref["entropy"] * g_ent.double()).sum()
    loss.backward()
    ref_loss.backward()
    for name, ours, exact in zip(("hidden", "weight", "bias"), leaves, ref_leaves):
        assert ours.grad.dtype == ours.dtype
        assert rel_err(ours.grad, exact.grad) < GRAD_TOL[dtype], name


def test_temperature_divides_after_the_softcap_not_before():
    hidden, weight, targets, bias = _inputs(torch.float32)
    ours = fused_linear_logprobs(hidden, weight, targets, bias, softcap=2.0, temperature=0.5)["log_probs"]
    after, _ = _reference(hidden, weight, targets, bias, softcap=2.0, temperature=0.5)
    before, _ = _reference(hidden, weight, targets, bias, softcap=2.0, logit_scale=2.0)
    assert rel_err(ours, after["log_probs"]) < 1e-6
    assert rel_err(ours, before["log_probs"]) > 1e-2


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_ignored_rows_hold_zero_and_get_no_gradient(strategy):
    hidden, weight, targets, bias = _inputs(torch.float32)
    leaves = _leaves(hidden, weight, bias)
    out = fused_linear_logprobs(*leaves[:2], targets, leaves[2], outputs=FIELDS, strategy=strategy)
    ignored = targets == -100
    for name in FIELDS:
        assert not out[name][ignored].any(), name
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert not leaves[0].grad[ignored].any()
    assert leaves[0].grad[~ignored].abs().sum(1).gt(0).all()


def test_is_top1_is_the_first_argmax():
    """Classes 2 and 9 have the same weight row, the largest logit of every row, exactly (small
    integers: every product and sum is exact): the first is top-1, the second never."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 6, 16, 40
    hidden = torch.randint(0, 3, (n, h), generator=g).float()
    weight = torch.randint(-2, 2, (v, h), generator=g).float()
    weight[2] = weight[9] = 3.0
    hidden, weight = hidden.to(DEVICE), weight.to(DEVICE)
    for target, expected in ((2, True), (9, False)):
        targets = torch.full((n,), target, device=DEVICE)
        assert fused_linear_logprobs(hidden, weight, targets, outputs=("is_top1",))["is_top1"].tolist() == [expected] * n


def test_leading_dims_and_shift_equal_the_flat_call():
    hidden, weight, _, bias = _inputs(torch.float32, n=24)
    labels = torch.randint(0, weight.shape[0], (2, 12), device=DEVICE)
    out = fused_linear_logprobs(hidden.reshape(2, 12, -1), weight, labels, bias, outputs=FIELDS, shift=True)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100, device=DEVICE)], 1).reshape(-1)
    flat = fused_linear_logprobs(hidden, weight, shifted, bias, outputs=FIELDS)
    for name in FIELDS:
        assert out[name].shape == (2, 12)
        assert torch.equal(out[name].reshape(-1), flat[name]), name


@pytest.fixture
def spies(monkeypatch):
    found = {"dlogits": KernelSpy(recompute.dlogits_kernel), "in_place": KernelSpy(chunked.softmax_gradient_kernel),
             "sweep": KernelSpy(sweep_kernels.lse_sweep_kernel)}
    monkeypatch.setattr(recompute, "dlogits_kernel", found["dlogits"])
    monkeypatch.setattr(chunked, "softmax_gradient_kernel", found["in_place"])
    monkeypatch.setattr(sweep_kernels, "lse_sweep_kernel", found["sweep"])
    return found


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_forward_only_runs_the_sweep_alone(strategy, spies):
    hidden, weight, targets, bias = _inputs(torch.float32)
    leaves = _leaves(hidden, weight, bias)
    with torch.no_grad():
        out = fused_linear_logprobs(*leaves[:2], targets, leaves[2], outputs=FIELDS, strategy=strategy)
    assert not out["log_probs"].requires_grad
    assert [k["STORE_E"] for k in spies["sweep"].launches] == [False], "one sweep, no exponentials kept"
    assert not spies["dlogits"].launches and not spies["in_place"].launches


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_the_entropy_costs_no_backward_work_unless_it_reaches_the_loss(strategy, spies):
    hidden, weight, targets, bias = _inputs(torch.float32)
    kernel = spies["dlogits" if strategy == "recompute" else "in_place"]
    for used in (False, True):
        leaves = _leaves(hidden, weight, bias)
        out = fused_linear_logprobs(*leaves[:2], targets, leaves[2], outputs=("log_probs", "entropy"),
                                    strategy=strategy)
        kernel.launches.clear()
        (out["log_probs"].sum() + (out["entropy"].sum() if used else 0)).backward()
        assert kernel.launches and {k["ENTROPY_GRAD"] for k in kernel.launches} == {used}
    # only the entropy in the loss: its term alone, the log-probs' coefficients zero
    leaves = _leaves(hidden, weight, bias)
    out = fused_linear_logprobs(*leaves[:2], targets, leaves[2], outputs=("entropy",), strategy=strategy)
    out["entropy"].sum().backward()
    ref, ref_leaves = _reference(hidden, weight, targets, bias)
    ref["entropy"].sum().backward()
    assert rel_err(leaves[1].grad, ref_leaves[1].grad) < 2e-6


def test_the_other_fields_carry_no_gradient():
    hidden, weight, targets, _ = _inputs(torch.float32, bias=False)
    w = weight.clone().requires_grad_()
    out = fused_linear_logprobs(hidden, w, targets, outputs=FIELDS)
    assert out["log_probs"].requires_grad and out["entropy"].requires_grad
    for name in ("log_sum_sq_probs", "mean_logits", "is_top1"):
        assert not out[name].requires_grad, name
    with pytest.raises(RuntimeError):
        out["mean_logits"].sum().backward()


def test_both_paths_backward_twice():
    """A second backward through the same graph adds the same gradients: the recompute path
    recomputes them bit for bit; the chunked path's first backward spent its exponentials, so the
    second takes the recompute backward (tests/kernel/test_double_backward.py has the rest)."""
    hidden, weight, targets, _ = _inputs(torch.float32, bias=False)
    for strategy in ("recompute", "chunked"):
        w = weight.clone().requires_grad_()
        lp = fused_linear_logprobs(hidden, w, targets, strategy=strategy)["log_probs"]
        lp.sum().backward(retain_graph=True)
        once = w.grad.clone()
        lp.sum().backward()
        if strategy == "recompute":
            assert torch.equal(w.grad, 2 * once)
        assert rel_err(w.grad, 2 * once) < GRAD_TOL[torch.float32], strategy


def test_auto_takes_the_chunked_path_only_where_it_fits(spies):
    hidden, weight, targets, _ = _inputs(torch.float32, bias=False)
    n, v = targets.shape[0], weight.shape[0]
    for chunk_bytes, expected in ((n * v * 4, True), (n * v * 4 - 1, False)):
        w = weight.clone().requires_grad_()
        spies["sweep"].launches.clear()
        fused_linear_logprobs(hidden, w, targets, chunk_bytes=chunk_bytes)["log_probs"].sum().backward()
        assert spies["sweep"].launches[0]["STORE_E"] == expected
    w = weight.clone().requires_grad_()
    spies["sweep"].launches.clear()  # a softcap with the entropy: the recompute path
    out = fused_linear_logprobs(hidden, w, targets, softcap=3.0, outputs=("log_probs", "entropy"), chunk_bytes=1 << 30)
    assert not spies["sweep"].launches[0]["STORE_E"]


def test_bad_arguments_raise_before_any_kernel(spies):
    hidden, weight, targets, _ = _inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="unknown outputs"):
        fused_linear_logprobs(hidden, weight, targets, outputs=("log_probs", "perplexity"))
    with pytest.raises(TypeError, match="tuple of field names"):
        fused_linear_logprobs(hidden, weight, targets, outputs="entropy")
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature"):
            fused_linear_logprobs(hidden, weight, targets, temperature=t)
    with pytest.raises(ValueError, match="softcap together with the entropy"):
        fused_linear_logprobs(hidden, weight, targets, softcap=3.0, outputs=("entropy",), strategy="chunked")
    with pytest.raises(ValueError, match="beyond chunk_bytes"):
        fused_linear_logprobs(hidden, weight, targets, strategy="chunked", chunk_bytes=1024)
    with pytest.raises(ValueError, match="does not match"):
        fused_linear_logprobs(hidden, weight, targets[:-1])
    assert not spies["sweep"].launches


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_empty_batch(strategy):
    hidden, weight, targets, bias = _inputs(torch.float32, n=0)
    leaves = _leaves(hidden, weight, bias)
    out = fused_linear_logprobs(*leaves[:2], targets, leaves[2], outputs=FIELDS, strategy=strategy)
    assert all(t.shape == (0,) for t in out.values())
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert leaves[0].grad.shape == (0, weight.shape[1])
    assert not leaves[1].grad.any() and not leaves[2].grad.any()


@pytest.mark.tier
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_compiles_without_a_graph_break_and_equals_eager(strategy):
    hidden, weight, targets, bias = _inputs(torch.float32)
    g_lp, g_ent = _upstream(targets.shape[0])

    def step(h, w, b, temperature):
        out = fused_linear_logprobs(h, w, targets, b, temperature=temperature, outputs=("log_probs", "entropy"),
                                    strategy=strategy)
        return (out["log_probs"] * g_lp).sum() + (out["entropy"] * g_ent).sum()

    compiled = torch.compile(step, backend="aot_eager" if not ON_GPU else "inductor", fullgraph=True)
    for temperature in (1.0, 0.7):
        eager_leaves, compiled_leaves = _leaves(hidden, weight, bias), _leaves(hidden, weight, bias)
        expected = step(*eager_leaves, temperature)
        got = compiled(*compiled_leaves, temperature)
        expected.backward()
        got.backward()
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
        for a, b in zip(compiled_leaves, eager_leaves):
            assert rel_err(a.grad, b.grad) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.tier
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_cuda_graph_capture_and_replay_on_new_data(strategy):
    """A GRPO-like step (log-probs and entropy with gradients) captured once and replayed on new inputs
    equals an eager step on them: no host synchronisation on either path."""
    hidden, weight, targets, _ = _inputs(torch.bfloat16, bias=False)
    h, w, static_t = hidden.clone().requires_grad_(), weight.clone().requires_grad_(), targets.clone()
    g_lp, g_ent = _upstream(targets.shape[0])

    def step(h, w, t):
        out = fused_linear_logprobs(h, w, t, outputs=("log_probs", "entropy"), strategy=strategy)
        loss = (out["log_probs"] * g_lp).sum() + (out["entropy"] * g_ent).sum()
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compiles the kernels) off the capture
            h.grad = w.grad = None
            step(h, w, static_t)
    torch.cuda.current_stream().wait_stream(side)
    h.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step(h, w, static_t)
    new_h, new_w, new_t, _ = _inputs(torch.bfloat16, bias=False, seed=1)
    with torch.no_grad():
        h.copy_(new_h)
        w.copy_(new_w)
    static_t.copy_(new_t)
    graph.replay()
    h2, w2 = new_h.clone().requires_grad_(), new_w.clone().requires_grad_()
    want = step(h2, w2, new_t)
    torch.testing.assert_close(static_loss, want)
    assert rel_err(h.grad, h2.grad) < 1e-6 and rel_err(w.grad, w2.grad) < 1e-6
