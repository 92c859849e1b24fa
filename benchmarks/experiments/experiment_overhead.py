"""One GPU call: where a step's time goes besides its kernels (the harness/experiment gap in NOTES.md).

    python3 benchmarks/experiments/experiment_overhead.py [--out DIR]

At S1 (bf16, random data as tune.py), per variant (ours at 64 MiB, the default, chunked whole;
torch.compile of plain torch; Liger and Cut Cross-Entropy when installed), the same forward+backward
step measured several ways:
- ``bench``: do_bench median, 1 s of repetitions (the L2 cleared before each, as the harness);
- ``first``: one step after 3 s idle (the GPU's clock and power budget recovered);
- ``loop``: 40 steps back to back between two events, per step (the regime of a training loop, at
  the power cap), and ``after_loop`` one more step right after them;
- ``smi_loop`` / ``smi_idle``: nvidia-smi's SM clock, power and throttle reasons (sampled every
  50 ms in the background) during the loop and around the idle step;
- ``busy``: one step behind a GPU sleep long enough that the CPU runs ahead (pure GPU time);
- ``cpu``: the host time of one step issued behind that sleep (a synchronisation inside the step
  would make it as long as the GPU's);
- ``host_profile``: cProfile of three steps issued behind that sleep (where the host time goes);
- ``kernels``: the profiler's sum over the step's kernels, and its largest idle gaps between kernels
  with the kernel that follows each.
Writes experiment_overhead.json under --out and prints a table last.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: tune.py, bench.py
from fused_linear_ce import fused_linear_cross_entropy  # noqa: E402

from experiment_common import MiB, liger_loss  # noqa: E402
from tune import problem  # noqa: E402


def events_ms(run):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def profile(run):
    """(sum of kernel ms, the 6 largest gaps between consecutive kernels as (ms, next kernel))."""
    from torch.profiler import ProfilerActivity, profile as prof_ctx

    with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    kernels = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type.name == "CUDA"), key=lambda k: k[0])
    total = sum(end - start for start, end, _ in kernels) / 1e3
    gaps = [((b[0] - a[1]) / 1e3, b[2][:40]) for a, b in zip(kernels, kernels[1:])]
    span = (kernels[-1][1] - kernels[0][0]) / 1e3 if kernels else 0.0
    return total, span, sorted(gaps, reverse=True)[:6]


def host_profile(step, top=25):
    """cProfile of three steps issued behind a GPU sleep (host time only), the ``top`` functions by
    their own time, as text lines."""
    import cProfile
    import io
    import pstats

    torch.cuda._sleep(2_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        step()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue().splitlines()


class Clocks:
    """nvidia-smi sampled every 50 ms in the background: SM clock (MHz), power (W), throttle reasons."""

    def __init__(self, path):
        self.path = path
        query = "timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active"
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                      "-lms", "50"], stdout=open(path, "w"), stderr=subprocess.DEVNULL)

    def between(self, t0, t1):
        """Mean SM clock, mean power and the throttle reasons seen in the samples taken in [t0, t1]."""
        import datetime

        clocks, power, reasons = [], [], set()
        for line in Path(self.path).read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            try:
                t = datetime.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except ValueError:
                continue
            if t0 <= t <= t1:
                clocks.append(float(parts[1]))
                power.append(float(parts[2]))
                reasons.add(parts[4])
        mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
        return dict(sm_mhz=mean(clocks), watts=mean(power), samples=len(clocks), reasons=sorted(reasons))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    n, h, v = 8192, 4096, 128256
    hidden, weight, targets = problem(n, h, v)
    variants = {
        "64M": lambda hd, wd: fused_linear_cross_entropy(hd, wd, targets, strategy="recompute", chunk_bytes=64 * MiB),
        "default": lambda hd, wd: fused_linear_cross_entropy(hd, wd, targets),
        "chunked-whole": lambda hd, wd: fused_linear_cross_entropy(hd, wd, targets, strategy="chunked",
                                                                   chunk_bytes=1 << 50),
    }
    compiled = torch.compile(lambda hd, wd: torch.nn.functional.cross_entropy((hd @ wd.T).float(), targets),
                             dynamic=False)
    variants["torch-compile"] = compiled
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        variants["cce"] = lambda hd, wd: cce(hd, wd, targets)
    except Exception:  # an optional oracle
        pass
    if liger_loss(targets) is not None:
        variants["liger"] = liger_loss(targets)
    rows = []
    clocks = Clocks(str(Path(args.out) / "nvidia_smi.csv"))
    for name, fn in variants.items():
        def step(fn=fn):
            hd = hidden.detach().requires_grad_(True)
            wd = weight.detach().requires_grad_(True)
            fn(hd, wd).backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        row = dict(name=name)
        row["bench"] = triton.testing.do_bench(step, warmup=100, rep=1000)
        time.sleep(3)  # idle: the clocks and power come back
        t0 = time.time()
        row["first"] = events_ms(step)
        row["loop"] = events_ms(lambda: [step() for _ in range(40)]) / 40
        row["after_loop"] = events_ms(step)
        row["smi_loop"] = clocks.between(t0, time.time())
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the CPU runs ahead of the step
        t0 = time.perf_counter()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        row["cpu"] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        row["busy"] = start.elapsed_time(end)
        row["smi_idle"] = clocks.between(time.time() - 0.5, time.time())
        row["kernels"], row["span"], row["gaps"] = profile(step)
        row["host_profile"] = host_profile(step)
        rows.append(row)
        print(row, flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "experiment_overhead.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    clocks.proc.terminate()
    print(f"\n{meta}\n{'variant':14s} {'bench':>7s} {'first':>7s} {'loop':>7s} {'after':>7s} {'busy':>7s} {'cpu':>7s} "
          f"{'kernels':>8s} {'MHz':>6s} {'W':>5s}  throttle reasons (loop)")
    for r in rows:
        smi = r["smi_loop"]
        print(f"{r['name']:14s} {r['bench']:7.2f} {r['first']:7.2f} {r['loop']:7.2f} {r['after_loop']:7.2f} "
              f"{r['busy']:7.2f} "
              f"{r['cpu']:7.2f} {r['kernels']:8.2f} {smi['sm_mhz']:6.0f} {smi['watts']:5.0f}  {smi['reasons']}")


if __name__ == "__main__":
    main()
