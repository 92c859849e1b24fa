"""fused_linear_divergence against the float64 plain-torch reference (``reference.linear_divergence``):
forward KL, reverse KL and the generalized JSD, their values, the student's entropy and target
log-prob, and the gradients of hidden, weight and bias for random upstream gradients, on both
strategies, in several chunks, under every option; extremes stay finite and right; bad inputs raise
before any kernel.

CPU (the Triton interpreter) runs fp32 and fp16 at small odd sizes; bf16 is covered by the GPU run
(``test_gpu_bf16_realistic`` and the parametrised cases, which take bf16 there): the interpreter's
``tl.dot`` is wrong for bf16 operands (triton#11584).
"""

import math

import pytest
import torch

from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import configs, divergence, fused_linear_divergence, products, reference
from fused_linear_ce import plan as plan_module

N, H_S, H_T, V = (53, 96, 128, 1000) if ON_GPU else (37, 48, 80, 300)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, **({"bf16": torch.bfloat16} if ON_GPU else {})}
# Values come from fp32 logits of inputs exact in every dtype: fp32 rounding only. Gradients are
# rounded once into the dtype (twice for dX with a log-prob gradient on the chunked strategy).
VALUE_TOL = 2e-5
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# Forces several chunks: 16 rows of two fp32 buffers (three chunks, the last one ragged); with
# ``small_groups``, a 16-bit da in a buffer of its own, groups of 32 rows in chunks of 8.
LOGITS = plan_module.LOGIT_PAIR_BYTES  # a chunk row's two fp32 logit rows, bytes a class
SMALL_CHUNKS = LOGITS * V * 16
# With ``small_groups``: fp32 da in its own buffer, groups of 32 rows in chunks of 8 (8 x 8 + 32 x 4
# bytes a class).
OWN_DA_FP32 = LOGITS * V * 8 + 4 * V * 32
# 16-bit da over the teacher's buffer in chunks of 6 rows: da's own buffer would hold none.
IN_PLACE_16 = LOGITS * V * 6


@pytest.fixture
def small_groups(monkeypatch):
    """Chunks of 8 rows where da takes a buffer of its own, on the GPU as on the interpreter."""
    monkeypatch.setattr(plan_module, "DIVERGENCE_GROUP_CHUNK_ROWS", 8)
    monkeypatch.setattr(plan_module, "INTERPRETED_DIVERGENCE_GROUP_CHUNK_ROWS", 8)


def _count_groups(monkeypatch):
    """A list that gets one entry (the group's rows) per call of the gradient products."""
    calls = []
    real = divergence._gradient_products
    monkeypatch.setattr(divergence, "_gradient_products",
                        lambda da, *a, **k: (calls.append(da.shape[0]), real(da, *a, **k))[1])
    return calls


def _inputs(dtype, *, seed=0, bias=False, teacher_bias=False, lead=None, peaked=False):
    g = torch.Generator().manual_seed(seed)
    shape = lead if lead is not None else (N,)
    hs = torch.randn(*shape, H_S, generator=g)
    ws = torch.randn(V, H_S, generator=g) / H_S**0.5 * 2
    ht = torch.randn(*shape, H_T, generator=g)
    wt = torch.randn(V, H_T, generator=g) / H_T**0.5 * 2
    targets = torch.randint(0, V, shape, generator=g)
    flat = targets.view(-1)
    flat[3] = -100
    flat[7:10] = -100
    if peaked:  # a near one-hot teacher: its target logit ~40 above the rest
        wt[flat.clamp(min=0)] += 40.0 * ht.reshape(-1, H_T) / ht.reshape(-1, H_T).norm(dim=1, keepdim=True) ** 2
    cast = lambda t: t.to(dtype).to(DEVICE)  # noqa: E731
    out = dict(student_hidden=cast(hs).requires_grad_(), student_weight=cast(ws).requires_grad_(),
               teacher_hidden=cast(ht), teacher_weight=cast(wt), targets=targets.to(DEVICE))
    if bias:
        out["student_bias"] = cast(torch.randn(V, generator=g)).requires_grad_()
    if teacher_bias:
        out["teacher_bias"] = cast(torch.randn(V, generator=g))
    return out


def _leaves(inputs):
    return [inputs[k] for k in ("student_hidden", "student_weight", "student_bias")
            if k in inputs and inputs[k].requires_grad]


def _run(fn, inputs, kwargs, upstream, lp_upstream):
    """(divergence, fields, gradients of <div, upstream> + <log_probs, lp_upstream>)."""
    leaves = _leaves(inputs)
    res = fn(**inputs, **kwargs)
    div, fields = res if isinstance(res, tuple) else (res, {})
    total = (div * upstream.to(div.dtype)).sum()
    if lp_upstream is not None:
        total = total + (fields["log_probs"] * lp_upstream.to(div.dtype)).sum()
    grads = torch.autograd.grad(total, leaves) if leaves else ()
    return div, fields, grads


def _check(inputs, dtype, lp_grad=False, seed=1, three_way=False, **kwargs):
    """Ours against the float64 reference: values, fields, and every student gradient. ``three_way``:
    a gradient may also be off by plain torch's own fp32 error (``reference`` in fp32) plus the
    tolerance, where the fp32 products themselves limit it (huge logits)."""
    kwargs.setdefault("outputs", ("entropy", "log_probs") if "targets" in inputs else ())
    g = torch.Generator().manual_seed(seed)
    reduction = kwargs.get("reduction", "mean")
    lead = inputs["student_hidden"].shape[:-1]
    upstream = (torch.randn(lead, generator=g) if reduction == "none" else torch.tensor(1.7)).to(DEVICE)
    lp_upstream = torch.randn(lead, generator=g).to(DEVICE) if lp_grad and "log_probs" in kwargs["outputs"] else None
    div, fields, grads = _run(fused_linear_divergence, inputs, kwargs, upstream, lp_upstream)
    ref_inputs = {k: (v.detach().double().requires_grad_(v.requires_grad) if v.is_floating_point() else v)
                  for k, v in inputs.items()}
    rdiv, rfields, rgrads = _run(reference.linear_divergence, ref_inputs, kwargs, upstream.double(),
                                 lp_upstream.double() if lp_upstream is not None else None)
    assert div.dtype == torch.float32 and div.shape == rdiv.shape
    assert rel_err(div, rdiv) <= VALUE_TOL, (rel_err(div, rdiv), div, rdiv)
    assert set(fields) == set(rfields)
    for name in fields:
        assert fields[name].shape == lead
        assert rel_err(fields[name], rfields[name]) <= VALUE_TOL, name
    assert "entropy" not in fields or not fields["entropy"].requires_grad
    plain = [0.0] * len(grads)
    if three_way:
        fp32_inputs = {k: (v.detach().float().requires_grad_(v.requires_grad) if v.is_floating_point() else v)
                       for k, v in inputs.items()}
        fp32 = _run(lambda **a: reference.linear_divergence(**a, compute_dtype=torch.float32), fp32_inputs, kwargs,
                    upstream, lp_upstream)[2]
        plain = [rel_err(g, want) for g, want in zip(fp32, rgrads)]
    for got, want, leaf, base in zip(grads, rgrads, _leaves(inputs), plain):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert rel_err(got, want) <= base + GRAD_TOL[dtype], (rel_err(got, want), base, leaf.shape)
    return div, fields, grads


@pytest.mark.parametrize("beta,reduction", [(b, r) for b in (0.0, 0.3, 0.5, 1.0) for r in ("mean", "none")]
                         + [(0.3, "sum")])
def test_matches_reference_fp32(beta, reduction):
    """With a random upstream gradient on log_probs too where beta is 0.3 (on the chunked strategy its
    gradient comes from a recompute in the backward)."""
    _check(_inputs(torch.float32, bias=True), torch.float32, lp_grad=beta == 0.3, beta=beta, reduction=reduction,
           temperature=1.5)


@pytest.mark.parametrize("dtype", [d for name, d in DTYPES.items() if name != "fp32"], ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("beta,reduction", [(0.0, "mean"), (0.3, "none"), (0.5, "sum"), (1.0, "mean")])
def test_matches_reference_16bit(beta, reduction, dtype):
    _check(_inputs(dtype, bias=True), dtype, lp_grad=reduction == "none", beta=beta, reduction=reduction)


OPTION_CASES = {
    "softcaps": dict(student_softcap=3.0, teacher_softcap=5.0, beta=0.5),
    "scales_temperature": dict(student_logit_scale=0.7, teacher_logit_scale=1.3, temperature=0.6, beta=1.0),
    "softcap_temperature_fkl": dict(student_softcap=4.0, temperature=2.0, beta=0.0),
    "recompute_mean": dict(strategy="recompute", beta=0.3, student_softcap=6.0, lp_grad=True),
    "no_targets": dict(beta=0.3, outputs=("entropy",)),
    "num_items_int": dict(beta=0.0, num_items_in_batch=50),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_options(case):
    kwargs = dict(OPTION_CASES[case])
    inputs = _inputs(torch.float32, bias=True, teacher_bias=True)
    if case == "no_targets":
        inputs.pop("targets")
    _check(inputs, torch.float32, **kwargs)


def test_num_items_tensor_and_sum():
    inputs = _inputs(torch.float32)
    with torch.no_grad():
        a = fused_linear_divergence(**inputs, beta=0.3, num_items_in_batch=torch.tensor(40.0, device=DEVICE))
        b = fused_linear_divergence(**inputs, beta=0.3, reduction="sum")
    assert torch.allclose(a * 40, b, rtol=1e-6)


@pytest.mark.parametrize("beta,strategy,reduction", [(0.0, "chunked", "mean"), (1.0, "recompute", "none")])
def test_several_chunks(beta, strategy, reduction):
    assert plan_module.divergence_chunk_rows(N, V, SMALL_CHUNKS) < N
    _check(_inputs(torch.float32, bias=True), torch.float32, beta=beta, strategy=strategy, reduction=reduction,
           chunk_bytes=SMALL_CHUNKS, student_softcap=5.0, lp_grad=reduction == "none")


def test_several_chunks_fp16_mask():
    inputs = _inputs(torch.float16)
    mask = torch.ones(N, dtype=torch.bool, device=DEVICE)
    mask[16:32] = False  # the whole second chunk uncounted
    _check(inputs, torch.float16, beta=0.5, mask=mask, chunk_bytes=SMALL_CHUNKS, lp_grad=True)


@pytest.mark.parametrize("strategy,reduction,chunk_bytes,groups",
                         [("chunked", "mean", None, 1), ("chunked", "mean", IN_PLACE_16, -(-N // 6)),
                          ("chunked", "mean", SMALL_CHUNKS, 2), ("recompute", "none", SMALL_CHUNKS, 2)],
                         ids=["one_chunk", "pair_in_place", "pair_own_da", "recompute_pair_own_da"])
def test_bf16_weight_gradient(strategy, reduction, chunk_bytes, groups, small_groups, monkeypatch):
    """bf16's weight gradient: rounded once from one chunk, or summed over several groups as a bf16 +
    4-bit compensated pair (``products.compensated``), da over the teacher's buffer or in its own
    (groups of 32 rows in chunks of 8), on the chunked strategy then scaled in place. On the CPU
    through the kernels' BF16_EMULATION (tl.dot on upcast tiles, round-to-nearest-even casts: what
    the GPU computes; tests/kernel/test_bf16_emulation.py)."""
    calls = _count_groups(monkeypatch)
    _check(_inputs(torch.bfloat16, bias=True), torch.bfloat16, beta=0.5, chunk_bytes=chunk_bytes,
           student_softcap=5.0, strategy=strategy, reduction=reduction)
    assert len(calls) == groups


@pytest.mark.parametrize("strategy,reduction", [("chunked", "mean"), ("recompute", "none")])
def test_own_da_buffer(strategy, reduction, small_groups, monkeypatch):
    """da in a buffer of its own (``plan.plan_divergence``): four chunks of 8 rows fill a group of
    32, whose gradient products run once; the ragged last group takes the rest."""
    assert plan_module.plan_divergence_chunks(N, V, OWN_DA_FP32, 4) == plan_module.DivergenceChunks(8, 32, True)
    calls = _count_groups(monkeypatch)
    _check(_inputs(torch.float32, bias=True), torch.float32, beta=0.3, strategy=strategy, reduction=reduction,
           chunk_bytes=OWN_DA_FP32, student_softcap=5.0, lp_grad=reduction == "none")
    assert calls == [32, N - 32]


def test_own_da_buffer_of_all_rows(small_groups, monkeypatch):
    """A budget whose da buffer holds all N rows: one group (its products once, grad_weight rounded
    once), and what the budget has left widens the chunks past 8 rows (fp16: 2-byte da)."""
    budget = LOGITS * V * 12 + 2 * V * N
    plan = plan_module.plan_divergence_chunks(N, V, budget, 2)
    assert plan.group == N and 8 < plan.rows < N and LOGITS * V * plan.rows + 2 * V * N <= budget
    calls = _count_groups(monkeypatch)
    _check(_inputs(torch.float16, bias=True), torch.float16, beta=0.7, chunk_bytes=budget, lp_grad=True)
    assert calls == [N, N]  # the forward's group, then the log-prob gradient's recompute


def test_plan_chunks(monkeypatch):
    """The plan at D1-like sizes on the GPU: a 16-bit da takes its own buffer where that buys fewer
    groups than da over the teacher's buffer; everything within the budget."""
    monkeypatch.setattr(divergence.device, "interpreted", lambda: False)
    plan, v, mib = plan_module.plan_divergence_chunks, 151936, 1 << 20
    assert plan(8192, v, None, 2) == plan_module.DivergenceChunks(256, 1184, True)  # 7 groups against 16 in place
    assert plan(8192, v, 512 * mib, 2) == plan_module.DivergenceChunks(256, 736, True)  # 12 against 19
    assert plan(8192, v, 512 * mib, 4) == plan_module.DivergenceChunks(432, 432)  # fp32 da: 371 rows alone, fewer
    assert plan(8192, v, None, None) == plan_module.DivergenceChunks(544, 544)  # values only
    assert plan(300, v, None, 2) == plan_module.DivergenceChunks(300, 300)  # one chunk
    assert plan(8192, v, 4096 * mib, 2) == plan_module.DivergenceChunks(1472, 8192, True)  # all rows' da; wider chunks
    for n in (1000, 8192, 65536):
        for budget in (64 * mib, 512 * mib, 1024 * mib, 4096 * mib):
            for da in (None, 2, 4):
                p = plan(n, v, budget, da)
                assert 1 <= p.rows <= p.group <= n and (p.group == n or p.group % plan_module.DIVERGENCE_ROW_ALIGN == 0)
                assert p.rows * v * LOGITS + (p.group * v * da if p.own_da else 0) <= budget or p.rows == 1


def test_mask_and_ignore_index():
    inputs = _inputs(torch.float32, bias=True)
    mask = torch.rand(N, generator=torch.Generator().manual_seed(3)).to(DEVICE) > 0.3
    inputs["targets"][inputs["targets"] == -100] = 7  # ignore_index 7: -100 would be out of range
    inputs["targets"][11] = 7
    _check(inputs, torch.float32, beta=0.3, mask=mask, ignore_index=7, reduction="none")
    div, fields = fused_linear_divergence(**inputs, beta=0.3, mask=mask, ignore_index=7, reduction="none",
                                          outputs=("entropy", "log_probs"))
    uncounted = ~mask | (inputs["targets"] == 7)
    for t in (div, fields["entropy"], fields["log_probs"]):
        assert (t[uncounted] == 0).all() and (t[~uncounted] != 0).all()


def test_leading_dims():
    inputs = _inputs(torch.float32, lead=(3, 13))
    div, fields, _ = _check(inputs, torch.float32, beta=0.5, reduction="none")
    assert div.shape == (3, 13)


@pytest.mark.parametrize("which", ["student_hidden", "student_weight"])
def test_gradient_of_one_leaf(which):
    inputs = _inputs(torch.float32, bias=True)
    for name in ("student_hidden", "student_weight", "student_bias"):
        if name != which:
            inputs[name] = inputs[name].detach()
    _check(inputs, torch.float32, beta=0.3)


def test_teacher_gets_no_gradient():
    inputs = _inputs(torch.float32, teacher_bias=True)
    for name in ("teacher_hidden", "teacher_weight", "teacher_bias"):
        inputs[name].requires_grad_(True)
    div = fused_linear_divergence(**inputs, beta=0.5)
    div.backward()
    assert all(inputs[name].grad is None for name in ("teacher_hidden", "teacher_weight", "teacher_bias"))
    assert inputs["student_weight"].grad is not None


def test_no_grad_forward_values_only(monkeypatch):
    """Without gradients nothing forms da: the chunked strategy runs its values-only sweep."""
    inputs = _inputs(torch.float32)
    calls = []
    monkeypatch.setattr(divergence, "_gradient_products", lambda *a, **k: calls.append(1))
    with torch.no_grad():
        div = fused_linear_divergence(**inputs, beta=0.5)
    assert not calls and torch.isfinite(div)


def test_log_prob_gradient_on_the_chunked_strategy_skips_the_teacher(monkeypatch):
    """The chunked strategy's gradients come from the forward; a log-prob gradient adds a recompute
    of that term alone, with the student's logits only: one teacher product in all."""
    inputs = _inputs(torch.float32)
    teacher_products = []
    real = products.accumulate

    def spy(a, b, *args, **kwargs):
        if b.shape[1] == V:  # a logit product h @ W.T (on the GPU grad_hidden may come through here too)
            teacher_products.append(a.shape[1] == H_T)
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(products, "accumulate", spy)
    div, fields = fused_linear_divergence(**inputs, beta=0.5, outputs=("log_probs",))
    (div + fields["log_probs"].sum()).backward()
    # the logit products: the forward's student and teacher, the log-prob recompute's student alone
    assert sum(teacher_products) == 1 and len(teacher_products) == 3


@pytest.mark.parametrize("beta", [1e-6, 1 - 1e-6, 0.0, 1.0])
def test_extreme_beta_and_one_hot_teacher(beta):
    """beta near 0 and 1 with a near one-hot teacher: finite, and right against float64."""
    inputs = _inputs(torch.float32, peaked=True)
    div, _, grads = _check(inputs, torch.float32, beta=beta, reduction="none")
    assert torch.isfinite(div).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_huge_logits_with_softcap(beta):
    """Logits of +-1e4 saturate both softcaps: p's near one-hot, the softcap's derivative 0 there. The
    gradients are limited by the fp32 products (an error of ~1e-3 in a logit of 1e4 moves the
    softcap's derivative ``1 - tanh^2`` by 1e-4 relative): three-way against plain fp32 torch."""
    inputs = _inputs(torch.float32)
    with torch.no_grad():
        inputs["student_weight"].mul_(3e3)
        inputs["teacher_weight"].mul_(3e3)
    div, _, grads = _check(inputs, torch.float32, beta=beta, student_softcap=20.0, teacher_softcap=30.0,
                           three_way=True)
    assert torch.isfinite(div) and all(torch.isfinite(g).all() for g in grads)


def test_out_of_range_target_is_nan():
    inputs = _inputs(torch.float32)
    inputs["targets"][5] = V
    div, fields = fused_linear_divergence(**inputs, beta=0.3, reduction="none", outputs=("log_probs",))
    assert torch.isnan(div[5]) and torch.isnan(fields["log_probs"][5])
    assert torch.isfinite(div[torch.arange(N, device=DEVICE) != 5]).all()


def test_nothing_counted():
    inputs = _inputs(torch.float32)
    mask = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    total = fused_linear_divergence(**inputs, beta=0.3, mask=mask, reduction="sum")
    total.backward()
    assert total == 0 and (inputs["student_weight"].grad == 0).all() and (inputs["student_hidden"].grad == 0).all()
    assert torch.isnan(fused_linear_divergence(**inputs, beta=0.3, mask=mask))


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
@pytest.mark.parametrize("nothing", ["mask", "ignore_index"])
@pytest.mark.parametrize("denominator", ["mean", "num_items_0"])
def test_nothing_counted_has_zero_gradients_over_no_rows(strategy, nothing, denominator):
    """No row counted, divided by no rows ("mean") or by num_items_in_batch=0: the value is 0 / 0 =
    NaN (as documented), every student gradient exactly 0 on both strategies, with a log-prob
    gradient beside it too (the cross-entropy's rule; 0 x 1/0 in the products' epilogue would be
    NaN). fp32 and fp16 (bf16 on the GPU) run the same host code."""
    dtype = torch.float16 if nothing == "mask" else torch.float32
    inputs = _inputs(dtype, bias=True)
    kwargs = dict(beta=0.3, strategy=strategy, outputs=("log_probs",))
    if nothing == "mask":
        kwargs["mask"] = torch.zeros(N, dtype=torch.bool, device=DEVICE)
    else:
        inputs["targets"][:] = -100
    if denominator == "num_items_0":
        kwargs.update(reduction="sum", num_items_in_batch=0)
    div, fields = fused_linear_divergence(**inputs, **kwargs)
    assert torch.isnan(div)
    (div + fields["log_probs"].float().sum()).backward()
    for name in ("student_hidden", "student_weight", "student_bias"):
        grad = inputs[name].grad
        assert grad is not None and grad.dtype == dtype and (grad == 0).all(), name


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_chunked_second_backward_raises_the_losss_error(dtype):
    """The chunked strategy scales its forward's gradients in place in the first backward (fp32 / bf16
    ones, already in the leaves' dtype): a second backward through the same graph raises the loss's
    clear error (``saved_gradients.check_spent``) naming fused_linear_divergence, before anything is written;
    fp16's fp32 unit gradients are scaled into new tensors, so its second backward is the first's
    again. strategy="recompute", which the message names, backwards the graph any number of times."""
    inputs = _inputs(dtype, bias=True)
    leaves = [inputs[k] for k in ("student_hidden", "student_weight", "student_bias")]
    div = fused_linear_divergence(**inputs, beta=0.3, strategy="chunked")
    first = [g.clone() for g in torch.autograd.grad(div, leaves, retain_graph=True)]
    if dtype == torch.float16:
        again = torch.autograd.grad(div, leaves, retain_graph=True)
        assert all(torch.equal(a, b) for a, b in zip(again, first))
        return
    with pytest.raises(RuntimeError, match=r'fused_linear_divergence: a second backward through the same graph '
                                           r'\(retain_graph=True\) on the chunked path.*strategy="recompute"'):
        torch.autograd.grad(div, leaves, retain_graph=True)
    div = fused_linear_divergence(**inputs, beta=0.3, strategy="recompute")
    for _ in range(2):
        again = torch.autograd.grad(div, leaves, retain_graph=True)
        assert all(rel_err(a, b) <= GRAD_TOL[dtype] for a, b in zip(again, first))


@pytest.mark.parametrize("strategy", ["chunked", "recompute"])
def test_autocast_master_weight(strategy):
    """Under a 16-bit autocast the operands go in fp16 (the same divergence as an explicit cast, with
    the gradients asked for as here: a values-only kernel is compiled apart and may sum in another
    order), and the fp32 student weight's gradient is the products' fp32 sum of the fp16 da, never
    rounded to fp16 itself (its entries are not all fp16 values), within fp16's tolerance of float64."""
    inputs = _inputs(torch.float32)
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        a = fused_linear_divergence(**inputs, beta=0.3, strategy=strategy)
    half = {k: (v.detach().half() if v.is_floating_point() else v) for k, v in inputs.items()}
    half["student_weight"].requires_grad_(True)
    b = fused_linear_divergence(**half, beta=0.3, strategy=strategy)
    half["student_weight"].requires_grad_(False)
    assert a.dtype == torch.float32 and torch.equal(a, b)
    with torch.no_grad():
        assert rel_err(fused_linear_divergence(**half, beta=0.3), b) <= VALUE_TOL
    a.backward()
    grad = inputs["student_weight"].grad
    assert grad.dtype == torch.float32
    leaves = {k: (v.double().requires_grad_(k == "student_weight") if v.is_floating_point() else v)
              for k, v in half.items()}
    want = torch.autograd.grad(reference.linear_divergence(**leaves, beta=0.3), leaves["student_weight"])[0]
    assert rel_err(grad, want) <= GRAD_TOL[torch.float16]
    assert (grad != grad.half().float()).any()


BAD = {
    "vocabulary": (ValueError, dict(teacher_weight=torch.randn(V + 1, H_T))),
    "student_width": (ValueError, dict(student_weight=torch.randn(V, H_S + 1))),
    "teacher_width": (ValueError, dict(teacher_hidden=torch.randn(N, H_T - 1))),
    "rows": (ValueError, dict(teacher_hidden=torch.randn(N + 1, H_T))),
    "beta_high": (ValueError, dict(beta=1.5)),
    "beta_nan": (ValueError, dict(beta=math.nan)),
    "beta_missing": (TypeError, dict(beta=None)),
    "temperature": (ValueError, dict(temperature=0.0)),
    "softcap": (ValueError, dict(student_softcap=-1.0)),
    "teacher_softcap": (ValueError, dict(teacher_softcap=0.0)),
    "dtype": (TypeError, dict(teacher_weight=torch.randn(V, H_T, dtype=torch.float16))),
    "float64": (TypeError, dict(student_hidden=torch.randn(N, H_S, dtype=torch.float64),
                                student_weight=torch.randn(V, H_S, dtype=torch.float64))),
    "targets_float": (TypeError, dict(targets=torch.zeros(N))),
    "targets_shape": (ValueError, dict(targets=torch.zeros(N + 1, dtype=torch.long))),
    "mask_dtype": (TypeError, dict(mask=torch.ones(N))),
    "reduction": (ValueError, dict(reduction="max")),
    "strategy": (ValueError, dict(strategy="fast")),
    "chunked_none": (ValueError, dict(strategy="chunked", reduction="none")),
    "num_items_none": (ValueError, dict(reduction="none", num_items_in_batch=3)),
    "outputs_unknown": (ValueError, dict(outputs=("argmax",))),
    "outputs_str": (TypeError, dict(outputs="entropy")),
    "log_probs_without_targets": (ValueError, dict(targets=None, outputs=("log_probs",))),
    "empty": (ValueError, dict(student_hidden=torch.randn(0, H_S), teacher_hidden=torch.randn(0, H_T),
                               targets=torch.zeros(0, dtype=torch.long))),
    "chunk_bytes": (ValueError, dict(chunk_bytes=0)),
    "bias_shape": (ValueError, dict(student_bias=torch.randn(V - 1))),
}


@pytest.mark.parametrize("strategy,reduction", [("chunked", "mean")] + [("recompute", "none")] * ON_GPU)
def test_compiles_without_a_graph_break_and_equals_eager(strategy, reduction):
    """torch.compile(fullgraph=True) over the custom ops, the temperature a traced float (no recompile
    per value): the same divergence, log-probs and gradients as eager. The chunked case with a
    log-prob gradient runs all three ops (forward, scale_gradients, the recompute backward); the
    "none" case only on the GPU (CPU time)."""
    inputs = _inputs(torch.float32, bias=True)
    g = torch.Generator().manual_seed(5)
    up, up_lp = torch.randn(N, generator=g).to(DEVICE), torch.randn(N, generator=g).to(DEVICE)
    fixed = {k: v for k, v in inputs.items() if not k.startswith("student")}

    def step(hs, ws, bs, temperature):
        div, fields = fused_linear_divergence(hs, ws, student_bias=bs, beta=0.3, temperature=temperature,
                                              strategy=strategy, reduction=reduction, outputs=("log_probs",),
                                              **fixed)
        return (div * (up if reduction == "none" else 1.0)).sum() + (fields["log_probs"] * up_lp).sum()

    compiled = torch.compile(step, backend="aot_eager" if not ON_GPU else "inductor", fullgraph=True)
    for temperature in (1.0, 0.7):
        leaves = [[t.detach().clone().requires_grad_() for t in _leaves(inputs)] for _ in range(2)]
        expected = step(*leaves[0], temperature)
        got = compiled(*leaves[1], temperature)
        expected.backward()
        got.backward()
        # inductor fuses the test's own sums over tokens into one kernel, which adds in another order
        # than eager's two reductions: the totals may differ by a few fp32 ulps per token.
        assert torch.allclose(got, expected, rtol=1e-5 if ON_GPU else 1e-6, atol=1e-6)
        for a, b in zip(leaves[1], leaves[0]):
            assert rel_err(a.grad, b.grad) < 1e-6


# Compiles the row kernel for sm_90 offline (scripts/registers.py's compile_case) in a subprocess
# without the interpreter: the GPU compiler refuses what the interpreter lets pass (a loop-carried
# name with two shapes did). Each case: MODE, VALUES, WRITE_DA, STATS_KNOWN, DIV_GRAD.
SM90_SCRIPT = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1] + "/scripts"); sys.path.insert(0, sys.argv[1] + "/torch-ext")
import registers as R
R._FP32_PTRS |= {"zs_ptr", "zt_ptr", "coef_ptr", "stats_ptr", "out_ptr"}
R._INT_PTRS["counted_ptr"] = "*i8"
R._FLOATS |= {"scale_s", "cap_s", "cap_out_s", "chain_s", "scale_t", "cap_t", "cap_out_t", "beta", "alpha", "log_a", "log_b"}
rows = []
with tempfile.TemporaryDirectory() as tmp:
    for mode, values, write, known, div_grad, block_v, warps in json.loads(sys.argv[2]):
        flags = dict(MODE=mode, VALUES=values, WRITE_DA=write, STATS_KNOWN=known, DIV_GRAD=div_grad)
        case = R.Case(name=f"{flags} BLOCK_V={block_v} warps={warps}", kernel="divergence_row_kernel", module="divergence_kernel",
                      constexprs=dict(flags, HAS_BIAS_S=True, HAS_BIAS_T=True, SOFTCAP_S=True, SOFTCAP_T=True,
                                      HAS_TARGETS=True, BLOCK_N=1, BLOCK_V=block_v, BF16_EMULATION=False),
                      descriptors={}, num_warps=warps, num_stages=1, unit_strides=())
        rows.append(R.compile_case(case, Path(tmp)))
print(json.dumps(rows))
"""


def test_row_kernel_compiles_for_sm90_without_spills():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "cuobjdump").exists() or not (tools / "ptxas").exists():
        pytest.skip(f"this Triton install has no ptxas / cuobjdump under {tools}")
    flags = [(0, True, True, False, True), (1, True, True, False, True), (2, True, False, False, True),
             (2, False, True, True, True), (0, False, True, True, False)]
    cases = [(*f, block_v, warps) for f in flags for _, block_v, warps in configs.DIVERGENCE_ROW_LAUNCHES]  # every launch
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SM90_SCRIPT, str(repo), json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in json.loads(out.stdout):
        assert 0 < row["registers"] <= 255 and row["stack"] == 0, row


def _no_kernel(*args, **kwargs):
    raise AssertionError("a kernel ran before the input check")


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_before_any_kernel(case, monkeypatch):
    error, change = BAD[case]
    args = {**_inputs(torch.float32), "beta": 0.5}
    args.update({k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in change.items()})
    if args["beta"] is None:
        del args["beta"]
    monkeypatch.setattr(divergence, "_launch", _no_kernel)
    monkeypatch.setattr(divergence, "_logits", _no_kernel)
    with pytest.raises(error):
        fused_linear_divergence(**args)


def test_device_mismatch():
    if not ON_GPU:
        pytest.skip("needs a second device")
    inputs = _inputs(torch.float32)
    inputs["teacher_weight"] = inputs["teacher_weight"].cpu()
    with pytest.raises(ValueError, match="one device"):
        fused_linear_divergence(**inputs, beta=0.5)


@pytest.mark.skipif(not ON_GPU, reason="realistic sizes in bf16 need the GPU")
@pytest.mark.parametrize("h_t", [1024, 2048])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_gpu_bf16_realistic(beta, h_t):
    """2048 x 1024 / h_t x 32000 bf16 against an fp32 reference (the float64 logits would take 500 MiB
    each; fp32 logits of bf16 inputs are what the kernel computes, up to the order of its sums)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h_s, v = 2048, 1024, 32000
    hs = torch.randn(n, h_s, device="cuda", generator=g).bfloat16().requires_grad_()
    ws = (torch.randn(v, h_s, device="cuda", generator=g) / h_s**0.5 * 3).bfloat16().requires_grad_()
    ht = torch.randn(n, h_t, device="cuda", generator=g).bfloat16()
    wt = (torch.randn(v, h_t, device="cuda", generator=g) / h_t**0.5 * 3).bfloat16()
    kwargs = dict(beta=beta, temperature=2.0, student_softcap=30.0)
    for strategy, chunk_bytes in (("chunked", 128 << 20), ("recompute", None)):
        div = fused_linear_divergence(hs, ws, ht, wt, strategy=strategy, chunk_bytes=chunk_bytes, **kwargs)
        gh, gw = torch.autograd.grad(div, (hs, ws))
        leaves = [t.detach().float().requires_grad_() for t in (hs, ws)]
        rdiv = reference.linear_divergence(leaves[0], leaves[1], ht.float(), wt.float(), compute_dtype=torch.float32,
                                           **kwargs)
        rgh, rgw = torch.autograd.grad(rdiv, leaves)
        assert rel_err(div, rdiv) <= 1e-4
        assert rel_err(gh, rgh) <= 1.2e-2 and rel_err(gw, rgw) <= 1.2e-2


@pytest.mark.skipif(not ON_GPU, reason="CUDA memory statistics")
def test_gpu_memory_within_the_budget_and_flat_in_n():
    """The default "mean" step's extra memory (the peak during forward and backward beyond what was
    allocated before and the two gradients): within ``chunk_bytes`` (logit buffers and da's own
    buffer, ``plan.plan_divergence_chunks``: chunks of 256 rows in groups of 1024 here), grad_weight's
    4-bit remainder, a group's fp32 grad_hidden product and 1 MiB of O(N) statistics, and the same
    at 4x the rows (2 and 8 groups)."""
    v, h_s, h_t, budget = 32768, 512, 768, 128 << 20
    assert plan_module.plan_divergence_chunks(8192, v, budget, 2) == plan_module.DivergenceChunks(256, 1024, True)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = (torch.randn(v, h_s, device="cuda", generator=g) / h_s**0.5).bfloat16().requires_grad_()
    wt = (torch.randn(v, h_t, device="cuda", generator=g) / h_t**0.5).bfloat16()
    extra = {}
    for n in (2048, 8192, 2048):  # the first call also allocates cuBLAS's workspace: the last one counts
        hs = torch.randn(n, h_s, device="cuda", generator=g).bfloat16().requires_grad_()
        ht = torch.randn(n, h_t, device="cuda", generator=g).bfloat16()
        ws.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fused_linear_divergence(hs, ws, ht, wt, beta=0.5, chunk_bytes=budget).backward()
        torch.cuda.synchronize()
        extra[n] = torch.cuda.max_memory_allocated() - base - hs.grad.nbytes - ws.grad.nbytes
    bound = budget + v * h_s // 2 + 1024 * h_s * 4 + (1 << 20)
    assert extra[8192] <= bound and extra[2048] <= bound, (extra, bound)
    assert abs(extra[8192] - extra[2048]) <= 1 << 20, extra
