"""Markdown tables from a bench_distill.py JSON: the full table beside it, and summaries into README blocks.

    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json                # writes h200.md beside it
    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json --readme README.md
    python3 benchmarks/render_distill.py benchmarks/results/distill/h200.json --readme README.md --check
    python3 benchmarks/render_distill.py --blocks [--check]     # every block of BLOCKS (the docs' own)

The full table: one row per (shape, dist, beta, method), time (median of the rounds, ± half their
range), its ratio to the floor and to TRL's head, extra memory and the errors against the reference.
A block, from ``<!-- results:NAME -->`` to ``<!-- /results:NAME -->`` (``--block``, default
"distill"; markers kept, each on its own line, the rest of the file untouched; the convention of
``render.py``): the run's header and source, one row per (shape, dist, beta) (``--shapes`` /
``--dists`` keep some), one cell "ms, MiB" per method. ``--check`` exits 1 where a block differs
from its JSON. ``--blocks``: the blocks that README.md and docs/benchmarks.md show, listed with
their JSON in BLOCKS (``benchmarks/results/distill/blocks.json``; ``tests/packaging`` checks them).
Standard library only.
"""

import argparse
import json
import re
import sys
from pathlib import Path

BLOCK_NAME = "distill"
ROOT = Path(__file__).resolve().parents[1]
BLOCKS = ROOT / "benchmarks" / "results" / "distill" / "blocks.json"
SUMMARY_METHODS = (  # (method, column label)
    ("flce", "ours"),
    ("flce-fast", "ours, one chunk"),
    ("flce-trl", "ours via TRL's call"),
    ("flce-none", "ours, \"none\""),
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


def _block(name):
    return re.compile(rf"^<!-- results:{name} -->\n(.*?)^<!-- /results:{name} -->$", re.MULTILINE | re.DOTALL)


def summary_block(data, source=None, shapes=None, dists=None):
    """A block's body: fwd+bwd ms and extra MiB per method, one row per case (those of ``shapes`` and
    ``dists`` where given); ``source``: the JSON's path, named under the header."""
    meta = data["meta"]
    rows = [r for r in data["rows"] if (not shapes or r["shape"] in shapes) and (not dists or r["dist"] in dists)]
    present = {r["method"] for r in rows}
    cols = [(m, label) for m, label in SUMMARY_METHODS if m in present]
    out = [header(meta) + (f" · `{source}`" if source else ""), "",
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


def fill(text, body, name=BLOCK_NAME):
    """``text`` with its block ``name``'s body replaced; ValueError when the block is missing or twice."""
    block = _block(name)
    found = block.findall(text)
    if len(found) != 1:
        raise ValueError(f"expected one <!-- results:{name} --> ... <!-- /results:{name} --> block, "
                         f"found {len(found)}")
    return block.sub(lambda m: f"<!-- results:{name} -->\n{body}\n<!-- /results:{name} -->", text)


def render_block(readme: Path, json_path: Path, name=BLOCK_NAME, shapes=None, dists=None, check=False,
                 source=None) -> bool:
    """Fills (or with ``check`` compares) ``readme``'s block ``name`` from ``json_path``; whether it was
    already the same."""
    data = json.loads(json_path.read_text())
    text = readme.read_text()
    new = fill(text, summary_block(data, source or str(json_path), shapes, dists), name)
    if new == text:
        return True
    if check:
        print(f"{readme}: the results:{name} block differs from {json_path}", file=sys.stderr)
    else:
        readme.write_text(new)
        print(f"filled the results:{name} block of {readme}")
    return False


def render_blocks(root: Path = ROOT, check=False) -> bool:
    """Every block of ``BLOCKS`` ([{"file", "block", "json", "shapes"?, "dists"?}], paths from the
    repository's root); whether all were already the same."""
    same = True
    for b in json.loads((root / BLOCKS.relative_to(ROOT)).read_text()):
        same &= render_block(root / b["file"], root / b["json"], b["block"], b.get("shapes"), b.get("dists"),
                             check, source=b["json"])
    return same


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="?", help="a bench_distill.py JSON")
    ap.add_argument("--md", default=None, help="the full table's path (default: the JSON's, .md)")
    ap.add_argument("--readme", default=None, help="a file with a results block to fill")
    ap.add_argument("--block", default=BLOCK_NAME, help="the block's name (results:NAME)")
    ap.add_argument("--shapes", default=None, help="comma-separated shapes the block keeps (default all)")
    ap.add_argument("--dists", default=None, help="comma-separated distributions the block keeps (default all)")
    ap.add_argument("--blocks", action="store_true", help="every block listed in benchmarks/results/distill/blocks.json")
    ap.add_argument("--check", action="store_true", help="compare only, exit 1 where a block differs")
    args = ap.parse_args(argv)
    if args.blocks:
        return 0 if render_blocks(check=args.check) or not args.check else 1
    if args.json is None:
        ap.error("a JSON, or --blocks")
    path = Path(args.json)
    data = json.loads(path.read_text())
    if data["meta"].get("harness") != "bench_distill":
        ap.error(f"{path} is not a bench_distill.py JSON")
    if not args.check:
        md = Path(args.md) if args.md else path.with_suffix(".md")
        md.write_text(full_table(data))
        print(f"wrote {md}")
    if args.readme:
        split = lambda s: s.split(",") if s else None  # noqa: E731
        same = render_block(Path(args.readme), path, args.block, split(args.shapes), split(args.dists), args.check)
        if args.check and not same:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
