"""The README's and docs' result tables are the rendering of the committed benchmark JSON
(``benchmarks/render.py``), and the renderer and bench.py's JSON merging do what they say on small
synthetic JSON. CPU only, standard library and the JSON: no kernel runs.
"""

import copy
import json
import subprocess
import sys

import pytest

from conftest import REPO

MODULES = ("render", "results_json")  # benchmarks/*.py, imported by path


@pytest.fixture
def mods(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    for name in MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import render
    import results_json

    yield render, results_json
    for name in MODULES:
        sys.modules.pop(name, None)


def test_readme_and_docs_are_the_rendering_of_the_committed_json(mods):
    """README.md (summary, settings) and docs/benchmarks.md (full) equal render.py's rendering of
    benchmarks/results/h200.json; a missing block is a failure too. Fix: python3 benchmarks/render.py."""
    render, _ = mods
    problems = render.check()
    assert not problems, "\n".join(problems) + "\nrun: python3 benchmarks/render.py"


def row(shape, dist, method, fwd, fwdbwd, mib, rounds=None, **extra):
    n, h, v = {"S1": (8192, 4096, 128256), "S4": (65536, 4096, 128256)}[shape]
    r = dict(shape=shape, dist=dist, N=n, H=h, V=v, method=method, fwd_ms=fwd, fwdbwd_ms=fwdbwd, extra_mib=mib,
             loss_rel=1e-6, dx_rel=1.7e-3, dw_rel=1.6e-3, tflops=1.0, error=None, **extra)
    if rounds:
        r.update(fwdbwd_ms_rounds=rounds, fwdbwd_ms_min=min(rounds), fwdbwd_ms_max=max(rounds),
                 fwd_ms_rounds=[fwd] * len(rounds), fwd_ms_min=fwd, fwd_ms_max=fwd)
    return r


OURS = {"flce": (201326592, "auto"), "flce-64M": (64 << 20, "recompute"), "flce-chunked-1G": (1 << 30, "chunked"),
        "flce-chunked-whole": (1 << 50, "chunked"), "flce-auto-1280M": (1280 << 20, "auto")}


def synthetic(rounds=3):
    """A two-shape, two-dist JSON in bench.py's format: every method the blocks name."""
    rows = []
    for shape, scale in (("S1", 1.0), ("S4", 7.0)):
        for dist in ("random", "peaked"):
            for k, method in enumerate(["matmul", *OURS, "torch-compile", "liger", "trl"]):
                t = scale * (40.0 + k)
                extra = {} if method not in OURS else dict(chunk_bytes=OURS[method][0], strategy=OURS[method][1])
                rs = [t - 0.5, t, t + 0.25] if rounds > 1 else None
                rows.append(row(shape, dist, method, t / 3, t, None if method == "matmul" else 100.0 + k, rs, **extra))
    run = dict(date="2026-12-04T10:00:00+00:00", commit="0123456789abcdef", dirty=False, rounds=rounds,
               gpu="NVIDIA H200", torch="2.11.0", triton="3.6.0")
    meta = dict(gpu="NVIDIA H200", torch="2.11.0", triton="3.6.0", trl="1.16.0", date=run["date"],
                commit=run["commit"], dirty=False, shape_runs={"S1": run, "S4": run}, skipped=[], notes=[], data={})
    return dict(meta=meta, rows=rows)


def write_tree(root, data, blocks=None):
    """A repo root with the JSON and files holding the blocks (empty bodies: not yet rendered)."""
    blocks = blocks or {"README.md": ("summary", "settings"), "docs/benchmarks.md": ("full",)}
    (root / "benchmarks/results").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "benchmarks/results/h200.json").write_text(json.dumps(data))
    for rel, names in blocks.items():
        body = "".join(f"text before {n}\n<!-- results:{n} -->\nstale\n<!-- /results:{n} -->\ntext after\n" for n in names)
        (root / rel).write_text(f"# {rel}\n\n{body}")


def test_render_then_check_passes_and_a_changed_figure_fails(mods, tmp_path):
    render, _ = mods
    data = synthetic()
    write_tree(tmp_path, data)
    assert render.check(tmp_path), "stale blocks pass the check"
    assert render.write(tmp_path) == ["README.md", "docs/benchmarks.md"]
    assert render.check(tmp_path) == []
    readme = (tmp_path / "README.md").read_text()
    assert "text before summary\n<!-- results:summary -->\n" in readme and "<!-- /results:summary -->\ntext after" in readme
    assert "stale" not in readme
    # S1 random default: median 45.0 of [44.5, 45.0, 45.25]: "45.0 ±0.4", memory 101 MiB
    assert "| ours, default | 41.0 ±0.4 | 101 |" in readme, readme
    assert "41.0 ±0.4 ms, 101 MiB" in readme
    assert "package of 0123456" in readme and "2026-12-04" in readme and "median of 3 interleaved rounds" in readme
    docs = (tmp_path / "docs/benchmarks.md").read_text()
    assert "**S4 (65536 x 4096 x 128256)**" in docs and 'ours, `strategy="chunked", chunk_bytes=1 << 30`' in docs

    changed = copy.deepcopy(data)
    target = next(r for r in changed["rows"] if (r["shape"], r["dist"], r["method"]) == ("S4", "random", "flce"))
    target["fwdbwd_ms"] += 1.0
    (tmp_path / "benchmarks/results/h200.json").write_text(json.dumps(changed))
    problems = render.check(tmp_path)
    assert len(problems) == 2 and all("(rendered)" in p for p in problems), problems  # README and docs differ
    assert "288.0" in problems[0] and "287.0" in problems[0]

    cli = [sys.executable, str(REPO / "benchmarks/render.py"), "--root", str(tmp_path)]
    done = subprocess.run([*cli, "--check"], capture_output=True, text=True)
    assert done.returncode == 1 and "288.0" in done.stdout
    assert subprocess.run(cli, capture_output=True, text=True).returncode == 0
    assert subprocess.run([*cli, "--check"], capture_output=True, text=True).returncode == 0


def test_an_edited_table_fails_the_check(mods, tmp_path):
    render, _ = mods
    write_tree(tmp_path, synthetic())
    render.write(tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text().replace("41.0 ±0.4 ms", "40.0 ±0.4 ms"))
    (problem,) = render.check(tmp_path)
    assert "-| bounded memory at any N (default)" in problem and "40.0 ±0.4 ms" in problem


def test_another_renderers_blocks_are_left_as_they_are(mods, tmp_path):
    """render_distill.py's blocks (``distill``, ``distill_<name>``) pass through, body and all; a
    look-alike name is still unknown."""
    render, _ = mods
    write_tree(tmp_path, synthetic())
    render.write(tmp_path)
    readme = tmp_path / "README.md"
    foreign = "<!-- results:distill -->\nbody | kept\n<!-- /results:distill -->\n"
    readme.write_text(readme.read_text() + foreign)
    assert render.check(tmp_path) == [] and render.write(tmp_path) == [] and readme.read_text().endswith(foreign)
    readme.write_text(readme.read_text() + "<!-- results:distillery -->\n<!-- /results:distillery -->\n")
    assert any("unknown block 'distillery'" in p for p in render.check(tmp_path))


@pytest.mark.parametrize("case, text, message", [
    ("missing", "<!-- results:summary -->\n<!-- /results:summary -->\n", "required block 'settings' is missing"),
    ("unknown", "<!-- results:summary -->\n<!-- /results:summary -->\n<!-- results:settings -->\n"
                "<!-- /results:settings -->\n<!-- results:bogus -->\n<!-- /results:bogus -->\n", "unknown block 'bogus'"),
    ("unclosed", "<!-- results:summary -->\n<!-- /results:summary -->\n<!-- results:settings -->\n", "not closed"),
    ("nested", "<!-- results:summary -->\n<!-- results:settings -->\n<!-- /results:settings -->\n"
               "<!-- /results:summary -->\n", "nested"),
])
def test_block_errors(mods, tmp_path, case, text, message):
    render, _ = mods
    write_tree(tmp_path, synthetic())
    (tmp_path / "README.md").write_text(text)
    problems = render.check(tmp_path)
    assert any(message in p for p in problems), (case, problems)
    with pytest.raises(render.BlockError, match=message):
        render.write(tmp_path)


def test_one_round_json_renders_without_spread(mods):
    """A JSON from before the rounds were kept (the committed one until the next GPU run): medians
    only, its one date, 'commit not recorded'."""
    render, _ = mods
    data = synthetic(rounds=1)
    for key in ("shape_runs", "commit", "dirty"):
        data["meta"].pop(key)
    data["meta"]["args"] = {"rounds": 1}
    blocks = render.render_all(data)
    assert "| ours, default | 41.0 | 101 |" in blocks["summary"]
    assert "±" not in "".join(blocks.values())
    assert "commit not recorded, one round" in blocks["summary"]
    assert "TRL's head" in blocks["summary"]


def test_caption_names_each_shapes_run_when_they_differ(mods):
    render, _ = mods
    data = synthetic()
    data["meta"]["shape_runs"]["S4"] = dict(data["meta"]["shape_runs"]["S4"], commit="fedcba9876", dirty=True)
    text = render.summary(data)
    assert "; S1: torch 2.11.0, triton 3.6.0; 2026-12-04, package of 0123456, median of 3" in text
    assert "; S4: torch 2.11.0, triton 3.6.0; 2026-12-04, package of fedcba9 with uncommitted changes" in text
    data["meta"]["shape_runs"]["S2"] = data["meta"]["shape_runs"]["S1"]
    data["rows"] += [dict(r, shape="S2") for r in data["rows"] if r["shape"] == "S1"]
    assert "; S1, S2: torch 2.11.0" in render.full(data)


def test_merge_replaces_the_shapes_run_and_keeps_the_others(mods):
    _, results_json = mods
    old = synthetic(rounds=1)
    for key in ("shape_runs", "commit", "dirty"):
        old["meta"].pop(key)
    old["meta"]["data"] = {"S1/random": {"x": 1}, "S4/random": {"x": 4}}
    old["meta"]["skipped"] = ["S1/random/cce-exact: slow", "S4/random/cce-exact: slow"]
    new = synthetic()
    new["rows"] = [dict(r, fwdbwd_ms=1.0) for r in new["rows"] if r["shape"] == "S1"]
    new["meta"].update(data={"S1/random": {"x": 11}}, skipped=[], shape_runs={"S1": new["meta"]["shape_runs"]["S1"]})
    got = results_json.merge(old, new)
    assert [r["fwdbwd_ms"] for r in got["rows"] if r["shape"] == "S1"] == [1.0] * 18
    assert [r for r in got["rows"] if r["shape"] == "S4"] == [r for r in old["rows"] if r["shape"] == "S4"]
    assert [r["shape"] for r in got["rows"]] == ["S1"] * 18 + ["S4"] * 18
    assert got["meta"]["data"] == {"S1/random": {"x": 11}, "S4/random": {"x": 4}}
    assert got["meta"]["skipped"] == ["S4/random/cce-exact: slow"]
    assert got["meta"]["shape_runs"]["S1"]["commit"] == "0123456789abcdef"
    assert got["meta"]["shape_runs"]["S4"]["commit"] is None and got["meta"]["shape_runs"]["S4"]["rounds"] == 1


def test_provenance_from_the_environment_else_git(mods, monkeypatch, tmp_path):
    _, results_json = mods
    monkeypatch.delenv("BENCH_COMMIT", raising=False)
    got = results_json.provenance()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert got["commit"] == head and got["commit_source"] == "git" and isinstance(got["dirty"], bool)
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")  # a copy whose travelled .git names its base: the variable wins
    monkeypatch.setenv("BENCH_DIRTY", "0")
    assert results_json.provenance() == dict(commit="abc1234", dirty=False, commit_source="BENCH_COMMIT")
    monkeypatch.setattr(results_json, "REPO", tmp_path)  # not a git checkout: a tree copied without .git
    assert results_json.provenance() == dict(commit="abc1234", dirty=False, commit_source="BENCH_COMMIT")
    monkeypatch.delenv("BENCH_COMMIT")
    monkeypatch.delenv("BENCH_DIRTY")
    assert results_json.provenance() == dict(commit=None, dirty=None, commit_source=None)
