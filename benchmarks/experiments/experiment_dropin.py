"""TRL's drop-in against the per-token function it calls, interleaved (issue 21), one GPU call.

The per-token harness (``bench_logprobs.py``, one round, methods one after another) measured the
drop-in (``fused_linear_ce.ChunkedLogProbFunction.apply``, called as TRL calls its head) 3-7 ms slower
than ``fused_linear_logprobs`` at S1 (8192 x 4096 x 128256) on three of four rows, with the same
budget, plan and outputs; at S3 and S4 the two were within 1 ms. Prediction: the same time within
the spread of single rounds at the power cap (3-6 ms at S1, NOTES v12): the drop-in adds only
Python around the same op. Here both, and TRL's head, run in interleaved rounds (triton's do_bench
medians; the median of the rounds), SFT and GRPO as ``bench_logprobs.py`` defines them.

    python3 benchmarks/experiments/experiment_dropin.py --shapes S1 S3 --rounds 5 --out $OUT/dropin
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402 - sets TRITON_INTERPRET on CPU and puts torch-ext on the path
import bench_logprobs as bl  # noqa: E402
import torch  # noqa: E402
import triton.testing  # noqa: E402

import fused_linear_ce  # noqa: E402


def methods():
    out = {"flce": bl.ours(fused_linear_ce.fused_linear_logprobs),
           "flce-trl": bl.trl_head(fused_linear_ce.ChunkedLogProbFunction)}
    try:
        from trl.kernels import ChunkedLogProbFunction

        out["trl"] = bl.trl_head(ChunkedLogProbFunction)
    except Exception as exc:  # noqa: BLE001 - the peer is optional
        print(f"note: TRL's head not importable ({type(exc).__name__}): its rows are left out", flush=True)
    return out


def step(fn, workload, hidden, weight, targets, adv):
    outputs, _ = bl.WORKLOADS[workload]
    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def run():
        h.grad = w.grad = None
        bl.workload_loss(workload, fn(h, w, targets, outputs, True), adv).backward()

    return run


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["S1", "S3"])
    ap.add_argument("--workloads", nargs="+", default=["sft", "grpo"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    dev = torch.device("cuda")
    rows, t0 = [], time.perf_counter()
    for shape in args.shapes:
        n, hd, v = bench.SHAPES[shape]
        hidden, weight, targets = bench.make_data(n, hd, v, "random", dev, seed=0)
        adv = torch.randn(n, generator=torch.Generator(device=dev).manual_seed(1), device=dev)
        for workload in args.workloads:
            runs = {name: step(fn, workload, hidden, weight, targets, adv) for name, fn in methods().items()}
            for run in runs.values():
                run()  # compile, warm
            times = {name: [] for name in runs}
            for _ in range(args.rounds):
                for name, run in runs.items():
                    times[name].append(triton.testing.do_bench(run, warmup=25, rep=300, return_mode="median"))
            for name, t in times.items():
                rows.append(dict(shape=shape, workload=workload, method=name, ms=statistics.median(t), times=t))
                print(f"[{time.perf_counter() - t0:5.0f}s] {shape} {workload:4} {name:9} "
                      f"{statistics.median(t):8.2f} ms  rounds {' '.join(f'{x:.2f}' for x in t)}", flush=True)
        del hidden, weight, targets, adv
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=torch.cuda.get_device_name(), **bl.versions(), date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                rounds=args.rounds)
    (out / "experiment_dropin.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))


if __name__ == "__main__":
    main()
