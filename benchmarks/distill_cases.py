"""The distillation benchmark's problems and their answers: shapes, data, and the reference (loss, dX,
dW) that every method of ``bench_distill.py`` is measured against: the package's specification
(``fused_linear_ce.reference.linear_divergence``) in chunks of rows.

The divergence, per token, between the student's p_s = softmax(x_s @ W_s.T) and the teacher's
p_t = softmax(x_t @ W_t.T), TRL's convention (``trl.trainer.distillation_trainer._chunked_divergence_loss``):
beta = 0 the forward KL(p_t || p_s), beta = 1 the reverse KL(p_s || p_t), else the generalized JSD
beta * KL(p_t || m) + (1 - beta) * KL(p_s || m) with m = (1 - beta) * p_s + beta * p_t. Only the student
gets gradients.
"""

import math
from types import SimpleNamespace

import bench  # noqa: F401 - benchmarks/bench.py: puts torch-ext on sys.path (TRITON_INTERPRET on CPU)
import torch
import torch.nn.functional as F
from fused_linear_ce import reference as spec

SHAPES = {  # name: (N tokens, student H, teacher H, V)
    "D1": (8192, 2048, 4096, 151936),  # Qwen-class vocabulary
    "D2": (8192, 2048, 4096, 128256),  # Llama-3 vocabulary
    "D3": (65536, 2048, 4096, 151936),  # D1 at long context
    "tiny": (32, 32, 48, 256),  # CPU smoke test (Triton interpreter)
}
SEQ = {"tiny": 16}  # tokens per sequence for TRL's (B, K, H) call; 2048 otherwise
DEFAULT_SEQ = 2048
TEACHER_OFFSET = 1.65  # peaked: E[sigmoid(1.65 + Z)] = 0.80, Z ~ N(0, 1): the teacher's mean p_t(top)
STUDENT_AGREES = 0.75  # peaked: share of tokens where the student leans onto the teacher's top class
REF_PLANE_BYTES = 1 << 30  # the reference's logit plane per row chunk


def seq_len(shape, n):
    k = SEQ.get(shape, DEFAULT_SEQ)
    if n % k:
        raise ValueError(f"{shape}: N = {n} is not a multiple of the sequence length {k}")
    return k


def _lean(x, weight, classes, margin):
    """x (noise) plus the direction that puts ``margin`` on ``classes``' logits: w_c * margin / |w_c|^2."""
    w_c = weight[classes].float()
    return x + (margin / w_c.pow(2).sum(-1, keepdim=True)) * w_c


def make_data(shape, dist, device, seed, dtype=torch.bfloat16, valid_frac=1.0):
    """One problem: student and teacher hidden states and heads in ``dtype``, the loss mask and the
    per-token weights of the reductions. |w_v|^2 ~ 4, so std-1 hidden states give logits of std 2.

    random: independent std-2 logits for both models. peaked: std-1 backgrounds (hidden = 0.5 * noise);
    the teacher leans onto one class per token by log(V e^0.5) + TEACHER_OFFSET (the background's
    log-sum-exp plus a margin; its top logit varies with std 1, so the mean p_t(top) is ~0.8), the
    student by the background's log-sum-exp minus 1 (p_s(top) ~ 0.3), onto the teacher's class for a STUDENT_AGREES share of tokens, else a random one.

    Mask: each sequence of ``seq_len`` tokens keeps its first ceil(valid_frac * K) (right padding, as
    TRL pads completions). Weights: ``u_mean`` = valid / n_valid (the mean over valid tokens),
    ``u_none`` = a fixed standard-normal draw times valid / n_valid (an arbitrary upstream gradient)."""
    n, hs, ht, v = SHAPES[shape]
    k = seq_len(shape, n)
    g = torch.Generator(device=device).manual_seed(seed)
    w_s = (torch.randn(v, hs, generator=g, device=device) * (4.0 / hs) ** 0.5).to(dtype)
    w_t = (torch.randn(v, ht, generator=g, device=device) * (4.0 / ht) ** 0.5).to(dtype)
    x_s = torch.randn(n, hs, generator=g, device=device)
    x_t = torch.randn(n, ht, generator=g, device=device)
    if dist == "peaked":
        background = math.log((v - 1) * math.exp(0.5))  # log sum of V - 1 std-1 lognormal terms
        top = torch.randint(0, v, (n,), generator=g, device=device)
        agree = torch.rand(n, generator=g, device=device) < STUDENT_AGREES
        other = torch.randint(0, v, (n,), generator=g, device=device)
        margin_t = background + TEACHER_OFFSET
        x_t = _lean(0.5 * x_t, w_t, top, margin_t)
        x_s = _lean(0.5 * x_s, w_s, torch.where(agree, top, other), background - 1.0)
    elif dist != "random":
        raise ValueError(f"unknown dist {dist!r}")
    keep = max(1, math.ceil(valid_frac * k))
    mask2d = (torch.arange(k, device=device) < keep).long().expand(n // k, k).contiguous()
    valid = mask2d.reshape(-1) != 0
    n_valid = int(valid.sum())
    u_mean = valid.float() / n_valid
    u_none = torch.randn(n, generator=g, device=device) * u_mean
    all_valid = n_valid == n
    return SimpleNamespace(
        shape=shape, dist=dist, n=n, hs=hs, ht=ht, v=v, batch=n // k, seq=k,
        x_s=x_s.to(dtype), w_s=w_s, x_t=x_t.to(dtype), w_t=w_t,
        valid=valid, n_valid=n_valid, mask2d=mask2d,
        mask=None if all_valid else valid,  # what a user without padding passes: nothing
        mask_f=None if all_valid else valid.float(),
        labels=None if all_valid else torch.where(valid, 0, -100),  # Liger's shift_labels (ignore_index -100)
        num_items=mask2d.sum().clamp(min=1.0) / 1,  # TRL's trainer: num_items_in_batch / num_processes
        u_mean=u_mean, u_none=u_none,
    )


def reference(data, beta, compute_dtype=torch.float32, plane_bytes=REF_PLANE_BYTES, stats_rows=4096):
    """Loss, dX and dW (fp32) of both reductions ("mean": sum of valid / n_valid * divergence; "none":
    of u_none * divergence), the per-token divergence, and what the data look like (from the first
    ``stats_rows`` tokens); ``reference.linear_divergence`` in ``compute_dtype``, rows in chunks of
    about ``plane_bytes`` of logits, gradients by autograd through it."""
    n, v = data.n, data.v
    dev = data.x_s.device
    size = torch.finfo(compute_dtype).bits // 8
    rows = max(1, min(n, plane_bytes // (size * v)))
    w_s = data.w_s.to(compute_dtype).requires_grad_(True)
    weights = {"mean": data.valid.to(compute_dtype) / data.n_valid, "none": data.u_none.to(compute_dtype)}
    loss = {k: 0.0 for k in weights}
    dx = {k: torch.empty(n, data.hs, device=dev, dtype=torch.float32) for k in weights}
    dw = {k: torch.zeros(v, data.hs, device=dev, dtype=compute_dtype) for k in weights}
    divergence = torch.empty(n, device=dev, dtype=compute_dtype)
    for r in range(0, n, rows):
        x = data.x_s[r : r + rows].to(compute_dtype).requires_grad_(True)
        div = spec.linear_divergence(x, w_s, data.x_t[r : r + rows], data.w_t, beta=beta, reduction="none",
                                     compute_dtype=compute_dtype)
        divergence[r : r + rows] = div.detach()
        for i, (k, u) in enumerate(weights.items()):
            part = (div * u[r : r + rows]).sum()
            g_x, g_w = torch.autograd.grad(part, (x, w_s), retain_graph=i + 1 < len(weights))
            loss[k] += part.item()
            dx[k][r : r + rows] = g_x
            dw[k] += g_w
            del g_x, g_w
        del x, div
    stats = dict(reference=str(compute_dtype).replace("torch.", ""), n_valid=data.n_valid, **_looks(data, compute_dtype, stats_rows),
                 ref_loss=loss["mean"])
    return dict(loss=loss, dx=dx, dw={k: x.float() for k, x in dw.items()}, divergence=divergence), stats


def _looks(data, compute_dtype, rows):
    """What the data look like over the valid ones of the first ``rows`` tokens."""
    with torch.no_grad():
        log_ps = F.log_softmax(spec.logits(data.x_s[:rows], data.w_s, compute_dtype=compute_dtype), -1)
        log_pt = F.log_softmax(spec.logits(data.x_t[:rows], data.w_t, compute_dtype=compute_dtype), -1)
        valid = data.valid[:rows]
        return dict(
            mean_p_teacher_top=log_pt.max(-1).values.exp()[valid].mean().item(),
            mean_p_student_top=log_ps.max(-1).values.exp()[valid].mean().item(),
            top1_agreement=(log_pt.argmax(-1) == log_ps.argmax(-1))[valid].double().mean().item(),
            teacher_entropy=(-(log_pt.exp() * log_pt).sum(-1))[valid].mean().item(),
        )
