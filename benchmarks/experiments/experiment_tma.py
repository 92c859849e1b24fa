"""One GPU call: the logit tiles' operands through TMA tensor descriptors, on and off (v11 in NOTES.md).

    python3 benchmarks/experiments/experiment_tma.py [--shapes S1 S3] [--out DIR]

``experiment_sweep.py`` found a reduced copy of the sweep 10% faster with TMA descriptors; this
measures the package itself with ``TileConfig.tma`` on and off (pointer loads) for every sweep
config, per shape (bf16, tune.py's random data): the evaluation forward (no grad), and forward+backward at the
default 256 MiB, at 64 MiB and chunked whole, each checked against an fp32 reference. On and off
alternate, in two rounds. Also fp32 (a small shape, TF32 off), where TMA measured slower: the
shipped fp32 config keeps pointer loads since (``configs._GPU_SWEEP_FP32``).
Prints a table last; writes experiment_tma.json under --out.
"""

import dataclasses
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce import configs, fused_linear_cross_entropy  # noqa: E402

from experiment_common import MiB, measured_row, parse_args, problems, write_results  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S2": (8192, 2304, 256000), "S3": (16384, 2048, 151936),
          "fp32": (2048, 1024, 32000)}
CONFIGS = ("_GPU_SWEEP", "_GPU_SWEEP_FP32", "_GPU_CHUNKED_SWEEP")
SHIPPED = {name: getattr(configs, name) for name in CONFIGS}


def set_tma(on):
    for name in CONFIGS:
        setattr(configs, name, dataclasses.replace(SHIPPED[name], tma=on))


def main():
    args = parse_args(["S1", "S3", "fp32"])
    rows = []
    for shape, (hidden, weight, targets, ref, grads_bytes, step, _liger) in problems(SHAPES, args.shapes):
        if shape == "fp32":
            hidden, weight = hidden.float(), weight.float()
            from experiment_common import make_step, reference
            ref, step = reference(hidden, weight, targets), make_step(hidden, weight)
            grads_bytes *= 2
        settings = {"256M": dict(strategy="recompute", chunk_bytes=256 * MiB),
                    "64M": dict(strategy="recompute", chunk_bytes=64 * MiB),
                    "chunked-whole": dict(strategy="chunked", chunk_bytes=1 << 50)}
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=100)

        def evaluate():
            with torch.no_grad():
                return fused_linear_cross_entropy(hidden, weight, targets)

        for rnd in range(2):
            for on in (True, False):
                set_tma(on)
                tag = "tma" if on else "ptr"
                ms = triton.testing.do_bench(evaluate, warmup=10, rep=100)
                rows.append(dict(shape=shape, name=f"eval-{tag}", round=rnd, ms=ms, matmul_ms=mm))
                print(rows[-1], flush=True)
                for setting, kwargs in settings.items():
                    def fn(hd, wd, kwargs=kwargs):
                        return fused_linear_cross_entropy(hd, wd, targets, **kwargs)

                    rows.append(measured_row(step, fn, ref, grads_bytes, shape=shape, name=f"{setting}-{tag}",
                                             round=rnd, matmul_ms=mm))
                    print(rows[-1], flush=True)
        set_tma(True)
        torch.cuda.empty_cache()
    write_results(args.out, "experiment_tma.json", rows)


if __name__ == "__main__":
    main()
