"""The per-token harness: log-probabilities (and entropy, top-1) of the lm head, ours against TRL's head
and plain torch, one process, one run.

    python3 benchmarks/bench_logprobs.py --out benchmarks/results/logprobs --budget-s 270   # GPU, S1-S4
    python3 benchmarks/bench_logprobs.py --shapes S1 --workloads grpo --methods 'flce*,trl'
    python3 benchmarks/bench_logprobs.py --tiny --quick --out /tmp/lp      # CPU smoke test (Triton interpreter)
    python3 benchmarks/plot.py benchmarks/results/logprobs/h200.json       # table + figure

Workloads (each a per-token call of ``hidden @ weight.T`` on bf16 data from ``bench.make_data``):
  sft   outputs log_probs, entropy, is_top1; loss = -log_probs.mean(); only log_probs carries gradient
        (torch computes its entropy under no_grad, as a metric)
  grpo  outputs log_probs, entropy, both with gradient: loss = -(log_probs * adv).mean()
        - ENTROPY_COEF * entropy.mean(), adv a fixed standard-normal draw per token
  ref   forward only under no_grad, log_probs only (a reference model's pass); ``fwd_x_matmul`` is its
        time over one cuBLAS ``hidden @ weight.T`` measured in the same run (the ``matmul`` row)
Methods: ``flce`` (``fused_linear_ce.fused_linear_logprobs``, default settings), ``flce-chunked``
(``strategy="chunked"`` with a chunk_bytes no plane reaches: one chunk of all rows; an out-of-memory or
ValueError is a row with ``error``), ``trl`` (TRL's ``trl.kernels.ChunkedLogProbFunction`` as a black box,
token chunk 32768), ``flce-trl`` (this package's drop-in ``fused_linear_ce.ChunkedLogProbFunction``
called as ``trl`` is: TRL's call path, with the drop-in's own budget ``trl_head.trl_chunk_bytes``), ``torch`` (plain torch on fp32 logits ``(h @ w.T).float()``; rows chunked under
activation checkpointing only if the whole would not fit; skipped at S4 unless --no-skip).

Per row: ``fwd_ms`` (the row's outputs under no_grad), ``fwdbwd_ms`` (sft / grpo), medians timed as
bench.py times them (do_bench; calls slower than bench.SLOW_MS by hand, 1-3 reps); ``extra_mib`` as
bench.py defines it (peak allocated during one forward+backward minus what was allocated before it minus
the bytes of dX and dW; for ref the peak of one no_grad forward minus what was allocated before it);
relative Frobenius errors (bench.rel) against a reference computed in float64 on the device (logits,
softmax and the gradient products; fp32 with IEEE matmuls where float64 would not fit, named per
(shape, dist) in meta.data[...]["reference"]): ``loss_rel``, ``dx_rel``, ``dw_rel``, ``logprobs_rel``,
``entropy_rel``, and ``top1_mismatch`` (share of tokens whose is_top1 differs from the reference's).

Writes ``<gpu>.json`` under --out after every (shape, dist) and prints a short table at the end.
``--budget-s`` skips (and records in meta.skipped) every row that would start after that many seconds,
so one device command stays within its time; shapes run in the order given, S4 last by default.
"""

import argparse
import datetime
import fnmatch
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import bench  # benchmarks/bench.py: sets TRITON_INTERPRET on CPU and puts torch-ext on the path
import torch
from bench import MiB, WHOLE, bench as bench_time, fmt, make_data, rel, sync

import fused_linear_ce  # noqa: E402 - torch-ext, put on sys.path by bench

SHAPES = dict(bench.SHAPES, tiny=(64, 32, 512))  # S1-S4 as bench.py; a smaller tiny (the interpreter is slow)
WORKLOADS = {  # name: (outputs, outputs that carry gradient; None = forward only)
    "sft": (("log_probs", "entropy", "is_top1"), ("log_probs",)),
    "grpo": (("log_probs", "entropy"), ("log_probs", "entropy")),
    "ref": (("log_probs",), None),
}
ENTROPY_COEF = 0.01
TRL_CHUNK = 32768  # ChunkedLogProbFunction's chunk_size argument
TRL_FIELDS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # its return order
SKIP = {("S4", "torch"): "plain torch: one fp32 logit plane of S4 is 31 GiB; chunked under checkpointing it "
                         "would take a large share of the run's time"}
REF_PLANE_BYTES = 2 << 30  # the reference's logit chunk
TORCH_BYTES_PER_LOGIT = 30  # plain torch's live bytes per logit in a forward+backward (bf16 + ~7 fp32 planes)


def ours(api, **kwargs):
    def call(h, w, t, outputs, grad):
        return api(h, w, t, outputs=outputs, **kwargs)

    return call


def trl_head(fn):
    def call(h, w, t, outputs, grad):
        got = fn.apply(h, w, None, t, 1.0, TRL_CHUNK, None, 1.0, tuple(o for o in outputs if o != "log_probs"))
        got = dict(zip(TRL_FIELDS, got))
        return {k: got[k] for k in outputs}

    return call


def _torch_piece(h, w, t, outputs, grad):
    z = (h @ w.T).float()
    logp = z.log_softmax(-1)
    out = {"log_probs": logp.gather(1, t[:, None])[:, 0]}
    if "entropy" in outputs:
        with torch.set_grad_enabled(torch.is_grad_enabled() and grad is not None and "entropy" in grad):
            out["entropy"] = -(logp.exp() * logp).sum(-1)
    if "is_top1" in outputs:
        out["is_top1"] = z.detach().argmax(-1) == t
    return out


def torch_logprobs(h, w, t, outputs, grad, chunk_rows=None):
    """Plain torch, fp32 logits; with ``chunk_rows``, row chunks under activation checkpointing."""
    n = h.shape[0]
    if not chunk_rows or chunk_rows >= n:
        return _torch_piece(h, w, t, outputs, grad)
    pieces = []
    for r in range(0, n, chunk_rows):
        args = (h[r : r + chunk_rows], w, t[r : r + chunk_rows], outputs, grad)
        if torch.is_grad_enabled() and (h.requires_grad or w.requires_grad):
            pieces.append(torch.utils.checkpoint.checkpoint(_torch_piece, *args, use_reentrant=False))
        else:
            pieces.append(_torch_piece(*args))
    return {k: torch.cat([p[k] for p in pieces]) for k in pieces[0]}


def torch_chunk_rows(n, v, device):
    """None if plain torch's planes fit in ~60% of free memory, else the rows per checkpointed chunk."""
    if device.type != "cuda":
        return None
    free = torch.cuda.mem_get_info(device)[0]
    if TORCH_BYTES_PER_LOGIT * n * v <= 0.6 * free:
        return None
    return max(1, int(0.3 * free) // (TORCH_BYTES_PER_LOGIT * v))


def free_memory(device):
    """bench.free_memory on a GPU; nothing on CPU (gc.collect is ~0.2 s a row there, and no memory is measured)."""
    if device.type == "cuda":
        bench.free_memory(device)


def build_methods(notes):
    """name -> call(h, w, targets, outputs, grad) -> {output: (N,) tensor}, in run order."""
    methods = {}
    api = getattr(fused_linear_ce, "fused_linear_logprobs", None)
    if api is None:
        notes.append("fused_linear_ce.fused_linear_logprobs not in this package: flce rows skipped")
    else:
        methods["flce"] = ours(api)
        methods["flce-chunked"] = ours(api, strategy="chunked", chunk_bytes=WHOLE)
        # the drop-in for TRL's head (fused_linear_ce.ChunkedLogProbFunction) called as TRL calls its own
        methods["flce-trl"] = trl_head(fused_linear_ce.ChunkedLogProbFunction)
    try:
        from trl.kernels import ChunkedLogProbFunction

        methods["trl"] = trl_head(ChunkedLogProbFunction)
    except Exception as e:  # noqa: BLE001 - any import failure means "not available"
        notes.append(f"trl.kernels.ChunkedLogProbFunction not available ({type(e).__name__}: {e}); trl rows skipped")
    methods["torch"] = torch_logprobs
    return methods


def workload_loss(workload, out, adv):
    if workload == "sft":
        return -out["log_probs"].mean()
    return -(out["log_probs"] * adv).mean() - ENTROPY_COEF * out["entropy"].mean()


def reference(hidden, weight, targets, adv):
    """Per-token log_probs, entropy, is_top1 and, for sft and grpo, the loss, dX and dW, in float64
    (fp32 with IEEE matmuls where float64 would not fit); gradients stored as fp32. Hand-derived
    gradients of the logits (tests/integrations/test_bench_logprobs.py checks them against autograd):
    d(-mean lp)/dz = (p - onehot) / N;  d(entropy)/dz = -p * (log p + entropy)."""
    dev = hidden.device
    n, h = hidden.shape
    v = weight.shape[0]
    dtype = torch.float64
    need = 8 * (3 * v * h + n * h) + 4 * REF_PLANE_BYTES + 4 * 2 * (n * h + v * h)
    if dev.type == "cuda" and need > 0.8 * torch.cuda.mem_get_info(dev)[0]:
        dtype = torch.float32
    size = torch.finfo(dtype).bits // 8
    rows = max(1, min(n, REF_PLANE_BYTES // (size * v)))
    w = weight.to(dtype)
    lp, ent, top1, std = [], [], [], []
    dx = {k: torch.empty(n, h, device=dev, dtype=torch.float32) for k in ("sft", "grpo")}
    dw = {k: torch.zeros(v, h, device=dev, dtype=dtype) for k in ("sft", "grpo")}
    with bench.matmul_precision("ieee", dev):
        for r in range(0, n, rows):
            x, t, a = hidden[r : r + rows].to(dtype), targets[r : r + rows, None], adv[r : r + rows, None].to(dtype)
            z = x @ w.T
            top1.append(z.argmax(-1) == t[:, 0])
            std.append(z.std(-1))
            logp = z.sub_(z.logsumexp(-1, keepdim=True))
            del z
            p = logp.exp()
            e = -(p * logp).sum(-1)
            lp.append(logp.gather(1, t)[:, 0])
            ent.append(e)
            g = p.scatter_add(1, t, torch.full_like(t, -1, dtype=dtype)).div_(n)  # sft: (p - onehot) / N
            dx["sft"][r : r + rows] = g @ w
            dw["sft"].addmm_(g.T, x)
            g.mul_(a).add_(logp.add_(e[:, None]).mul_(p), alpha=ENTROPY_COEF / n)  # grpo
            del logp, p
            dx["grpo"][r : r + rows] = g @ w
            dw["grpo"].addmm_(g.T, x)
            del g
    lp, ent, top1 = torch.cat(lp), torch.cat(ent), torch.cat(top1)
    losses = dict(sft=-lp.mean().item(),
                  grpo=(-(lp * adv.to(dtype)).mean() - ENTROPY_COEF * ent.mean()).item())
    ref = dict(log_probs=lp, entropy=ent, is_top1=top1, loss=losses, dx=dx,
               dw={k: x.float() for k, x in dw.items()})
    stats = dict(
        reference="float64" if dtype == torch.float64 else "fp32 (ieee matmuls): float64 would not fit",
        mean_p_target=lp.exp().mean().item(),
        mean_entropy=ent.mean().item(),
        top1_share=top1.double().mean().item(),
        logit_std=torch.cat(std).mean().item(),
        sft_loss=losses["sft"],
        grpo_loss=losses["grpo"],
    )
    return ref, stats


def errors(out, ref, workload, loss=None, dx=None, dw=None):
    got = {"logprobs_rel": rel(out["log_probs"], ref["log_probs"])}
    if "entropy" in out:
        got["entropy_rel"] = rel(out["entropy"], ref["entropy"])
    if "is_top1" in out:
        got["top1_mismatch"] = (out["is_top1"].bool() != ref["is_top1"]).double().mean().item()
    if loss is not None:
        want = ref["loss"][workload]
        got["loss_rel"] = abs(loss - want) / abs(want)
        got["dx_rel"], got["dw_rel"] = rel(dx, ref["dx"][workload]), rel(dw, ref["dw"][workload])
    return got


def measure(fn, workload, hidden, weight, targets, adv, ref, quick):
    """One row: memory and errors from one measured call after a warm-up, then the times. On CPU with
    --quick the warm-ups are skipped and the measured calls are the times (the Triton interpreter is slow)."""
    outputs, grad = WORKLOADS[workload]
    dev = hidden.device
    cuda = dev.type == "cuda"
    clock = bench._event_ms if cuda else bench._wall_ms
    once = quick and not cuda
    holder = {}

    def fwd():
        with torch.no_grad():
            return fn(hidden, weight, targets, outputs, grad)

    def keep(res):
        holder["out"] = {k: x.detach() for k, x in res.items()}

    row = {}
    if grad is None:  # forward only
        if not once:
            fwd()
        sync(dev)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        est = clock(lambda: keep(fwd()))
        if cuda:
            row["extra_mib"] = (torch.cuda.max_memory_allocated() - base) / MiB
        row.update(errors(holder.pop("out"), ref, workload))
        row["fwd_ms"] = est if once else bench_time(fwd, est, dev, quick)
        return row

    h = hidden.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def fwdbwd():
        res = fn(h, w, targets, outputs, grad)
        loss = workload_loss(workload, res, adv)
        loss.backward()
        return loss, res

    def measured():
        loss, res = fwdbwd()
        holder["loss"] = loss.detach()
        keep(res)

    if not once:
        fwdbwd()  # warm-up: compile, autotune
        h.grad = w.grad = None
    sync(dev)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    est = clock(measured)
    if cuda:
        row["extra_mib"] = (torch.cuda.max_memory_allocated() - base - h.grad.nbytes - w.grad.nbytes) / MiB
    loss = float(holder.pop("loss"))
    row.update(errors(holder.pop("out"), ref, workload, loss, h.grad, w.grad))
    h.grad = w.grad = None
    if not once:
        fwd()  # the no_grad path's warm-up
    fwd_est = clock(fwd)
    row["fwd_ms"] = fwd_est if once else bench_time(fwd, fwd_est, dev, quick)
    row["fwdbwd_ms"] = est if once else bench_time(fwdbwd, est, dev, quick, grad_to_none=(h, w))
    h.grad = w.grad = None
    return row


def versions():
    v = bench.versions()
    for dist in ("trl", "transformers"):
        try:
            v[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            v[dist] = None
    return v


ROW_KEYS = ("fwd_ms", "fwdbwd_ms", "extra_mib", "fwd_x_matmul", "loss_rel", "dx_rel", "dw_rel", "logprobs_rel",
            "entropy_rel", "top1_mismatch", "error")


def progress(t0, tag, row):
    if row.get("error"):
        msg = f"ERROR {row['error']}"
    else:
        msg = (f"fwd {fmt(row.get('fwd_ms'), '8.2f')} ms ({fmt(row.get('fwd_x_matmul'), '.2f')}x mm)  "
               f"fwd+bwd {fmt(row.get('fwdbwd_ms'), '8.2f')} ms  extra {fmt(row.get('extra_mib'), '9.1f')} MiB  "
               f"lp {fmt(row.get('logprobs_rel'), '.1e')} ent {fmt(row.get('entropy_rel'), '.1e')} "
               f"loss {fmt(row.get('loss_rel'), '.1e')} dx {fmt(row.get('dx_rel'), '.1e')} dw {fmt(row.get('dw_rel'), '.1e')}")
    print(f"[{time.perf_counter() - t0:6.0f}s] {tag} {row['workload']:4s} {row['method']:12s} {msg}", flush=True)


def summary(rows):
    """The short table printed at the end (plot.py writes the full markdown one)."""
    cols = (("fwd ms", "fwd_ms", ".2f", 8), ("x mm", "fwd_x_matmul", ".2f", 5), ("fwd+bwd", "fwdbwd_ms", ".2f", 8),
            ("extra MiB", "extra_mib", ".1f", 9), ("lp err", "logprobs_rel", ".1e", 7),
            ("ent err", "entropy_rel", ".1e", 7), ("dX err", "dx_rel", ".1e", 7), ("dW err", "dw_rel", ".1e", 7))
    lines = [f"{'shape':5s} {'dist':6s} {'work':4s} {'method':12s} " + " ".join(f"{c:>{w}s}" for c, _, _, w in cols)]
    for r in rows:
        if r["method"] == "matmul":
            continue
        lead = f"{r['shape']:5s} {r['dist']:6s} {r['workload']:4s} {r['method']:12s}"
        if r.get("error"):
            lines.append(f"{lead} error: {r['error'][:60]}")
            continue
        lines.append(f"{lead} " + " ".join(f"{fmt(r.get(k), s):>{w}s}" for _, k, s, w in cols))
    return "\n".join(lines)


def _names(text):
    return [s.strip() for s in text.split(",") if s.strip()]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/logprobs", help="folder for <gpu>.json (default %(default)s)")
    ap.add_argument("--shapes", default="S1,S2,S3,S4", help="from " + ",".join(SHAPES) + " (default %(default)s)")
    ap.add_argument("--dists", default="random,peaked", help="random and/or peaked (default %(default)s)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="from %(default)s (default all)")
    ap.add_argument("--methods", default="*", help="names or globs among flce, flce-chunked, flce-trl, trl, torch (default all)")
    ap.add_argument("--tiny", action="store_true", help="one tiny shape; runs on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--quick", action="store_true", help="fewer timing reps (on CPU: one call per figure)")
    ap.add_argument("--no-skip", action="store_true", help="also run the combinations skipped by default (torch at S4)")
    ap.add_argument("--budget-s", type=float, default=0.0, help="skip every row that would start after this "
                    "many seconds (0: no limit)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = ["tiny"] if args.tiny else _names(args.shapes)
    for s in shapes:
        if s not in SHAPES:
            ap.error(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    if device.type == "cpu" and shapes != ["tiny"]:
        ap.error("no CUDA GPU: only --tiny runs on the CPU")
    workloads = _names(args.workloads)
    for wl in workloads:
        if wl not in WORKLOADS:
            ap.error(f"unknown workload {wl!r}; known: {', '.join(WORKLOADS)}")
    dists = _names(args.dists)

    notes = []
    methods = build_methods(notes)
    patterns = _names(args.methods)
    methods = {k: f for k, f in methods.items() if any(fnmatch.fnmatchcase(k, p) for p in patterns)}
    for note in notes:
        print(f"note: {note}", flush=True)

    name = bench.gpu_name(device)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out_path = out_dir / f"{bench.file_stem(name)}.json"
    meta = dict(
        harness="bench_logprobs",
        gpu=name,
        **versions(),
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        args=vars(args),
        workloads={k: dict(outputs=list(o), grad=list(g) if g else None) for k, (o, g) in WORKLOADS.items()},
        entropy_coef=ENTROPY_COEF,
        trl_chunk_size=TRL_CHUNK,
        reference="float64 on the device (fp32 with IEEE matmuls where float64 would not fit: see data[...].reference)",
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

    def over_budget():
        return args.budget_s > 0 and time.perf_counter() - t0 > args.budget_s

    for shape in shapes:
        n, h, v = SHAPES[shape]
        for dist in dists:
            tag = f"{shape} {dist}"
            if over_budget():
                meta["skipped"].append(f"{shape}/{dist}: over --budget-s {args.budget_s:g}")
                print(f"note: skipped {tag}: over --budget-s", flush=True)
                continue
            hidden, weight, targets = make_data(n, h, v, dist, device, args.seed)
            g = torch.Generator(device=device).manual_seed(args.seed + 1)
            adv = torch.randn(n, generator=g, device=device)
            ref, stats = reference(hidden, weight, targets, adv)
            free_memory(device)
            meta["data"][f"{shape}/{dist}"] = stats
            print(f"[{time.perf_counter() - t0:6.0f}s] {tag} N={n} H={h} V={v} " + " ".join(
                f"{k}={x:.3g}" if isinstance(x, float) else f"{k}={x}" for k, x in stats.items()), flush=True)
            base = dict(shape=shape, dist=dist, N=n, H=h, V=v)
            mm = dict(base, workload="-", method="matmul", **dict.fromkeys(ROW_KEYS))
            try:
                figures, _ = bench.measure_matmul(hidden, weight, args.quick)
                mm.update(figures)  # fwd_ms: one matmul; fwdbwd_ms: the three of a forward+backward
            except Exception as e:  # noqa: BLE001
                mm["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            rows.append(mm)
            stats["matmul_ms"], stats["matmul3_ms"] = mm["fwd_ms"], mm["fwdbwd_ms"]
            chunk_rows = torch_chunk_rows(n, v, device)
            for workload in workloads:
                for method, fn in methods.items():
                    key = f"{shape}/{dist}/{workload}/{method}"
                    if (shape, method) in SKIP and not args.no_skip:
                        meta["skipped"].append(f"{key}: {SKIP[(shape, method)]}")
                        continue
                    if over_budget():
                        meta["skipped"].append(f"{key}: over --budget-s {args.budget_s:g}")
                        print(f"note: skipped {key}: over --budget-s", flush=True)
                        continue
                    row = dict(base, workload=workload, method=method, outputs=list(WORKLOADS[workload][0]),
                               **dict.fromkeys(ROW_KEYS))
                    call = fn
                    if method == "flce-chunked":
                        row.update(strategy="chunked", chunk_bytes=WHOLE)
                    elif method == "torch" and chunk_rows:
                        row["chunk_rows"] = chunk_rows
                        call = lambda *a, fn=fn: fn(*a, chunk_rows=chunk_rows)  # noqa: E731
                    try:
                        row.update(measure(call, workload, hidden, weight, targets, adv, ref, args.quick))
                        if row["fwd_ms"] and mm["fwd_ms"]:
                            row["fwd_x_matmul"] = row["fwd_ms"] / mm["fwd_ms"]
                    except Exception as e:  # noqa: BLE001 - an OOM or a failing method is a row, not a crash
                        row["error"] = f"{type(e).__name__}: {str(e).strip()[:300]}"
                    free_memory(device)
                    rows.append(row)
                    progress(t0, tag, row)
            del hidden, weight, targets, adv, ref
            free_memory(device)
            write()
    write()
    print(summary(rows), flush=True)
    print(f"[{time.perf_counter() - t0:6.0f}s] wrote {out_path}", flush=True)
    return out_path


if __name__ == "__main__":
    main()
