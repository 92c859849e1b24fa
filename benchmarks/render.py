"""The README's and docs' result tables, rendered from the committed bench.py JSON.

    python3 benchmarks/render.py            # rewrite the blocks of README.md and docs/benchmarks.md in place
    python3 benchmarks/render.py --check    # exit 1 with a diff where a file's blocks differ from the JSON

A block is the lines from ``<!-- results:NAME -->`` to ``<!-- /results:NAME -->`` (both markers kept,
each on its own line); everything between them is the renderer's. Blocks:
  summary   README: time and extra memory at S1 and S4 for ours (default, chunked 1 GiB, one chunk),
            torch.compile, Liger and TRL's head, on the random data
  settings  README "Choosing a setting": you want | pass | S1 | S4, each cell "ms, MiB"
  full      docs/benchmarks.md: one table per shape, every method, both distributions
Times are the median over the JSON's interleaved rounds, "±" half the range of the rounds (none
where a row has one round: a JSON written before the rounds were kept). README's summary and
settings and the docs' full block are required: a file without one of them is an error. Blocks
another renderer owns (``FOREIGN``: ``render_distill.py``'s distillation tables) are left as they are.
"""

import argparse
import difflib
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JSON = "benchmarks/results/h200.json"
FILES = {"README.md": ("summary", "settings"), "docs/benchmarks.md": ("full",)}
SUMMARY_DIST = "random"
BLOCK = re.compile(r"^<!-- results:([\w-]+) -->\n(.*?)^<!-- /results:\1 -->$", re.MULTILINE | re.DOTALL)
OPEN = re.compile(r"^<!-- (/?)results:([\w-]+) -->$", re.MULTILINE)
# Names of the blocks ``render_distill.py`` renders and checks (``benchmarks/results/distill/blocks.json``).
FOREIGN = re.compile(r"distill(_\w+)?")

SUMMARY_ROWS = (  # (method in the JSON, label)
    ("flce", "ours, default"),
    ("flce-chunked-1G", 'ours, `strategy="chunked", chunk_bytes=1 << 30`'),
    ("flce-chunked-whole", 'ours, one chunk (`strategy="chunked", chunk_bytes=1 << 50`)'),
    ("torch-compile", "torch.compile"),
    ("liger", "Liger"),
    ("trl", "TRL's head (`ChunkedLogProbFunction`)"),
)
SETTINGS_ROWS = (  # (you want, pass, method)
    ("bounded memory at any N (default)", "nothing", "flce"),
    ("less memory", "`chunk_bytes=64 << 20`", "flce-64M"),
    ("speed at <= 1.5 GiB", '`strategy="chunked", chunk_bytes=1 << 30`', "flce-chunked-1G"),
    ("long context in less memory", "`chunk_bytes=1280 << 20`", "flce-auto-1280M"),
    ("memory to spare", '`strategy="chunked", chunk_bytes=1 << 50` (one chunk)', "flce-chunked-whole"),
)
LABELS = {
    "matmul": "one cuBLAS matmul (3 for fwd+bwd)",
    "flce": "**ours, default**",
    "torch": "torch (fp32 logits)",
    "torch-compile": "torch.compile",
    "liger": "Liger",
    "liger-fp32": "Liger, `accum_dtype=torch.float32`",
    "cce": "Cut Cross-Entropy",
    "cce-exact": "CCE, `filter_eps=None`",
    "trl": "TRL's head, chunk 32768",
}
VERSIONS = ("torch", "triton", "liger-kernel", "cut-cross-entropy", "trl")


class BlockError(ValueError):
    """A file's markers are missing, unknown, unbalanced or nested."""


# --- figures -------------------------------------------------------------------------------------


def index(rows):
    return {(r["shape"], r["dist"], r["method"]): r for r in rows}


def ms(row, key="fwdbwd_ms"):
    """'57.0 ±0.3' (median, half the range of the rounds), '57.0' for one round, '-' when absent."""
    if row is None or row.get(key) is None:
        return "error" if row is not None and row.get("error") else "-"
    text = f"{row[key]:.1f}"
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if lo is not None and hi is not None and len(row.get(f"{key}_rounds") or ()) > 1:
        text += f" ±{(hi - lo) / 2:.1f}"
    return text


def mib(row):
    if row is None or row.get("extra_mib") is None:
        return "-"
    x = row["extra_mib"]
    return f"{x:.1f}" if x < 10 else f"{x:,.0f}"


def err(row, key):
    return "-" if row is None or row.get(key) is None else f"{row[key]:.1e}"


def pair(a, b):
    """'a / b', or 'a' when both read the same."""
    return a if a == b else f"{a} / {b}"


def size_expr(n):
    """201326592 -> '192 << 20', 1 << 50 -> '1 << 50'."""
    for shift in (50, 40, 30, 20, 10):
        if n % (1 << shift) == 0:
            return f"{n >> shift} << {shift}"
    return str(n)


def label(row):
    """The method's name in the tables: ours as the call's keywords, peers by name."""
    method = row["method"]
    if method in LABELS:
        return LABELS[method]
    if method.startswith("flce") and row.get("chunk_bytes") is not None:
        strategy = row.get("strategy", "auto")
        kw = ("" if strategy == "auto" else f'strategy="{strategy}", ') + f"chunk_bytes={size_expr(row['chunk_bytes'])}"
        return f"ours, `{kw}`"
    return f"`{method}`"


def shape_label(rows, shape):
    r = next((r for r in rows if r["shape"] == shape), None)
    return shape if r is None else f"{shape} ({r['N']} x {r['H']} x {r['V']})"


def order(rows, key):
    return list(dict.fromkeys(r[key] for r in rows))


# --- captions ------------------------------------------------------------------------------------


def runs_of(meta, rows):
    """Per shape, the call that measured it: date, commit, dirty, rounds, GPU and versions."""
    if "shape_runs" in meta:
        return meta["shape_runs"]
    run = {k: meta.get(k) for k in ("date", "commit", "dirty", "gpu", *VERSIONS)}
    run["rounds"] = (meta.get("args") or {}).get("rounds", 1)
    return {s: run for s in order(rows, "shape")}


def provenance(run):
    vers = ", ".join(f"{k} {run[k]}" for k in VERSIONS if run.get(k))
    date = (run.get("date") or "date not recorded")[:10]
    commit = run.get("commit")
    pkg = f"package of {commit[:7]}" + (" with uncommitted changes" if run.get("dirty") else "") if commit \
        else "commit not recorded"
    n = run.get("rounds") or 1
    rounds = f"median of {n} interleaved rounds ±half their range" if n > 1 else "one round"
    return f"{vers}; {date}, {pkg}, {rounds}"


def caption(data, shapes, what):
    """One line: GPU, and per shape (or once, where they agree) versions, date, commit and rounds."""
    meta, rows = data["meta"], data["rows"]
    runs = runs_of(meta, rows)
    shapes = [s for s in shapes if s in runs]
    per = {s: provenance(runs[s]) for s in shapes}
    gpus = list(dict.fromkeys(runs[s].get("gpu") or meta.get("gpu") for s in shapes)) or [meta.get("gpu")]
    groups = {}  # provenance -> its shapes
    for s, p in per.items():
        groups.setdefault(p, []).append(s)
    if len(groups) == 1:
        when = next(iter(groups))
    else:
        when = "; ".join(f"{', '.join(ss)}: {p}" for p, ss in groups.items()) or "no runs recorded"
    return f"One {' / '.join(str(g) for g in gpus)}, bf16, {what}; {when} (`{JSON}`)."


# --- blocks --------------------------------------------------------------------------------------


def summary(data):
    rows = data["rows"]
    at = index(rows)
    shapes = ("S1", "S4")
    dims = ", ".join(shape_label(rows, s) for s in shapes)
    out = [caption(data, shapes, f"{dims}, `{SUMMARY_DIST}` data, forward+backward ms and extra MiB above the "
                   "inputs and gradients"), "",
           "| method | " + " | ".join(f"{s} fwd+bwd ms | {s} extra MiB" for s in shapes) + " |",
           "|---|" + "---|---|" * len(shapes)]
    for method, text in SUMMARY_ROWS:
        cells = []
        for s in shapes:
            row = at.get((s, SUMMARY_DIST, method))
            cells += [ms(row), mib(row)]
        out.append(f"| {text} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def settings(data):
    rows = data["rows"]
    at = index(rows)
    shapes = ("S1", "S4")
    out = [caption(data, shapes, f"`{SUMMARY_DIST}` data, forward+backward ms, extra MiB"), "",
           "| you want | pass | " + " | ".join(shape_label(rows, s) for s in shapes) + " |",
           "|---|---|" + "---|" * len(shapes)]
    for want, how, method in SETTINGS_ROWS:
        cells = []
        for s in shapes:
            row = at.get((s, SUMMARY_DIST, method))
            cells.append("-" if row is None else ("error" if row.get("error") else f"{ms(row)} ms, {mib(row)} MiB"))
        out.append(f"| {want} | {how} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def full(data):
    rows = data["rows"]
    at = index(rows)
    shapes = order(rows, "shape")
    dists = order(rows, "dist")
    out = [caption(data, shapes, f"every method; each cell {' / '.join(dists)} data, extra MiB once where "
                   "they agree, errors relative to an fp32-logit reference")]
    for s in shapes:
        dists = [d for d in order(rows, "dist") if any(r["shape"] == s and r["dist"] == d for r in rows)]
        out += ["", f"**{shape_label(rows, s)}**", "",
                "| method | fwd ms | fwd+bwd ms | extra MiB | dX err | dW err |",
                "|---|---|---|---|---|---|"]
        for method in order([r for r in rows if r["shape"] == s], "method"):
            got = [at.get((s, d, method)) for d in dists]
            errors = [r["error"] for r in got if r is not None and r.get("error")]
            name = label(next(r for r in got if r is not None))
            if errors:
                out.append(f"| {name} | error: {errors[0][:80].replace('|', '/')} | | | | |")
                continue
            cells = [" / ".join(ms(r, "fwd_ms") for r in got), " / ".join(ms(r) for r in got),
                     " / ".join(dict.fromkeys(mib(r) for r in got)),
                     " / ".join(err(r, "dx_rel") for r in got), " / ".join(err(r, "dw_rel") for r in got)]
            if method == "matmul":
                cells[2:] = ["", "", ""]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    skipped = [x for x in data["meta"].get("skipped", [])]
    if skipped:
        out += ["", "Not run: " + "; ".join(skipped) + "."]
    return "\n".join(out)


RENDERERS = {"summary": summary, "settings": settings, "full": full}


def render_all(data):
    return {name: fn(data) for name, fn in RENDERERS.items()}


def apply(text, blocks, required=()):
    """``text`` with each block's body replaced by ``blocks[name]``; BlockError for a missing required
    block, an unknown name, or markers that do not pair up."""
    marks = [(m[1] == "/", m[2]) for m in OPEN.finditer(text)]
    depth = None
    for closing, name in marks:
        if name not in blocks and not FOREIGN.fullmatch(name):
            raise BlockError(f"unknown block {name!r} (known: {', '.join(blocks)})")
        if closing != (depth is not None) or (closing and name != depth):
            raise BlockError(f"unpaired or nested marker of block {name!r}")
        depth = None if closing else name
    if depth is not None:
        raise BlockError(f"block {depth!r} is not closed")
    found = [m[1] for m in BLOCK.finditer(text)]
    for name in required:
        if name not in found:
            raise BlockError(f"required block {name!r} is missing")
    if len(found) != len(set(found)):
        raise BlockError("a block appears twice")
    return BLOCK.sub(lambda m: f"<!-- results:{m[1]} -->\n{blocks[m[1]]}\n<!-- /results:{m[1]} -->"
                     if m[1] in blocks else m[0], text)


def check(root=REPO, json_path=None, files=FILES):
    """Problems (diffs or block errors), one string each; empty when every file matches its rendering."""
    root = Path(root)
    data = json.loads((root / (json_path or JSON)).read_text())
    blocks = render_all(data)
    problems = []
    for rel, required in files.items():
        path = root / rel
        if not path.exists():
            problems.append(f"{rel}: missing")
            continue
        text = path.read_text()
        try:
            want = apply(text, blocks, required)
        except BlockError as e:
            problems.append(f"{rel}: {e}")
            continue
        if want != text:
            diff = difflib.unified_diff(text.splitlines(True), want.splitlines(True), f"{rel} (committed)",
                                        f"{rel} (rendered)")
            problems.append("".join(diff))
    return problems


def write(root=REPO, json_path=None, files=FILES):
    """Rewrites the blocks in place; BlockError (nothing written to that file) as check reports it."""
    root = Path(root)
    blocks = render_all(json.loads((root / (json_path or JSON)).read_text()))
    changed = []
    for rel, required in files.items():
        path = root / rel
        text = path.read_text()
        new = apply(text, blocks, required)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    return changed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare, do not write; exit 1 on a difference")
    ap.add_argument("--json", default=JSON, help="the bench.py JSON, relative to --root (default %(default)s)")
    ap.add_argument("--root", default=str(REPO), help="the repository root (default: this checkout)")
    args = ap.parse_args(argv)
    if args.check:
        problems = check(args.root, args.json)
        for p in problems:
            print(p)
        if problems:
            print(f"render.py --check: {len(problems)} file(s) differ from {args.json}; run benchmarks/render.py",
                  file=sys.stderr)
            return 1
        print("render.py --check: README.md and docs/benchmarks.md match " + args.json)
        return 0
    try:
        changed = write(args.root, args.json)
    except BlockError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 1
    print("rewrote " + (", ".join(changed) if changed else "nothing (already current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
