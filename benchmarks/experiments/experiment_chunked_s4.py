"""Where the chunked path's time goes at S4 (issue 22, target 2: 960 MiB chunks, 1.5 GiB), and two
variants of its dX product, side by side in one process on one GPU:

- ``triton``: as shipped, each chunk's grad_hidden = da @ weight on the package's Triton matmul (one
  program per 128 x 256 output tile, the whole V reduction in it: 30 x 16 = 480 tiles for 132 SMs at
  3840 rows, a ragged fourth wave);
- ``cublas``: the same product on cuBLAS with an fp32 result and one scaling kernel
  (``products._fp32_then_scale``, an fp32 rows x H buffer, 60 MiB), which splits the V reduction;

per-kernel GPU times from ``torch.profiler`` for one step of each, and fwd+bwd medians of 5 steps,
with Liger as the reference point. Errors against the fp32-logit reference (both must match).

    python3 benchmarks/experiments/experiment_chunked_s4.py --out $OUT/chunked_s4
"""

import collections
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fused_linear_ce import fused_linear_cross_entropy, products  # noqa: E402

from bench import SHAPES, make_data, versions  # noqa: E402
from experiment_accumulators import event_times, reference, rel  # noqa: E402
from experiment_common import liger_loss, parse_args  # noqa: E402

MiB = 1 << 20
ORIGINAL = products.product


def cublas_dx(a, b, out, accumulate, unscale=None):
    """products.product with the chunked path's dX (da @ weight, K = V) sent to cuBLAS."""
    if not accumulate and out.dtype != torch.float32 and a.shape[1] == b.shape[0] and b.shape[0] > 16 * b.shape[1]:
        return products._fp32_then_scale(a, b, out, unscale)
    return ORIGINAL(a, b, out, accumulate, unscale)


def timed(fn, hidden, weight, reps):
    def step():
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        fn(h, w).backward()
        return h.grad, w.grad

    dx, dw = step()
    return dx, dw, statistics.median(event_times(step, reps)), step


def kernel_table(step):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    totals = collections.Counter()
    counts = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name.split("(")[0][:60]
            totals[name] += e.device_time_total / 1e3 if hasattr(e, "device_time_total") else e.cuda_time_total / 1e3
            counts[name] += 1
    return [(n, round(ms, 2), counts[n]) for n, ms in totals.most_common(12)]


def main():
    args = parse_args(["S4"], lambda ap: ap.add_argument("--reps", type=int, default=5))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    n, h, v = SHAPES[args.shapes[0]]
    hidden, weight, targets = make_data(n, h, v, "random", torch.device("cuda"), 0)
    ref = reference(hidden, weight, targets)
    rows = []

    def flce(hd, wd):
        return fused_linear_cross_entropy(hd, wd, targets, strategy="chunked", chunk_bytes=960 * MiB)

    for name, patch in (("triton", ORIGINAL), ("cublas", cublas_dx), ("triton-again", ORIGINAL)):
        products.product = patch
        dx, dw, ms, step = timed(flce, hidden, weight, args.reps)
        row = dict(variant=name, ms=ms, dx=rel(dx, ref[1]), dw=rel(dw, ref[2]))
        if name != "triton-again":
            row["kernels"] = kernel_table(step)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del dx, dw
        torch.cuda.empty_cache()
    products.product = ORIGINAL
    liger = liger_loss(targets)
    if liger is not None:
        _, _, ms, _ = timed(liger, hidden, weight, args.reps)
        rows.append(dict(variant="liger", ms=ms))
        print(json.dumps(rows[-1]), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), **versions(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    (out_dir / "experiment_chunked_s4.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("\nvariant        fwd+bwd ms")
    for r in rows:
        print(f"{r['variant']:14} {r['ms']:8.1f}")


if __name__ == "__main__":
    main()
