"""The long-context chunked plan (NOTES v28: grad_weight as a bf16 + 4-bit pair, V x H / 2 bytes, and
chunks of rows in the rest of the budget) at budgets past the default's 512 MiB, against the int8
pair's 1 GiB chunks (issue 22's target 2 setting, 1.5 GiB in all) and Liger, at S4 = 65536 x 4096 x
128256, bf16, on one H200. The question: does the 4-bit pair's smaller remainder (250.5 MiB where the
int8 one takes 501) buy enough larger chunks within 1.5 GiB to clear 1.1x Liger with a margin, and at
what cost in dW error?

The budgets past 512 MiB are not a package setting: ``plan._long_context_budget`` is replaced here
to return them (``budget - V x H / 2`` of chunk), the rest of the path unchanged. Per variant: extra
peak memory, dX / dW errors against bench.py's fp32-logit reference, and fwd+bwd ms, the medians of
interleaved rounds. Prints a table last; writes lean_budgets.json under --out.

    python3 benchmarks/experiments/experiment_lean_budgets.py --out $OUT --rounds 2
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench import gpu_name, make_data, reference_and_stats, rel, versions  # noqa: E402

import fused_linear_ce  # noqa: E402
from fused_linear_ce import plan  # noqa: E402

MiB = 1 << 20
N, H, V = 65536, 4096, 128256
LEAN = {"lean-512M (default)": None, "lean-768M": 768 * MiB, "lean-1G": 1024 * MiB, "lean-1.25G": 1280 * MiB,
        "lean-1.5G": 1536 * MiB}


def lean_runner(total):
    """The default call with the long-context plan's total budget ``total`` (None: the package's)."""
    real = plan._long_context_budget

    def budget(opts, n, v, h, dtype, needs, master, sharded, dlogits):
        got = real(opts, n, v, h, dtype, needs, master, sharded, dlogits)
        return got if got is None or total is None else total - v * ((h + 1) // 2)

    def call(hidden, weight, targets):
        plan._long_context_budget = budget
        try:
            return fused_linear_ce.fused_linear_cross_entropy(hidden, weight, targets)
        finally:
            plan._long_context_budget = real

    return call


def liger_runner():
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    def call(hidden, weight, targets):
        out = liger_fused_linear_cross_entropy(hidden, weight, targets)
        return out[0] if isinstance(out, (tuple, list)) else out

    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dist", default="random")
    args = ap.parse_args()
    device = torch.device("cuda")
    hidden, weight, targets = make_data(N, H, V, args.dist, device, seed=0)
    _, ref_dx, ref_dw, _ = reference_and_stats(hidden, weight, targets, "tf32")
    fns = {name: lean_runner(total) for name, total in LEAN.items()}
    fns["int8 chunked-1G"] = lambda h, w, t: fused_linear_ce.fused_linear_cross_entropy(
        h, w, t, strategy="chunked", chunk_bytes=1 << 30)
    fns["liger"] = liger_runner()
    rows, runs = [], {}
    for name, fn in fns.items():
        hl, wl = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)

        def run(fn=fn, hl=hl, wl=wl):
            hl.grad = wl.grad = None
            fn(hl, wl, targets).backward()

        run()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        rows.append(dict(variant=name, extra_mib=(torch.cuda.max_memory_allocated() - base) / MiB,
                         dx_err=rel(hl.grad, ref_dx), dw_err=rel(wl.grad, ref_dw), times=[]))
        runs[name] = (run, rows[-1])
        budget = LEAN.get(name, 0)
        if name in LEAN:
            total = budget or plan.DEFAULT_PAIRED_BYTES
            rows[-1]["chunk_rows"] = plan.chunk_rows(N, V, torch.bfloat16, total - V * H // 2, 128)
        print(json.dumps(rows[-1]), flush=True)
    for _ in range(args.rounds):  # interleaved: clocks and heat hit every variant alike
        for run, row in runs.values():
            row["times"].append(triton.testing.do_bench(run, warmup=10, rep=300, return_mode="median"))
    for row in rows:
        row["ms"] = statistics.median(row["times"])
    liger_ms = runs["liger"][1]["ms"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=gpu_name(device), versions=versions(), dist=args.dist, rounds=args.rounds, shape=[N, H, V])
    (out / "lean_budgets.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{meta['gpu']}  {meta['versions']}  S4 {args.dist}, medians of {args.rounds} interleaved rounds")
    print(f"{'variant':22} {'rows':>5} {'ms':>8} {'/liger':>7} {'MiB':>7} {'dX':>8} {'dW':>8}")
    for row in rows:
        print(f"{row['variant']:22} {row.get('chunk_rows', ''):>5} {row['ms']:8.1f} {row['ms'] / liger_ms:7.3f} "
              f"{row['extra_mib']:7.0f} {row['dx_err']:8.1e} {row['dw_err']:8.1e}")


if __name__ == "__main__":
    main()
