"""What the one-call experiment scripts share: the fp32 reference, one variant's errors / time /
extra memory, and per-kernel times of one step. Inputs and the error measure are ``tune.py``'s."""

import torch
import triton.testing

from fused_linear_ce.reference import chunked_linear_cross_entropy

from tune import rel

MiB = 1 << 20


def reference(hidden, weight, targets):
    """(loss, grad_hidden, grad_weight) of the mean loss, fp32 logits, TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loss, count, dx, dw, _ = chunked_linear_cross_entropy(hidden, weight, targets, chunk=2048)
    return loss / count, dx / count, dw / count


def measure(step, fn, ref, grads_bytes):
    """Errors against ``ref``, the do_bench median of ``step(fn)`` (forward + backward) and its peak
    allocation above what was allocated before it and the gradients' own bytes (MiB)."""
    ref_loss, ref_dx, ref_dw = ref
    loss, dx, dw = step(fn)
    out = dict(dx=rel(dx, ref_dx), dw=rel(dw, ref_dw), loss=abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    del loss, dx, dw
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(fn)
    out["extra_mib"] = (torch.cuda.max_memory_allocated() - base - grads_bytes) / MiB
    out["ms"] = triton.testing.do_bench(lambda: step(fn), warmup=3, rep=40)
    return out


def kernel_times(run, top=10, width=48):
    """Per-kernel GPU time (ms) of one ``run()`` under the profiler, the ``top`` largest."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    agg = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            key = e.name.split("(")[0][:width]
            agg[key] = agg.get(key, 0.0) + e.device_time_total / 1e3
    return dict(sorted(agg.items(), key=lambda kv: -kv[1])[:top])
