"""Markdown tables from a bench_distill.py JSON: the full table beside it, and a summary into a README block.

    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json                # writes h200.md beside it
    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json --readme README.md
    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json --readme README.md --check

The full table: one row per (shape, dist, beta, method), time (median of the rounds, ± half their
range), its ratio to the floor and to TRL's head, extra memory and the errors against the reference.
The README block, from ``<!-- results:distill -->`` to ``<!-- /results:distill -->`` (markers kept, each
on its own line, the rest of the file untouched; the convention of ``render.py``): one row per (shape,
dist, beta), one cell "ms, MiB" per method. ``--check`` exits 1 where the block differs from the JSON.
Standard library only.
"""

import argparse
import json
import re
import sys
from pathlib import Path

BLOCK_NAME = "distill"
BLOCK = re.compile(rf"^<!-- results:{BLOCK_NAME} -->\n(.*?)^<!-- /results:{BLOCK_NAME} -->$", re.MULTILINE | re.DOTALL)
SUMMARY_METHODS = (  # (method, column label)
    ("flce", "ours"),
    ("flce-fast", "ours, one chunk"),
    ("flce-trl", "ours via TRL's call"),
    ("trl", "TRL's head"),
    ("liger", "Liger"),
    ("torch-compile", "torch.compile"),
    ("matmul", "4 matmuls (floor)"),
)


def _e(x, spec=".1e"):
    return "" if x is None else format(x, spec)


def _ms(row):
    if row.get("fwdbwd_ms") is None:
        return ""
    rounds = row.get("fwdbwd_ms_rounds") or []
    half = (max(rounds) - min(rounds)) / 2 if len(rounds) > 1 else None
    return f"{row['fwdbwd_ms']:.1f}" + (f" ± {half:.1f}" if half is not None else "")


def header(meta):
    vers = ", ".join(f"{k} {meta[k]}" for k in ("torch", "triton", "trl", "liger-kernel", "transformers") if meta.get(k))
    commit = meta.get("commit")
    commit = "unknown commit" if not commit else commit[:10] + (" (dirty)" if meta.get("dirty") else "")
    return f"GPU: {meta.get('gpu')} · {vers} · {meta.get('date')} · {commit} · reference: {meta.get('reference')}"


def _case(row):
    return row["shape"], row["dist"], row["beta"]


def _by_case(rows):
    cases = {}
    for r in rows:
        cases.setdefault(_case(r), {})[r["method"]] = r
    return cases


def full_table(data):
    meta, rows = data["meta"], data["rows"]
    out = [header(meta), ""]
    for key, s in meta.get("data", {}).items():
        out.append(f"- {key}: mean p_t(top) {s['mean_p_teacher_top']:.3g}, p_s(top) {s['mean_p_student_top']:.3g}, "
                   f"top-1 agreement {s['top1_agreement']:.2f}, reference loss {s['ref_loss']:.4g}")
    for s in meta.get("skipped", []):
        out.append(f"- skipped {s}")
    for note in meta.get("notes", []):
        out.append(f"- note: {note}")
    out += ["", "| shape | dist | beta | method | fwd+bwd ms | x floor | x TRL | extra MiB | loss err | dX err | dW err |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    cases = _by_case(rows)
    for r in rows:
        lead = f"| {r['shape']} | {r['dist']} | {r['beta']:g} | {r['method']} |"
        if r.get("skipped") or r.get("error"):
            what = f"skipped: {r['skipped']}" if r.get("skipped") else f"error: {r['error']}"
            out.append(f"{lead} {what.replace('|', '/')[:120]} | | | | | | |")
            continue
        trl = cases[_case(r)].get("trl", {}).get("fwdbwd_ms")
        x_trl = r["fwdbwd_ms"] / trl if trl and r.get("fwdbwd_ms") else None
        out.append(f"{lead} {_ms(r)} | {_e(r.get('x_floor'), '.2f')} | {_e(x_trl, '.2f')} | "
                   f"{_e(r.get('extra_mib'), '.0f')} | {_e(r.get('loss_rel'))} | {_e(r.get('dx_rel'))} | {_e(r.get('dw_rel'))} |")
    return "\n".join(out) + "\n"


def summary_block(data):
    """The README block's body: fwd+bwd ms and extra MiB per method, one row per case."""
    meta, rows = data["meta"], data["rows"]
    present = {r["method"] for r in rows}
    cols = [(m, label) for m, label in SUMMARY_METHODS if m in present]
    out = [header(meta), "",
           "| shape | dist | beta | " + " | ".join(label for _, label in cols) + " |",
           "|---|---|---|" + "---:|" * len(cols)]
    for (shape, dist, beta), by in _by_case(rows).items():
        cells = []
        for m, _ in cols:
            r = by.get(m)
            if r is None or r.get("skipped"):
                cells.append("")
            elif r.get("error"):
                cells.append("error")
            elif r.get("extra_mib") is None:
                cells.append(f"{r['fwdbwd_ms']:.1f}" if r.get("fwdbwd_ms") is not None else "")
            else:
                cells.append(f"{r['fwdbwd_ms']:.1f}, {r['extra_mib']:.0f}")
        out.append(f"| {shape} | {dist} | {beta:g} | " + " | ".join(cells) + " |")
    out += ["", "Cells: forward+backward ms (median of interleaved rounds), extra MiB beyond inputs and gradients. "
            "beta 0: forward KL, 1: reverse KL, 0.5: JSD."]
    return "\n".join(out)


def fill(text, body):
    """``text`` with its distill block's body replaced; ValueError when the block is missing or twice."""
    found = BLOCK.findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one <!-- results:{BLOCK_NAME} --> ... <!-- /results:{BLOCK_NAME} --> block, "
                         f"found {len(found)}")
    return BLOCK.sub(lambda m: f"<!-- results:{BLOCK_NAME} -->\n{body}\n<!-- /results:{BLOCK_NAME} -->", text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench_distill.py JSON")
    ap.add_argument("--md", default=None, help="the full table's path (default: the JSON's, .md)")
    ap.add_argument("--readme", default=None, help="a file with a results:distill block to fill")
    ap.add_argument("--check", action="store_true", help="with --readme: compare only, exit 1 where it differs")
    args = ap.parse_args(argv)
    path = Path(args.json)
    data = json.loads(path.read_text())
    if data["meta"].get("harness") != "bench_distill":
        ap.error(f"{path} is not a bench_distill.py JSON")
    if not args.check:
        md = Path(args.md) if args.md else path.with_suffix(".md")
        md.write_text(full_table(data))
        print(f"wrote {md}")
    if args.readme:
        readme = Path(args.readme)
        text = readme.read_text()
        new = fill(text, summary_block(data))
        if args.check:
            if new != text:
                print(f"{readme}: the results:{BLOCK_NAME} block differs from {path}", file=sys.stderr)
                return 1
            return 0
        readme.write_text(new)
        print(f"filled the results:{BLOCK_NAME} block of {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
