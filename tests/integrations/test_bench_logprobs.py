"""The per-token harness (benchmarks/bench_logprobs.py) runs end to end at the tiny size and writes its
schema; its float64 reference's hand-derived gradients match autograd.

On CPU it runs in this process under the Triton interpreter, wall-clock timing, memory null.
"""

import importlib.util
import json
import math
import sys

import pytest
import torch

import fused_linear_ce
from conftest import REPO

HARNESS_MODULES = ("bench", "bench_logprobs", "plot")  # benchmarks/*.py, imported by path


@pytest.fixture
def harness(monkeypatch):
    """bench_logprobs and plot imported from benchmarks/ (dropped from sys.modules afterwards)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    for name in HARNESS_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import bench_logprobs
    import plot

    yield bench_logprobs, plot
    for name in HARNESS_MODULES:
        sys.modules.pop(name, None)


def trl_peer_importable():
    try:
        from trl.kernels import ChunkedLogProbFunction  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


def test_tiny_quick_run_writes_every_row_and_the_table(harness, tmp_path, capsys):
    bench_logprobs, plot = harness
    path = bench_logprobs.main(["--tiny", "--quick", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]

    assert meta["harness"] == "bench_logprobs" and meta["gpu"] and meta["torch"]
    for dist in ("random", "peaked"):
        assert meta["data"][f"tiny/{dist}"]["reference"] == "float64"
    assert meta["data"]["tiny/peaked"]["mean_p_target"] > 0.5 > meta["data"]["tiny/random"]["mean_p_target"]

    methods = {"flce", "flce-chunked", "flce-trl", "torch"} | ({"trl"} if trl_peer_importable() else set())
    by = {(r["dist"], r["workload"], r["method"]): r for r in rows}
    assert len(by) == len(rows), "a row twice"
    assert set(by) == {(d, "-", "matmul") for d in ("random", "peaked")} | {
        (d, wl, m) for d in ("random", "peaked") for wl in ("sft", "grpo", "ref") for m in methods}
    for (dist, wl, method), row in by.items():
        assert not row["error"], (dist, wl, method, row["error"])
        assert row["fwd_ms"] > 0
        if method == "matmul":
            assert row["fwdbwd_ms"] > 0
            continue
        assert row["fwd_x_matmul"] > 0
        assert row["logprobs_rel"] < 0.05, row  # bf16 inputs: the rounding of bf16 logits at worst
        if wl == "ref":
            assert row["fwdbwd_ms"] is None and row["dx_rel"] is None and row["entropy_rel"] is None
            continue
        assert row["fwdbwd_ms"] > 0
        for key in ("loss_rel", "dx_rel", "dw_rel", "entropy_rel"):
            assert math.isfinite(row[key]) and row[key] < 0.05, (dist, wl, method, key, row[key])
        assert (row["top1_mismatch"] is not None) == (wl == "sft")
        if method.startswith("flce"):  # fp32 logits from bf16 inputs; bf16 gradients
            assert row["loss_rel"] < 1e-3 and row["dx_rel"] < 1e-2 and row["dw_rel"] < 1e-2, row
            assert row["logprobs_rel"] < 2e-3 and row["entropy_rel"] < 2e-3, row
            if wl == "sft":
                assert row["top1_mismatch"] <= 1 / row["N"], row
    for method in methods:
        assert f"sft  {method} " in printed, method  # the short table at the end

    plot.main([str(path)])
    table = path.with_suffix(".md").read_text()
    assert table.startswith("GPU: ") and "| shape | dist | workload | method |" in table
    for method in methods:
        assert f"| grpo | {method} |" in table, method
    if importlib.util.find_spec("matplotlib") is not None:
        png = path.with_name(path.stem + "_logprobs.png")
        assert png.exists() and png.stat().st_size > 1000


def test_a_failing_method_is_a_row_and_the_budget_skips(harness, tmp_path, monkeypatch):
    bench_logprobs, _ = harness

    real = fused_linear_ce.fused_linear_logprobs

    def refuses_chunked(*args, strategy="auto", **kwargs):
        if strategy == "chunked":
            raise ValueError("no chunked path here")
        return real(*args, strategy=strategy, **kwargs)

    monkeypatch.setattr(fused_linear_ce, "fused_linear_logprobs", refuses_chunked, raising=False)
    path = bench_logprobs.main(["--tiny", "--quick", "--dists", "random", "--workloads", "ref",
                                "--methods", "flce*,torch", "--out", str(tmp_path / "a")])
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["flce-chunked"]["error"].startswith("ValueError: no chunked path here")
    assert not rows["flce"]["error"] and not rows["torch"]["error"] and rows["torch"]["fwd_ms"] > 0

    path = bench_logprobs.main(["--tiny", "--quick", "--budget-s", "1e-9", "--out", str(tmp_path / "b")])
    data = json.loads(path.read_text())
    assert data["rows"] == [] and len(data["meta"]["skipped"]) == 2  # both distributions


def test_reference_gradients_match_autograd(harness, monkeypatch):
    """The reference's hand-derived logit gradients (sft; grpo with its entropy term made dominant)
    against float64 autograd."""
    bench_logprobs, _ = harness
    monkeypatch.setattr(bench_logprobs, "ENTROPY_COEF", 3.0)
    monkeypatch.setattr(bench_logprobs, "REF_PLANE_BYTES", 8 * 300 * 7)  # several row chunks
    for dist in ("random", "peaked"):
        hidden, weight, targets = bench_logprobs.make_data(40, 24, 300, dist, torch.device("cpu"), 1)
        adv = torch.randn(40, generator=torch.Generator().manual_seed(2))
        ref, stats = bench_logprobs.reference(hidden, weight, targets, adv)
        assert stats["reference"] == "float64"

        x = hidden.double().requires_grad_(True)
        w = weight.double().requires_grad_(True)
        logp = (x @ w.T).log_softmax(-1)
        lp = logp.gather(1, targets[:, None])[:, 0]
        ent = -(logp.exp() * logp).sum(-1)
        assert torch.allclose(ref["log_probs"], lp) and torch.allclose(ref["entropy"], ent)
        assert torch.equal(ref["is_top1"], (x @ w.T).argmax(-1) == targets)
        losses = {"sft": -lp.mean(), "grpo": -(lp * adv.double()).mean() - 3.0 * ent.mean()}
        for wl, loss in losses.items():
            dx, dw = torch.autograd.grad(loss, (x, w), retain_graph=True)
            assert ref["loss"][wl] == pytest.approx(loss.item(), rel=1e-12)
            assert bench_logprobs.rel(ref["dx"][wl], dx) < 1e-6, (dist, wl)  # stored as fp32
            assert bench_logprobs.rel(ref["dw"][wl], dw) < 1e-6, (dist, wl)


def test_plain_torch_in_checkpointed_row_chunks_matches_the_whole(harness):
    """The torch method's fallback where its logits would not fit (chunked, checkpointed): same values
    and gradients as in one piece."""
    bench_logprobs, _ = harness
    hidden, weight, targets = bench_logprobs.make_data(37, 16, 200, "peaked", torch.device("cpu"), 3)
    outputs, grad = bench_logprobs.WORKLOADS["grpo"]
    adv = torch.randn(37, generator=torch.Generator().manual_seed(4))
    got = []
    for chunk_rows in (None, 10):
        h, w = hidden.detach().requires_grad_(True), weight.detach().requires_grad_(True)
        out = bench_logprobs.torch_logprobs(h, w, targets, outputs, grad, chunk_rows=chunk_rows)
        bench_logprobs.workload_loss("grpo", out, adv).backward()
        got.append((out["log_probs"].detach(), out["entropy"].detach(), h.grad, w.grad))
    for name, whole, chunked in zip(("log_probs", "entropy", "dX", "dW"), *got):
        # dW: the chunks' bf16 gradients are summed in bf16, one rounding per chunk
        assert bench_logprobs.rel(chunked, whole.float()) < (4e-3 if name == "dW" else 1e-6), name
