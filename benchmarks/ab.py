"""Side by side: this package against copies of other commits, in one process, interleaved.

    mkdir -p .ab/base && git archive <commit> torch-ext/fused_linear_ce | tar -x -C .ab/base --strip-components=1
    python3 benchmarks/ab.py --variants base=.ab/base/fused_linear_ce [--shapes S1] [--dists random peaked]
        [--settings eval default 64M none chunked-whole] [--rounds 3] [--out DIR]

What a refactor or a fix must show: the same times within noise, and the same errors. Per shape and
data distribution (bench.py's ``make_data``, bf16) and setting, each package's fwd+bwd time (the
evaluation forward alone for ``eval``) as the median of ``--rounds`` interleaved rounds of
``triton.testing.do_bench`` medians, its extra peak memory, and its dX / dW errors against bench.py's
fp32-logit reference (mean loss; ``none`` is the per-row loss summed over the counted rows).
Settings: ``eval`` (no_grad forward), ``default`` (the default budget), ``64M`` (recompute path,
64 MiB), ``none`` (reduction="none", the per-row upstream gradient path), ``chunked-whole``
(chunked path in one chunk), ``sft-chunked`` / ``grpo-chunked`` (the same in one chunk), ``chunked-256M``, ``chunked-960M``, ``chunked-1G``, ``auto-1.25G`` ("auto" with
``chunk_bytes=1280 << 20``: at S4 the chunked path in 4096-row chunks with a 4-bit remainder), ``master`` / ``master-448M`` / ``master-recompute``
(fp32 hidden and weight under ``torch.autocast(bfloat16)``: an fp32 master weight), ``sft`` and ``grpo`` (``fused_linear_logprobs`` with
``bench_logprobs.py``'s outputs; sft's loss is the mean NLL, so its errors are against the same
reference; grpo's errors are against that reference too and only compare packages with each other).
``softcap-bias`` / ``softcap-bias-chunked`` (Gemma-2-like: ``softcap=30`` and a bias, at the default budget
and on the chunked path in one chunk; their errors, dB's too, against an fp32 reference of that loss).
``--liger`` adds Liger's loss (to every plain-loss setting's block, interleaved with it) as the
issue's reference point.
Prints a table last; writes ab.json under --out.
"""

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "torch-ext"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench import SHAPES, gpu_name, make_data, reference_and_stats, reference_gradients, rel, versions  # noqa: E402
from bench_logprobs import WORKLOADS, workload_loss  # noqa: E402

import fused_linear_ce  # noqa: E402

MiB = 1 << 20
GEMMA_SOFTCAP = 30.0  # Gemma-2's final logit softcap
SETTINGS = {
    "eval": None,
    "default": dict(),
    "64M": dict(strategy="recompute", chunk_bytes=64 * MiB),
    "none": dict(reduction="none"),
    "chunked-whole": dict(strategy="chunked", chunk_bytes=1 << 50),
    # per-token (fused_linear_logprobs), bench_logprobs.py's workloads at the default budget
    "sft": dict(outputs=WORKLOADS["sft"][0]),
    "grpo": dict(outputs=WORKLOADS["grpo"][0]),
    "sft-chunked": dict(outputs=WORKLOADS["sft"][0], strategy="chunked", chunk_bytes=1 << 50),
    "grpo-chunked": dict(outputs=WORKLOADS["grpo"][0], strategy="chunked", chunk_bytes=1 << 50),
    "chunked-256M": dict(strategy="chunked", chunk_bytes=256 * MiB),
    "auto-1.25G": dict(chunk_bytes=1280 * MiB),  # at long context the chunked path, bf16 + 4-bit pair
    "chunked-960M": dict(strategy="chunked", chunk_bytes=960 * MiB),
    "chunked-1G": dict(strategy="chunked", chunk_bytes=1024 * MiB),
    # an fp32 weight and fp32 hidden states under torch.autocast(bfloat16): a master weight
    "master": dict(),
    "master-448M": dict(chunk_bytes=448 * MiB),
    "master-recompute": dict(strategy="recompute"),
    # Gemma-2-like: a softcapped loss with a bias (the chunked sweep's epilogue tiles differ for it)
    "softcap-bias": dict(softcap=GEMMA_SOFTCAP),
    "softcap-bias-chunked": dict(softcap=GEMMA_SOFTCAP, strategy="chunked", chunk_bytes=1 << 50),
}
MASTER = ("master", "master-448M", "master-recompute")
SOFTCAP_BIAS = ("softcap-bias", "softcap-bias-chunked")


def make_bias(weight):
    """The bias of the softcap-bias settings: fixed, of the order of trained lm-head biases."""
    g = torch.Generator(weight.device).manual_seed(2)
    return (0.1 * torch.randn(weight.shape[0], generator=g, device=weight.device)).to(weight.dtype)


def load_copy(name, path):
    """The package at ``path`` imported as ``fused_linear_ce_<name>`` (its own custom-op namespace)."""
    full = f"fused_linear_ce_{name}"
    spec = importlib.util.spec_from_file_location(full, Path(path) / "__init__.py",
                                                  submodule_search_locations=[str(path)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    spec.loader.exec_module(module)
    return module


class Liger:
    """Liger's fused loss (bf16 grad_weight summed across its chunks) as a package with this one's
    call, for ``--liger``: it runs in the plain loss settings' blocks (``LIGER_SETTINGS``), its own way."""

    def __init__(self):
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        self.fn = liger_fused_linear_cross_entropy

    def fused_linear_cross_entropy(self, hidden, weight, targets, **kwargs):
        out = self.fn(hidden, weight, targets)
        return out[0] if isinstance(out, (tuple, list)) else out


# Liger ignores the settings (its own chunks): it runs in every plain-loss block, so each of ours has
# it interleaved in the same rounds.
LIGER_SETTINGS = ("default", "64M", "chunked-whole", "chunked-256M", "auto-1.25G", "chunked-960M", "chunked-1G")


def runner(package, setting, hidden, weight, targets):
    """A zero-argument callable: one forward (+ backward) of ``package`` under ``setting``."""
    if setting == "eval":
        def run():
            with torch.no_grad():
                package.fused_linear_cross_entropy(hidden, weight, targets)
        return run, None, None
    h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    kwargs = SETTINGS[setting]
    if setting in SOFTCAP_BIAS:
        b = make_bias(weight).requires_grad_(True)

        def run():
            h.grad = w.grad = b.grad = None
            package.fused_linear_cross_entropy(h, w, targets, bias=b, **kwargs).backward()

        run.bias = b
        return run, h, w
    if setting in MASTER:
        h, w = hidden.float().requires_grad_(True), weight.float().requires_grad_(True)

        def run():
            h.grad = w.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = package.fused_linear_cross_entropy(h, w, targets, **kwargs)
            loss.backward()

        return run, h, w
    counted = (targets != -100).sum()
    workload = setting.split("-")[0]  # sft-chunked: the sft workload
    if workload in ("sft", "grpo"):  # bench_logprobs.py's losses: sft the mean NLL (make_data ignores no row)
        adv = torch.randn(targets.shape, generator=torch.Generator(targets.device).manual_seed(1),
                          device=targets.device)

        def run():
            h.grad = w.grad = None
            workload_loss(workload, package.fused_linear_logprobs(h, w, targets, **kwargs), adv).backward()

        return run, h, w

    def run():
        h.grad = w.grad = None
        loss = package.fused_linear_cross_entropy(h, w, targets, **kwargs)
        if loss.ndim:
            loss = loss.sum() / counted
        loss.backward()

    return run, h, w


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="*", default=[], help="NAME=PATH of other copies of the package")
    ap.add_argument("--shapes", nargs="+", default=["S1"], choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--dists", nargs="+", default=["random", "peaked"])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--liger", action="store_true", help="also Liger's loss, in every plain-loss setting's block")
    ap.add_argument("--out", default="benchmarks/results/ab")
    args = ap.parse_args()
    device = torch.device("cuda")
    packages = {"new": fused_linear_ce}
    for spec in args.variants:
        name, path = spec.split("=", 1)
        packages[name] = load_copy(name, path)
    if args.liger:
        packages["liger"] = Liger()
    rows = []
    for shape in args.shapes:
        n, h, v = SHAPES[shape]
        for dist in args.dists:
            hidden, weight, targets = make_data(n, h, v, dist, device, seed=0)
            _, ref_dx, ref_dw, _ = reference_and_stats(hidden, weight, targets, "tf32")
            capped = None  # (dX, dW, dB) of the softcap-bias loss, computed when a setting needs it
            for setting in args.settings:
                runs = {}
                for name, package in packages.items():
                    if name == "liger" and setting not in LIGER_SETTINGS:
                        continue
                    run, hl, wl = runner(package, setting, hidden, weight, targets)
                    run()  # compile, tune, warm
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    run()
                    torch.cuda.synchronize()
                    row = dict(shape=shape, dist=dist, setting=setting, package=name,
                               extra_mib=(torch.cuda.max_memory_allocated() - base) / MiB, times=[])
                    if setting in SOFTCAP_BIAS:
                        if capped is None:
                            _, *capped = reference_gradients(hidden, weight, targets, "tf32", run.bias,
                                                             softcap=GEMMA_SOFTCAP)
                        row.update(dx_err=rel(hl.grad, capped[0]), dw_err=rel(wl.grad, capped[1]),
                                   db_err=rel(run.bias.grad, capped[2]))
                    elif hl is not None:
                        row.update(dx_err=rel(hl.grad, ref_dx), dw_err=rel(wl.grad, ref_dw))
                    runs[name] = (run, row)
                    rows.append(row)
                for _ in range(args.rounds):  # interleaved: drift in clocks or heat hits every package alike
                    for name, (run, row) in runs.items():
                        row["times"].append(triton.testing.do_bench(run, warmup=25, rep=400, return_mode="median"))
                for run, row in runs.values():
                    row["ms"] = statistics.median(row["times"])
                    print(json.dumps(row), flush=True)
                del runs
            del hidden, weight, targets, ref_dx, ref_dw, capped
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(gpu=gpu_name(device), versions=versions(), date=time.strftime("%Y-%m-%d"),
                variants=dict(v.split("=", 1) for v in args.variants), rounds=args.rounds)
    (out / "ab.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    names = [n for n in packages if n != "liger"]
    print(f"\n{meta['gpu']}  {meta['versions']}  medians of {args.rounds} interleaved rounds (ms)")
    print(f"{'shape':5} {'dist':7} {'setting':14}" + "".join(f" {n + ' ms':>10} {n + ' MiB':>9} {n + ' dX':>8}"
                                                              for n in names) + "   new/" + names[-1])
    for shape in args.shapes:
        for dist in args.dists:
            for setting in args.settings:
                cells = {r["package"]: r for r in rows
                         if (r["shape"], r["dist"], r["setting"]) == (shape, dist, setting)}
                line = f"{shape:5} {dist:7} {setting:14}"
                for n in names:
                    r = cells[n]
                    line += f" {r['ms']:10.2f} {r['extra_mib']:9.0f} {r.get('dx_err', float('nan')):8.1e}"
                line += f"   {cells['new']['ms'] / cells[names[-1]]['ms']:.3f}"
                if "liger" in cells:
                    line += (f"   liger {cells['liger']['ms']:.2f} ms {cells['liger']['extra_mib']:.0f} MiB"
                             f"  new/liger {cells['new']['ms'] / cells['liger']['ms']:.3f}")
                print(line)


if __name__ == "__main__":
    main()
