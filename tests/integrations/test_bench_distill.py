"""The distillation harness (benchmarks/bench_distill.py) runs end to end at the tiny size as a
subprocess and writes its schema, ours within tolerance of the reference; the reference matches float64
autograd; failing methods are rows; the TRL swap restores TRL; the renderer fills its README block.

On CPU the tiny run uses fp32 inputs (the interpreter's tl.dot is wrong for bf16: Triton issue 11584);
bf16 is covered by the GPU run (the same command on a GPU keeps fp32 at --tiny; D1-D3 are bf16).
"""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import fused_linear_ce
from conftest import REPO

HARNESS_MODULES = ("bench", "bench_distill", "distill_cases", "distill_methods", "render_distill")
BETAS = (1.0, 0.5, 0.0)
OURS = ("flce", "flce-fast", "flce-none", "flce-trl")
# fp32 inputs against float64 (tf32 products on a GPU): a wrong divergence or gradient is O(1) off
OURS_TOL = 1e-2 if torch.cuda.is_available() else 1e-3


@pytest.fixture
def harness(monkeypatch):
    """The harness modules imported from benchmarks/ (dropped from sys.modules afterwards)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    for name in HARNESS_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    import bench_distill
    import distill_cases
    import distill_methods
    import render_distill

    yield bench_distill, distill_cases, distill_methods, render_distill
    for name in HARNESS_MODULES:
        sys.modules.pop(name, None)


def _importable(stmt):
    try:
        exec(stmt, {})
    except Exception:  # noqa: BLE001
        return False
    return True


def _use_in_trl_replaces_the_distillation_loss(distill_methods):
    """Whether this package's use_in_trl() replaces TRL's distillation loss (TRL left as it was)."""
    try:
        state = distill_methods.TrlState()
        replaced = state.install(fused_linear_ce.use_in_trl)
    except Exception:  # noqa: BLE001 - no TRL, or no use_in_trl
        return False
    return any(name.startswith("trl.trainer.distillation_trainer.") for name in replaced)


def test_tiny_quick_run_as_a_subprocess_writes_every_row_ours_within_tolerance(harness, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_distill.py"), "--tiny", "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]

    assert meta["harness"] == "bench_distill" and meta["gpu"] and meta["date"]
    for key in ("torch", "triton", "trl", "liger-kernel", "transformers", "commit", "dirty"):
        assert key in meta, key
    assert "estimate_s" in meta and meta["estimate_s"] > 0
    for dist in ("random", "peaked"):
        for beta in BETAS:
            stats = meta["data"][f"tiny/{dist}/beta={beta:g}"]
            assert stats["reference"] == "float64"
            assert stats["n_valid"] == 24  # 2 sequences of 16, 12 valid each (--valid 0.75)
    assert meta["data"]["tiny/peaked/beta=0"]["mean_p_teacher_top"] > 0.5 > meta["data"]["tiny/random/beta=0"]["mean_p_teacher_top"]

    cuda = torch.cuda.is_available()
    names = {"matmul", *OURS, "trl", *(("liger", "torch-compile") if cuda else ("torch",))}
    by = {(r["dist"], r["beta"], r["method"]): r for r in rows}
    assert len(by) == len(rows), "a row twice"
    assert set(by) == {(d, b, m) for d in ("random", "peaked") for b in BETAS for m in names}

    have_ours = hasattr(fused_linear_ce, "fused_linear_divergence")
    have_trl = _importable("import trl.trainer.distillation_trainer")
    available = {"matmul", "torch", "torch-compile"} | (set(OURS) if have_ours else set()) | ({"trl"} if have_trl else set())
    available |= {"liger"} if _importable("from liger_kernel.transformers import LigerFusedLinearJSD") else set()
    if not (have_ours and have_trl and _use_in_trl_replaces_the_distillation_loss(harness[2])):
        available.discard("flce-trl")
    for (dist, beta, method), row in by.items():
        if method not in available:
            assert row["error"] and "not available" in row["error"], (dist, beta, method, row["error"])
            continue
        assert not row["error"], (dist, beta, method, row["error"])
        assert row["fwdbwd_ms"] > 0 and len(row["fwdbwd_ms_rounds"]) >= 1 and row["spread"] >= 0
        assert row["x_floor"] > 0
        if method == "matmul":
            continue
        tol = OURS_TOL if method.startswith("flce") else (1e-5 if method.startswith("torch") else 1e-2)
        for key in ("loss_rel", "dx_rel", "dw_rel"):
            assert math.isfinite(row[key]) and row[key] < tol, (dist, beta, method, key, row[key])
        assert (row["tok_rel"] is not None) == (method == "flce-none"), (method, row["tok_rel"])
        if method == "flce-none":
            assert row["tok_rel"] < OURS_TOL and row["reduction"] == "none"
    for method in names:
        assert f" {method} " in proc.stdout, method  # the short table at the end
    if not have_ours:
        pytest.skip("fused_linear_ce.fused_linear_divergence is not in this package: ours' rows are errors (checked)")


def test_reference_matches_float64_autograd(harness):
    """The harness's reference (the package's reference.linear_divergence in several row chunks, both
    reductions' weights, a mask) against float64 autograd of the divergence written from its
    definition: p (log p - log m) summed, m = (1 - beta) p_s + beta p_t."""
    _, distill_cases, _, _ = harness
    for dist in ("random", "peaked"):
        data = distill_cases.make_data("tiny", dist, torch.device("cpu"), 3, torch.float32, valid_frac=0.6)
        assert data.n_valid == 2 * 10 and data.mask is not None
        for beta in (0.0, 0.3, 0.5, 1.0):
            ref, stats = distill_cases.reference(data, beta, torch.float64, plane_bytes=8 * data.v * 5)
            x = data.x_s.double().requires_grad_(True)
            w = data.w_s.double().requires_grad_(True)
            log_ps = (x @ w.T).log_softmax(-1)
            log_pt = (data.x_t.double() @ data.w_t.double().T).log_softmax(-1)
            p_s, p_t = log_ps.exp(), log_pt.exp()
            if beta == 0:
                div = (p_t * (log_pt - log_ps)).sum(-1)
            elif beta == 1:
                div = (p_s * (log_ps - log_pt)).sum(-1)
            else:
                log_m = ((1 - beta) * p_s + beta * p_t).log()
                div = beta * (p_t * (log_pt - log_m)).sum(-1) + (1 - beta) * (p_s * (log_ps - log_m)).sum(-1)
            assert torch.allclose(ref["divergence"], div.detach(), rtol=1e-9, atol=1e-12)
            mean = div[data.valid].mean()
            assert stats["ref_loss"] == pytest.approx(mean.item(), rel=1e-12)
            for red, u in (("mean", data.valid.double() / data.n_valid), ("none", data.u_none.double())):
                loss = (div * u).sum()
                dx, dw = torch.autograd.grad(loss, (x, w), retain_graph=True)
                assert ref["loss"][red] == pytest.approx(loss.item(), rel=1e-10), (dist, beta, red)
                for got, want in ((ref["dx"][red], dx), (ref["dw"][red], dw)):
                    assert ((got.double() - want).norm() / want.norm()).item() < 1e-6, (dist, beta, red)


def test_failing_methods_are_rows_rounds_interleave_and_the_budget_skips(harness, tmp_path, monkeypatch):
    bench_distill, _, distill_methods, _ = harness
    real = bench_distill.build_methods

    def with_failures(notes):
        def oom(data, beta, x, w):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

        return real(notes) + [distill_methods.Method("boom-oom", oom),
                              distill_methods.Method("boom-missing", error="peer not available (simulated)")]

    monkeypatch.setattr(bench_distill, "build_methods", with_failures)
    path = bench_distill.main(["--tiny", "--quick", "--betas", "0.5", "--dists", "random", "--rounds", "3", "--reps", "1",
                               "--methods", "matmul,torch,boom*", "--out", str(tmp_path / "a")])
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {"matmul", "torch", "boom-oom", "boom-missing"}
    assert rows["boom-oom"]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert rows["boom-missing"]["error"] == "peer not available (simulated)"
    for name in ("matmul", "torch"):
        assert not rows[name]["error"] and len(rows[name]["fwdbwd_ms_rounds"]) == 3, rows[name]
        times = rows[name]["fwdbwd_ms_rounds"]
        assert rows[name]["fwdbwd_ms"] == sorted(times)[1]
        assert rows[name]["spread"] == pytest.approx((max(times) - min(times)) / sorted(times)[1])
    assert rows["matmul"]["x_floor"] == 1.0 and rows["torch"]["x_floor"] > 0

    path = bench_distill.main(["--tiny", "--quick", "--budget-s", "1e-9", "--out", str(tmp_path / "b")])
    data = json.loads(path.read_text())
    assert data["rows"] == [] and len(data["meta"]["skipped"]) == 6  # 2 dists x 3 betas


def test_skips_and_the_estimate(harness, capsys):
    bench_distill, _, _, _ = harness
    assert bench_distill.skip_reason("D3", "liger") and bench_distill.skip_reason("D3", "torch-compile")
    assert bench_distill.skip_reason("D1", "liger") is None and bench_distill.skip_reason("D3", "flce") is None
    assert bench_distill.skip_reason("D3", "liger", no_skip=True) is None
    names = ("matmul", "flce", "flce-fast", "flce-none", "flce-trl", "trl", "liger", "torch-compile")
    both = bench_distill.estimate_seconds(["D1", "D2"], ["random", "peaked"], [1, 0.5, 0], names, 3, 3)
    one = bench_distill.estimate_seconds(["D1"], ["random", "peaked"], [1, 0.5, 0], names, 3, 3)
    assert 60 < one < both < 900
    d3 = bench_distill.estimate_seconds(["D3"], ["random"], [0.5], names, 3, 3)
    assert d3 < bench_distill.estimate_seconds(["D3"], ["random"], [0.5], names, 3, 3, no_skip=True)
    assert bench_distill.main(["--shapes", "D1,D2", "--estimate-only"]) is None
    assert "estimate (H200, rough): ~" in capsys.readouterr().out


def test_trl_state_swaps_ours_in_for_one_call_and_restores_trl(harness, monkeypatch):
    pytest.importorskip("trl.trainer.distillation_trainer")
    _, _, distill_methods, _ = harness
    import trl.trainer.distillation_trainer as trainer
    import trl.trainer.utils as trl_utils

    original = trainer._chunked_divergence_loss
    head = trl_utils._ChunkedLogProbFunction
    monkeypatch.setattr(trainer, "_chunked_divergence_loss", original)  # put back whatever happens
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", head)

    def ours(*args, **kwargs):
        return "ours"

    def fake_use_in_trl():
        trainer._chunked_divergence_loss = ours
        trainer._added_by_use_in_trl = True

    state = distill_methods.TrlState()
    replaced = state.install(fake_use_in_trl)
    assert replaced == ["trl.trainer.distillation_trainer._added_by_use_in_trl",
                        "trl.trainer.distillation_trainer._chunked_divergence_loss"]
    assert trainer._chunked_divergence_loss is original and not hasattr(trainer, "_added_by_use_in_trl")
    with state.using("ours"):
        assert trainer._chunked_divergence_loss is ours and trainer._added_by_use_in_trl
    assert trainer._chunked_divergence_loss is original and not hasattr(trainer, "_added_by_use_in_trl")
    with state.using("trl"):
        assert trainer._chunked_divergence_loss is original


def test_render_writes_the_table_and_fills_the_readme_block(harness, tmp_path):
    _, _, _, render_distill = harness
    meta = dict(harness="bench_distill", gpu="NVIDIA H200", torch="2.11", triton="3.6", trl="1.16",
                commit="0123456789abcdef", dirty=True, date="2026-12-03", reference="fp32 logits",
                data={"D1/random/beta=0.5": dict(mean_p_teacher_top=0.01, mean_p_student_top=0.01, top1_agreement=0.0,
                                                  ref_loss=0.5)},
                skipped=["D3/random/beta=0.5/liger: why"], notes=[])
    base = dict(shape="D1", dist="random", beta=0.5, skipped=None, error=None)
    rows = [dict(base, method="matmul", fwdbwd_ms=40.0, fwdbwd_ms_rounds=[39.0, 40.0, 41.0], x_floor=1.0, extra_mib=None),
            dict(base, method="flce", fwdbwd_ms=60.0, fwdbwd_ms_rounds=[60.0, 61.0, 59.0], x_floor=1.5, extra_mib=256.0,
                 loss_rel=1e-6, dx_rel=2e-3, dw_rel=3e-3),
            dict(base, method="trl", fwdbwd_ms=120.0, fwdbwd_ms_rounds=[120.0], x_floor=3.0, extra_mib=1024.0,
                 loss_rel=1e-6, dx_rel=2e-3, dw_rel=3e-3),
            dict(base, method="liger", error="OutOfMemoryError: x | y")]
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- results:distill -->\nold\n<!-- /results:distill -->\nafter\n")
    assert render_distill.main([str(path), "--readme", str(readme)]) == 0
    table = (tmp_path / "h200.md").read_text()
    assert table.startswith("GPU: NVIDIA H200") and "0123456789 (dirty)" in table
    assert "| D1 | random | 0.5 | flce | 60.0 ± 1.0 | 1.50 | 0.50 | 256 | 1.0e-06 | 2.0e-03 | 3.0e-03 |" in table
    assert "| D1 | random | 0.5 | liger | error: OutOfMemoryError: x / y |" in table
    assert "- skipped D3/random/beta=0.5/liger: why" in table
    text = readme.read_text()
    assert text.startswith("intro\n<!-- results:distill -->\n") and text.endswith("<!-- /results:distill -->\nafter\n")
    assert "| D1 | random | 0.5 | 60.0, 256 | 120.0, 1024 | error | 40.0 |" in text and "old" not in text
    assert render_distill.main([str(path), "--readme", str(readme), "--check"]) == 0
    readme.write_text(text.replace("60.0, 256", "59.0, 256"))
    assert render_distill.main([str(path), "--readme", str(readme), "--check"]) == 1
    readme.write_text("no block here\n")
    with pytest.raises(ValueError, match="expected one"):
        render_distill.main([str(path), "--readme", str(readme)])
    # a named block keeping some cases, its source named under the header
    rows.append(dict(base, dist="peaked", method="flce", fwdbwd_ms=70.0, fwdbwd_ms_rounds=[70.0], x_floor=1.7,
                     extra_mib=256.0))
    path.write_text(json.dumps(dict(meta=meta, rows=rows)))
    readme.write_text("<!-- results:distill_peaked -->\n<!-- /results:distill_peaked -->\n")
    args = [str(path), "--readme", str(readme), "--block", "distill_peaked", "--dists", "peaked"]
    assert render_distill.main(args) == 0 and render_distill.main([*args, "--check"]) == 0
    text = readme.read_text()
    assert "| D1 | peaked | 0.5 | 70.0, 256 |" in text and "| D1 | random" not in text
    assert f"· `{path}`" in text


def test_the_docs_distill_blocks_match_their_json(harness):
    """README.md's and docs/benchmarks.md's distillation tables are the ones their JSON renders
    (``benchmarks/results/distill/blocks.json``)."""
    _, _, _, render_distill = harness
    assert render_distill.render_blocks(check=True)
    assert render_distill.main(["--blocks", "--check"]) == 0
