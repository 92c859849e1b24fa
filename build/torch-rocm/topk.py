"""Log-probs of k targets per row (a teacher served elsewhere sends its top-k ids): ``fused_linear_logprobs(...,
topk=True)``.

For a row with logits z (after the scale, softcap and temperature) and ids t_1..t_k:

    log_probs_j = z_{t_j} - lse,    d/dz = sum_j u_j (onehot(t_j) - p)   (u: the upstream gradient)

One vocabulary sweep gives the row's log-prob of one of its ids, the anchor a (the first id in range):
``lp_a = z_a - lse``, differentiable as a single-target cross-entropy. The k target logits are gathered
exactly in fp32 (``h . W[t_j] + b``, scale, softcap, / T: an N x k x H product in blocks of rows, no
(N, V) tensor), and ``log_probs_j = lp_a + (z_{t_j} - z_a)``: the gradient through lp_a carries
``(sum_j u_j) (onehot(a) - p)`` and the gathered difference ``sum_j u_j (onehot(t_j) - onehot(a))``,
which add up to the multi-target gradient above.
"""

import torch

from .api import autocast_head
from .partitioned import check_gathered

# The gathered weight rows of one block of rows, fp32: (rows, k, H) within this many bytes.
GATHER_BYTES = 64 << 20
ROW_FIELDS = ("entropy", "log_sum_sq_probs", "mean_logits")  # per row, as without topk


def check_topk(hidden, weight, targets, outputs, process_group) -> int:
    """k, for ``targets`` (..., k) against ``hidden`` (..., H); TypeError / ValueError otherwise (the
    rest is ``fused_linear_logprobs``' own checks, before any kernel)."""
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    check_gathered("weight", weight)
    if weight.ndim != 2:
        raise ValueError(f"weight must be 2-D (V, H), got shape {tuple(weight.shape)}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 (or int32) ids, got {targets.dtype}")
    if targets.dim() != hidden.dim() or targets.shape[:-1] != hidden.shape[:-1]:
        raise ValueError(f"with topk=True, targets must be hidden's leading shape plus k, (..., k): hidden is "
                         f"{tuple(hidden.shape)}, targets {tuple(targets.shape)}")
    if targets.shape[-1] < 1:
        raise ValueError("with topk=True, targets must hold k >= 1 ids per row")
    if "is_top1" in outputs:
        raise ValueError('outputs "is_top1" is per target; with topk=True compare the ids with the argmax yourself')
    if process_group is not None:
        raise ValueError("topk=True does not take a vocabulary-parallel process_group (the gathered ids may live "
                         "on another rank's shard)")
    return targets.shape[-1]


class _TargetLogits(torch.autograd.Function):
    """``rows[n] . weight[ids[n, j]] (+ bias[ids[n, j]])`` in fp32, (N, k), ids in range; the weight
    rows and bias go in ``rows``' dtype first (the sweep's operands). Blocks of rows bound the gathered
    (rows, k, H) weight; the weight's and bias's gradients are summed in fp32 and rounded once (for a
    16-bit weight through an fp32 (V, H) buffer: ids repeat across rows, and a sync-free sum of the
    touched rows alone would need an N k x H one)."""

    @staticmethod
    def forward(ctx, rows, weight, bias, ids):
        n, k = ids.shape
        out = torch.empty((n, k), device=rows.device, dtype=torch.float32)
        step = _block_rows(k, rows.shape[1])
        with torch.autocast(rows.device.type, enabled=False):
            for s in range(0, n, step):
                w = weight[ids[s:s + step]].to(rows.dtype).float()  # (b, k, H)
                out[s:s + step] = torch.bmm(w, rows[s:s + step].float().unsqueeze(-1)).squeeze(-1)
            if bias is not None:
                out += bias[ids].to(rows.dtype).float()
        ctx.save_for_backward(rows, weight, ids)
        ctx.has_bias, ctx.bias_dtype = bias is not None, None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, weight, ids = ctx.saved_tensors
        n, k = ids.shape
        need_rows, need_weight, need_bias = ctx.needs_input_grad[:3]
        d_rows = d_weight = d_bias = None
        grad = grad.float()
        with torch.autocast(rows.device.type, enabled=False):
            if need_rows:
                d_rows = torch.empty_like(rows)
                step = _block_rows(k, rows.shape[1])
                for s in range(0, n, step):
                    w = weight[ids[s:s + step]].to(rows.dtype).float()
                    d_rows[s:s + step] = torch.bmm(grad[s:s + step].unsqueeze(1), w).squeeze(1).to(rows.dtype)
            flat = ids.reshape(-1)
            if need_weight:
                acc = torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
                step = _block_rows(k, rows.shape[1])
                for s in range(0, n, step):
                    g, h = grad[s:s + step], rows[s:s + step].float()
                    contrib = (g.unsqueeze(-1) * h.unsqueeze(1)).reshape(-1, rows.shape[1])  # (b k, H)
                    _add_rows(acc, ids[s:s + step].reshape(-1), contrib)
                d_weight = acc.to(weight.dtype)
            if need_bias and ctx.has_bias:
                d_bias = torch.zeros((weight.shape[0], 1), device=grad.device, dtype=torch.float32)
                _add_rows(d_bias, flat, grad.reshape(-1, 1))
                d_bias = d_bias.squeeze(1).to(ctx.bias_dtype)
        return d_rows, d_weight, d_bias, None


def _add_rows(acc: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> None:
    """acc[ids] += values, the values of a repeated id summed in a fixed order, without atomics (an
    ``index_add_`` on CUDA sums in a run-dependent order): the values sorted by id (a stable sort), their
    fp64 prefix sums, each id's total the difference of the prefix sums at its run's ends; every
    position of a run writes the same total, so the store is the same whichever write lands."""
    order = torch.argsort(ids, stable=True)
    sid = ids[order]
    prefix = torch.zeros((values.shape[0] + 1, values.shape[1]), dtype=torch.float64, device=values.device)
    torch.cumsum(values[order].double(), dim=0, out=prefix[1:])
    lo = torch.searchsorted(sid, sid, side="left")
    hi = torch.searchsorted(sid, sid, side="right")
    acc.index_put_((sid,), acc[sid] + (prefix[hi] - prefix[lo]).to(acc.dtype))


def _block_rows(k: int, h: int) -> int:
    return max(1, GATHER_BYTES // max(1, k * h * 4))


def target_logits(hidden, weight, bias, ids, *, temperature, logit_scale, softcap):
    """z at ``ids`` (..., k) (in range), fp32, differentiable: ``softcap((h . W[t] + b) * logit_scale)
    / temperature``, the operands in the sweep's dtype (the autocast dtype under autocast)."""
    hidden, weight, bias = autocast_head(hidden, weight, bias, keep_fp32_weight=True)
    lead, k = ids.shape[:-1], ids.shape[-1]
    rows = hidden.reshape(-1, hidden.shape[-1])
    z = _TargetLogits.apply(rows, weight, bias, ids.reshape(-1, k)).reshape(*lead, k)
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature if temperature != 1.0 else z


def topk_log_probs(per_token, hidden, weight, targets, bias, *, temperature, logit_scale, softcap, outputs,
                   ignore_index, shift, chunk_bytes, strategy) -> dict:
    """``fused_linear_logprobs(..., topk=True)`` (``per_token``: that function, for the anchor's sweep).
    log_probs (..., k); the other requested fields per row (...). An id equal to ``ignore_index`` gets 0
    and no gradient; an id out of [0, V) gets NaN (its row's other ids are unaffected)."""
    v = weight.shape[0]
    targets = targets.to(torch.int64)
    if shift and targets.shape[-2] > 0:  # row t scored against the ids of row t + 1, along the sequence dim
        pad = targets.new_full((*targets.shape[:-2], 1, targets.shape[-1]), ignore_index)
        targets = torch.cat([targets[..., 1:, :], pad], dim=-2)
    counted = targets != ignore_index
    in_range = counted & (targets >= 0) & (targets < v)
    first = in_range.to(torch.int8).argmax(-1, keepdim=True)  # the first id in range (0 when none)
    anchor = torch.where(in_range.any(-1), targets.gather(-1, first).squeeze(-1), ignore_index)
    fields = ("log_probs", *(name for name in ROW_FIELDS if name in outputs))
    row = per_token(hidden, weight, anchor, bias, temperature=temperature, logit_scale=logit_scale, softcap=softcap,
                    outputs=fields, ignore_index=ignore_index, chunk_bytes=chunk_bytes, strategy=strategy)
    ids = torch.where(in_range, targets, 0)
    z = target_logits(hidden, weight, bias, ids, temperature=temperature, logit_scale=logit_scale, softcap=softcap)
    log_probs = row["log_probs"].unsqueeze(-1) + (z - z.gather(-1, first))
    zero, nan = log_probs.new_zeros(()), log_probs.new_full((), float("nan"))
    out = {"log_probs": torch.where(in_range, log_probs, torch.where(counted, nan, zero))}
    out.update((name, row[name]) for name in fields[1:])
    return out
