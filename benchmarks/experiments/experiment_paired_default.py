"""Two questions for one GPU call (issue 21's S1-S3 memory target, and the per-token master weight),
side by side in one process:

- ``paired``: should the recompute backward's default below long context be the paired plan
  (grad_hidden summed as bf16 + an int8 N x H remainder, one pass of vocabulary blocks) in a smaller
  budget, instead of today's fp32 N x H accumulator in 256 MiB? The target: at S1-S3 no slower than
  TRL's head at <= 1/8 of its extra memory (S3: TRL 1572 MiB, so <= 196 MiB; ours 260 today). Per
  bf16 shape and workload (``loss``: ``fused_linear_cross_entropy``, mean; ``sft`` and ``grpo``:
  ``bench_logprobs``' per-token workloads), the variants
    default            the planner as shipped
    paired-<B>         the paired plan forced within B bytes (the int8 remainder and the da block)
    borrowed-<B>       the accumulator in grad_weight's own memory (V >= 2N), da blocks of B bytes
    trl                TRL's head (per-token workloads; as a black box)
  Prediction: per vocabulary block the pair moves 3 bytes an element of N x H each way, the fp32
  accumulator 4, and the paired blocks are as long; so paired-192M should be within noise of the
  default at S1-S3, at 3/4 of its memory.
- ``budget``: the per-token path at S4 in larger budgets (``chunk_bytes`` 1-3 GiB: one pass with an
  fp32 N x H accumulator of 1 GiB and da blocks of the rest) against the default (the paired plan in
  512 MiB) and TRL's head (3.3 GiB). Prediction: at 2 GiB, 16 vocabulary blocks, the accumulator's
  traffic ~7 ms, so ~4.2 matmul-times (~440 ms): TRL's time within its memory, as a setting.
- ``master``: an fp32 lm-head weight under ``torch.autocast(bfloat16)`` (TRL's trainers with
  ``bf16=True`` on an fp32 model) on the per-token path: ours keeping the weight fp32 into the op,
  ours casting first (before), and TRL's head (which casts). ``extra_mib`` is above the inputs and
  the fp32 gradients, so a bf16 weight copy held from the forward to the backward shows in it.

Errors: ``bench_logprobs``' float64 references of the bf16-rounded operands (per-token) and
``bench``'s fp32-logit reference (loss). Times: ``bench``'s (do_bench, or by hand for slow calls).

    python3 benchmarks/experiments/experiment_paired_default.py --out $OUT/paired          # GPU
    python3 benchmarks/experiments/experiment_paired_default.py --tiny --budgets 40K,30K   # CPU smoke
"""

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: bench, bench_logprobs
import bench  # noqa: E402 - sets TRITON_INTERPRET on CPU and puts torch-ext on the path
import bench_logprobs as lp_bench  # noqa: E402

from fused_linear_ce import fused_linear_cross_entropy, fused_linear_logprobs  # noqa: E402
from fused_linear_ce import plan  # noqa: E402

MiB = 1 << 20


def parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


@contextlib.contextmanager
def forced_plan(kind, budget):
    """Within the block: the recompute backward's planner answers ``kind`` ("paired" or "borrowed")
    for a call that may take it, within ``budget`` bytes; every other call as shipped. Yields the
    list of the plans it forced (a row whose list stays empty measured the shipped planner)."""
    original = plan.plan_passes
    taken = []

    def forced(n, v, h, dtype, chunk_bytes, block_n, block_v, need_rows, need_dw, **kw):
        if need_rows and need_dw and dtype == torch.bfloat16:
            if kind == "paired" and kw.get("may_pair"):
                cols = (max(0, budget - n * h) // 2 // n) // block_v * block_v
                if cols >= block_v:
                    taken.append(plan.BackwardPlan(n, cols, True, False, paired=True))
                    return (taken[-1],)
            if kind == "borrowed" and plan.borrows_weight_grad(n, v, dtype):
                cols = (budget // 2 // n) // block_v * block_v
                if cols >= block_v:
                    taken.append(plan.BackwardPlan(n, cols, True, False, borrowed=True))
                    return (taken[-1],)
        return original(n, v, h, dtype, chunk_bytes, block_n, block_v, need_rows, need_dw, **kw)

    plan.plan_passes = forced
    try:
        yield taken
    finally:
        plan.plan_passes = original


def per_token_variants(budgets, with_trl):
    """The default call, the recompute path with each forced plan (``measure_variants``), TRL's head."""
    out = {"default": lp_bench.ours(fused_linear_logprobs)}
    recompute = lp_bench.ours(fused_linear_logprobs, strategy="recompute")
    for b in budgets:
        for kind in ("paired", "borrowed"):
            out[f"{kind}-{b}"] = (recompute, (kind, parse_bytes(b)))
    if with_trl is not None:
        out["trl"] = lp_bench.trl_head(with_trl)
    return out


def trl_function():
    try:
        from trl.kernels import ChunkedLogProbFunction
        return ChunkedLogProbFunction
    except Exception:  # noqa: BLE001 - an optional oracle
        return None


def timed_forced(kind, budget, measure, *args):
    """``measure(*args)`` with the planner forced for the whole row (warm-up, memory, timing), and
    the forced plan's block columns (None when the planner was not forced)."""
    with forced_plan(kind, budget) as taken:
        got = measure(*args)
    return got, (taken[0].cols if taken else None)


def record_row(rows, t0, row):
    rows.append(row)
    shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())
    print(f"[{time.perf_counter() - t0:5.0f}s] {shown}", flush=True)


def per_token_data(shape, dist, device):
    """bf16 inputs of ``shape``, the GRPO advantages and ``bench_logprobs``' float64 references."""
    n, h, v = lp_bench.SHAPES[shape]
    hidden, weight, targets = bench.make_data(n, h, v, dist, device, 0)
    adv = torch.randn(n, generator=torch.Generator(device=device).manual_seed(1), device=device)
    ref, _ = lp_bench.reference(hidden, weight, targets, adv)
    return hidden, weight, targets, adv, ref


def measure_variants(labels, variants, hidden, weight, targets, adv, ref, args, rows, t0):
    """One ``bench_logprobs.measure`` row per workload and variant (an exception is a row's error).
    A variant is a call, or (call, (kind, budget)): the call with the planner forced for the whole
    row (``timed_forced``)."""
    for workload in args.workloads:
        for name, fn in variants.items():
            row = dict(labels, workload=workload, method=name)
            try:
                if isinstance(fn, tuple):
                    got, row["forced_cols"] = timed_forced(*fn[1], lp_bench.measure, fn[0], workload, hidden, weight,
                                                           targets, adv, ref, args.quick)
                else:
                    got = lp_bench.measure(fn, workload, hidden, weight, targets, adv, ref, args.quick)
                row.update(got)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            record_row(rows, t0, row)
            lp_bench.free_memory(hidden.device)


def paired_part(shape, dist, device, args, rows, t0, trl):
    hidden, weight, targets, adv, token_ref = per_token_data(shape, dist, device)
    labels = dict(part="paired", shape=shape, dist=dist)
    # The loss.
    ref = bench.reference_and_stats(hidden, weight, targets, "ieee")[:3]
    # The forced plans are the recompute path's: strategy="recompute", which "auto" takes at S1-S3 too
    # (their N x V gradient passes 256 MiB); "default" is the call as a user makes it.
    loss_fn = lambda hd, wd, t: fused_linear_cross_entropy(hd, wd, t)  # noqa: E731
    recompute_fn = lambda hd, wd, t: fused_linear_cross_entropy(hd, wd, t, strategy="recompute")  # noqa: E731
    loss_variants = {"default": None, **{f"{k}-{b}": (k, parse_bytes(b)) for b in args.budgets
                                         for k in ("paired", "borrowed")}}
    for name, force in loss_variants.items():
        row = dict(labels, workload="loss", method=name)
        try:
            if force is None:
                got, _ = bench.measure(loss_fn, hidden, weight, targets, ref, args.quick)
            else:
                (got, _), row["forced_cols"] = timed_forced(*force, bench.measure, recompute_fn, hidden, weight,
                                                            targets, ref, args.quick)
            row.update(got)
        except Exception as exc:  # a row, not a crash
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        record_row(rows, t0, row)
        lp_bench.free_memory(device)
    del ref
    # The per-token workloads.
    measure_variants(labels, per_token_variants(args.budgets, trl), hidden, weight, targets, adv, token_ref, args,
                     rows, t0)


def budget_part(shape, dist, device, args, rows, t0, trl):
    hidden, weight, targets, adv, ref = per_token_data(shape, dist, device)
    variants = {"default": lp_bench.ours(fused_linear_logprobs)}
    for b in args.large_budgets:
        variants[f"chunk-{b}"] = lp_bench.ours(fused_linear_logprobs, chunk_bytes=parse_bytes(b))
    if trl is not None:
        variants["trl"] = lp_bench.trl_head(trl)
    measure_variants(dict(part="budget", shape=shape, dist=dist), variants, hidden, weight, targets, adv, ref, args,
                     rows, t0)


def autocast(fn, cast_first=False):
    """``fn`` (a bench_logprobs call) under autocast(bf16), the weight cast first when asked."""
    def call(h, w, t, outputs, grad):
        with torch.autocast(h.device.type, dtype=torch.bfloat16):
            return fn(h, w.to(torch.bfloat16) if cast_first else w, t, outputs, grad)
    return call


def master_part(shape, dist, device, args, rows, t0, trl):
    hidden16, weight16, targets, adv, ref = per_token_data(shape, dist, device)
    hidden, weight = hidden16.float(), weight16.float()  # an fp32 model: fp32 states and head
    del hidden16, weight16
    ours = lp_bench.ours(fused_linear_logprobs)
    variants = {"flce-master": autocast(ours), "flce-cast-first": autocast(ours, cast_first=True)}
    if trl is not None:
        variants["trl"] = autocast(lp_bench.trl_head(trl))
    measure_variants(dict(part="master", shape=shape, dist=dist), variants, hidden, weight, targets, adv, ref, args,
                     rows, t0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--paired-shapes", nargs="+", default=["S1", "S2", "S3"])
    ap.add_argument("--master-shapes", nargs="+", default=["S1", "S4"])
    ap.add_argument("--budget-shapes", nargs="+", default=["S4"])
    ap.add_argument("--large-budgets", type=lambda s: s.split(","), default=["1G", "2G", "3G"])
    ap.add_argument("--dists", nargs="+", default=["random"])
    ap.add_argument("--budgets", type=lambda s: s.split(","), default=["256M", "192M", "160M", "128M"])
    ap.add_argument("--workloads", nargs="+", default=["sft", "grpo"])
    ap.add_argument("--parts", nargs="+", default=["paired", "budget", "master"])
    ap.add_argument("--tiny", action="store_true", help="the tiny shape only, on the CPU interpreter")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.tiny:
        args.paired_shapes = args.master_shapes = args.budget_shapes = ["tiny"]
        args.quick = True
    trl = trl_function()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=bench.gpu_name(device), **lp_bench.versions(),
                date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), args=vars(args))
    rows, t0 = [], time.perf_counter()
    parts = {"paired": (paired_part, args.paired_shapes), "budget": (budget_part, args.budget_shapes),
             "master": (master_part, args.master_shapes)}
    for part in args.parts:
        run, shapes = parts[part]
        for shape in shapes:
            for dist in args.dists:
                run(shape, dist, device, args, rows, t0, trl)
                (out_dir / "experiment_paired_default.json").write_text(
                    json.dumps(dict(meta=meta, rows=rows), indent=1))

    print(f"\n{'part':7} {'shape':5} {'dist':7} {'work':5} {'method':16} {'fwd+bwd ms':>10} {'extra MiB':>9} "
          f"{'dX err':>8} {'dW err':>8} {'cols':>6}")
    for r in rows:
        lead = f"{r['part']:7} {r['shape']:5} {r['dist']:7} {r['workload']:5} {r['method']:16}"
        if "error" in r:
            print(f"{lead} {r['error'][:70]}")
            continue
        print(f"{lead} {bench.fmt(r.get('fwdbwd_ms'), '10.2f')} {bench.fmt(r.get('extra_mib'), '9.0f')} "
              f"{bench.fmt(r.get('dx_rel'), '8.1e')} {bench.fmt(r.get('dw_rel'), '8.1e')} "
              f"{r.get('forced_cols', '')!s:>6}")


if __name__ == "__main__":
    main()
