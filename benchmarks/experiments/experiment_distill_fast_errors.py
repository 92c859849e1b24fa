"""Why the one-chunk ("fast") divergence step's dX / dW errors were erratic in the D1/D2 benchmark
(2.3e-3 to 1.4e-2 at D2 peaked beta = 0, the default's 2.3e-3 beside them): each piece of the step at
D2 peaked, the step itself three times, the row kernel's da against torch's, and the Triton products
of da (a view with row stride 2V inside the teacher's fp32 buffer) against cuBLAS on an fp32 copy
and against the Triton products of a contiguous copy; then the row kernel's time with da for each beta.
Prints the table last.

One GPU call:

    python3 benchmarks/experiments/experiment_distill_fast_errors.py --shape D2 --beta 0
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import distill_cases  # noqa: E402
from fused_linear_ce import divergence, fused_linear_divergence, products  # noqa: E402
from fused_linear_ce.divergence import Spec  # noqa: E402
from fused_linear_ce.validate import Options  # noqa: E402


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="D2", choices=list(distill_cases.SHAPES))
    ap.add_argument("--beta", type=float, default=0.0, help="the divergence's beta (0: forward KL)")
    args = ap.parse_args()
    shape, beta = args.shape, args.beta
    torch.backends.cuda.matmul.allow_tf32 = False
    data = distill_cases.make_data(shape, "peaked", "cuda", seed=0)
    ref = distill_cases.reference(data, beta)[0]
    lines = []
    for label, kw in (("fast", dict(chunk_bytes=1 << 40)), ("default", {})):
        for trial in range(3):
            x = data.x_s.detach().requires_grad_(True)
            w = data.w_s.detach().requires_grad_(True)
            fused_linear_divergence(x, w, data.x_t, data.w_t, beta=beta, **kw).backward()
            lines.append(f"step {label} #{trial}: dx {rel(x.grad, ref['dx']['mean']):.2e} dw {rel(w.grad, ref['dw']['mean']):.2e}")
            print(lines[-1], flush=True)
    del ref
    n, v = data.n, data.v
    zs = torch.empty((n, v), dtype=torch.float32, device="cuda")
    zt = torch.empty_like(zs)
    products.accumulate(data.x_s, data.w_s.t(), zs, True)
    products.accumulate(data.x_t, data.w_t.t(), zt, True)
    ls = torch.log_softmax(zs.double(), -1)
    lt = torch.log_softmax(zt.double(), -1)
    if beta == 0:
        want = (ls.exp() - lt.exp()) / n
    else:
        want = None
    del ls, lt
    opts = Options()
    spec = Spec(beta=beta, student=opts, teacher=opts, reduction="mean")
    counted = torch.ones(n, dtype=torch.int8, device="cuda")
    coef = torch.zeros((2, n), dtype=torch.float32, device="cuda")
    coef[0] = 1.0
    stats = torch.empty((3, n), dtype=torch.float32, device="cuda")
    out = torch.empty_like(stats)
    da = divergence._da_view(zt, torch.bfloat16)
    divergence._launch(zs, zt, da, (None, None), None, counted, coef, stats, out, 0, n, spec, values=True,
                       write_da=True, stats_known=False, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    if want is not None:
        lines.append(f"row kernel da vs torch (fp64): {rel(da.double() / n, want):.2e}")
        print(lines[-1], flush=True)
        del want
    one = torch.ones(1, dtype=torch.float32, device="cuda")
    dense = da.contiguous()
    exact_dx = torch.mm(dense.float(), data.w_s.float())
    exact_dw = torch.mm(dense.float().t(), data.x_s.float())
    for name, a in (("strided view", da), ("contiguous", dense)):
        dx = torch.empty_like(data.x_s)
        dw = torch.empty_like(data.w_s)
        for trial in range(2):
            products.product(a, data.w_s, dx, False, one)
            products.product(a.t(), data.x_s, dw, False, one)
            torch.cuda.synchronize()
            lines.append(f"triton products of da ({name}) #{trial}: dx {rel(dx, exact_dx):.2e} dw {rel(dw, exact_dw):.2e}")
            print(lines[-1], flush=True)
    import triton.testing
    for b in (1.0, 0.5, 0.0):
        spec_b = Spec(beta=b, student=opts, teacher=opts, reduction="mean")
        ms = triton.testing.do_bench(lambda: divergence._launch(
            zs, zt, da, (None, None), None, counted, coef, stats, out, 0, n, spec_b, values=True, write_da=True,
            stats_known=False, dtype=torch.bfloat16), warmup=5, rep=100, return_mode="median")
        lines.append(f"row kernel +da beta={b:g}: {ms:.2f} ms")
        print(lines[-1], flush=True)
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
