"""The training-run example at a tiny size: it runs, writes its log and plot, and the fused
loss follows transformers' own loss step by step: to fp32 rounding on CPU (no autocast), to bf16
rounding on a GPU (autocast)."""

import json
import os
import subprocess
import sys

from conftest import ON_GPU, REPO


def test_train_llama_example_runs_and_the_curves_agree(tmp_path):
    env = dict(os.environ)
    if not ON_GPU:
        env["TRITON_INTERPRET"] = "1"
    cmd = [sys.executable, str(REPO / "examples" / "train_llama.py"), "--tiny", "--steps", "3", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=600)
    log = json.loads((tmp_path / "train_llama.json").read_text())
    assert (tmp_path / "train_llama.png").stat().st_size > 10_000
    assert set(log["runs"]) == {"torch", "torch-fp32-head", "fused"}
    losses = log["runs"]["fused"]["loss"]
    assert len(losses) == 3 and all(5.0 < x < 7.0 for x in losses)  # ~log(512) = 6.24 at the start
    assert log["max_abs_gap"] < (2e-2 if ON_GPU else 1e-4), log["max_abs_gap"]
