"""The product into the bf16 + int8 compensated pair at long context: v25's split (the remainder in
steps of hi's binade: exponent extraction, a division, a floor) against v26's (the remainder in units
of 2^8 of the sum's fp32 bit pattern: integer arithmetic on the bits), beside cuBLAS into bf16 and
the Triton matmul into plain bf16 (the floors), on one H200 (S4 = 65536 x 4096 x 128256, bf16).
The committed run (results/pair_bits/) also timed v26 with the old pair asked of L2 before the
tile's K loop (``prefetch.global.L2``, a variant since removed: 2-6% slower, NOTES v26):

- ``chunk-dW-R``: a chunk's grad_weight summed into the pair (a = da^T of R x V, b = the chunk's
  hidden rows), R = 4096 (1 GiB chunks) and 3840 (960 MiB);
- ``paired-dX``: the default plan's grad_hidden block (a = da of N x 2048, b = the weight's 2048 rows,
  role ``paired_rows``).

Checks first: v26's hi against v25's (the same fp32 sum, rounded the same way: bits equal), and both
pairs' values against float64 (relative error of the decoded pair). Times: medians of interleaved
rounds. The old package is a copy of another commit (``--base``, as ``ab.py``). Prints a table last;
writes pair_bits.json under --out.

    python3 benchmarks/experiments/experiment_pair_bits.py --base .ab/base/fused_linear_ce --out $OUT
"""

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiment_common import interleaved, median, pair_case  # noqa: E402  (puts torch-ext on the path)

from ab import load_copy  # noqa: E402
from fused_linear_ce import gemm  # noqa: E402


def decode_v26(hi, lo):
    return ((hi.view(torch.int16).int() << 16) + lo.int() * 256).view(torch.float32).double()


def decode_v25(hi, lo):
    hi = hi.double()
    _, ex = torch.frexp(hi)
    e = torch.where(hi == 0, torch.full_like(ex, -127), ex - 1).clamp(min=-111)
    return hi + lo.double() * torch.exp2(e.double() - 15)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="a copy of the v25 package (ab.py's copies)")
    ap.add_argument("--cases", nargs="+", default=["chunk-dW-4096", "chunk-dW-3840", "paired-dX"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    base = load_copy("base", args.base)
    unscale = torch.tensor([0.5], device="cuda")
    rows, checks = [], {}
    for name in args.cases:
        a, b, shape, role = pair_case(name)
        hi0 = (1e-3 * torch.randn(shape, device="cuda")).bfloat16()
        lo0 = torch.zeros(shape, dtype=torch.int8, device="cuda")
        bufs = {k: (hi0.clone(), lo0.clone()) for k in ("v25", "v26")}

        def pair_run(pkg, key):
            hi, lo = bufs[key]
            return lambda: pkg.products.compensated(a, b, hi, lo, True, unscale, role=role)

        runs = {"v25": pair_run(base, "v25"), "v26": pair_run(sys.modules["fused_linear_ce"], "v26")}
        # The checks: one call each from (hi0, lo0 = 0), against float64.
        exact = hi0.double() + (a.double() @ b.double()) * 0.5
        for key, run in runs.items():
            run()
        torch.cuda.synchronize()
        his = {k: v[0] for k, v in bufs.items()}
        values = {"v25": decode_v25(*bufs["v25"]), "v26": decode_v26(*bufs["v26"])}
        scale = exact.abs().clamp(min=1e-30)
        check = dict(
            hi_bits_v26_eq_v25=float((his["v26"].view(torch.int16) == his["v25"].view(torch.int16)).float().mean()),
            **{f"rel_max_{k}": float(((v - exact).abs() / scale).max()) for k, v in values.items()},
            **{f"rel_mean_{k}": float(((v - exact).abs() / scale).mean()) for k, v in values.items()},
        )
        checks[name] = check
        print(name, json.dumps(check), flush=True)
        del exact, values, scale
        out16 = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        runs["cublas-bf16"] = lambda: torch.mm(a, b, out=out16)
        runs["triton-bf16"] = lambda: gemm.matmul(a, b, out16, False, unscale, role=role)
        times = interleaved(runs, rounds=args.rounds, rep=200)
        for variant, ts in times.items():
            rows.append(dict(case=name, variant=variant, ms=median(ts), rounds=ts))
        del bufs, a, b, hi0, lo0, out16
        torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, rounds=args.rounds)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "pair_bits.json").write_text(json.dumps(dict(meta=meta, checks=checks, rows=rows), indent=1))
    print(f"\n{meta}")
    print(f"{'case':14} {'variant':14} {'ms':>8}   rounds")
    for r in rows:
        print(f"{r['case']:14} {r['variant']:14} {r['ms']:8.3f}   " + " ".join(f"{t:.3f}" for t in r["rounds"]))


if __name__ == "__main__":
    main()
