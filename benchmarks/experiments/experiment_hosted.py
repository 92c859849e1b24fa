"""The chunked path's buffer hosted in grad_weight's memory (NOTES v29; issue 22, target 3), side by
side in one process, interleaved rounds.

- ``master``, S1 (8192 x 4096 x 128256) under ``torch.autocast(bfloat16)`` with fp32 hidden and
  weight: ours now (one chunk, its 2 GiB bf16 buffer class-major in the fp32 gradient, slabs of
  16384 rows), the package of ``--old`` (2048-row chunks summed into the gradient by cuBLAS),
  ``torch.compile`` of ``F.linear`` + ``F.cross_entropy`` under the same autocast.
- ``bf16``, 4096 x 4096 x 128256 (N = H: a 1 GiB plane): ours now (hosted in the bf16 gradient),
  the old package's default (the recompute path), ours in one row-major chunk (1 GiB beside the
  gradient), torch.compile, Liger.
- ``master-s4``, S4 (65536 x 4096 x 128256), as ``master``: ours now (a hosted head of 8192 rows, then
  1792-row chunks; NOTES v30), the same in 2048-row chunks (``ours-504M``), the old package
  (1792-row chunks), torch.compile.
- ``bf16-s4``, S4 in bf16 by default (the long-context chunked path): ours now (a hosted head of 4096
  rows, then 1024-row chunks), the old package (1024-row chunks), Liger.

``extra`` = peak above the inputs minus the gradients (fp32 for the master weight) and, for the
master weight, minus a bf16 copy of the weight, which every method holds in its forward. Errors:
relative Frobenius norms against bench.py's fp32-logit reference of the bf16-rounded operands.
Times: ``triton.testing.do_bench`` medians, the median over ``--rounds`` interleaved rounds.

    python3 benchmarks/experiments/experiment_hosted.py --old .ab/head/fused_linear_ce --out $OUT/hosted
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import fused_linear_ce  # noqa: E402
from ab import load_copy  # noqa: E402
from bench import gpu_name, make_data, reference_and_stats, rel, versions  # noqa: E402

MiB = 1 << 20
SHAPES = {"master": (8192, 4096, 128256), "bf16": (4096, 4096, 128256),
          "master-s4": (65536, 4096, 128256), "bf16-s4": (65536, 4096, 128256)}


def compiled_loss():
    def loss(h, w, t):
        return F.cross_entropy(F.linear(h, w).float(), t)
    return torch.compile(loss, dynamic=False)


def methods(kind, old, targets):
    new = fused_linear_ce.fused_linear_cross_entropy
    out = {"ours": lambda h, w: new(h, w, targets)}
    if old is not None:
        out["old"] = lambda h, w: old.fused_linear_cross_entropy(h, w, targets)
    if kind == "master-s4":  # 2048-row chunks after the head: 501 MiB of buffer
        out["ours-504M"] = lambda h, w: new(h, w, targets, chunk_bytes=504 * MiB)
    if kind != "bf16-s4":
        comp = compiled_loss()
        out["torch-compile"] = lambda h, w: comp(h, w, targets)
    if kind == "bf16":
        out["ours-row-major-1G"] = lambda h, w: new(h, w, targets, strategy="chunked", chunk_bytes=1 << 50)
    if kind.startswith("bf16"):
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy as liger

            def liger_loss(h, w):
                res = liger(h, w, targets)
                return res[0] if isinstance(res, (tuple, list)) else res
            out["liger"] = liger_loss
        except Exception as err:  # an optional oracle
            print(f"no liger: {err}")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default=None, help="path of another commit's fused_linear_ce package")
    ap.add_argument("--kinds", nargs="+", default=list(SHAPES))
    ap.add_argument("--dists", nargs="+", default=["random", "peaked"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=300, help="do_bench's rep (ms); 2000 at S4")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    old = load_copy("old", args.old) if args.old else None
    rows = []
    for kind in args.kinds:
        n, h, v = SHAPES[kind]
        master = kind.startswith("master")
        for dist in args.dists:
            hidden, weight, targets = make_data(n, h, v, dist, torch.device("cuda"), seed=0)
            _, ref_dx, ref_dw, _ = reference_and_stats(hidden, weight, targets, "tf32")
            leaf_h = (hidden.float() if master else hidden).detach().requires_grad_(True)
            leaf_w = (weight.float() if master else weight).detach().requires_grad_(True)
            runs = {}
            for name, fn in methods(kind, old, targets).items():
                def run(fn=fn):
                    leaf_h.grad = leaf_w.grad = None
                    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=master):
                        loss = fn(leaf_h, leaf_w)
                    loss.backward()
                run()  # compile, warm
                torch.cuda.synchronize()
                row = dict(kind=kind, shape=f"{n}x{h}x{v}", dist=dist, method=name,
                           dx_err=rel(leaf_h.grad, ref_dx), dw_err=rel(leaf_w.grad, ref_dw),
                           dw_dtype=str(leaf_w.grad.dtype).replace("torch.", ""), times=[])
                grads = leaf_h.grad.nbytes + leaf_w.grad.nbytes
                leaf_h.grad = leaf_w.grad = None
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run()
                torch.cuda.synchronize()
                copy = v * h * 2 if master else 0  # the bf16 weight every method holds under autocast
                row["extra_mib"] = (torch.cuda.max_memory_allocated() - base - grads - copy) / MiB
                runs[name] = (run, row)
                rows.append(row)
            for _ in range(args.rounds):
                for run, row in runs.values():
                    row["times"].append(triton.testing.do_bench(run, warmup=25, rep=args.rep, return_mode="median"))
            for run, row in runs.values():
                row["ms"] = statistics.median(row["times"])
                print(json.dumps(row), flush=True)
            del runs, leaf_h, leaf_w, hidden, weight, targets, ref_dx, ref_dw
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=gpu_name(torch.device("cuda")), versions=versions(), old=args.old, rounds=args.rounds)
    (out / "experiment_hosted.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"\n{meta['gpu']}  {meta['versions']}  medians of {args.rounds} interleaved rounds")
    print(f"{'kind':9} {'dist':7} {'method':18} {'ms':>8} {'x ref':>9} {'extra MiB':>10} {'dX err':>8} {'dW err':>8}")
    for r in rows:
        # the ratio to torch.compile, or for bf16-s4 (no compile) to Liger
        comp = next(c["ms"] for c in rows if (c["kind"], c["dist"]) == (r["kind"], r["dist"])
                    and c["method"] in ("torch-compile", "liger"))
        print(f"{r['kind']:9} {r['dist']:7} {r['method']:18} {r['ms']:8.2f} {r['ms'] / comp:9.3f} "
              f"{r['extra_mib']:10.1f} {r['dx_err']:8.1e} {r['dw_err']:8.1e}")


if __name__ == "__main__":
    main()
