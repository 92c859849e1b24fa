"""The methods of the distillation benchmark: each computes, from one problem of ``distill_cases``, a
loss whose gradient w.r.t. the student's hidden states and head is measured.

Every method is ``call(data, beta, x_s, w_s) -> (loss, per-token divergence or None)`` with ``x_s`` and
``w_s`` the leaves that get gradients, and a ``reduction``: "mean" (loss = mean of the divergence over
valid tokens; the reference's ``u_mean``) or "none" (loss = sum of u_none * divergence, an arbitrary
per-token upstream gradient). Peers are used as black boxes through their public entry points; one
that is not installed is a ``Method`` with ``error`` (a row with that error, not a crash).
"""

import math
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

FAST_CHUNK_BYTES = 1 << 40  # ours with memory to spare: a chunk_bytes no plane reaches, one chunk
_ABSENT = object()


@dataclass
class Method:
    name: str
    call: Callable | None = None
    reduction: str = "mean"
    error: str | None = None
    note: str = ""


def per_token_divergence(log_ps, log_pt, beta):
    """The plain loss's divergence: (rows, V) log-probabilities of the student and the teacher -> (rows,)."""
    if beta == 0:
        return F.kl_div(log_ps, log_pt, reduction="none", log_target=True).sum(-1)  # KL(p_t || p_s)
    if beta == 1:
        return F.kl_div(log_pt, log_ps, reduction="none", log_target=True).sum(-1)  # KL(p_s || p_t)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))
    kl_t = F.kl_div(log_m, log_pt, reduction="none", log_target=True).sum(-1)
    kl_s = F.kl_div(log_m, log_ps, reduction="none", log_target=True).sum(-1)
    return beta * kl_t + (1 - beta) * kl_s


def plain_divergence_loss(x_s, w_s, x_t, w_t, beta, mask=None):
    """The loss as a user writes it: logits in the input dtype, log_softmax of their .float()."""
    log_ps = F.log_softmax((x_s @ w_s.T).float(), dim=-1)
    log_pt = F.log_softmax((x_t @ w_t.T).float(), dim=-1)
    div = per_token_divergence(log_ps, log_pt, beta)
    if mask is None:
        return div.mean()
    return (div * mask).sum() / mask.sum()


def four_products(data):
    """The floor: teacher logits, student logits, dX and dW as plain matmuls of the right shapes in the
    input dtype (cuBLAS on a GPU); a stand-in for dlogits is allocated once, outside the timed call."""
    g = data.x_s @ data.w_s.T

    def run():
        data.x_t @ data.w_t.T
        data.x_s @ data.w_s.T
        g @ data.w_s
        g.T @ data.x_s

    return run


class TrlState:
    """TRL's module attributes as TRL ships them and as ``use_in_trl()`` leaves them. ``use_in_trl`` is
    called once, what it changed in the loaded ``trl.*`` modules is recorded and put back, and
    ``using("ours")`` installs the changes for the duration of one call (the trainer looks
    ``_chunked_divergence_loss`` up in its module at call time), so TRL's own and ours through TRL's
    call run side by side in one process."""

    def __init__(self):
        import trl.trainer.distillation_trainer as trainer

        self.trainer = trainer
        self.patched = {}

    @staticmethod
    def _snapshot():
        return {(name, attr): value for name, mod in list(sys.modules.items())
                if mod is not None and (name == "trl" or name.startswith("trl.")) for attr, value in vars(mod).items()}

    def install(self, use_in_trl):
        before = self._snapshot()
        modules = {name for name, _ in before}
        use_in_trl()
        after = self._snapshot()
        changed = {key: value for key, value in after.items()
                   if key[0] in modules and (key not in before or before[key] is not value)
                   and not isinstance(value, type(sys))}
        for (name, attr) in changed:
            if (name, attr) in before:
                setattr(sys.modules[name], attr, before[(name, attr)])
            else:
                delattr(sys.modules[name], attr)
        self.originals = {key: before.get(key, _ABSENT) for key in changed}
        self.patched = changed
        return sorted(f"{name}.{attr}" for name, attr in changed)

    @contextmanager
    def using(self, which):
        if which != "ours":
            yield
            return
        for (name, attr), value in self.patched.items():
            setattr(sys.modules[name], attr, value)
        try:
            yield
        finally:
            for (name, attr), value in self.originals.items():
                if value is _ABSENT:
                    delattr(sys.modules[name], attr)
                else:
                    setattr(sys.modules[name], attr, value)


def _trl_call(state, which):
    def call(data, beta, x_s, w_s):
        with state.using(which):
            loss_fn = state.trainer._chunked_divergence_loss  # as DistillationTrainer._compute_loss finds it
            loss, _entropy_sum, _n_valid = loss_fn(
                x_s.view(data.batch, data.seq, data.hs),
                data.x_t.view(data.batch, data.seq, data.ht),
                w_s,
                data.w_t,
                data.mask2d,
                beta,
                num_items_in_batch=data.num_items,
                student_lm_head_bias=None,
                teacher_lm_head_bias=None,
                student_logit_scale=1.0,
                teacher_logit_scale=1.0,
                student_final_logit_softcapping=None,
                teacher_final_logit_softcapping=None,
                temperature=1.0,
            )
        return loss, None

    return call


def _unavailable(names, why):
    return [Method(name, error=why) for name in names]


def build_methods(notes):
    """All methods, in run order (the floor first)."""
    methods = [Method("matmul", call=None, reduction="-", note="four plain matmuls (the floor)")]
    try:
        import fused_linear_ce

        api = fused_linear_ce.fused_linear_divergence
    except Exception as e:  # noqa: BLE001 - any failure means "not available"
        why = f"fused_linear_ce.fused_linear_divergence not available ({type(e).__name__}: {e})"
        notes.append(why)
        methods += _unavailable(("flce", "flce-fast", "flce-none"), why)
    else:
        def ours(**kwargs):
            def call(data, beta, x_s, w_s):
                return api(x_s, w_s, data.x_t, data.w_t, beta=beta, mask=data.mask, **kwargs), None
            return call

        def ours_none(data, beta, x_s, w_s):
            div = api(x_s, w_s, data.x_t, data.w_t, beta=beta, mask=data.mask, reduction="none")
            return (div.float() * data.u_none).sum(), div

        methods += [
            Method("flce", ours(), note="fused_linear_divergence, default settings"),
            Method("flce-fast", ours(chunk_bytes=FAST_CHUNK_BYTES), note=f"chunk_bytes={FAST_CHUNK_BYTES}"),
            Method("flce-none", ours_none, reduction="none", note='reduction="none", loss = sum(u * divergence)'),
        ]
    try:
        state = TrlState()
    except Exception as e:  # noqa: BLE001
        why = f"trl.trainer.distillation_trainer not importable ({type(e).__name__}: {e})"
        notes.append(why)
        return methods + _unavailable(("flce-trl", "trl"), why) + _peers(notes)
    try:
        from fused_linear_ce import use_in_trl

        replaced = state.install(use_in_trl)
        if not any(name.startswith("trl.trainer.distillation_trainer.") for name in replaced):
            raise RuntimeError("use_in_trl() left trl.trainer.distillation_trainer unchanged "
                               f"(it replaced: {', '.join(replaced) or 'nothing'})")
        notes.append(f"use_in_trl() replaced {', '.join(replaced)}; put back except during flce-trl calls")
        methods.append(Method("flce-trl", _trl_call(state, "ours"), note="use_in_trl(), TRL's _chunked_divergence_loss"))
    except Exception as e:  # noqa: BLE001
        why = f"ours through TRL's call not available ({type(e).__name__}: {e})"
        notes.append(why)
        methods += _unavailable(("flce-trl",), why)
    methods.append(Method("trl", _trl_call(state, "trl"), note="TRL's _chunked_divergence_loss (its ChunkedDivergenceFunction)"))
    return methods + _peers(notes)


def _peers(notes):
    methods = []
    try:
        from liger_kernel.transformers import LigerFusedLinearJSD

        modules = {}

        def liger(data, beta, x_s, w_s):
            # jsd_beta is our beta: its docstring's JSD(beta)(P || Q) with P the teacher and mixture
            # beta P + (1 - beta) Q, forward / reverse KL at 0 / 1; mean over tokens whose label is not -100
            if beta not in modules:
                modules[beta] = LigerFusedLinearJSD(jsd_beta=beta)
            return modules[beta](x_s, w_s, data.x_t, data.w_t, data.labels), None

        methods.append(Method("liger", liger, note="LigerFusedLinearJSD(jsd_beta=beta), soft loss only"))
    except Exception as e:  # noqa: BLE001
        why = f"liger_kernel.transformers.LigerFusedLinearJSD not available ({type(e).__name__}: {e})"
        notes.append(why)
        methods += _unavailable(("liger",), why)
    compiled = torch.compile(plain_divergence_loss, dynamic=False)

    def plain(fn):
        def call(data, beta, x_s, w_s):
            return fn(x_s, w_s, data.x_t, data.w_t, beta, data.mask_f), None
        return call

    methods.append(Method("torch-compile", plain(compiled), note="torch.compile of the plain loss"))
    methods.append(Method("torch", plain(plain_divergence_loss), note="the plain loss, eager"))
    return methods
