"""Where the weight gradient's sum across token chunks lives (issue 22, targets 2 and 3), side by side
in one process on one GPU:

- ``master``: an fp32 lm-head weight under ``torch.autocast(bfloat16)`` (a ``Trainer`` with
  ``bf16=True`` on an fp32 model). Ours keeps the weight fp32 into the op and sums every chunk's dW
  straight into its fp32 gradient; against ours casting the weight first (the earlier behaviour),
  ours on the recompute path, and ``torch.compile`` of ``F.linear`` + ``F.cross_entropy`` under the same
  autocast. ``above_grads_mib`` = peak above the inputs minus the fp32 gradients of hidden and
  weight; ``extra_mib`` = that minus a bf16 copy of the weight (V x H x 2 bytes), which every method
  holds during its forward (autocast's cache, or ours inside the op).
- ``pair``: bf16 weights; ours by default (at S4 the recompute path's paired plan: grad_hidden summed
  as bf16 + int8 in one pass), ours at 256 MiB (at S4 the two-pass plan), the chunked path at several
  chunk sizes, whose weight gradient is summed across chunks as a pair (the gradient and an int8
  V x H remainder), against Liger (bf16 sums across chunks). Extra = peak minus the bf16 gradients.

Errors are relative Frobenius norms against the fp32-logit reference of the bf16-rounded operands
(TF32 matmuls read bf16 exactly). Times: CUDA events around whole forward+backward steps, the
median of ``--reps`` after a warm-up step.

    python3 benchmarks/experiments/experiment_accumulators.py --shapes S1 S4 --out $OUT/acc
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fused_linear_ce import fused_linear_cross_entropy  # noqa: E402
from fused_linear_ce.reference import chunked_linear_cross_entropy  # noqa: E402

from bench import SHAPES, make_data, versions  # noqa: E402
from experiment_common import liger_loss, parse_args  # noqa: E402

MiB = 1 << 20


def reference(hidden, weight, targets):
    torch.backends.cuda.matmul.allow_tf32 = True
    chunk = max(1, (2 << 30) // (4 * weight.shape[0]))
    loss, count, dx, dw, _ = chunked_linear_cross_entropy(hidden.bfloat16(), weight.bfloat16(), targets, chunk=chunk)
    torch.backends.cuda.matmul.allow_tf32 = False
    return (loss / count).item(), dx.div_(count), dw.div_(count)


def rel(a, b):
    return ((a.float() - b).norm() / b.norm()).item()


def step(fn, hidden, weight, autocast):
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w)
    loss.backward()
    return loss.detach(), h.grad, w.grad


def measure(fn, hidden, weight, ref, autocast, reps, subtract):
    ref_loss, ref_dx, ref_dw = ref
    loss, dx, dw = step(fn, hidden, weight, autocast)  # warm-up (compiles) and errors
    out = dict(loss=abs(loss.item() - ref_loss) / abs(ref_loss), dx=rel(dx, ref_dx), dw=rel(dw, ref_dw),
               dw_dtype=str(dw.dtype).replace("torch.", ""))
    grads = dx.nbytes + dw.nbytes
    del loss, dx, dw
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step(fn, hidden, weight, autocast)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    out["peak_mib"] = peak / MiB
    out["above_grads_mib"] = (peak - grads) / MiB
    out["extra_mib"] = (peak - grads - subtract) / MiB
    out["ms_all"] = event_times(lambda: step(fn, hidden, weight, autocast), reps)
    out["ms"] = statistics.median(out["ms_all"])
    return out


def event_times(run, reps):
    """``reps`` timings (ms, CUDA events) of ``run()``, each waited for."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times


def torch_ce(h, w, t):
    return F.cross_entropy(F.linear(h, w).float(), t)


def main():
    args = parse_args(["S1", "S4"], lambda ap: (ap.add_argument("--reps", type=int, default=5),
                                                  ap.add_argument("--parts", nargs="+", default=["master", "pair"]),
                                                  ap.add_argument("--dists", nargs="+", default=["random"])))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows, t0 = [], time.perf_counter()
    meta = dict(gpu=torch.cuda.get_device_name(), **versions(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), args=vars(args))

    def record(row):
        rows.append(row)
        print(f"[{time.perf_counter() - t0:5.0f}s] " + " ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items() if k != "ms_all"), flush=True)
        (out_dir / "experiment_accumulators.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))

    for shape in args.shapes:
        n, h, v = SHAPES[shape]
        torch._dynamo.reset()
        for dist in args.dists:
            hidden16, weight16, targets = make_data(n, h, v, dist, torch.device("cuda"), 0)
            ref = reference(hidden16, weight16, targets)
            flce = fused_linear_cross_entropy
            if "master" in args.parts:
                hidden, weight = hidden16.float(), weight16.float()  # an fp32 model: fp32 hidden states and head
                compiled = torch.compile(torch_ce, dynamic=False)
                variants = {
                    "torch-compile": lambda hd, wd: compiled(hd, wd, targets),
                    "flce": lambda hd, wd: flce(hd, wd, targets),
                    "flce-448M": lambda hd, wd: flce(hd, wd, targets, chunk_bytes=448 * MiB),
                    "flce-1G": lambda hd, wd: flce(hd, wd, targets, chunk_bytes=1024 * MiB),
                    "flce-cast-first": lambda hd, wd: flce(hd, wd.to(torch.bfloat16), targets),
                    "flce-recompute": lambda hd, wd: flce(hd, wd, targets, strategy="recompute"),
                }
                for name, fn in variants.items():
                    labels = dict(part="master", shape=shape, dist=dist, method=name)
                    try:
                        record(dict(labels, **measure(fn, hidden, weight, ref, True, args.reps, v * h * 2)))
                    except Exception as exc:  # a row, not a crash
                        record(dict(labels, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    torch.cuda.empty_cache()
                del hidden, weight
            if "pair" in args.parts:
                # flce: the default (S4: the paired one-pass plan); flce-256M: the same budget for
                # everything, which at S4 leaves no room beside the remainder: the two-pass plan.
                variants = {"flce": lambda hd, wd: flce(hd, wd, targets),
                            "flce-256M": lambda hd, wd: flce(hd, wd, targets, chunk_bytes=256 * MiB)}
                for size in (448, 960, 1024):
                    variants[f"flce-chunked-{size}M"] = (
                        lambda hd, wd, s=size: flce(hd, wd, targets, strategy="chunked", chunk_bytes=s * MiB))
                liger = liger_loss(targets)
                if liger is not None:
                    variants["liger"] = liger
                for name, fn in variants.items():
                    labels = dict(part="pair", shape=shape, dist=dist, method=name)
                    try:
                        record(dict(labels, **measure(fn, hidden16, weight16, ref, False, args.reps, 0)))
                    except Exception as exc:
                        record(dict(labels, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
                    torch.cuda.empty_cache()
            del hidden16, weight16, targets, ref
            torch.cuda.empty_cache()

    print("\npart    shape dist    method               ms      extra MiB  above grads  dW err    dX err")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:7} {r['shape']:5} {r['dist']:7} {r['method']:20} {r['error']}")
        else:
            print(f"{r['part']:7} {r['shape']:5} {r['dist']:7} {r['method']:20} {r['ms']:7.1f} {r['extra_mib']:9.0f} "
                  f"{r['above_grads_mib']:11.0f}  {r['dw']:9.2e} {r['dx']:9.2e}")


if __name__ == "__main__":
    main()
