"""The main job: load the kernel the way users do, train-step a small problem, compare with plain torch.

    bash scripts/demo.sh            # or: python3 scripts/demo.py [--n N --h H --v V --dtype bf16]

Loads the kernel with ``kernels.get_local_kernel`` from this clone (the repo root on a CUDA machine;
the ``build/torch-cuda`` variant folder under the Triton interpreter on a machine without a GPU),
computes loss, metrics and gradients, checks them against plain torch in float64, and prints the
peak memory of both: measured with the CUDA allocator on a GPU; on CPU (no allocator statistics)
the bytes of each method's (N, V)-sized temporaries, computed from the shapes.
"""

import argparse
import os
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module is imported
    # numpy warns about masked-out lanes (0 * -inf) that the kernels discard with tl.where
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")

from kernels import get_local_kernel  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8192 if ON_GPU else 256, help="tokens")
    ap.add_argument("--h", type=int, default=4096 if ON_GPU else 128, help="hidden size")
    ap.add_argument("--v", type=int, default=128256 if ON_GPU else 8000, help="vocabulary")
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    args = ap.parse_args()
    n, h, v, dtype = args.n, args.h, args.v, DTYPES[args.dtype]
    device = "cuda" if ON_GPU else "cpu"

    kernel = get_local_kernel(REPO if ON_GPU else REPO / "build" / "torch-cuda")
    print(f"loaded {kernel.__name__} from {Path(kernel.__file__).parent.relative_to(REPO)} on {device}"
          f"{'' if ON_GPU else ' (Triton interpreter)'}; torch {torch.__version__}")

    g = torch.Generator(device=device).manual_seed(0)
    hidden = (torch.randn(n, h, device=device, generator=g) * 2.0).to(dtype)
    weight = (torch.randn(v, h, device=device, generator=g) / h**0.5).to(dtype)
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    targets[::10] = -100  # some padding

    def step(fn):
        hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if ON_GPU:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        loss, metrics = fn(hd, wd)
        loss.backward()
        peak = (torch.cuda.max_memory_allocated() - base) if ON_GPU else None
        return loss.detach(), metrics, hd.grad, wd.grad, peak

    def ours(hd, wd):
        return kernel.fused_linear_cross_entropy(hd, wd, targets, return_metrics=True)

    def plain_torch(hd, wd):
        logits = (hd @ wd.T).float()
        loss = torch.nn.functional.cross_entropy(logits, targets)
        with torch.no_grad():
            counted = targets != -100
            logp = logits.log_softmax(-1)[counted]
            metrics = {"mean_token_accuracy": (logits.argmax(-1)[counted] == targets[counted]).float().mean(),
                       "entropy": -(logp.exp() * logp).sum(-1).mean()}
        return loss, metrics

    results = {"fused-linear-ce": step(ours), "plain torch": step(plain_torch)}
    ref_loss, ref_metrics, ref_dx, ref_dw, _ = step(
        lambda hd, wd: kernel.reference.linear_cross_entropy(hd, wd, targets, return_metrics=True))

    mib = 2**20
    print(f"\nN={n} H={h} V={v} {args.dtype}; reference: float64 from the same {args.dtype} inputs")
    print(f"{'method':18s} {'loss':>10s} {'accuracy':>9s} {'entropy':>9s} {'dX err':>9s} {'dW err':>9s} {'peak extra':>12s}")
    for name, (loss, metrics, dx, dw, peak) in results.items():
        mem = f"{peak / mib:9.1f} MiB" if peak is not None else "      n/a"
        print(f"{name:18s} {loss.item():10.6f} {metrics['mean_token_accuracy'].item():9.4f} "
              f"{metrics['entropy'].item():9.4f} {rel(dx, ref_dx):9.2e} {rel(dw, ref_dw):9.2e} {mem}")
    print(f"{'float64 reference':18s} {ref_loss.item():10.6f} {ref_metrics['mean_token_accuracy'].item():9.4f} "
          f"{ref_metrics['entropy'].item():9.4f}")
    if not ON_GPU:
        plan = kernel.backward_passes.plan_backward(n, v, h, dtype, None, 16, 256)
        print(f"\nCPU, no allocator statistics; (N, V)-sized temporaries by shape: plain torch holds the "
              f"{args.dtype} logits, their fp32 copy and its gradient: {n * v * (dtype.itemsize + 8) / mib:.1f} MiB; "
              f"fused-linear-ce holds a {plan.rows} x {plan.cols} gradient block: "
              f"{plan.rows * plan.cols * dtype.itemsize / mib:.1f} MiB")

    loss = results["fused-linear-ce"][0]
    ok = abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    ok &= rel(results["fused-linear-ce"][2], ref_dx) <= rel(results["plain torch"][2], ref_dx) + 5e-3
    print("\nOK: matches the float64 reference" if ok else "\nFAILED: does not match the reference")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
