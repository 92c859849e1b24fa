"""fused_linear_logprobs(..., topk=True): the log-probs of k ids per row (a teacher's top-k served
elsewhere), their gradients for a random upstream against float64, padding, the per-row fields beside
them, autocast, shift, and the errors.

bf16 is covered by the GPU run (``test_topk_bf16_on_gpu``): the interpreter's ``tl.dot`` is wrong for bf16
operands (Triton issue 11584); the CPU cases are fp32 and fp16.
"""

import pytest
import torch

from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import fused_linear_logprobs, topk

N, H, V = (97, 128, 2000) if ON_GPU else (37, 32, 300)
# Against float64 with inputs exact in the dtype: the log-probs are fp32 (the sweep's lse and the
# gathered fp32 logits); the gradients are rounded once into the dtype (the fp32 sum of the sweep's and
# the gather's into fp16 twice: each is rounded, then autograd adds them).
LP_TOL = 2e-6
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _inputs(dtype, k, bias=True, seed=0, lead=(N,)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*lead, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.25
    ids = torch.stack([torch.randperm(V, generator=g)[:k] for _ in range(int(torch.tensor(lead).prod()))])
    ids = ids.reshape(*lead, k)
    flat = ids.view(-1, k)
    flat[3, :] = -100  # a row of padding only
    if k > 1:
        flat[5, k // 2:] = -100  # trailing padding
        flat[7, 0] = -100  # padding first, ids after it
    b = torch.randn(V, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(hidden), cast(weight), ids.to(DEVICE), cast(b)


def _reference(hidden, weight, ids, bias, temperature=1.0, logit_scale=1.0, softcap=None):
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in (hidden, weight, bias)]
    z = leaves[0] @ leaves[1].T
    if bias is not None:
        z = z + leaves[2]
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    lp = torch.log_softmax(z / temperature, -1)
    padded = ids == -100
    log_probs = torch.where(padded, 0.0, lp.gather(-1, ids.clamp(min=0)))
    p = lp.exp()
    entropy = torch.where(padded.all(-1), 0.0, -(p * lp).sum(-1))
    return log_probs, entropy, leaves


def _leaves(*tensors):
    return [t.clone().requires_grad_() if t is not None else None for t in tensors]


VARIANTS = {
    "plain": dict(),
    "temp0.7": dict(temperature=0.7),
    "cap3-temp0.8-scale1.3": dict(softcap=3.0, temperature=0.8, logit_scale=1.3),
}


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("k", [1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_topk_log_probs_and_gradients_against_float64(dtype, k, variant, strategy):
    kwargs = VARIANTS[variant]
    hidden, weight, ids, bias = _inputs(dtype, k)
    h, w, b = _leaves(hidden, weight, bias)
    out = fused_linear_logprobs(h, w, ids, b, topk=True, strategy=strategy, **kwargs)
    want, _, leaves = _reference(hidden, weight, ids, bias, **kwargs)
    lp = out["log_probs"]
    assert lp.shape == ids.shape and lp.dtype == torch.float32 and list(out) == ["log_probs"]
    assert rel_err(lp, want) < LP_TOL
    assert torch.all(lp[ids == -100] == 0)
    upstream = torch.randn(ids.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    (lp * upstream).sum().backward()
    (want * upstream.double()).sum().backward()
    for mine, ref in zip((h, w, b), leaves):
        assert mine.grad.dtype == dtype
        assert rel_err(mine.grad, ref.grad) < GRAD_TOL[dtype]


def test_the_multi_target_gradient_is_the_weighted_cross_entropys():
    """d/dz = sum_j u_j (onehot(t_j) - p): with u = 1 on every id the hidden gradient is the sum of the k
    single-target cross-entropy gradients (fused_linear_logprobs one id at a time)."""
    hidden, weight, ids, bias = _inputs(torch.float32, 4, bias=False, seed=2)
    h = hidden.clone().requires_grad_()
    fused_linear_logprobs(h, weight, ids, topk=True)["log_probs"].sum().backward()
    g = hidden.clone().requires_grad_()
    sum(fused_linear_logprobs(g, weight, ids[:, j])["log_probs"].sum() for j in range(4)).backward()
    assert rel_err(h.grad, g.grad) < 1e-5


def test_row_fields_beside_the_topk_and_leading_dims_and_shift():
    hidden, weight, ids, bias = _inputs(torch.float32, 3, lead=(2, 9), seed=4)
    out = fused_linear_logprobs(hidden, weight, ids, bias, topk=True, outputs=("entropy", "log_probs"),
                                temperature=0.9)
    want, entropy, _ = _reference(hidden, weight, ids, bias, temperature=0.9)
    assert list(out) == ["log_probs", "entropy"] and out["entropy"].shape == (2, 9)
    assert rel_err(out["log_probs"], want) < LP_TOL
    assert rel_err(out["entropy"], entropy) < 1e-5
    shifted = fused_linear_logprobs(hidden, weight, ids, bias, topk=True, shift=True)["log_probs"]
    assert torch.equal(shifted[:, -1], torch.zeros_like(shifted[:, -1]))
    moved = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    assert torch.equal(shifted, fused_linear_logprobs(hidden, weight, moved, bias, topk=True)["log_probs"])


def test_bad_ids_give_nan_in_their_entries_only():
    """An id out of [0, V) (not ignore_index) is NaN, as a bad target is without topk (no host sync to
    check ids); its row's other ids keep their log-probs, and no out-of-bounds read happens."""
    hidden, weight, ids, bias = _inputs(torch.float32, 3, seed=5)
    bad = ids.clone()
    bad[0, 1], bad[1, 0], bad[2, :] = V, -7, V + 5
    lp = fused_linear_logprobs(hidden, weight, bad, bias, topk=True)["log_probs"]
    good = fused_linear_logprobs(hidden, weight, ids, bias, topk=True)["log_probs"]
    broken = torch.zeros_like(bad, dtype=torch.bool)
    broken[0, 1] = broken[1, 0] = True
    broken[2, :] = True
    assert torch.isnan(lp[broken]).all()
    assert torch.allclose(lp[~broken], good[~broken], rtol=0, atol=1e-5)


def test_errors_before_any_kernel():
    hidden, weight, ids, bias = _inputs(torch.float32, 2)
    with pytest.raises(ValueError, match=r"\(\.\.\., k\)"):
        fused_linear_logprobs(hidden, weight, ids[:, 0], topk=True)  # no k dim
    with pytest.raises(ValueError, match=r"\(\.\.\., k\)"):
        fused_linear_logprobs(hidden, weight, ids[:-1], topk=True)  # rows differ
    with pytest.raises(ValueError, match="k >= 1"):
        fused_linear_logprobs(hidden, weight, ids[:, :0], topk=True)
    with pytest.raises(TypeError, match="int64"):
        fused_linear_logprobs(hidden, weight, ids.float(), topk=True)
    with pytest.raises(ValueError, match="is_top1"):
        fused_linear_logprobs(hidden, weight, ids, topk=True, outputs=("log_probs", "is_top1"))
    with pytest.raises(TypeError, match="topk must be a bool"):
        fused_linear_logprobs(hidden, weight, ids, topk=1)
    with pytest.raises(ValueError, match="temperature"):
        fused_linear_logprobs(hidden, weight, ids, topk=True, temperature=0.0)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fused_linear_logprobs(hidden[:, :-1], weight, ids, topk=True)
    with pytest.raises(ValueError, match="targets shape"):  # without the flag, (N, k) is not guessed
        fused_linear_logprobs(hidden, weight, ids)


def test_autocast_and_fp32_master_weight():
    """Under a 16-bit autocast the gathered logits use the operands the sweep uses (hidden and an fp32
    weight rounded to fp16), and the fp32 weight's gradient stays fp32 (to fp16's tolerance: the sweep's
    part of it comes from fp16 operands, 1.3e-4 for one target without topk)."""
    hidden, weight, ids, bias = _inputs(torch.float32, 4, bias=False, seed=6)
    w = weight.clone().requires_grad_()
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        lp = fused_linear_logprobs(hidden, w, ids, topk=True)["log_probs"]
    want, _, leaves = _reference(hidden.half(), weight.half(), ids, None)
    assert rel_err(lp, want) < LP_TOL
    lp.sum().backward()
    want.sum().backward()
    assert w.grad.dtype == torch.float32 and rel_err(w.grad, leaves[1].grad) < GRAD_TOL[torch.float16]


def test_the_gather_runs_in_blocks_of_rows(monkeypatch):
    """A budget of a few rows' gathered weights: several blocks, the same values and gradients."""
    hidden, weight, ids, bias = _inputs(torch.float32, 5, seed=7)
    runs = []
    for budget in (topk.GATHER_BYTES, 5 * H * 4 * 4):  # one block; blocks of 4 rows
        monkeypatch.setattr(topk, "GATHER_BYTES", budget)
        h, w, b = _leaves(hidden, weight, bias)
        lp = fused_linear_logprobs(h, w, ids, b, topk=True)["log_probs"]
        (lp * torch.arange(5, device=DEVICE)).sum().backward()
        runs.append((lp, h.grad, w.grad, b.grad))
    assert topk._block_rows(5, H) == 4
    for one, blocks in zip(*runs):
        assert torch.allclose(one, blocks, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not ON_GPU, reason="bf16 tl.dot is wrong under the interpreter (Triton issue 11584)")
@pytest.mark.parametrize("k", [1, 8])
def test_topk_bf16_on_gpu(k):
    hidden, weight, ids, bias = _inputs(torch.bfloat16, k)
    h, w, b = _leaves(hidden, weight, bias)
    lp = fused_linear_logprobs(h, w, ids, b, topk=True, softcap=5.0, temperature=0.8)["log_probs"]
    want, _, leaves = _reference(hidden, weight, ids, bias, softcap=5.0, temperature=0.8)
    assert rel_err(lp, want) < LP_TOL
    upstream = torch.randn(ids.shape, device=DEVICE)
    (lp * upstream).sum().backward()
    (want * upstream.double()).sum().backward()
    for mine, ref in zip((h, w, b), leaves):
        assert rel_err(mine.grad, ref.grad) < GRAD_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_topk_only_kl_against_float64(dtype):
    """docs/development.md's worked example: a KL over a teacher's top-k ids only, sum_j p_t (lt - ls),
    the student's ls from ``topk=True`` and the rest plain torch on (N, k): its per-token values and
    the student's gradients against float64 logits gathered at the same ids (padding: lt = -inf, p_t
    = 0). bf16: the GPU run of this file's other cases covers the kernels it calls."""
    k = 5
    hidden, weight, ids, bias = _inputs(dtype, k)
    g = torch.Generator().manual_seed(11)
    lt = torch.log_softmax(torch.randn(N, k, generator=g), -1).to(DEVICE)
    lt = torch.where(ids == -100, float("-inf"), lt)  # padding carries no teacher mass
    p_t = lt.exp()
    leaves = _leaves(hidden, weight, bias)
    ls = fused_linear_logprobs(leaves[0], leaves[1], ids, bias=leaves[2], topk=True)["log_probs"]
    kl = torch.where(p_t > 0, p_t * (lt - ls), 0.0).sum(-1)
    up = torch.randn(N, generator=g).to(DEVICE)
    (kl * up).sum().backward()
    ls_ref, _, ref_leaves = _reference(hidden, weight, ids, bias)
    kl_ref = torch.where(p_t > 0, p_t.double() * (lt.double() - ls_ref), 0.0).sum(-1)
    (kl_ref * up.double()).sum().backward()
    assert rel_err(kl, kl_ref) < 1e-5
    for mine, ref in zip(leaves, ref_leaves):
        assert rel_err(mine.grad, ref.grad) < GRAD_TOL[dtype]
