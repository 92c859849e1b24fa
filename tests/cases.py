"""Test problems: one frozen dataclass per case, with a readable id, and the three-way check."""

from dataclasses import dataclass, field

import torch

from conftest import CAP, DEVICE, TOL, reference, rel_err
from fused_linear_ce import fused_linear_cross_entropy, plan
from fused_linear_ce.validate import Options

# The chunked path rounds each non-target entry of the logits' gradient twice (exp(z - m_tile) into
# the buffer, then da), its bf16 gradients once more after the products (the common factor, exact
# when it is a power of two) and again when the upstream gradient is not a power of two (the tests'
# upstream is random). Each extra rounding is independent per element, so the Frobenius errors the
# tests measure grow by about one rounding of the input dtype.
CHUNKED_EXTRA = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@dataclass(frozen=True)
class Case:
    n: int
    h: int
    v: int
    dtype: torch.dtype = torch.float32
    reduction: str = "mean"
    ignored: float = 0.0  # fraction of rows whose target is ignore_index
    bias: bool = False
    logit_scale: float = 1.0
    softcap: float | None = None
    grad: tuple = ("hidden", "weight", "bias")  # which inputs require grad
    chunk_bytes: int | None = None
    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    class_weight: bool | str = False  # True: positive weights; "signed": any sign
    seed: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def id(self) -> str:
        parts = [f"N{self.n}H{self.h}V{self.v}", str(self.dtype).replace("torch.", ""), self.reduction]
        if self.ignored:
            parts.append(f"ign{int(self.ignored * 100)}")
        if self.bias:
            parts.append("bias")
        if self.logit_scale != 1.0:
            parts.append(f"scale{self.logit_scale}")
        if self.softcap is not None:
            parts.append(f"cap{self.softcap}")
        if self.grad != ("hidden", "weight", "bias"):
            parts.append("grad-" + "+".join(self.grad))
        if self.chunk_bytes is not None:
            parts.append(f"chunk{self.chunk_bytes}")
        if self.label_smoothing:
            parts.append(f"ls{self.label_smoothing}")
        if self.z_loss:
            parts.append(f"z{self.z_loss}")
        if self.class_weight:
            parts.append("cw" if self.class_weight is True else f"cw-{self.class_weight}")
        if "targets_dtype" in self.extra:
            parts.append(str(self.extra["targets_dtype"]).replace("torch.", ""))
        if "strategy" in self.extra:
            parts.append(self.extra["strategy"])
        return "-".join(parts)


def make_inputs(case: Case, device=DEVICE):
    """hidden, weight, bias, targets: logits of std ~2 (before scale/softcap), targets uniform."""
    g = torch.Generator().manual_seed(case.seed)
    hidden = torch.randn(case.n, case.h, generator=g)
    weight = torch.randn(case.v, case.h, generator=g) * (4.0 / max(case.h, 1)) ** 0.5
    bias = torch.randn(case.v, generator=g) if case.bias else None
    targets = torch.randint(0, case.v, (case.n,), generator=g)
    if case.ignored:
        drop = torch.rand(case.n, generator=g) < case.ignored
        if case.ignored >= 1.0:
            drop[:] = True
        targets[drop] = case.ignore_index
    cast = lambda t: None if t is None else t.to(case.dtype).to(device)  # noqa: E731
    return cast(hidden), cast(weight), cast(bias), targets.to(device)


def class_weights(case: Case, device=DEVICE):
    """(V,) fp32 weights when the case asks for them, else None: in [0.25, 2.25), or with
    ``class_weight="signed"`` standard normal, of any sign (as PyTorch's own OpInfo samples draw them)."""
    if not case.class_weight:
        return None
    g = torch.Generator().manual_seed(case.seed + 2)
    if case.class_weight == "signed":
        return torch.randn(case.v, generator=g).to(device)
    return (torch.rand(case.v, generator=g) * 2.0 + 0.25).to(device)


def upstream(case: Case, loss: torch.Tensor) -> torch.Tensor:
    """A random upstream gradient of the loss's shape (per-row for reduction='none')."""
    g = torch.Generator().manual_seed(case.seed + 1)
    return (torch.rand(loss.shape, generator=g, dtype=torch.float64) + 0.5).to(loss.device)


def run(fn, case: Case, hidden, weight, bias, targets, **kwargs):
    """Loss and gradients of ``fn`` with the case's options and upstream gradient."""
    leaves = {"hidden": hidden, "weight": weight, "bias": bias}
    leaves = {k: (None if t is None else t.detach().clone().requires_grad_(k in case.grad)) for k, t in leaves.items()}
    out = fn(
        leaves["hidden"], leaves["weight"], targets, leaves["bias"],
        ignore_index=case.ignore_index, logit_scale=case.logit_scale, softcap=case.softcap,
        reduction=case.reduction, label_smoothing=case.label_smoothing, z_loss=case.z_loss,
        class_weight=class_weights(case, targets.device), **kwargs,
    )
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward(upstream(case, loss).to(loss.dtype))
    grads = {k: (t.grad if t is not None and t.requires_grad else None) for k, t in leaves.items()}
    return out, grads


def ours(case: Case, hidden, weight, bias, targets, **kwargs):
    """Our loss and gradients; ``case.extra`` (e.g. ``strategy``) and ``kwargs`` go to the call, but
    ``targets_dtype`` (e.g. int32), which the targets are cast to for our call only."""
    kwargs = dict(case.extra, **kwargs)
    targets = targets.to(kwargs.pop("targets_dtype", targets.dtype))
    return run(fused_linear_cross_entropy, case, hidden, weight, bias, targets, chunk_bytes=case.chunk_bytes, **kwargs)


def plain(case: Case, hidden, weight, bias, targets, compute_dtype):
    def fn(*args, **kw):
        return reference.linear_cross_entropy(*args, compute_dtype=compute_dtype, **kw)

    return run(fn, case, hidden, weight, bias, targets)


def runs_chunked(case: Case) -> bool:
    """Whether ``ours(case, ...)`` forms the gradients in the forward (``plan.plan_loss``)."""
    opts = Options(ignore_index=case.ignore_index, logit_scale=case.logit_scale, softcap=case.softcap,
                   reduction=case.reduction, label_smoothing=case.label_smoothing, z_loss=case.z_loss,
                   return_lse=case.extra.get("return_lse", False), chunk_bytes=case.chunk_bytes,
                   strategy=case.extra.get("strategy", "auto"))
    needs = tuple(k in case.grad and (k != "bias" or case.bias) for k in ("hidden", "weight", "bias"))
    return plan.plan_loss(opts, case.n, case.v, case.h, case.dtype, needs,
                          bias=case.bias).mode in plan.GRADIENTS_IN_FORWARD


def check_three_way(case: Case, inputs=None, floor=None):
    """Ours against float64, held to plain torch's own error in the input dtype plus TOL. ``inputs``
    (hidden, weight, bias, targets) replaces ``make_inputs(case)`` for hand-made values; ``floor``
    ({name: relative error}) raises a bound to what rounding alone may cause (tiny random shapes)."""
    hidden, weight, bias, targets = make_inputs(case) if inputs is None else inputs
    loss, grads = ours(case, hidden, weight, bias, targets)
    gt_loss, gt_grads = plain(case, hidden, weight, bias, targets, torch.float64)
    ref_loss, ref_grads = plain(case, hidden, weight, bias, targets, case.dtype)
    assert loss.dtype == torch.float32
    assert loss.shape == gt_loss.shape
    pairs = [("loss", loss, ref_loss, gt_loss)] + [
        (k, grads[k], ref_grads[k], gt_grads[k]) for k in grads if gt_grads[k] is not None
    ]
    for name, got, ref, gt in pairs:
        expected_nan = torch.isnan(gt.detach()).cpu()
        if expected_nan.any():  # e.g. "mean" over zero counted rows, as F.cross_entropy
            assert torch.equal(torch.isnan(got.detach()).cpu(), expected_nan), f"{name}: NaN pattern differs"
            got, ref, gt = (t.detach().cpu()[~expected_nan] for t in (got, ref, gt))
        if name != "loss":
            assert got is not None, f"no gradient for {name}"
            assert got.dtype == case.dtype and got.shape == gt.shape, (name, got.dtype, got.shape)
        err = rel_err(got, gt)
        extra = CHUNKED_EXTRA[case.dtype] if runs_chunked(case) else 0.0
        bound = min(rel_err(ref, gt) + TOL[case.dtype] + extra, CAP[case.dtype])
        bound = max(bound, (floor or {}).get(name, 0.0))
        assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (plain torch {rel_err(ref, gt):.3e})"
    for k in ("hidden", "weight", "bias"):
        if k not in case.grad or (k == "bias" and bias is None):
            assert grads[k] is None
    return loss, grads


def long_context_at(monkeypatch, chunk: int) -> list:
    """"auto"'s long-context plan on a small case: ``plan._long_context_budget`` gives ``chunk``
    bytes wherever its rules take S4 (65536 x 4096 x 128256) for this call's options, dtype and
    gradients. Returns the list each ``products.compensated`` call appends to: (remainder dtype,
    remainder shape, accumulate)."""
    from fused_linear_ce import products

    real = plan._long_context_budget

    def small(opts, n, v, h, dtype, needs, master, sharded, dlogits):
        return None if real(opts, 65536, 128256, 4096, dtype, needs, master, sharded, dlogits) is None else chunk

    monkeypatch.setattr(plan, "_long_context_budget", small)
    lows, original = [], products.compensated

    def spy(a, b, hi, lo, accumulate, unscale=None, role="product"):
        lows.append((lo.dtype, tuple(lo.shape), accumulate))
        return original(a, b, hi, lo, accumulate, unscale, role)

    monkeypatch.setattr(products, "compensated", spy)
    return lows
