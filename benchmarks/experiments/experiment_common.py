"""What the one-call experiment scripts share: the fp32 reference, the command line, do_bench
medians and interleaved rounds, Liger as a peer, and per-kernel times of one step."""

import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce.reference import chunked_linear_cross_entropy  # noqa: E402

MiB = 1 << 20


def reference(hidden, weight, targets):
    """(loss, grad_hidden, grad_weight) of the mean loss, fp32 logits, TF32 off."""
    torch.backends.cuda.matmul.allow_tf32 = False
    loss, count, dx, dw, _ = chunked_linear_cross_entropy(hidden, weight, targets, chunk=2048)
    return loss / count, dx / count, dw / count


def parse_args(shapes, extra=None):
    """The experiment scripts' command line: --shapes (names of ``shapes``) and --out (default $OUT),
    and whatever ``extra(parser)`` adds."""
    import argparse
    import os

    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=list(shapes))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def timed(fn, rep=100):
    """Median ms of ``fn()``: ``triton.testing.do_bench`` on the GPU; one wall-clock call elsewhere
    (a smoke run only)."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def against_compile(prefix, times, label_width=12):
    """One row per method of interleaved rounds (``times``: label -> ms per round, with a "compile"
    entry): "prefix label  ms ms ...  best / torch.compile's best", printed and returned."""
    base = min(times["compile"])
    rows = []
    for label, ts in times.items():
        rows.append(f"{prefix} {label:{label_width}s} " + " ".join(f"{t:7.2f}" for t in ts) + f"  {min(ts) / base:6.3f}x")
        print(rows[-1], flush=True)
    return rows


def liger_loss(targets):
    """Liger's fused loss as ``(hidden, weight) -> loss`` for ``targets``, or None when not installed
    (an optional oracle)."""
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger
    except Exception:
        return None

    def loss(hd, wd):
        out = liger(hd, wd, targets)
        return out[0] if isinstance(out, (tuple, list)) else out

    return loss


def make_step(hidden, weight):
    """``step(fn)``: one forward+backward of ``fn(hidden, weight)`` on fresh leaves; returns (loss,
    grad_hidden, grad_weight)."""

    def step(fn):
        hd = hidden.detach().requires_grad_(True)
        wd = weight.detach().requires_grad_(True)
        loss = fn(hd, wd)
        loss.backward()
        return loss, hd.grad, wd.grad

    return step


def interleaved(runs, rounds=3, rep=60):
    """{name: [do_bench ms of each round]} for ``runs`` ({name: callable}), the rounds interleaved
    across the names (the H200 runs at its power cap: neighbours in time share its state); ``rep``:
    do_bench's time budget (ms) per round and name."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            times[name].append(triton.testing.do_bench(fn, warmup=5, rep=rep))
    return times


def median(xs):
    return sorted(xs)[len(xs) // 2]


def kernel_times(run, top=10, width=48):
    """Per-kernel GPU time (ms) of one ``run()`` under the profiler, the ``top`` largest, and the sum
    over every kernel (``(all kernels)``)."""
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
    top_kernels = dict(sorted(agg.items(), key=lambda kv: -kv[1])[:top])
    return {**top_kernels, "(all kernels)": sum(agg.values())}


def cuda_events(step, reps=3):
    """The CUDA kernel events of ``reps`` calls of ``step()`` under the profiler (after one call
    outside it), in launch order."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    return sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)


def kernel_sequence(step, reps=3):
    """[(kernel name, ms)] of one ``step()`` in launch order, each the mean over ``reps`` steps (so
    that kernels of one name, as the products sharing ``matmul_kernel``, stay apart)."""
    events = cuda_events(step, reps)
    per = len(events) // reps
    return [(events[i].name[:70], sum(events[i + r * per].device_time for r in range(reps)) / 1000 / reps)
            for i in range(per)]


def write_results(out_dir, filename, rows, **extra):
    """Writes {meta, rows, **extra} as JSON under ``out_dir`` and prints the rows as a table last."""
    import json

    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / filename).write_text(json.dumps(dict(meta=meta, rows=rows, **extra), indent=1))
    nan = float("nan")
    print(f"\n{meta}\n{'shape':5s} {'variant':32s} {'plan':28s} {'ms':>7s} {'x mm':>6s} {'MiB':>6s} {'dx':>8s} {'dw':>8s}")
    for r in rows:
        head = f"{r['shape']:5s} {r['name']:32s}"
        if "ms" in r:
            ratio = r["ms"] / r["matmul_ms"] if r.get("matmul_ms") else nan
            print(f"{head} {r.get('plan', '')[:28]:28s} {r['ms']:7.2f} {ratio:6.2f} {r.get('extra_mib', nan):6.0f} "
                  f"{r.get('dx', nan):8.1e} {r.get('dw', nan):8.1e}")
        else:
            print(f"{head} {r.get('same_as', r.get('error', ''))[:80]}")


def pair_case(name, n=65536, h=4096, v=128256):
    """The compensated pair's products at S4 (bf16, on the GPU): (a, b, the pair's shape, the
    products' role). ``chunk-dW-R``: a chunk's grad_weight (a = da^T of R x V, b = the chunk's hidden
    rows); ``paired-dX``: the default plan's grad_hidden block (a = da of N x 2048, b = the weight's
    2048 rows)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    if name.startswith("chunk-dW"):
        r = int(name.split("-")[-1])
        da = (1e-4 * torch.randn(r, v, device="cuda", generator=g)).bfloat16()
        x = torch.randn(r, h, device="cuda", generator=g).bfloat16()
        return da.t(), x, (v, h), "product"
    da = (1e-4 * torch.randn(n, 2048, device="cuda", generator=g)).bfloat16()
    w = (0.02 * torch.randn(2048, h, device="cuda", generator=g)).bfloat16()
    return da, w, (n, h), "paired_rows"


def divergence_step(data, beta, before=None, **kwargs):
    """A fwd+bwd step of ``fused_linear_divergence`` on a ``distill_cases`` problem (``kwargs`` its
    settings; with reduction "none" the loss is the mean of the per-token values), after ``before()``
    (a setting to patch) where given: a callable returning (grad_hidden, grad_weight)."""
    from fused_linear_ce import fused_linear_divergence

    def step():
        if before is not None:
            before()
        x = data.x_s.detach().requires_grad_(True)
        w = data.w_s.detach().requires_grad_(True)
        out = fused_linear_divergence(x, w, data.x_t, data.w_t, beta=beta, **kwargs)
        (out.sum() / out.numel() if kwargs.get("reduction") == "none" else out).backward()
        return x.grad, w.grad
    return step


def check_divergence_steps(shape, steps, refs, data, t0, plans=None):
    """Each of ``steps`` ({name: divergence_step}, names ending "b=<beta>", those of reduction "none"
    starting "step none") once before timing: dX / dW against ``refs[beta]`` (``distill_cases.reference``;
    "none" against the mean's gradient times n_valid / n) and the extra memory (peak during the step
    less what was allocated before and the gradients). Prints a line each; {name: dict(dx, dw,
    extra_mib[, plan])}."""
    checks = {}
    for name, fn in steps.items():
        beta = float(name.split("b=")[1])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        dx, dw = fn()
        extra = (torch.cuda.max_memory_allocated() - base - dx.nbytes - dw.nbytes) / MiB
        scale = data.n_valid / data.n if name.startswith("step none") else 1.0
        ref = refs[beta]
        err = [float((g.float() - want).norm() / want.norm())
               for g, want in ((dx, ref["dx"]["mean"].float() * scale), (dw, ref["dw"]["mean"].float() * scale))]
        checks[name] = dict(dx=err[0], dw=err[1], extra_mib=extra, **({"plan": plans[name]} if plans else {}))
        print(f"[{time.perf_counter() - t0:5.0f}s] {shape} {name}{' ' + plans[name] if plans else ''}: "
              f"dx {err[0]:.1e} dw {err[1]:.1e} extra {extra:.0f} MiB", flush=True)
        del dx, dw
    return checks


def distill_problem(shape, betas):
    """(data, {beta: reference}) of a ``distill_cases`` shape: peaked data on the GPU, each beta's
    reference with IEEE fp32 products (``distill_cases.reference``)."""
    import distill_cases

    data = distill_cases.make_data(shape, "peaked", "cuda", seed=0)
    torch.backends.cuda.matmul.allow_tf32 = False
    return data, {b: distill_cases.reference(data, b)[0] for b in betas}
