"""The benchmark harness runs end to end at a tiny size and writes the documented schema.

On CPU it runs under the Triton interpreter with wall-clock timing (memory figures null); on a GPU the
same command uses do_bench and includes whichever peers are installed.
"""

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ROW_KEYS = {"shape", "dist", "N", "H", "V", "method", "fwd_ms", "fwdbwd_ms", "extra_mib",
            "loss_rel", "dx_rel", "dw_rel", "tflops", "error"}


def _run(args):
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    done = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{args[0]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_bench_tiny_and_plot(tmp_path):
    out = _run(["benchmarks/bench.py", "--tiny", "--quick", "--rounds", "1", "--out", str(tmp_path)])
    assert "flce" in out and "estimate (H200" in out
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())

    meta = data["meta"]
    for key in ("gpu", "torch", "triton", "date", "data", "commit", "dirty", "shape_runs"):
        assert key in meta, key
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert meta["commit"] == head and isinstance(meta["dirty"], bool)
    assert meta["shape_runs"]["tiny"]["commit"] == head and meta["shape_runs"]["tiny"]["rounds"] == 1
    for dist in ("random", "peaked"):
        p = meta["data"][f"tiny/{dist}"]["mean_p_target"]
        assert 0.0 <= p <= 1.0
    assert meta["data"]["tiny/peaked"]["mean_p_target"] > 0.5 > meta["data"]["tiny/random"]["mean_p_target"]

    rows = data["rows"]
    for row in rows:
        assert ROW_KEYS <= row.keys(), ROW_KEYS - row.keys()
    by = {(r["dist"], r["method"]): r for r in rows}
    for dist in ("random", "peaked"):
        assert not by[(dist, "matmul")]["error"]
        assert by[(dist, "matmul")]["fwdbwd_ms"] > 0
        for method in ("flce", "torch"):
            row = by[(dist, method)]
            assert not row["error"], row["error"]
            assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0 and row["tflops"] > 0
            for key in ("loss_rel", "dx_rel", "dw_rel"):
                assert math.isfinite(row[key]), (dist, method, key, row[key])
            # bf16 inputs, fp32-logit reference: ours stays at the bf16 output rounding floor
            if method == "flce":
                assert row["dx_rel"] < 1e-2 and row["dw_rel"] < 1e-2 and row["loss_rel"] < 1e-3, row
        assert any(m.startswith("flce-") for d, m in by if d == dist), "no other chunk_bytes setting ran"

    _run(["benchmarks/plot.py", str(path)])
    table = path.with_suffix(".md").read_text()
    assert "| shape | dist | method |" in table and "| flce |" in table and "| torch |" in table
    assert table.splitlines()[0].startswith("GPU: ")
    if importlib.util.find_spec("matplotlib") is None:  # the table needs none; PNGs need matplotlib
        return
    for suffix in ("_frontier.png", "_accuracy.png", "_memory.png"):
        png = path.with_name(path.stem + suffix)
        assert png.exists() and png.stat().st_size > 1000, png


def test_bench_rounds_report_the_median_of_interleaved_rounds(tmp_path):
    """--rounds 3 (the default): each method's times are the medians of its three rounds, each round
    and the range kept per row; --merge replaces the shape run and keeps the others."""
    old = dict(meta=dict(data={"S4/random": {"x": 1}}, skipped=["S4/random/cce-exact: slow"], notes=[]),
               rows=[dict(shape="S4", dist="random", method="flce", fwdbwd_ms=394.0),
                     dict(shape="tiny", dist="random", method="stale", fwdbwd_ms=1.0)])
    (tmp_path / "cpu.json").write_text(json.dumps(old))
    out = _run(["benchmarks/bench.py", "--tiny", "--quick", "--dists", "random", "--methods", "matmul,flce,torch",
                "--merge", "--out", str(tmp_path)])
    assert out.index("set up 3 methods") < out.index("round 1 of 3") < out.index("round 3 of 3")
    data = json.loads((tmp_path / "cpu.json").read_text())
    rows = [r for r in data["rows"] if r["shape"] == "tiny"]
    assert [r["method"] for r in rows] == ["matmul", "flce", "torch"]
    for row in rows:
        assert not row["error"], row["error"]
        for key in ("fwd_ms", "fwdbwd_ms"):
            rounds = row[f"{key}_rounds"]
            assert len(rounds) == 3 and all(t > 0 for t in rounds)
            assert row[key] == sorted(rounds)[1]
            assert (row[f"{key}_min"], row[f"{key}_max"]) == (min(rounds), max(rounds))
        assert row["tflops"] > 0 and row["pct_matmul"] > 0
    assert data["rows"][0] == old["rows"][0] and len(data["rows"]) == 4  # S4 kept (first), the stale tiny row gone
    assert data["meta"]["data"]["S4/random"] == {"x": 1} and "tiny/random" in data["meta"]["data"]
    assert data["meta"]["skipped"] == ["S4/random/cce-exact: slow"]
    assert data["meta"]["shape_runs"]["tiny"]["rounds"] == 3


@pytest.fixture
def bench_module(monkeypatch):
    """benchmarks/bench.py imported in this process (dropped from sys.modules afterwards)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    for name in ("bench", "results_json"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import bench

    yield bench
    for name in ("bench", "results_json"):
        sys.modules.pop(name, None)


def test_rounds_are_interleaved(bench_module, tmp_path):
    """Every method is set up (warm-up, memory, errors) before any timing; then round r times method 1,
    2, ..., k (forward, then forward+backward) before round r + 1."""
    bench = bench_module
    calls = []

    def method(name):
        def fn(h, w, t):
            calls.append((name, torch.is_grad_enabled()))
            return bench.torch_ce(h, w, t)

        return fn

    args = bench.parse_args(["--tiny", "--quick", "--rounds", "2"])
    rows, meta = [], dict(data={}, skipped=[])
    bench.run_dist("tiny", "random", {"a": method("a"), "b": method("b")}, args, torch.device("cpu"), meta, rows,
                   time.perf_counter())
    # set-up: a's warm-up, measured step, no-grad warm-up and estimate; then b's; then 2 rounds of
    # (fwd, fwd+bwd) each
    setup = [(m, grad) for m in "ab" for grad in (True, True, False, False)]
    one_round = [("a", False), ("a", True), ("b", False), ("b", True)]
    assert calls == setup + one_round * 2
    assert [r["method"] for r in rows] == ["a", "b"]
    assert all(len(r["fwdbwd_ms_rounds"]) == 2 and not r["error"] for r in rows)


def test_estimate_matches_run_log():
    """The estimate's model reproduces the one-round run of benchmarks/results/run.log (S1-S3 177 s with
    15 methods, S4 89 s with 14) within 15%, and the two calls of 3 rounds fit 8 minutes each."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import bench
    finally:
        sys.path.pop(0)
    per, _ = bench.estimate_s(["S1", "S2", "S3"], 2, 15, 1)
    assert abs(sum(per.values()) - 177) < 0.15 * 177, per
    per, _ = bench.estimate_s(["S4"], 2, 14, 1)
    assert abs(sum(per.values()) - 89) < 0.15 * 89, per
    assert bench.estimate_s(["S1", "S2", "S3"], 2, 13, 3)[1] < 480
    assert bench.estimate_s(["S4"], 2, 12, 3)[1] < 480
