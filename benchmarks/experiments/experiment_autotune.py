"""One GPU call: opt-in autotuning at several shapes, what it picks, and what that is worth.

    python3 benchmarks/experiments/experiment_autotune.py [--shapes S1 Q G] [--out DIR]

Per shape (bf16, tune.py's random data): with ``autotune.enable(True)`` one evaluation forward (tunes
the sweep), one fwd+bwd at 64 MiB on the recompute path (the dlogits kernel) and one of the chunked
path in one chunk (the chunked sweep); prints each candidate's time and the choice. Then the same
three settings with the choices against the table's tiles (autotuning off), interleaved in three
rounds (medians), each checked against an fp32 reference. Small-H shapes (Q: Qwen2.5-0.5B's
H=896, V=151936; G: Gemma-3-270M's H=640, V=262144) ask whether the table needs a bucket below the
shapes it was tuned on (S1-S3, H >= 2048). Prints a table last; writes experiment_autotune.json.
"""

import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from experiment_common import (MiB, interleaved, measured_row, median, package_eval, parse_args,  # noqa: E402
                               problems, write_results)
from fused_linear_ce import autotune, fused_linear_cross_entropy  # noqa: E402

SHAPES = {"S1": (8192, 4096, 128256), "S3": (16384, 2048, 151936), "Q": (8192, 896, 151936),
          "G": (8192, 640, 262144)}
SETTINGS = {"64M": dict(strategy="recompute", chunk_bytes=64 * MiB),
            "chunked-whole": dict(strategy="chunked", chunk_bytes=1 << 50)}


def switched(flag, fn):
    def run():
        autotune.enable(flag)
        try:
            return fn()
        finally:
            autotune.enable(False)
    return run


def main():
    args = parse_args(["S1", "Q", "G"])
    rows, choices = [], []
    for shape, (hidden, weight, targets, ref, grads_bytes, step, _liger) in problems(SHAPES, args.shapes):
        mm = triton.testing.do_bench(lambda: hidden @ weight.T, warmup=20, rep=200)
        evaluate = package_eval(hidden, weight, targets)
        fns = {name: (lambda hd, wd, kw=kw: fused_linear_cross_entropy(hd, wd, targets, **kw))
               for name, kw in SETTINGS.items()}
        before = set(autotune.chosen())
        switched(True, evaluate)()
        for fn in fns.values():
            switched(True, lambda fn=fn: step(fn))()
        for key in set(autotune.chosen()) - before:
            timed = autotune.timings()[key]
            choices.append(dict(shape=shape, role=key[0], chosen=repr(autotune.chosen()[key]),
                                candidates=[dict(cfg=repr(c), ms=ms) for c, ms in timed]))
            print(f"{shape} {key[0]}: " + "; ".join(
                f"{c.block_n}x{c.block_v}x{c.block_h} w{c.num_warps} s{c.num_stages} g{c.group_m} r{c.resident} "
                f"{'-' if ms is None else f'{ms:.2f}'}" for c, ms in timed), flush=True)
        runs, labels = {}, {}
        for flag, tag in ((False, "table"), (True, "tuned")):
            runs[f"eval {tag}"], labels[f"eval {tag}"] = switched(flag, evaluate), {}
            for name, fn in fns.items():
                row = switched(flag, lambda fn=fn, name=name: measured_row(step, fn, ref, grads_bytes, name=name))()
                labels[f"{name} {tag}"] = {k: row.get(k) for k in ("dx", "dw", "extra_mib", "error")}
                runs[f"{name} {tag}"] = switched(flag, lambda fn=fn: step(fn))
        times = interleaved(runs, rounds=3, rep=300)
        for key, ts in times.items():
            rows.append(dict(shape=shape, name=key, ms=median(ts), rounds=ts, matmul_ms=mm,
                             **{k: v for k, v in labels[key].items() if v is not None}))
            print(rows[-1], flush=True)
        runs.clear()
        torch.cuda.empty_cache()
    write_results(args.out, "experiment_autotune.json", rows, choices=choices)


if __name__ == "__main__":
    main()
