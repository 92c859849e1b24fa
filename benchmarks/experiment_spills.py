"""One GPU call: this working tree's package against an earlier build of it, side by side (v12 in NOTES.md).

    python3 benchmarks/experiment_spills.py --base DIR [--shapes S1 S3] [--out DIR]

``DIR`` holds an earlier copy of the package as ``fused_linear_ce_base`` (made with
``git archive <rev> torch-ext/fused_linear_ce``, the folder renamed); both are imported into one
process (each registers its own custom ops under its module name). Per shape (bf16, tune.py's random
data): the evaluation forward (no grad), and forward+backward at the default 256 MiB, at 64 MiB and
chunked whole, each checked against an fp32 reference; base and new alternate, in two rounds; at S1
also per-kernel times of one step of each setting. v12 changed, against v11: the Triton matmul's
operands through TMA descriptors, the logit kernels' target comparison in int32 local columns and
no column mask when V is a multiple of the tile (both removed register spills that an offline
sm_90 compile showed), and the chunked sweep's exp(z - m_tile) stored through a descriptor.
Prints a table last; writes experiment_spills.json under --out.
"""

import argparse
import importlib
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from experiment_common import MiB, kernel_times, measured_row, problems, write_results  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936)}
SETTINGS = {"256M": dict(strategy="recompute", chunk_bytes=256 * MiB),
            "64M": dict(strategy="recompute", chunk_bytes=64 * MiB),
            "chunked-whole": dict(strategy="chunked", chunk_bytes=1 << 50)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--shapes", nargs="+", default=["S1", "S3"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    sys.path.insert(0, args.base)
    builds = {"base": importlib.import_module("fused_linear_ce_base").fused_linear_cross_entropy,
              "new": importlib.import_module("fused_linear_ce").fused_linear_cross_entropy}
    rows = []
    for shape, (hidden, weight, targets, ref, grads_bytes, step, _liger) in problems(SHAPES, args.shapes):
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=100)
        rows.append(dict(shape=shape, name="matmul", ms=mm, matmul_ms=mm))
        for rnd in range(2):
            for tag, loss_fn in builds.items():
                def evaluate(loss_fn=loss_fn):
                    with torch.no_grad():
                        return loss_fn(hidden, weight, targets)

                ms = triton.testing.do_bench(evaluate, warmup=10, rep=200)
                rows.append(dict(shape=shape, name=f"eval-{tag}", round=rnd, ms=ms, matmul_ms=mm))
                print(rows[-1], flush=True)
                for setting, kwargs in SETTINGS.items():
                    def fn(hd, wd, kwargs=kwargs, loss_fn=loss_fn):
                        return loss_fn(hd, wd, targets, **kwargs)

                    rows.append(measured_row(step, fn, ref, grads_bytes, shape=shape, name=f"{setting}-{tag}",
                                             round=rnd, matmul_ms=mm))
                    print(rows[-1], flush=True)
        if shape == "S1":
            for tag, loss_fn in builds.items():
                for setting, kwargs in SETTINGS.items():
                    def run(kwargs=kwargs, loss_fn=loss_fn):
                        return step(lambda hd, wd: loss_fn(hd, wd, targets, **kwargs))

                    times = kernel_times(run)
                    rows.append(dict(shape=shape, name=f"kernels {setting}-{tag}", kernels=times))
                    print(f"kernels {setting}-{tag}: " + ", ".join(f"{k} {v:.2f}" for k, v in times.items()),
                          flush=True)
        torch.cuda.empty_cache()
    write_results(args.out, "experiment_spills.json", [r for r in rows if "kernels" not in r],
                  kernels=[r for r in rows if "kernels" in r])


if __name__ == "__main__":
    main()
