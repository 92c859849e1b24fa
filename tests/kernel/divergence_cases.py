"""What the fused_linear_divergence tests share (test_divergence.py, test_divergence_plan.py,
test_divergence_errors.py): the sizes and dtypes, the tolerances against float64, the chunk budgets
that force several chunks, a student and teacher's inputs, and ``check``: ours against the float64
plain-torch reference (``reference.linear_divergence``), values, fields and every student gradient.

CPU (the Triton interpreter) runs fp32 and fp16 at small odd sizes; bf16 is covered by the GPU run
(``test_gpu_bf16_realistic`` and the parametrised cases, which take bf16 there): the interpreter's
``tl.dot`` is wrong for bf16 operands (triton#11584).
"""

import torch

from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import fused_linear_divergence, reference
from fused_linear_ce import plan as plan_module

N, H_S, H_T, V = (53, 96, 128, 1000) if ON_GPU else (37, 48, 80, 300)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, **({"bf16": torch.bfloat16} if ON_GPU else {})}
# Values come from fp32 logits of inputs exact in every dtype: fp32 rounding only. Gradients are
# rounded once into the dtype (twice for dX with a log-prob gradient on the chunked strategy).
VALUE_TOL = 2e-5
GRAD_TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}
# Forces several chunks: 16 rows of two fp32 buffers (three chunks, the last one ragged); with
# test_divergence_plan.py's ``small_groups``, a 16-bit da in a buffer of its own, groups of 32 rows in
# chunks of 8.
LOGITS = plan_module.LOGIT_PAIR_BYTES  # a chunk row's two fp32 logit rows, bytes a class
SMALL_CHUNKS = LOGITS * V * 16


def divergence_inputs(dtype, *, seed=0, bias=False, teacher_bias=False, lead=None, peaked=False):
    """A student's and a teacher's hidden states and heads in ``dtype`` (the student's requiring
    gradients), targets with ignored rows; ``lead`` the leading dimensions (N rows by default)."""
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


def student_leaves(inputs):
    """The student's tensors that require a gradient, in the order hidden, weight, bias."""
    return [inputs[k] for k in ("student_hidden", "student_weight", "student_bias")
            if k in inputs and inputs[k].requires_grad]


def _run(fn, inputs, kwargs, upstream, lp_upstream):
    """(divergence, fields, gradients of <div, upstream> + <log_probs, lp_upstream>)."""
    leaves = student_leaves(inputs)
    res = fn(**inputs, **kwargs)
    div, fields = res if isinstance(res, tuple) else (res, {})
    total = (div * upstream.to(div.dtype)).sum()
    if lp_upstream is not None:
        total = total + (fields["log_probs"] * lp_upstream.to(div.dtype)).sum()
    grads = torch.autograd.grad(total, leaves) if leaves else ()
    return div, fields, grads


def check(inputs, dtype, lp_grad=False, seed=1, three_way=False, **kwargs):
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
    for got, want, leaf, base in zip(grads, rgrads, student_leaves(inputs), plain):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
        assert rel_err(got, want) <= base + GRAD_TOL[dtype], (rel_err(got, want), base, leaf.shape)
    return div, fields, grads
