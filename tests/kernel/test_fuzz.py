"""Property test: random shapes, dtypes and every option over the domain the API accepts, against
the float64 reference: class weights of either sign, logit scales and softcaps over orders of
magnitude, int32 and int64 targets, ignore_index inside and beyond the class range.

Each example is one ``cases.Case`` checked by ``cases.check_three_way``: loss and every requested
gradient within plain torch's own error in the input dtype plus TOL, never above CAP, with one
allowance for tiny shapes (``_rounding_floor``): with N = 1 or H = 1 nothing averages out and plain
torch's own error can be 0 by luck, so a result may also be off by what rounding alone can cause in
this kernel's documented arithmetic. When the example asks for metrics, a second run checks that they
match the reference and leave the loss and gradients bit for bit unchanged. Values come from
``cases.make_inputs`` (logits of std ~2 before scale / softcap); 16-bit cases keep logit_scale <= 4,
so plain torch's own 16-bit logits stay meaningful.

Bounded for CI and reproducible: the examples are derandomized (the same ones every run) and their
number comes from FLCE_FUZZ_EXAMPLES (default 50 on CPU, ~25 s on 2 cores; 100 on a GPU, where most
of the time is Triton compiling the kernels' many specialisations). Before each release, run the same
generator longer on the GPU:

    FLCE_FUZZ_EXAMPLES=2000 bash scripts/test.sh tests/kernel/test_fuzz.py

FLCE_FUZZ_RANDOM=1 draws new examples each run instead (hypothesis prints a failing example and its
``@reproduce_failure`` blob).
"""

import math
import os

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import Case, check_three_way, class_weights, make_inputs, ours, upstream
from conftest import ON_GPU, reference

EXAMPLES = int(os.environ.get("FLCE_FUZZ_EXAMPLES", "100" if ON_GPU else "50"))
RANDOM = os.environ.get("FLCE_FUZZ_RANDOM") == "1"

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _either(value, strategy):
    """The default value half the time, else a draw: options are often off in real use."""
    return st.one_of(st.just(value), strategy)


# Unit roundoff of each input dtype: round-to-nearest changes a value by at most this, relatively.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _rounding_floor(case, inputs):
    """What rounding alone may cause, as a relative error per result (to first order).

    Gradients: the kernel rounds da (the gradient of the logits) to the input dtype, accumulates the
    products in fp32 and rounds the result, and the float64 expectation is rounded to the input
    dtype too: |error| <= u (|da| @ |weight| + 2 |g|) elementwise for grad_hidden (likewise for the
    others), plus for fp16 half a subnormal step (2^-25) twice per element. da comes from float64
    autograd through the logits themselves (as hidden, with an identity weight).
    Loss: each row's loss is a difference of fp32 numbers as large as its lse and largest logit (a
    confident row's loss is far smaller than either), so a few fp32 ulps of those, per row."""
    hidden, weight, bias, targets = (None if t is None else t.double() for t in inputs)
    w = class_weights(case, hidden.device)
    a = reference.logits(hidden, weight, bias).detach().requires_grad_(True)
    eye = torch.eye(case.v, dtype=torch.float64, device=a.device)
    kw = dict(ignore_index=case.ignore_index, logit_scale=case.logit_scale, softcap=case.softcap,
              label_smoothing=case.label_smoothing, z_loss=case.z_loss, class_weight=w)
    loss = reference.linear_cross_entropy(a, eye, inputs[3], reduction=case.reduction, **kw)
    loss.backward(upstream(case, loss))
    da = torch.nan_to_num(a.grad)  # "mean" over no counted row: NaN loss, zero gradients
    u = UNIT_ROUNDOFF[case.dtype]
    # p = exp(z - lse) in fp32: the argument's rounding, a few fp32 ulps of |z| and |lse|, is a
    # relative error of p (the whole of da's error in fp32, where da is not rounded further).
    z = reference.logits(hidden, weight, bias, case.logit_scale, case.softcap)
    lse = torch.logsumexp(z, -1)
    k = (2 + lse.abs() + z.abs().amax(-1))[:, None] * 2.0**-24
    floor = {}
    for name, g, spread, spread_p in (
        ("hidden", da @ weight, da.abs() @ weight.abs(), (da.abs() * k) @ weight.abs()),
        ("weight", da.T @ hidden, da.abs().T @ hidden.abs(), (da.abs() * k).T @ hidden.abs()),
        ("bias", da.sum(0), da.abs().sum(0), (da.abs() * k).sum(0)),
    ):
        bound = u * (spread.norm() + 2 * g.norm()).item() + spread_p.norm().item()
        if case.dtype == torch.float16:
            bound += 2.0**-24 * g.numel() ** 0.5
        expected = g.to(case.dtype).double().norm().item()  # rel_err's denominator
        floor[name] = bound / expected if expected > 0 else bound

    counted = inputs[3] != case.ignore_index
    w_t = torch.ones_like(lse) if w is None else w.double()[inputs[3].clamp(0, case.v - 1)]
    w_t = torch.where(counted, w_t, torch.zeros_like(w_t))
    per_row = 2.0**-20 * (1 + lse.abs() + z.abs().amax(-1)) * (w_t.abs() + counted * (1 + 2 * case.z_loss * lse.abs()))
    loss = loss.detach()
    if case.reduction == "none":
        bound, expected = per_row.norm().item(), loss.norm().item()
    else:
        total = abs(w_t.sum().item()) if case.reduction == "mean" else 1.0
        bound, expected = per_row.sum().item() / max(total, 1e-30), abs(loss.item())
    floor["loss"] = bound / expected if expected > 0 and math.isfinite(expected) else 0.0
    if case.reduction == "mean" and w is not None:
        # Everything is divided by the fp32 sum of the counted rows' weights; with weights of both
        # signs that sum cancels, by |w|.sum() / |w.sum()|, and its rounding is every result's.
        condition = (w_t.abs().sum() / w_t.sum().abs().clamp_min(1e-30)).item()
        for name in floor:
            floor[name] += case.n * 2.0**-24 * condition
    return floor


@st.composite
def fuzz_cases(draw):
    dtype = draw(st.sampled_from(DTYPES))
    n, h, v = draw(st.integers(1, 40)), draw(st.integers(1, 80)), draw(st.integers(2, 600))
    bias = draw(st.booleans())
    grad = tuple(k for k in ("hidden", "weight", "bias") if draw(st.booleans()) and (k != "bias" or bias))
    if not grad:  # at least one input must require grad for a backward
        grad = ("hidden",)
    plane = n * v * dtype.itemsize  # the whole (N, V) gradient block in bytes
    chunk_bytes = draw(st.one_of(st.none(), st.just(1), st.integers(1, plane)))
    # Scales over six orders of magnitude in fp32 (three in 16 bits, where plain torch's own logits
    # lose their meaning beyond ~4); a softcap from one that saturates most logits (|u / c| ~ 10)
    # to one that leaves them alone.
    scale_exponent = st.floats(-3.0, 3.0) if dtype == torch.float32 else st.floats(-2.0, 0.6)
    logit_scale = draw(_either(1.0, scale_exponent.map(lambda e: 10.0**e)))
    softcap = draw(_either(None, st.floats(-1.0, 7.0).map(lambda e: 2.0 * logit_scale * 10.0**e)))
    # 2^33 + 1 matches no int32 target: compared in int64, never wrapped onto a class id (and no
    # int32 target can hold it, so nothing is ignored then).
    ignore_index = draw(st.sampled_from([-100, 0, 1, 2**33 + 1]))
    int32 = draw(st.booleans())
    extra = {"targets_dtype": torch.int32} if int32 else {}
    ignored = draw(st.sampled_from([0.0, 0.0, 0.25, 0.5, 1.0]))
    if int32 and ignore_index > torch.iinfo(torch.int32).max:
        ignored = 0.0
    return Case(
        n, h, v, dtype,
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        ignored=ignored,
        bias=bias,
        logit_scale=logit_scale,
        softcap=softcap,
        grad=grad,
        chunk_bytes=chunk_bytes,
        ignore_index=ignore_index,
        label_smoothing=draw(_either(0.0, st.floats(0.0, 1.0))),
        z_loss=draw(_either(0.0, st.floats(1e-4, 0.1))),
        class_weight=draw(st.sampled_from([False, True, "signed"])),
        seed=draw(st.integers(0, 2**16)),
        extra=extra,
    )


def _check_metrics(case, loss, grads):
    """return_metrics: loss and gradients bit-identical to the run without, metrics as the reference
    computes them (accuracy up to rows whose two best logits are within fp32 rounding of a tie)."""
    hidden, weight, bias, targets = make_inputs(case)
    (loss_m, metrics), grads_m = ours(case, hidden, weight, bias, targets, return_metrics=True)
    torch.testing.assert_close(loss_m, loss, rtol=0, atol=0, equal_nan=True)
    for k in grads:
        assert (grads[k] is None) == (grads_m[k] is None), k
        if grads[k] is not None:
            torch.testing.assert_close(grads_m[k], grads[k], rtol=0, atol=0, equal_nan=True)

    kw = dict(ignore_index=case.ignore_index, logit_scale=case.logit_scale, softcap=case.softcap)
    _, want = reference.linear_cross_entropy(hidden, weight, targets, bias, return_metrics=True, **kw)
    counted = targets != case.ignore_index
    got_acc, want_acc = metrics["mean_token_accuracy"].item(), want["mean_token_accuracy"].item()
    got_ent, want_ent = metrics["entropy"].item(), want["entropy"].item()
    if not counted.any():
        assert math.isnan(got_acc) and math.isnan(got_ent)
        return
    z = reference.logits(hidden, weight, bias, case.logit_scale, case.softcap)
    top2 = z.topk(min(2, case.v), dim=-1).values
    near_tie = (top2[:, 0] - top2[:, -1] < 1e-4 * (1.0 + top2[:, 0].abs())) & counted
    assert abs(got_acc - want_acc) <= near_tie.sum().item() / counted.sum().item() + 1e-6
    assert abs(got_ent - want_ent) <= 1e-4 * (1.0 + abs(want_ent))


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fuzz_cases(), metrics=st.booleans())
def test_random_case_matches_float64_reference(case, metrics):
    inputs = make_inputs(case)
    loss, grads = check_three_way(case, inputs, floor=_rounding_floor(case, inputs))
    if metrics:
        _check_metrics(case, loss, grads)

