"""Figures and the README table from a bench.py JSON.

    python3 benchmarks/plot.py [benchmarks/results/h200.json] [--out DIR]

Writes, beside the JSON (or under --out), for a JSON named <stem>.json:
  <stem>.md            markdown table: shape, dist, method, times, extra memory, errors, TFLOP/s
  <stem>_frontier.png  forward+backward time against extra memory, one panel per shape: our
                       chunk_bytes settings as two curves (recompute, chunked), peers as points, the
                       3-matmul floor; points above 3x the floor drawn as arrows at the top edge
  <stem>_accuracy.png  forward+backward time against the worse of the dX / dW errors, first shape,
                       one panel per distribution
  <stem>_memory.png    extra memory per method, one bar per shape sharing the first shape's H and V
A JSON from bench_logprobs.py (meta.harness == "bench_logprobs") gives instead:
  <stem>.md            markdown table: shape, dist, workload, method, times, extra memory, errors
  <stem>_logprobs.png  fwd+bwd ms (ref: fwd ms) and extra MiB per method and shape, one column per
                       workload, first distribution, with the cuBLAS matmul floor marked
The table needs nothing beyond the standard library; the PNGs need matplotlib (skipped with a note
when it is missing).
"""

import argparse
import json
import math
import sys
from pathlib import Path

MiB_FLOOR = 0.01  # log axes: a measured extra of 0 (or a hair below) is drawn here


def ok(row):
    return not row.get("error") and row.get("fwdbwd_ms")


def order(rows, key):
    seen = []
    for r in rows:
        if r[key] not in seen:
            seen.append(r[key])
    return seen


def e(x, spec=".1e"):
    return "" if x is None else format(x, spec)


def header(meta):
    vers = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "liger-kernel", "cut-cross-entropy", "trl") if meta.get(k))
    commit = f" · package of {meta['commit'][:7]}{' (dirty)' if meta.get('dirty') else ''}" if meta.get("commit") else ""
    return f"GPU: {meta.get('gpu')} · {vers} · {meta.get('date')}{commit} · reference: {meta.get('reference', 'fp32 logits')}"


def timed(row, key):
    """'56.95' or, from several rounds, '56.95 [56.50-57.30]' (median [min-max])."""
    text = e(row.get(key), ".2f")
    if len(row.get(f"{key}_rounds") or ()) > 1:
        text += f" [{row[f'{key}_min']:.2f}-{row[f'{key}_max']:.2f}]"
    return text


def table(data):
    meta, rows = data["meta"], data["rows"]
    out = [header(meta), ""]
    for key, s in meta.get("data", {}).items():
        mm = f", one matmul {s['matmul_tflops']:.0f} TFLOP/s" if s.get("matmul_tflops") else ""
        out.append(f"- {key}: mean p(target) {s['mean_p_target']:.3g}, logit std {s['logit_std']:.2f}, "
                   f"reference loss {s['ref_loss']:.3f}{mm}")
    for shape, run in meta.get("shape_runs", {}).items():
        out.append(f"- {shape}: {run.get('date')}, commit {run.get('commit') or 'not recorded'}"
                   f"{' (dirty tree)' if run.get('dirty') else ''}, {run.get('rounds')} interleaved round(s), "
                   "times median [min-max] over the rounds")
    for s in meta.get("skipped", []):
        out.append(f"- skipped {s}")
    for note in meta.get("notes", []):
        out.append(f"- {note}")
    out += ["", "| shape | dist | method | fwd ms | fwd+bwd ms | extra MiB | dX err | dW err | TFLOP/s (% of 3 matmuls) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lead = f"| {r['shape']} ({r['N']}x{r['H']}x{r['V']}) | {r['dist']} | {r['method']} |"
        if r.get("error"):
            out.append(f"{lead} error: {r['error'][:80].replace('|', '/')} | | | | | |")
            continue
        tf = "" if r.get("tflops") is None else f"{r['tflops']:.3g}"
        if r.get("pct_matmul") is not None and r["method"] != "matmul":
            tf += f" ({r['pct_matmul']:.0%})"
        out.append(f"{lead} {timed(r, 'fwd_ms')} | {timed(r, 'fwdbwd_ms')} | {e(r['extra_mib'], '.1f')} | "
                   f"{e(r['dx_rel'])} | {e(r['dw_rel'])} | {tf} |")
    return "\n".join(out) + "\n"


PEER_MARKERS = "s^vP*Xhd<>"
OURS = "C0"


def peers_style(rows):
    """One colour and marker per peer method across all figures (C0 is ours)."""
    peers = [m for m in order(rows, "method") if not m.startswith("flce") and m != "matmul"]
    return {m: (f"C{1 + k % 9}", PEER_MARKERS[k % len(PEER_MARKERS)]) for k, m in enumerate(peers)}


def short(method):
    """flce-chunked-1G -> chunked 1G, flce-64M -> 64M, flce -> default."""
    name = method.removeprefix("flce").lstrip("-")
    return name.replace("chunked-", "chunked ") if name else "default"


ABOVE, RIGHT, BELOW = "above", "right", "below"


def place(ax, labels):
    """Annotate `(x, y, text, color, where)` labels above, right of or below-right of their points,
    each moved away from its point (up, up, down) until its box clears every label placed before;
    a thin line joins a moved label to its point."""
    scale = ax.figure.dpi / 72
    boxes = []
    for x, y, text, color, where in labels:
        px, py = ax.transData.transform((x, y)) / scale  # in points
        w, h = 4.1 * len(text) + 2, 8
        dx, dy = {ABOVE: (-w / 2, 5), RIGHT: (5, -3), BELOW: (5, -14)}[where]
        start, step = dy, (-9 if where == BELOW else 9)
        while any(abs(px + dx + w / 2 - bx) < (w + bw) / 2 and abs(py + dy + h / 2 - by) < (h + bh) / 2
                  for bx, by, bw, bh in boxes):
            dy += step
        boxes.append((px + dx + w / 2, py + dy + h / 2, w, h))
        line = dict(arrowstyle="-", lw=0.4, color=color, alpha=0.6) if dy != start else None
        ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7, color=color,
                    arrowprops=line)


def frontier(data, path, plt):
    """fwd+bwd time against extra memory, one panel per shape, first distribution (timing does not
    depend on it except for a method that skips tiles: drawn hollow from the other distribution)."""
    rows = [r for r in data["rows"] if ok(r)]
    style = peers_style(data["rows"])
    shapes, dists = order(data["rows"], "shape"), order(data["rows"], "dist")
    ncol = min(2, len(shapes))
    nrow = -(-len(shapes) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 4.4 * nrow), squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        here = [r for r in rows if r["shape"] == shape]
        base = [r for r in here if r["dist"] == dists[0]]
        floor = [r["fwdbwd_ms"] for r in base if r["method"] == "matmul"]
        top = 3 * floor[0] if floor else max(r["fwdbwd_ms"] for r in here) * 1.1
        labels = []
        for kind, mark in (("recompute", "o-"), ("chunked", "D-")):
            ours = sorted((r for r in base if r["method"].startswith("flce") and r["extra_mib"] is not None
                           and ("chunked" in r["method"]) == (kind == "chunked")), key=lambda r: r["extra_mib"])
            if ours:
                xs = [max(r["extra_mib"], MiB_FLOOR) for r in ours]
                ax.plot(xs, [r["fwdbwd_ms"] for r in ours], mark, color=OURS, ms=5,
                        label=f"ours, {kind} path (chunk_bytes)")
                labels += [(x, r["fwdbwd_ms"], short(r["method"]), OURS, ABOVE if kind == "recompute" else RIGHT)
                           for x, r in zip(xs, ours)]
        for r in here:
            if r["method"] not in style or r["extra_mib"] is None:
                continue
            if r["dist"] != dists[0] and abs(r["fwdbwd_ms"] - next((b["fwdbwd_ms"] for b in base
                                                                       if b["method"] == r["method"]), 0)) < 0.2 * r["fwdbwd_ms"]:
                continue  # same time on the other data: nothing to show
            color, marker = style[r["method"]]
            x, y = max(r["extra_mib"], MiB_FLOOR), r["fwdbwd_ms"]
            hollow = r["dist"] != dists[0]
            name = r["method"] + (f" ({r['dist']} data)" if hollow else "")
            if y > top:  # off the scale: an arrow at the top edge with its time
                ax.plot([x], [top * 0.97], "^", color=color, ms=7)
                labels.append((x, top * 0.97, f"{r['method']} {y:.0f} ms", color, BELOW))
                continue
            ax.plot([x], [y], marker, color=color, ms=7, mfc="none" if hollow else color, label=name)
        if floor:
            ax.axhline(floor[0], color="gray", ls="--", lw=0.8, label="3 cuBLAS matmuls (floor)")
        ax.set_xscale("log")
        ax.set_ylim(0, top)
        n = here[0] if here else {}
        ax.set_title(f"{shape}: N={n.get('N')}, H={n.get('H')}, V={n.get('V')} ({dists[0]} data)", fontsize=9)
        ax.set_xlabel("extra memory (MiB, log)", fontsize=8)
        ax.set_ylabel("fwd+bwd ms (lower is better)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5, loc="lower left")
        fig.canvas.draw()
        place(ax, labels)
    for ax in axes.flat[len(shapes):]:
        ax.set_visible(False)
    fig.suptitle(header(data["meta"]), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def accuracy(data, path, plt):
    """Time against the worse of the dX / dW relative errors, first shape, one panel per distribution."""
    rows = [r for r in data["rows"] if ok(r) and r.get("dx_rel") is not None and r.get("dw_rel") is not None]
    style = peers_style(data["rows"])
    shape, dists = order(data["rows"], "shape")[0], order(data["rows"], "dist")
    fig, axes = plt.subplots(1, len(dists), figsize=(5.6 * len(dists), 4.2), squeeze=False, sharey=True)
    for ax, dist in zip(axes[0], dists):
        here = [r for r in rows if r["shape"] == shape and r["dist"] == dist]
        ours = [r for r in here if r["method"].startswith("flce")]
        ax.plot([r["fwdbwd_ms"] for r in ours], [max(r["dx_rel"], r["dw_rel"]) for r in ours], "o", color=OURS,
                ms=6, label="ours (every chunk_bytes / strategy)")
        for r in here:
            if r["method"] in style:
                color, marker = style[r["method"]]
                ax.plot([r["fwdbwd_ms"]], [max(r["dx_rel"], r["dw_rel"])], marker, color=color, ms=7, label=r["method"])
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0e}"))
        ax.yaxis.set_minor_formatter(plt.FuncFormatter(lambda v, _: f"{v:.0e}" if round(v / 10 ** math.floor(
            math.log10(v))) in (2, 3, 5) else ""))
        ax.tick_params(axis="y", which="both", labelsize=7)
        n = here[0] if here else {}
        ax.set_title(f"{shape} {dist} data: N={n.get('N')}, H={n.get('H')}, V={n.get('V')}", fontsize=9)
        ax.set_xlabel("fwd+bwd ms (lower is better)", fontsize=8)
        ax.set_ylabel("max(dX, dW) relative error (log, lower is better)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6.5)
    fig.suptitle(f"{header(data['meta'])}\nerrors: relative Frobenius against the reference above", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory(data, path, plt):
    """Extra memory per method, one bar per shape that has the first shape's H and V (S1 and S4: the
    same head at 8x the tokens), first distribution (memory does not depend on the data)."""
    dist = order(data["rows"], "dist")[0]
    rows = [r for r in data["rows"] if ok(r) and r["extra_mib"] is not None and r["dist"] == dist]
    if not rows:  # e.g. a CPU run: no memory figures
        fig, ax = plt.subplots(figsize=(6, 2))
        ax.text(0.5, 0.5, "no extra-memory measurements in this run", ha="center", transform=ax.transAxes)
        ax.set_axis_off()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return
    first = rows[0]
    shapes = [s for s in order(rows, "shape")
              if any(r["shape"] == s and (r["H"], r["V"]) == (first["H"], first["V"]) for r in rows)]
    methods = order(rows, "method")
    fig, ax = plt.subplots(figsize=(7.5, 0.2 * len(methods) * len(shapes) + 1.4))
    height = 0.8 / len(shapes)
    for k, s in enumerate(shapes):
        got = {r["method"]: max(r["extra_mib"], MiB_FLOOR) for r in rows if r["shape"] == s}
        ys = [i + k * height for i, m in enumerate(methods) if m in got]
        vals = [got[m] for m in methods if m in got]
        n = next(r["N"] for r in rows if r["shape"] == s)
        ax.barh(ys, vals, height=height, color=f"C{k}", label=f"{s}: N={n}")
        for y, v in zip(ys, vals):
            ax.text(v * 1.08, y, f"{v:,.0f}" if v >= 10 else f"{v:.1f}", va="center", fontsize=6.5)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(methods))], methods, fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("extra memory above inputs and gradients (MiB, log)", fontsize=8)
    ax.set_title(f"extra memory, H={first['H']}, V={first['V']} ({header(data['meta']).split(' · ')[0]})", fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


LOGPROBS_VERSIONS = ("torch", "triton", "trl", "transformers")


def logprobs_header(meta):
    vers = ", ".join(f"{k} {meta[k]}" for k in LOGPROBS_VERSIONS if meta.get(k))
    return f"GPU: {meta.get('gpu')} · {vers} · {meta.get('date')} · per-token harness (bench_logprobs.py)"


def logprobs_table(data):
    """The bench_logprobs.py table: one line per (shape, dist, workload, method), the matmul first."""
    meta, rows = data["meta"], data["rows"]
    out = [logprobs_header(meta), ""]
    for key, s in meta.get("data", {}).items():
        mm = f", one matmul {s['matmul_ms']:.2f} ms" if s.get("matmul_ms") else ""
        out.append(f"- {key}: reference {s.get('reference')}; mean p(target) {s['mean_p_target']:.3g}, mean entropy "
                   f"{s['mean_entropy']:.3g}, target is top-1 for {s['top1_share']:.0%}{mm}")
    out.append(f"- grpo loss: -(log_probs * adv).mean() - {meta.get('entropy_coef')} * entropy.mean(); errors are "
               "relative Frobenius against the reference; top-1: share of tokens whose is_top1 differs from it")
    for s in meta.get("skipped", []):
        out.append(f"- skipped {s}")
    for note in meta.get("notes", []):
        out.append(f"- {note}")
    out += ["", "| shape | dist | workload | method | fwd ms | fwd / matmul | fwd+bwd ms | extra MiB | loss err | "
            "dX err | dW err | log_probs err | entropy err | top-1 diff |", "|---" * 14 + "|"]
    for r in rows:
        method = "matmul (1; 3 for fwd+bwd)" if r["method"] == "matmul" else r["method"]
        lead = f"| {r['shape']} ({r['N']}x{r['H']}x{r['V']}) | {r['dist']} | {r['workload']} | {method} |"
        if r.get("error"):
            out.append(f"{lead} error: {r['error'][:80].replace('|', '/')} |" + " |" * 9)
            continue
        cells = [e(r.get("fwd_ms"), ".2f"), e(r.get("fwd_x_matmul"), ".2f"), e(r.get("fwdbwd_ms"), ".2f"),
                 e(r.get("extra_mib"), ".1f"), e(r.get("loss_rel")), e(r.get("dx_rel")), e(r.get("dw_rel")),
                 e(r.get("logprobs_rel")), e(r.get("entropy_rel")), e(r.get("top1_mismatch"), ".2%")]
        out.append(f"{lead} " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def logprobs_figure(data, path, plt):
    """Bars per shape, one per method: top fwd+bwd ms (ref: fwd ms) with the matmul floor (3 matmuls;
    ref: 1) as a black line over each shape's bars, bottom extra MiB; one column per workload; first
    distribution (the times hardly depend on it). Log axes: S4 is 8x S1."""
    rows = [r for r in data["rows"] if not r.get("error")]
    dist = order(data["rows"], "dist")[0]
    shapes = order(data["rows"], "shape")
    workloads = [w for w in order(data["rows"], "workload") if w != "-"]
    methods = [m for m in order(data["rows"], "method") if m != "matmul"]
    if not workloads or not methods:
        return
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.6 * len(workloads), 6.4), squeeze=False)
    width = 0.8 / len(methods)
    for col, wl in enumerate(workloads):
        key = "fwd_ms" if wl == "ref" else "fwdbwd_ms"
        for ax, what in zip(axes[:, col], (key, "extra_mib")):
            for k, m in enumerate(methods):
                got = {r["shape"]: r[what] for r in rows if r["workload"] == wl and r["method"] == m
                       and r["dist"] == dist and r.get(what) is not None}
                xs = [i + (k - (len(methods) - 1) / 2) * width for i, s in enumerate(shapes) if s in got]
                vals = [max(got[s], MiB_FLOOR) for s in shapes if s in got]
                ax.bar(xs, vals, width=width, color=OURS if m == "flce" else f"C{1 + k}", label=m)
            if what != "extra_mib":
                for i, s in enumerate(shapes):
                    mm = next((r[key] for r in rows if r["method"] == "matmul" and r["shape"] == s
                               and r["dist"] == dist and r.get(key)), None)
                    if mm:
                        ax.plot([i - 0.45, i + 0.45], [mm, mm], color="black", lw=1.2,
                                label=("1 matmul" if wl == "ref" else "3 matmuls") if i == 0 else None)
            ax.set_yscale("log")
            ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.tick_params(axis="y", labelsize=7)
        axes[0, col].set_title(f"{wl} ({dist} data)", fontsize=9)
        axes[0, col].set_ylabel(("fwd" if wl == "ref" else "fwd+bwd") + " ms (log, lower is better)", fontsize=8)
        axes[1, col].set_ylabel("extra MiB (log)", fontsize=8)
        axes[0, col].legend(fontsize=6.5)
    fig.suptitle(logprobs_header(data["meta"]), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", default="benchmarks/results/h200.json")
    ap.add_argument("--out", default=None, help="folder for the outputs (default: beside the JSON)")
    args = ap.parse_args(argv)
    src = Path(args.json)
    data = json.loads(src.read_text())
    out = Path(args.out) if args.out else src.parent
    out.mkdir(parents=True, exist_ok=True)
    stem = src.stem
    logprobs = data.get("meta", {}).get("harness") == "bench_logprobs"
    (out / f"{stem}.md").write_text(logprobs_table(data) if logprobs else table(data))
    print(f"wrote {out / f'{stem}.md'}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib missing; PNGs skipped", file=sys.stderr)
        return
    figures = (("logprobs", logprobs_figure),) if logprobs else (("frontier", frontier), ("accuracy", accuracy), ("memory", memory))
    for name, draw in figures:
        draw(data, out / f"{stem}_{name}.png", plt)
        print(f"wrote {out / f'{stem}_{name}.png'}")


if __name__ == "__main__":
    main()
