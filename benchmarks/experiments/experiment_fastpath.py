"""Issue 22 target 4: where the fast path (the chunked path in one chunk) spends the time that
torch.compile does not, at S1-S3. One GPU call.

- Each kernel of one step in launch order under the profiler (ours and torch.compile's), so the
  products that share ``matmul_kernel`` are told apart.
- The products alone: cuBLAS into bf16 (torch.compile's), cuBLAS into fp32, the package's Triton
  matmul with the factor in its epilogue, for the logits (N x V), dX ((N, V) @ (V, H)) and dW
  ((V, N) @ (N, H)).
- Whole steps side by side (interleaved rounds): ours, torch.compile, ``--variants`` patched into
  the package (``VARIANTS``), and with ``--base`` another copy of the package (ab.py's).

Run 1 (NOTES v31) had ``gluon_store_e.patch`` applied and a ``gluon-e`` variant for it (the chunked
sweep as the Hopper ping-pong kernel, refuted); the patch and that script are at commit 3502f5a
(``git show 3502f5a:benchmarks/results/fastpath/gluon_store_e.patch``). Run 2 is v31 (split K, the
in-place factor of 1) against the package before it:

    python3 benchmarks/experiments/experiment_fastpath.py --out $OUT/fastpath
    python3 benchmarks/experiments/experiment_fastpath.py --variants no-split --base .ab/head/fused_linear_ce --rounds 3
"""

import collections
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import fused_linear_ce  # noqa: E402
from bench import WHOLE, make_data  # noqa: E402
from experiment_common import against_compile, kernel_sequence, parse_args, reference, timed  # noqa: E402
from fused_linear_ce import gemm  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
WHOLE_KW = dict(strategy="chunked", chunk_bytes=WHOLE)


def torch_ce(h, w, t):
    return F.cross_entropy((h @ w.T).float(), t)


def _dx_on_cublas():
    """The chunk's grad_hidden (da (R, V) @ weight (V, H)) by cuBLAS into fp32, then one scale."""
    real = gemm.few_tiles

    def patched(a, b):
        return b.shape[0] == a.shape[1] and a.stride(1) == 1 and b.shape[0] > b.shape[1] or real(a, b)
    gemm.few_tiles = patched
    return lambda: setattr(gemm, "few_tiles", real)


def _no_split():
    """v31's split K turned off: every product one program per output tile (as before v31)."""
    real = gemm.split_k
    gemm.split_k = lambda a, b: 1
    return lambda: setattr(gemm, "split_k", real)


VARIANTS = {"dx-cublas": _dx_on_cublas, "no-split": _no_split}
BASE = {}  # --base: another copy of the package, as "base" (ab.py's load_copy)


def stepper(fn, hidden, weight, targets):
    x = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def step():
        x.grad = w.grad = None
        fn(x, w, targets).backward()
    return step


def errors(hidden, weight, targets, ours, variants):
    """dX / dW relative errors against the fp32 reference of ours and each variant: a variant that
    is wrong is not timed as if it were right."""
    ref_loss, ref_dx, ref_dw = reference(hidden, weight, targets)
    out = {}
    for name in ["ours", *variants, *(["base"] if BASE else [])]:
        undo = VARIANTS[name]() if name in VARIANTS else (lambda: None)
        try:
            x = hidden.detach().requires_grad_(True)
            w = weight.detach().requires_grad_(True)
            fn = partial(BASE["module"].fused_linear_cross_entropy, **WHOLE_KW) if name == "base" else ours
            loss = fn(x, w, targets)
            loss.backward()
            rel = lambda a, b: ((a.float() - b).norm() / b.norm()).item()
            out[name] = dict(loss=abs(loss.item() - ref_loss.item()), dx=rel(x.grad, ref_dx), dw=rel(w.grad, ref_dw))
        finally:
            undo()
        print(f"errors {name:12s} loss {out[name]['loss']:.2e} dX {out[name]['dx']:.2e} dW {out[name]['dw']:.2e}",
              flush=True)
    del ref_dx, ref_dw
    return out


def products_alone(hidden, weight, rep):
    n, h = hidden.shape
    v = weight.shape[0]
    da = (torch.randn(n, v, device="cuda") * 1e-4).bfloat16()
    unscale = torch.full((1,), 0.5, device="cuda")
    out = {}
    out["logits cuBLAS bf16"] = timed(lambda: torch.mm(hidden, weight.t()), rep)
    dx = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)
    dx32 = torch.empty(n, h, device="cuda", dtype=torch.float32)
    out["dX cuBLAS bf16"] = timed(lambda: torch.mm(da, weight, out=dx), rep)
    out["dX cuBLAS fp32"] = timed(lambda: torch.mm(da, weight, out=dx32, out_dtype=torch.float32), rep)
    out["dX Triton"] = timed(lambda: gemm.matmul(da, weight, dx, False, unscale), rep)
    dw = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
    out["dW cuBLAS bf16"] = timed(lambda: torch.mm(da.t(), hidden, out=dw), rep)
    out["dW Triton"] = timed(lambda: gemm.matmul(da.t(), hidden, dw, False, unscale), rep)
    return out


def main():
    args = parse_args(SHAPES, lambda ap: (ap.add_argument("--dists", nargs="+", default=["random", "peaked"]),
                                          ap.add_argument("--variants", nargs="*", default=list(VARIANTS)),
                                          ap.add_argument("--rounds", type=int, default=2),
                                          ap.add_argument("--rep", type=int, default=300),
                                          ap.add_argument("--base", default=None,
                                                          help="a copy of the package to time beside (ab.py)")))
    if args.base:
        from ab import load_copy
        BASE["module"] = load_copy("base", args.base)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = dict(shapes={}, device=torch.cuda.get_device_name(), torch=torch.__version__)
    table = []
    for name in args.shapes:
        n, h, v = SHAPES[name]
        torch._dynamo.reset()
        compiled = torch.compile(torch_ce, dynamic=False)
        ours = partial(fused_linear_ce.fused_linear_cross_entropy, **WHOLE_KW)
        rec = result["shapes"][name] = dict(products=None, profiles={}, steps={})
        for dist in args.dists:
            hidden, weight, targets = make_data(n, h, v, dist, torch.device("cuda"), seed=0)
            if dist == args.dists[0]:
                rec["errors"] = errors(hidden, weight, targets, ours, args.variants)
                rec["products"] = products_alone(hidden, weight, args.rep)
                for key, ms in rec["products"].items():
                    print(f"{name} {key:22s} {ms:8.3f} ms", flush=True)
                for label, fn in (("ours", ours), ("compile", compiled)):
                    seq = kernel_sequence(stepper(fn, hidden, weight, targets))
                    rec["profiles"][label] = seq
                    print(f"\n{name} {label}: {sum(ms for _, ms in seq):.2f} ms of kernels", flush=True)
                    for kname, ms in seq:
                        if ms > 0.05:
                            print(f"  {ms:8.3f}  {kname}")
            steps = {"ours": stepper(ours, hidden, weight, targets),
                     "compile": stepper(compiled, hidden, weight, targets)}
            if BASE:
                steps["base"] = stepper(partial(BASE["module"].fused_linear_cross_entropy, **WHOLE_KW), hidden,
                                        weight, targets)
            times = collections.defaultdict(list)
            for _ in range(args.rounds):
                for label, step in steps.items():
                    times[label].append(timed(step, args.rep))
                for vname in args.variants:
                    undo = VARIANTS[vname]()
                    try:
                        times[vname].append(timed(steps["ours"], args.rep))
                    finally:
                        undo()
            rec["steps"][dist] = dict(times)
            table += against_compile(f"{name} {dist:7s}", times)
            del hidden, weight, targets
            torch.cuda.empty_cache()
        (out / "experiment_fastpath.json").write_text(json.dumps(result, indent=1))
    print("\nshape dist method ms (rounds) min/compile-min")
    print("\n".join(table))


if __name__ == "__main__":
    main()
