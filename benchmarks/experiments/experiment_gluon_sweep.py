"""Issue 22 target 4 (and issue 21's forward-only target): can the sweep's softmax epilogue overlap
the next tile's products in Triton 3.6? One GPU call.

Prediction: the package's sweep (Triton, one tile's products then its epilogue, in one instruction
stream) costs 1.10-1.25x one cuBLAS matmul of the same shape (S3, H = 2048: 1.24x). The ping-pong
sweep of ``gluon_pingpong.py`` (two consumer warpgroups taking turns on the tensor cores, a loader
warp, written in Gluon) hides the epilogue under the other consumer's products: within ~1.05x of
cuBLAS at S1-S3.

Each shape runs in a child process (a deadlocked variant costs that child's timeout, not the call);
each variant is first checked against a float64 reference on a small ragged shape, then on the
shape's first rows, then timed (do_bench median, the kernel plus the merge of its splits).

    python3 benchmarks/experiments/experiment_gluon_sweep.py --out $OUT/gluon
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch-ext"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import SHAPES, versions  # noqa: E402 - before triton: sets TRITON_INTERPRET=1 without a GPU
from experiment_common import timed  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

VARIANTS = {  # name: gluon_pingpong.lse_stats keywords (splits: None = plan.vocab_splits)
    "pp 64x256 s4": dict(block_n=64, block_v=256, stages=4),
    "pp 64x256 s4 products only": dict(block_n=64, block_v=256, stages=4, epilogue=0),
    "pp 64x256 s4 lse only": dict(block_n=64, block_v=256, stages=4, epilogue=1),
    "pp 64x256 s4 metrics": dict(block_n=64, block_v=256, stages=4, metrics=True),
    "pp 64x256 s3 2 splits": dict(block_n=64, block_v=256, stages=3, splits=2),
    "pp 128x128 s4": dict(block_n=128, block_v=128, stages=4),
}
POWER = ("cuBLAS matmul (bf16 out)", "package forward (log_probs, no grad)", "pp 64x256 s4",
         "pp 64x256 s4 products only", "pp 64x256 s4 metrics")


def clocks(fn, seconds=1.5):
    """Median SM clock (MHz) and power (W) that nvidia-smi samples while ``fn`` runs back to back."""
    import time

    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                            "-lms", "50"], stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    smi.terminate()
    samples = [tuple(float(x) for x in line.split(",")) for line in smi.communicate()[0].splitlines()
               if line.count(",") == 1]
    samples = samples[len(samples) // 4:] or samples  # past the ramp
    mid = sorted(samples)[len(samples) // 2] if samples else (float("nan"), float("nan"))
    power = sorted(p for _, p in samples)[len(samples) // 2] if samples else float("nan")
    return mid[0], power


def reference(hidden, weight, targets, rows):
    """float64 (lse, target logit, entropy, argmax) of ``rows``."""
    z = hidden[rows].double() @ weight.double().T
    lse = torch.logsumexp(z, dim=1)
    p = torch.exp(z - lse[:, None])
    return lse, z.gather(1, targets[rows, None])[:, 0], lse - (p * z).sum(dim=1), z.argmax(dim=1)


def errors(stats, hidden, weight, targets, rows):
    """Max abs errors of lse and the target logit (and entropy, and the share of argmax mismatches
    with metrics) against float64."""
    import gluon_pingpong as gp

    got = gp.merge(stats)
    want = reference(hidden, weight, targets, rows)
    errs = [float((g[rows].double() - w).abs().max()) for g, w in zip(got[:3], want[:3])]
    if len(got) == 4:
        errs.append(float((got[3][rows] != want[3]).double().mean()))
    return errs


def child(shape, out):
    import gluon_pingpong as gp
    from tune import problem

    from fused_linear_ce import fused_linear_logprobs, plan

    def emit(**row):
        print("ROW " + json.dumps(row), flush=True)

    n, h, v = SHAPES[shape]
    # The small ragged check first: a deadlock or a wrong barrier shows up here, in a second.
    torch.manual_seed(0)
    sh, sw = torch.randn(300, 320, device="cuda").bfloat16(), torch.randn(1000, 320, device="cuda").bfloat16()
    st = torch.randint(0, 1000, (300,), device="cuda")
    hidden, weight, targets = problem(n, h, v)
    rows = torch.arange(256, device="cuda")
    n_tiles = lambda bv: triton.cdiv(v, bv)  # noqa: E731

    mm = timed(lambda: hidden @ weight.T)
    emit(shape=shape, method="cuBLAS matmul (bf16 out)", ms=mm, clock=clocks(lambda: hidden @ weight.T))
    ref = lambda: fused_linear_logprobs(hidden, weight, targets)  # noqa: E731
    with torch.no_grad():
        lp = ref()["log_probs"]
        lse_ref, zt_ref = reference(hidden, weight, targets, rows)[:2]
        pkg_err = float((lp[rows].double() - (zt_ref - lse_ref)).abs().max())
        emit(shape=shape, method="package forward (log_probs, no grad)", ms=timed(lambda: ref()), err=pkg_err,
             clock=clocks(ref))
        sft = lambda: fused_linear_logprobs(hidden, weight, targets, outputs=("log_probs", "entropy", "is_top1"))  # noqa: E731
        emit(shape=shape, method="package forward (+ entropy, is_top1)", ms=timed(sft))
    for name, kw in VARIANTS.items():
        try:
            kw = dict(kw)
            splits = kw.pop("splits", None) or plan.vocab_splits(
                triton.cdiv(n, kw["block_n"]), n_tiles(kw["block_v"]), hidden.device)
            small = [errors(gp.lse_stats(sh, sw, st, splits=s, **kw), sh, sw, st, torch.arange(300, device="cuda"))
                     for s in (1, 3)]
            stats = gp.lse_stats(hidden, weight, targets, splits=splits, **kw)
            big = errors(stats, hidden, weight, targets, rows)
            ms = timed(lambda: gp.merge(gp.lse_stats(hidden, weight, targets, splits=splits, **kw)))
            merge_ms = timed(lambda: gp.merge(stats))
            run = lambda: gp.lse_stats(hidden, weight, targets, splits=splits, **kw)  # noqa: E731
            extra = dict(clock=clocks(run)) if name in POWER else {}
            emit(shape=shape, method=name, ms=ms, merge_ms=merge_ms, splits=splits, errs=big, **extra,
                 err=max(big[:3]), small_err=max(max(e) for e in small))
        except Exception as exc:  # a compile or launch error: a row, not the end of the run
            emit(shape=shape, method=name, error=f"{type(exc).__name__}: {str(exc)[-1500:]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="S1,S3,S2")
    ap.add_argument("--out", default=".")
    ap.add_argument("--child", default=None)
    ap.add_argument("--timeout", type=int, default=150)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.out)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, log = [], []
    for shape in args.shapes.split(","):
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", shape, "--out", str(out)],
                                  capture_output=True, text=True, timeout=args.timeout)
            text, status = proc.stdout + proc.stderr, f"rc {proc.returncode}"
        except subprocess.TimeoutExpired as exc:
            text = (exc.stdout or b"").decode() + (exc.stderr or b"").decode() if isinstance(exc.stdout, bytes) \
                else (exc.stdout or "") + (exc.stderr or "")
            status = f"timed out after {args.timeout} s"
        log.append(f"== {shape}: {status}\n{text}")
        rows += [json.loads(line[4:]) for line in text.splitlines() if line.startswith("ROW ")]
        print(f"{shape}: {status}", flush=True)
    (out / "run.log").write_text("\n".join(log))
    (out / "experiment_gluon_sweep.json").write_text(json.dumps(dict(meta=versions(), rows=rows), indent=1))
    mm = {r["shape"]: r["ms"] for r in rows if r["method"].startswith("cuBLAS")}
    print(f"{'shape':5} {'method':42} {'ms':>7} {'x mm':>5} {'err':>8} {'small':>8}  note")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:5} {r['method']:42} {r['error']}")
            continue
        ratio = r["ms"] / mm[r["shape"]] if r["shape"] in mm else float("nan")
        note = f"merge {r['merge_ms']:.2f} ms, {r['splits']} splits" if "merge_ms" in r else ""
        if "clock" in r:
            note += f"  {r['clock'][0]:.0f} MHz {r['clock'][1]:.0f} W"
        print(f"{r['shape']:5} {r['method']:42} {r['ms']:7.2f} {ratio:5.2f} {r.get('err', float('nan')):8.1e} "
              f"{r.get('small_err', float('nan')):8.1e}  {note}")


if __name__ == "__main__":
    main()
