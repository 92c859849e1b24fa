"""The plain-torch specification of the loss. Tests and benchmarks import it; there is no second copy.

``linear_cross_entropy`` computes in ``compute_dtype`` (float64 by default) and materialises the
logits: it is the definition, not a fast path. ``chunked_linear_cross_entropy`` gives the same loss
and gradients in chunks of rows, for problems whose full logits do not fit in memory.
``linear_divergence`` is the student-teacher divergence of ``fused_linear_divergence``.
"""

import math

import torch


def logits(hidden, weight, bias=None, logit_scale=1.0, softcap=None, compute_dtype=torch.float64):
    z = hidden.to(compute_dtype) @ weight.to(compute_dtype).T
    if bias is not None:
        z = z + bias.to(compute_dtype)
    z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def row_losses(z, targets, ignore_index=-100, label_smoothing=0.0, class_weight=None):
    """Per-row cross-entropy as F.cross_entropy(..., reduction="none") computes it (0 on ignored
    rows, NaN for an out-of-range target), the per-row target weight and the counted-row mask."""
    v = z.shape[-1]
    counted = targets != ignore_index
    in_range = (targets >= 0) & (targets < v)
    safe = torch.where(in_range, targets, 0)
    logp = torch.log_softmax(z, dim=-1)
    w = torch.ones(v, dtype=z.dtype, device=z.device) if class_weight is None else class_weight.to(z.dtype)
    w_t = torch.where(counted, w[safe], torch.zeros_like(w[safe]))
    nll = -logp.gather(-1, safe[:, None])[:, 0]
    nll = torch.where(in_range, nll, torch.full_like(nll, float("nan")))
    loss = w_t * nll
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - (label_smoothing / v) * (logp * w).sum(-1)
    return torch.where(counted, loss, torch.zeros_like(loss)), w_t, counted


def linear_cross_entropy(
    hidden,
    weight,
    targets,
    bias=None,
    ignore_index=-100,
    logit_scale=1.0,
    softcap=None,
    reduction="mean",
    return_metrics=False,
    *,
    label_smoothing=0.0,
    z_loss=0.0,
    class_weight=None,
    return_lse=False,
    compute_dtype=torch.float64,
    **_ignored,
):
    """Same signature and semantics as ``fused_linear_cross_entropy``; results in ``compute_dtype``.
    Extra keyword arguments of the fused function that do not change the result (``chunk_bytes``)
    are accepted and ignored."""
    z = logits(hidden, weight, bias, logit_scale, softcap, compute_dtype)
    loss, w_t, counted = row_losses(z, targets, ignore_index, label_smoothing, class_weight)
    lse = torch.logsumexp(z, dim=-1)
    z_rows = torch.where(counted, z_loss * lse.square(), torch.zeros_like(lse))
    if reduction == "none":
        loss = loss + z_rows if z_loss else loss
    elif reduction == "sum":
        loss = loss.sum() + (z_rows.sum() if z_loss else 0.0)
    elif reduction == "mean":
        loss = loss.sum() / w_t.sum() + (z_rows.sum() / counted.sum() if z_loss else 0.0)
    else:
        raise ValueError(f"unknown reduction {reduction!r}")
    out = [loss]
    if return_metrics:
        with torch.no_grad():
            logp = torch.log_softmax(z, dim=-1)
            entropy = -(logp.exp() * logp).sum(-1)
            hit = (z.argmax(-1) == targets).to(compute_dtype)
            zero = torch.zeros_like(entropy)
            count = counted.sum()
            out.append({
                "mean_token_accuracy": torch.where(counted, hit, zero).sum() / count,
                "entropy": torch.where(counted, entropy, zero).sum() / count,
            })
    if return_lse:
        out.append(lse)
    return out[0] if len(out) == 1 else tuple(out)


def chunked_linear_cross_entropy(
    hidden, weight, targets, bias=None, chunk=1024, compute_dtype=torch.float32, **kwargs
):
    """Sum-reduced ``linear_cross_entropy`` with gradients, ``chunk`` rows at a time, in
    ``compute_dtype``. Returns (loss_sum, count, grad_hidden, grad_weight, grad_bias) of the summed
    loss; divide by count for the mean. For references at sizes whose logits do not fit."""
    n = hidden.shape[0]
    w = weight.detach().to(compute_dtype).requires_grad_(True)
    b = bias.detach().to(compute_dtype).requires_grad_(True) if bias is not None else None
    grad_hidden = torch.empty(hidden.shape, dtype=compute_dtype, device=hidden.device)
    total = torch.zeros((), dtype=compute_dtype, device=hidden.device)
    count = torch.zeros((), dtype=torch.int64, device=hidden.device)
    ignore_index = kwargs.get("ignore_index", -100)
    for r in range(0, n, chunk):
        h = hidden[r : r + chunk].detach().to(compute_dtype).requires_grad_(True)
        t = targets[r : r + chunk]
        loss = linear_cross_entropy(h, w, t, b, reduction="sum", compute_dtype=compute_dtype, **kwargs)
        loss.backward()
        grad_hidden[r : r + chunk] = h.grad
        total += loss.detach()
        count += (t != ignore_index).sum()
    return total, count, grad_hidden, w.grad, (b.grad if b is not None else None)


def linear_divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, *, beta, student_bias=None,
                      teacher_bias=None, temperature=1.0, student_logit_scale=1.0, student_softcap=None,
                      teacher_logit_scale=1.0, teacher_softcap=None, targets=None, mask=None, ignore_index=-100,
                      reduction="mean", num_items_in_batch=None, outputs=(), compute_dtype=torch.float64,
                      **_ignored):
    """Same signature and semantics as ``fused_linear_divergence``, with the (N, V) logits in
    ``compute_dtype``; differentiable in the student's tensors (the teacher's are detached). Extra
    keyword arguments that do not change the result (``chunk_bytes``, ``strategy``) are ignored."""
    lead = student_hidden.shape[:-1]
    n = lead.numel()
    zs = logits(student_hidden.reshape(n, -1), student_weight, student_bias, student_logit_scale, student_softcap,
                compute_dtype) / temperature
    zt = logits(teacher_hidden.reshape(n, -1).detach(), teacher_weight.detach(),
                teacher_bias.detach() if teacher_bias is not None else None, teacher_logit_scale, teacher_softcap,
                compute_dtype) / temperature
    ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    ps, pt = ls.exp(), lt.exp()
    if beta == 0:
        rows = (pt * (lt - ls)).sum(-1)
    elif beta == 1:
        rows = (ps * (ls - lt)).sum(-1)
    else:
        log_m = torch.logsumexp(torch.stack([ls + math.log1p(-beta), lt + math.log(beta)]), 0)
        rows = beta * (pt * (lt - log_m)).sum(-1) + (1 - beta) * (ps * (ls - log_m)).sum(-1)
    counted = torch.ones(n, dtype=torch.bool, device=zs.device) if mask is None else mask.reshape(n)
    zero = torch.zeros((), dtype=compute_dtype, device=zs.device)
    log_probs = torch.zeros_like(rows)
    if targets is not None:
        t = targets.reshape(n).to(torch.int64)
        counted = counted & (t != ignore_index)
        in_range = (t >= 0) & (t < zs.shape[-1])
        log_probs = ls.gather(1, torch.where(in_range, t, 0)[:, None])[:, 0]
        nan = torch.full((), float("nan"), dtype=compute_dtype, device=zs.device)
        rows = torch.where(in_range, rows, nan)
        log_probs = torch.where(in_range, log_probs, nan)
    rows = torch.where(counted, rows, zero)
    if reduction == "none":
        div = rows.reshape(lead)
    elif num_items_in_batch is not None:
        div = rows.sum() / num_items_in_batch
    elif reduction == "sum":
        div = rows.sum()
    else:
        div = rows.sum() / counted.sum()
    if not outputs:
        return div
    fields = {"entropy": torch.where(counted, -(ps * ls).sum(-1), zero).detach().reshape(lead),
              "log_probs": torch.where(counted, log_probs, zero).reshape(lead)}
    return div, {name: fields[name] for name in ("entropy", "log_probs") if name in outputs}
