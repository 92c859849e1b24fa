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
from pathlib import Path

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
    out = _run(["benchmarks/bench.py", "--tiny", "--quick", "--out", str(tmp_path)])
    assert "flce" in out
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())

    meta = data["meta"]
    for key in ("gpu", "torch", "triton", "date", "data"):
        assert key in meta, key
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
    """--rounds 3: each method's times are the medians of its three rounds (kept per row)."""
    _run(["benchmarks/bench.py", "--tiny", "--quick", "--dists", "random", "--methods", "matmul,flce,torch",
          "--settings", "chunked:whole", "--rounds", "3", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*.json")
    rows = json.loads(path.read_text())["rows"]
    assert {r["method"] for r in rows} == {"matmul", "flce", "torch"}
    for row in rows:
        assert not row["error"], row["error"]
        for key in ("fwd_ms", "fwdbwd_ms"):
            rounds = row[f"{key}_rounds"]
            assert len(rounds) == 3 and all(t > 0 for t in rounds)
            assert row[key] == sorted(rounds)[1]
        assert row["tflops"] > 0 and row["pct_matmul"] > 0
