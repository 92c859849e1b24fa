"""The distillation harness: the student-teacher divergence of two lm heads, forward + backward, ours
against TRL's head, Liger, torch.compile and the four matmuls alone, side by side in one process.

    python3 benchmarks/bench_distill.py --shapes D1,D2 --betas 1,0.5,0 --rounds 3 --out benchmarks/results/distill
    python3 benchmarks/bench_distill.py --shapes D3 --methods 'flce*,trl,matmul' --out benchmarks/results/distill_d3
    python3 benchmarks/bench_distill.py --shapes D1 --estimate-only          # the time estimate, nothing run
    python3 benchmarks/bench_distill.py --tiny --quick --out /tmp/d          # CPU smoke test (Triton interpreter)
    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json --readme README.md

Per (shape, dist, beta), every method computes loss = the mean over valid tokens of the per-token
divergence (``distill_cases``: beta 0 forward KL, 1 reverse KL, else TRL's generalized JSD) and its
gradient w.r.t. the student's hidden states and head (bf16 on a GPU); ``flce-none`` instead
sum(u * divergence) with ``reduction="none"`` and an arbitrary per-token upstream gradient u. Methods
(``distill_methods``): ``matmul`` (the four products alone: the floor), ``flce`` / ``flce-fast`` /
``flce-none`` (``fused_linear_ce.fused_linear_divergence``: defaults; ``chunk_bytes=1 << 40``; per
token), ``flce-trl`` (``use_in_trl()``, then TRL's ``_chunked_divergence_loss`` called as
``DistillationTrainer`` calls it), ``trl`` (the same call to TRL's own), ``liger``
(``LigerFusedLinearJSD``, ``jsd_beta`` = beta), ``torch-compile`` (the plain loss, ``dynamic=False``) and
``torch`` (the same eager; CPU default, GPU on request). A method that is not installed, fails or runs
out of memory is a row with ``error``; per-(shape, method) skips (``SKIP``) are printed and listed.
TRL's rows (``trl``, ``flce-trl``) need ``trl`` and ``datasets`` importable (``trl.trainer.utils``, which
TRL's divergence head and trainer import, imports ``datasets``). Nothing here uses the network.

Per row: ``fwdbwd_ms``, the median over ``--rounds`` interleaved rounds (every method of the case in
each round, the order rotated per round; a round's figure is the median of ``--reps`` calls, fewer for
calls over ``bench.SLOW_MS``), each round's figure in ``fwdbwd_ms_rounds`` and ``spread`` =
(max - min) / median of them; ``x_floor`` = fwdbwd_ms over the matmul row's; ``extra_mib`` as bench.py
defines it (peak allocated during one step minus what was allocated before it minus the bytes of dX
and dW); ``loss_rel`` / ``dx_rel`` / ``dw_rel`` (relative Frobenius, ``bench.rel``) against
``distill_cases.reference`` (fp32 logits, tf32 matmuls on a GPU; float64 at --tiny), and ``tok_rel``
for the per-token divergence of ``flce-none``. Writes ``<gpu>.json`` under --out after every case and
prints a short table at the end; ``render_distill.py`` writes the markdown.
"""

import argparse
import datetime
import fnmatch
import importlib.metadata
import json
import statistics
import time
from pathlib import Path

import bench  # benchmarks/bench.py: sets TRITON_INTERPRET on CPU and puts torch-ext on the path
import torch
from bench import MiB, fmt, rel, sync
import results_json
from distill_cases import SHAPES, make_data, reference
from distill_methods import FAST_CHUNK_BYTES, build_methods, four_products

REPO = Path(__file__).resolve().parents[1]
SKIP = {  # (shape, method): why; --no-skip runs them anyway
    ("D3", "liger"): "D3 is ours and TRL's only (Liger at 65536 tokens: long, not compared)",
    ("D3", "torch-compile"): "D3: its fp32 logit planes are 37 GiB each (out of memory or close)",
    ("D3", "torch"): "D3: its fp32 logit planes are 37 GiB each (out of memory)",
}
GPU_DEFAULT_SKIPS = ("torch",)  # eager plain torch: only on request on a GPU (torch-compile is the user's choice)
CPU_METHODS = ("matmul", "flce*", "trl", "torch")  # peers' GPU kernels and inductor's C++ build are slow on CPU
# The estimate: fwd+bwd time of each method as a multiple of the four products at FLOOR_TFLOPS (guesses
# from the cross-entropy harness on an H200: cuBLAS ~660 TF/s, ours ~1.5x the floor, Liger's CE 1.45x).
FLOOR_TFLOPS = 650.0
FACTOR = {"matmul": 1.0, "flce": 1.5, "flce-fast": 1.25, "flce-none": 1.5, "flce-trl": 1.5, "trl": 2.5,
          "liger": 3.0, "torch-compile": 1.8, "torch": 2.5}
COMPILE_S = {"torch-compile": 12.0, "flce": 4.0, "trl": 4.0, "liger": 4.0}  # per (shape, beta); first call
STARTUP_S = 25.0


def free_memory(device):
    """bench.free_memory on a GPU; nothing on CPU (gc.collect is ~0.2 s a call there, and no memory is measured)."""
    if device.type == "cuda":
        bench.free_memory(device)


def four_product_flop(n, hs, ht, v):
    return 2.0 * n * v * (ht + 3 * hs)


def skip_reason(shape, method, no_skip=False):
    return None if no_skip else SKIP.get((shape, method))


def estimate_seconds(shapes, dists, betas, names, rounds, reps, no_skip=False):
    """A rough wall-clock estimate on an H200 (see FACTOR): compile, reference and timed steps."""
    total = STARTUP_S
    for shape in shapes:
        n, hs, ht, v = SHAPES[shape]
        floor_s = four_product_flop(n, hs, ht, v) / (FLOOR_TFLOPS * 1e12)
        for name in names:
            if skip_reason(shape, name, no_skip):
                continue
            total += COMPILE_S.get(name.split("-")[0] if name.startswith("flce") else name, 0.0) * len(betas)
            call_s = FACTOR.get(name, 2.0) * floor_s
            per_round = max(1, min(reps, int(bench.SLOW_BUDGET_MS / 1e3 // call_s))) if call_s > bench.SLOW_MS / 1e3 else reps
            total += len(dists) * len(betas) * call_s * (2 + rounds * per_round)
        total += len(dists) * len(betas) * (12 * floor_s + 1.5)  # reference (fp32, tf32) + data + gc per case
    return total


def git_state(commit=None):
    """The package measured: ``commit`` (``--commit``) where given, since a copy of the tree on another
    machine may carry a .git naming the copy's base; else ``results_json.provenance`` (BENCH_COMMIT,
    then git)."""
    if commit:
        return dict(commit=commit, dirty=None)
    found = results_json.provenance()
    return dict(commit=found["commit"], dirty=found["dirty"])


def versions():
    v = bench.versions()
    v.pop("cut-cross-entropy", None)
    for dist in ("trl", "transformers"):
        try:
            v[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[dist] = None
    return v


def make_timer(step, leaves, est_ms, reps, device):
    """One round's figure: the median of ``reps`` timed calls (fewer for slow calls), gradients cleared
    before each, outside the timed call."""
    clock = bench._event_ms if device.type == "cuda" else bench._wall_ms
    n = reps if est_ms <= bench.SLOW_MS else max(1, min(reps, int(bench.SLOW_BUDGET_MS // est_ms)))

    def one_round():
        times = []
        for _ in range(n):
            for x in leaves:
                x.grad = None
            times.append(clock(step))
        for x in leaves:
            x.grad = None
        return statistics.median(times)

    return one_round


def setup(method, data, beta, ref, once):
    """A method's warm-up, then one measured step (memory, errors, its time): (figures, step, leaves, est_ms)."""
    dev = data.x_s.device
    cuda = dev.type == "cuda"
    clock = bench._event_ms if cuda else bench._wall_ms
    if method.call is None:  # the floor
        step = four_products(data)
        if not once:
            step()
        sync(dev)
        return {}, step, (), clock(step)
    x = data.x_s.detach().requires_grad_(True)
    w = data.w_s.detach().requires_grad_(True)
    holder = {}

    def step():
        loss, per = method.call(data, beta, x, w)
        loss.backward()
        return loss, per

    def measured():
        loss, per = step()
        holder["loss"], holder["per"] = loss.detach(), (None if per is None else per.detach())

    if not once:
        step()  # warm-up: compile, autotune
        x.grad = w.grad = None
    sync(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    est = clock(measured)
    out = {}
    if cuda:
        out["extra_mib"] = (torch.cuda.max_memory_allocated() - base - x.grad.nbytes - w.grad.nbytes) / MiB
    red = method.reduction
    want = ref["loss"][red]
    out["loss_rel"] = abs(float(holder["loss"]) - want) / abs(want) if want else abs(float(holder["loss"]))
    out["dx_rel"], out["dw_rel"] = rel(x.grad, ref["dx"][red]), rel(w.grad, ref["dw"][red])
    if holder["per"] is not None:
        v = data.valid
        out["tok_rel"] = rel(holder["per"].reshape(-1)[v], ref["divergence"][v].float())
    x.grad = w.grad = None
    return out, step, (x, w), est


ROW_KEYS = ("fwdbwd_ms", "spread", "x_floor", "tflops", "extra_mib", "loss_rel", "dx_rel", "dw_rel", "tok_rel",
            "error", "skipped")


def run_case(methods, data, beta, ref, args, device, meta, t0):
    """Every method of one (shape, dist, beta): setups in order, then the interleaved rounds. Rows."""
    once = args.quick and device.type != "cuda"
    base = dict(shape=data.shape, dist=data.dist, beta=beta, N=data.n, H_student=data.hs, H_teacher=data.ht,
                V=data.v, n_valid=data.n_valid)
    rows, timed = [], []
    for method in methods:
        row = dict(base, method=method.name, reduction=method.reduction, **dict.fromkeys(ROW_KEYS))
        rows.append(row)
        why = skip_reason(data.shape, method.name, args.no_skip)
        if why:
            row["skipped"] = why
            meta["skipped"].append(f"{data.shape}/{data.dist}/beta={beta}/{method.name}: {why}")
            print(f"note: skipped {data.shape} {method.name}: {why}", flush=True)
            continue
        if method.error:
            row["error"] = method.error
            continue
        try:
            figures, step, leaves, est = setup(method, data, beta, ref, once)
            row.update(figures)
            if args.rounds == 1 and once:
                row["fwdbwd_ms_rounds"] = [est]
            else:
                row["fwdbwd_ms_rounds"] = []
                timed.append((row, make_timer(step, leaves, est, args.reps, device)))
        except Exception as e:  # noqa: BLE001 - an OOM or a failing method is a row, not a crash
            row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
        free_memory(device)
    for r in range(args.rounds if timed else 0):
        order = timed[r % len(timed):] + timed[: r % len(timed)]
        for row, one_round in order:
            if row["error"]:
                continue
            try:
                row["fwdbwd_ms_rounds"].append(one_round())
            except Exception as e:  # noqa: BLE001
                row["error"] = f"round {r + 1}: {type(e).__name__}: {str(e).strip()[:300]}"
                free_memory(device)
    floor = next((r for r in rows if r["method"] == "matmul" and r.get("fwdbwd_ms_rounds")), None)
    flop = four_product_flop(data.n, data.hs, data.ht, data.v)
    for row in (floor, *rows):
        times = row and not row["error"] and row.get("fwdbwd_ms_rounds")
        if not times:
            continue
        row["fwdbwd_ms"] = statistics.median(times)
        row["spread"] = (max(times) - min(times)) / row["fwdbwd_ms"]
        row["tflops"] = flop / row["fwdbwd_ms"] / 1e9
        if floor is not None and floor.get("fwdbwd_ms"):
            row["x_floor"] = row["fwdbwd_ms"] / floor["fwdbwd_ms"]
    for row in rows:
        progress(t0, row)
    return rows


def progress(t0, row):
    tag = f"{row['shape']} {row['dist']:6s} b={row['beta']:<4g} {row['method']:13s}"
    if row.get("skipped"):
        msg = f"skipped: {row['skipped']}"
    elif row.get("error"):
        msg = f"ERROR {row['error']}"
    else:
        msg = (f"fwd+bwd {fmt(row['fwdbwd_ms'], '8.2f')} ms (spread {fmt(row['spread'], '.1%')}, "
               f"{fmt(row['x_floor'], '.2f')}x floor)  extra {fmt(row['extra_mib'], '9.1f')} MiB  "
               f"loss {fmt(row['loss_rel'], '.1e')} dx {fmt(row['dx_rel'], '.1e')} dw {fmt(row['dw_rel'], '.1e')}"
               + (f" tok {fmt(row['tok_rel'], '.1e')}" if row.get("tok_rel") is not None else ""))
    print(f"[{time.perf_counter() - t0:6.0f}s] {tag} {msg}", flush=True)


def summary(rows):
    """The short table printed at the end (render_distill.py writes the markdown one)."""
    cols = (("ms", "fwdbwd_ms", ".2f", 8), ("spread", "spread", ".1%", 6), ("x floor", "x_floor", ".2f", 7),
            ("extra MiB", "extra_mib", ".1f", 9), ("loss err", "loss_rel", ".1e", 8), ("dX err", "dx_rel", ".1e", 7),
            ("dW err", "dw_rel", ".1e", 7))
    lines = [f"{'shape':5s} {'dist':6s} {'beta':4s} {'method':13s} " + " ".join(f"{c:>{w}s}" for c, _, _, w in cols)]
    for r in rows:
        lead = f"{r['shape']:5s} {r['dist']:6s} {r['beta']:<4g} {r['method']:13s}"
        if r.get("skipped") or r.get("error"):
            lines.append(f"{lead} {'skipped' if r.get('skipped') else 'error'}: {(r.get('skipped') or r['error'])[:70]}")
            continue
        lines.append(f"{lead} " + " ".join(f"{fmt(r.get(k), s):>{w}s}" for _, k, s, w in cols))
    return "\n".join(lines)


def _names(text):
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/distill", help="folder for <gpu>.json (default %(default)s)")
    ap.add_argument("--shapes", default="D1,D2", help="from " + ",".join(s for s in SHAPES if s != "tiny") + " (default %(default)s)")
    ap.add_argument("--betas", default="1,0.5,0", help="in [0, 1] (default %(default)s)")
    ap.add_argument("--dists", default="random,peaked", help="random and/or peaked (default %(default)s)")
    ap.add_argument("--methods", default=None, help="names or globs among matmul, flce, flce-fast, flce-none, flce-trl, "
                    "trl, liger, torch-compile, torch (default: all but torch on a GPU; " + ",".join(CPU_METHODS) + " on CPU)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 3; 1 with --quick on CPU)")
    ap.add_argument("--reps", type=int, default=None, help="timed calls per method per round (default 3, --quick 2)")
    ap.add_argument("--quick", action="store_true", help="fewer calls (on CPU: no warm-up, one round)")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape; on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="inputs (default bf16; fp32 with "
                    "--tiny: the interpreter's tl.dot is wrong for bf16)")
    ap.add_argument("--valid", type=float, default=None, help="share of valid tokens per sequence (default 1; 0.75 with --tiny)")
    ap.add_argument("--ref-precision", choices=("tf32", "ieee"), default="tf32", help="the fp32 reference's matmuls on a GPU")
    ap.add_argument("--no-skip", action="store_true", help="also run the (shape, method) pairs in SKIP")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip every case that would start after this many "
                    "seconds (0: no limit)")
    ap.add_argument("--estimate-only", action="store_true", help="print the time estimate and exit")
    ap.add_argument("--commit", default=None, help="the git commit to record where git cannot tell (a copy "
                    "of the working tree without .git)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return ap, args


def main(argv=None):
    ap, args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ["tiny"] if args.tiny else _names(args.shapes)
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    if device.type == "cpu" and shapes != ["tiny"] and not args.estimate_only:
        ap.error("no CUDA GPU: only --tiny runs on the CPU")
    betas = [float(b) for b in _names(args.betas)]
    if any(not 0 <= b <= 1 for b in betas):
        ap.error("betas must be in [0, 1]")
    dists = _names(args.dists)
    for d in dists:
        if d not in ("random", "peaked"):
            ap.error(f"unknown dist {d!r}; known: random, peaked")
    if args.rounds is None:
        args.rounds = 1 if (args.quick and device.type != "cuda" and not args.estimate_only) else 3
    if args.reps is None:
        args.reps = 2 if args.quick else 3
    if args.rounds < 1 or args.reps < 1:
        ap.error("--rounds and --reps must be >= 1")
    args.dtype = args.dtype or ("fp32" if args.tiny else "bf16")
    args.valid = args.valid if args.valid is not None else (0.75 if args.tiny else 1.0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    all_names = ("matmul", "flce", "flce-fast", "flce-none", "flce-trl", "trl", "liger", "torch-compile", "torch")
    if args.methods is None:
        patterns = list(CPU_METHODS) if device.type == "cpu" else [m for m in all_names if m not in GPU_DEFAULT_SKIPS]
    else:
        patterns = _names(args.methods)
    wanted = lambda name: any(fnmatch.fnmatchcase(name, p) for p in patterns)  # noqa: E731
    est = estimate_seconds(shapes, dists, betas, [m for m in all_names if wanted(m)], args.rounds, args.reps, args.no_skip)
    print(f"estimate (H200, rough): ~{est:.0f} s = {est / 60:.1f} min for {len(shapes)} shape(s) x {len(dists)} dist(s) "
          f"x {len(betas)} beta(s), {args.rounds} round(s) of {args.reps} call(s)", flush=True)
    if args.estimate_only:
        return None

    notes = []
    methods = [m for m in build_methods(notes) if wanted(m.name)]
    for note in notes:
        print(f"note: {note}", flush=True)
    name = bench.gpu_name(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"{bench.file_stem(name)}.json"
    ref_dtype = torch.float64 if shapes == ["tiny"] else torch.float32
    meta = dict(
        harness="bench_distill",
        gpu=name,
        **versions(),
        **git_state(args.commit),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args=vars(args),
        shapes={s: dict(zip(("N", "H_student", "H_teacher", "V"), SHAPES[s])) for s in shapes},
        methods={m.name: m.note for m in methods},
        fast_chunk_bytes=FAST_CHUNK_BYTES,
        reference=("float64" if ref_dtype == torch.float64 else f"fp32 logits, {args.ref_precision} matmuls")
        + ", distill_cases.reference (chunked rows)",
        estimate_s=est,
        notes=notes,
        skipped=[],
        data={},
    )
    rows = []
    t0 = time.perf_counter()

    def write():
        tmp = out_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        tmp.replace(out_path)

    for shape in shapes:
        torch._dynamo.reset()  # fresh torch.compile graphs for this shape (one per beta), no recompile limit
        for dist in dists:
            data = None
            for beta in betas:
                key = f"{shape}/{dist}/beta={beta:g}"
                if args.budget_s > 0 and time.perf_counter() - t0 > args.budget_s:
                    meta["skipped"].append(f"{key}: over --budget-s {args.budget_s:g}")
                    print(f"note: skipped {key}: over --budget-s", flush=True)
                    continue
                if data is None:
                    data = make_data(shape, dist, device, args.seed, dtype, args.valid)
                with bench.matmul_precision(args.ref_precision, device):
                    ref, stats = reference(data, beta, ref_dtype)
                free_memory(device)
                meta["data"][key] = stats
                print(f"[{time.perf_counter() - t0:6.0f}s] {key} N={data.n} Hs={data.hs} Ht={data.ht} V={data.v} "
                      + " ".join(f"{k}={x:.3g}" if isinstance(x, float) else f"{k}={x}" for k, x in stats.items()), flush=True)
                rows += run_case(methods, data, beta, ref, args, device, meta, t0)
                del ref
                free_memory(device)
                write()
            del data
            free_memory(device)
    write()
    print(summary(rows), flush=True)
    print(f"[{time.perf_counter() - t0:6.0f}s] wrote {out_path}", flush=True)
    return out_path


if __name__ == "__main__":
    main()
