"""Where the hosted chunk's time goes (NOTES v29): each kernel's CUDA time under the profiler, the
hosted one chunk (class-major in grad_weight) against the same chunk row-major beside it, and whole
steps with the class-major gradient kernel's programs varied.

- ``bf16``: 4096 x 4096 x 128256, bf16 weight; ``master``: 8192 x 4096 x 128256, an fp32 weight and
  fp32 hidden under ``torch.autocast(bfloat16)``.
- ``hosted`` = "auto" (the default budget), ``row-major`` = ``chunk_bytes=1 << 50`` (one chunk in its
  own buffer).

    python3 benchmarks/experiments/experiment_hosted_profile.py --out $OUT/profile
"""

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import fused_linear_ce  # noqa: E402
from bench import make_data  # noqa: E402
from experiment_common import cuda_events  # noqa: E402
from fused_linear_ce import chunked  # noqa: E402

SHAPES = {"bf16": (4096, 4096, 128256), "master": (8192, 4096, 128256)}
SETTINGS = {"hosted": {}, "row-major": dict(chunk_bytes=1 << 50)}


def stepper(kind, kwargs):
    n, h, v = SHAPES[kind]
    hidden, weight, targets = make_data(n, h, v, "random", torch.device("cuda"), seed=0)
    master = kind == "master"
    x = (hidden.float() if master else hidden).detach().requires_grad_(True)
    w = (weight.float() if master else weight).detach().requires_grad_(True)

    def step():
        x.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master):
            loss = fused_linear_ce.fused_linear_cross_entropy(x, w, targets, **kwargs)
        loss.backward()
    return step


def kernel_times(step, reps=3):
    totals = collections.Counter()
    for evt in cuda_events(step, reps):
        totals[evt.name[:60]] += evt.device_time / 1000 / reps
    return totals


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(profiles={}, variants=[])
    for kind in SHAPES:
        for setting, kwargs in SETTINGS.items():
            times = kernel_times(stepper(kind, kwargs))
            result["profiles"][f"{kind}/{setting}"] = dict(times)
            print(f"\n{kind} {setting}: {sum(times.values()):.2f} ms of kernels")
            for name, ms in times.most_common(12):
                print(f"  {ms:8.3f}  {name}")
    # The class-major gradient kernel's programs: (rows, warps), whole hosted steps.
    # (Run at 6597d0a, where these functions took a class_major flag; the hosted steps here are the
    # only chunked calls, so every gradient kernel launch in them is class-major.)
    real_rows, real_warps = chunked.gradient_rows, chunked.gradient_warps
    for rows, warps in ((128, 4), (128, 8), (64, 8), (64, 16), (32, 8)):
        chunked.gradient_rows = lambda cfg, ent, r=rows: real_rows(cfg, ent) if ent else r
        chunked.gradient_warps = lambda cfg, ent, wp=warps: real_warps(cfg, ent) if ent else wp
        for kind in SHAPES:
            step = stepper(kind, {})
            step()
            ms = triton.testing.do_bench(step, warmup=25, rep=300, return_mode="median")
            times = kernel_times(step, reps=2)
            grad_ms = sum(t for name, t in times.items() if "softmax_gradient" in name)
            result["variants"].append(dict(kind=kind, rows=rows, warps=warps, step_ms=ms, gradient_kernel_ms=grad_ms))
            print(f"variant {kind} rows {rows} warps {warps}: step {ms:.2f} ms, gradient kernel {grad_ms:.3f} ms",
                  flush=True)
    chunked.gradient_rows, chunked.gradient_warps = real_rows, real_warps
    (out / "experiment_hosted_profile.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
