"""Figures and the README table from a bench.py JSON.

    python3 benchmarks/plot.py [benchmarks/results/h200.json] [--out DIR]

Writes, beside the JSON (or under --out), for a JSON named <stem>.json:
  <stem>.md            markdown table: shape, dist, method, times, extra memory, errors, TFLOP/s
  <stem>_frontier.png  forward+backward time against extra memory, one panel per (dist, shape):
                       our chunk_bytes settings as a curve, peers as labelled points, the 3-matmul floor
  <stem>_memory.png    extra memory against N for the methods measured at both S1 and S4 (same H, V)
The table needs nothing beyond the standard library; the PNGs need matplotlib (skipped with a note
when it is missing).
"""

import argparse
import json
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
    vers = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "liger-kernel", "cut-cross-entropy") if meta.get(k))
    return f"GPU: {meta.get('gpu')} · {vers} · {meta.get('date')} · reference: {meta.get('reference', 'fp32 logits')}"


def table(data):
    meta, rows = data["meta"], data["rows"]
    out = [header(meta), ""]
    for key, s in meta.get("data", {}).items():
        mm = f", one matmul {s['matmul_tflops']:.0f} TFLOP/s" if s.get("matmul_tflops") else ""
        out.append(f"- {key}: mean p(target) {s['mean_p_target']:.3g}, logit std {s['logit_std']:.2f}, "
                   f"reference loss {s['ref_loss']:.3f}{mm}")
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
        out.append(f"{lead} {e(r['fwd_ms'], '.2f')} | {e(r['fwdbwd_ms'], '.2f')} | {e(r['extra_mib'], '.1f')} | "
                   f"{e(r['dx_rel'])} | {e(r['dw_rel'])} | {tf} |")
    return "\n".join(out) + "\n"


def colors(rows):
    """One colour per method across all panels (C0 is ours)."""
    peers = [m for m in order(rows, "method") if not m.startswith("flce")]
    return {m: f"C{1 + k % 9}" for k, m in enumerate(peers)}


def frontier(data, path, plt):
    rows = data["rows"]
    color = colors(rows)
    shapes, dists = order(rows, "shape"), order(rows, "dist")
    fig, axes = plt.subplots(len(dists), len(shapes), figsize=(4.6 * len(shapes), 3.9 * len(dists)), squeeze=False)
    for i, dist in enumerate(dists):
        for j, shape in enumerate(shapes):
            ax = axes[i][j]
            here = [r for r in rows if r["shape"] == shape and r["dist"] == dist]
            for kind, style, label in (("recompute", "o-", "ours, recompute (chunk_bytes)"),
                                       ("chunked", "D-", "ours, chunked (chunk_bytes)")):
                ours = sorted((r for r in here if ok(r) and r["method"].startswith("flce") and r["extra_mib"] is not None
                               and ("chunked" in r["method"]) == (kind == "chunked")), key=lambda r: r["extra_mib"])
                if not ours:
                    continue
                xs = [max(r["extra_mib"], MiB_FLOOR) for r in ours]
                ax.plot(xs, [r["fwdbwd_ms"] for r in ours], style, color="C0", label=label,
                        alpha=1.0 if kind == "recompute" else 0.7)
                for x, r in zip(xs, ours):
                    ax.annotate(r["method"], (x, r["fwdbwd_ms"]), fontsize=7, color="C0",
                                xytext=(3, 3), textcoords="offset points")
            peers = [r for r in here if ok(r) and not r["method"].startswith("flce") and r["method"] != "matmul"
                     and r["extra_mib"] is not None]
            for r in peers:
                x = max(r["extra_mib"], MiB_FLOOR)
                ax.plot([x], [r["fwdbwd_ms"]], "s", color=color[r["method"]])
                ax.annotate(r["method"], (x, r["fwdbwd_ms"]), fontsize=7, xytext=(3, -9), textcoords="offset points")
            floor = [r for r in here if ok(r) and r["method"] == "matmul"]
            if floor:
                ax.axhline(floor[0]["fwdbwd_ms"], color="gray", ls="--", lw=0.8, label="3 matmuls")
            ax.set_xscale("log")
            ax.set_ylim(bottom=0)
            n = here[0] if here else {}
            ax.set_title(f"{shape} {dist}: {n.get('N')}x{n.get('H')}x{n.get('V')}", fontsize=9)
            ax.set_xlabel("extra memory (MiB, log)", fontsize=8)
            ax.set_ylabel("fwd+bwd ms", fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            if i == 0 and j == 0:
                ax.legend(fontsize=7)
    fig.suptitle(header(data["meta"]), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory(data, path, plt):
    """Extra memory against N for the methods that ran at both S1 and S4 (same H and V)."""
    rows = [r for r in data["rows"] if ok(r) and r["extra_mib"] is not None and r["shape"] in ("S1", "S4")]
    dists = order(data["rows"], "dist")
    fig, axes = plt.subplots(1, len(dists), figsize=(5.5 * len(dists), 4.2), squeeze=False)
    for ax, dist in zip(axes[0], dists):
        here = [r for r in rows if r["dist"] == dist]
        for k, m in enumerate(order(here, "method")):
            pts = sorted((r["N"], max(r["extra_mib"], MiB_FLOOR)) for r in here if r["method"] == m)
            if len({n for n, _ in pts}) < 2:
                continue
            style = "o-" if m.startswith("flce") else "s--"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, color=f"C{k % 10}", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N tokens (H=4096, V=128256)", fontsize=8)
        ax.set_ylabel("extra memory (MiB, log)", fontsize=8)
        ax.set_title(f"extra memory vs N, {dist}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no method ran at both S1 and S4", ha="center", transform=ax.transAxes)
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
    (out / f"{stem}.md").write_text(table(data))
    print(f"wrote {out / f'{stem}.md'}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib missing; PNGs skipped", file=sys.stderr)
        return
    frontier(data, out / f"{stem}_frontier.png", plt)
    memory(data, out / f"{stem}_memory.png", plt)
    print(f"wrote {out / f'{stem}_frontier.png'} and {out / f'{stem}_memory.png'}")


if __name__ == "__main__":
    main()
