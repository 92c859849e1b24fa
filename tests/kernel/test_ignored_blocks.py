"""Row blocks whose rows are all ignored (prompt tokens under an assistant-only loss, padding) skip
their logit tiles: the sweep computes none for them (the chunked path's sweep then leaves their
exponentials unwritten: NaN here, ``FUSED_LINEAR_CE_POISON``, which must not reach a gradient), and the
recompute path's dlogits kernel none for tiles whose rows all have zero coefficients. Checked here:
that the skipping happens (the logit tiles computed, counted on the interpreter; the sweep's neutral
statistics, on any device), and that every variant stays exact around it, on both paths, with whole
ignored blocks next to counted and partly ignored ones, ignored rows' gradients exactly zero.
Autotuning is held off here: its candidates include taller row blocks than B."""

import pytest
import torch

from cases import Case, check_three_way, make_inputs
from conftest import ON_GPU, reference, rel_err
from fused_linear_ce import autotune, fused_linear_cross_entropy, recompute, sweep, sweep_kernels
from fused_linear_ce.validate import Options

# Every kernel's BLOCK_N in the tuned table divides it (CPU tiles: 16 rows; GPU: 64 or 128), so rows
# [B, 3B) are whole row blocks for each of them.
B = 128 if ON_GPU else 16


@pytest.fixture(autouse=True)
def table_tiles():
    """The table's tiles, whatever FUSED_LINEAR_CE_AUTOTUNE says (see the module docstring)."""
    autotune.enable(False)
    yield
    autotune.enable(None)


def blocky(case: Case):
    """The case's inputs with rows [B, 3B) and the last B rows ignored, and a few more in between
    (a partly ignored block)."""
    hidden, weight, bias, targets = make_inputs(case)
    targets = targets.clone()
    targets[B : 3 * B] = case.ignore_index
    targets[-B:] = case.ignore_index
    targets[3 * B + 1 : 3 * B + 4] = case.ignore_index
    return hidden, weight, bias, targets


N = 5 * B + 3  # counted block, two ignored, one partly ignored, a counted tail into the ignored end

CASES = []
for strategy in ("recompute", "chunked"):
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        CASES.append(Case(N, 48, 300, dtype, "mean", bias=True, extra=dict(strategy=strategy)))
    CASES += [
        Case(N, 48, 300, torch.float32, "sum", label_smoothing=0.1, class_weight=True, z_loss=1e-3,
             extra=dict(strategy=strategy)),
        Case(N, 48, 300, torch.float32, "mean", softcap=4.0, logit_scale=0.8, extra=dict(strategy=strategy)),
        Case(N, 48, 300, torch.float32, "mean", ignore_index=7, extra=dict(strategy=strategy)),
        Case(N, 48, 300, torch.float16, "mean", chunk_bytes=2 * B * 300 * 2, extra=dict(strategy=strategy)),
    ]
CASES += [
    Case(N, 48, 300, torch.float32, "none", label_smoothing=0.1, z_loss=1e-3),
    Case(N, 48, 300, torch.bfloat16, "mean", chunk_bytes=N * 64 * 2, extra=dict(strategy="recompute")),
]


@pytest.mark.tier_if(lambda case: case.bias and "strategy" in case.extra)  # each dtype on both paths
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_exact_around_ignored_blocks(case):
    inputs = blocky(case)
    loss, grads = check_three_way(case, inputs=inputs)
    ignored = inputs[3] == case.ignore_index
    assert torch.equal(grads["hidden"][ignored], torch.zeros_like(grads["hidden"][ignored]))
    if case.reduction == "none":
        assert torch.equal(loss[ignored], torch.zeros_like(loss[ignored]))


@pytest.mark.tier
def test_the_sweep_leaves_neutral_statistics_in_skipped_blocks():
    """On any device: a wholly ignored block's rows get the neutral m = 0, log-sum 0 (only a skipped
    block writes those), a partly ignored block's ignored rows their real statistics; with the lse
    returned nothing is skipped."""
    case = Case(N, 48, 300, torch.bfloat16)
    hidden, weight, _, targets = blocky(case)
    expected = torch.logsumexp(hidden.double() @ weight.double().t(), dim=1)
    skipped = sweep.forward(hidden, weight, targets, None, None, Options())
    assert torch.equal(skipped.lse2[:, B : 3 * B], torch.zeros_like(skipped.lse2[:, B : 3 * B]))
    assert rel_err(skipped.lse[3 * B : 3 * B + 4], expected[3 * B : 3 * B + 4]) < 1e-5  # partly ignored
    assert rel_err(skipped.lse[:B], expected[:B]) < 1e-5
    kept = sweep.forward(hidden, weight, targets, None, None, Options(return_lse=True))
    assert rel_err(kept.lse, expected) < 1e-5


@pytest.mark.tier
def test_returned_lse_covers_ignored_blocks():
    """The lse is returned for every row, ignored ones too: nothing is skipped then, and its
    gradient reaches the ignored rows."""
    case = Case(N, 48, 300)
    hidden, weight, bias, targets = blocky(case)

    def step(fn, **kw):
        h = hidden.detach().clone().requires_grad_(True)
        loss, lse = fn(h, weight, targets, return_lse=True, **kw)
        (loss + lse.sum()).backward()
        return lse.detach(), h.grad

    lse, grad = step(fused_linear_cross_entropy)
    ref_lse, ref_grad = step(reference.linear_cross_entropy, compute_dtype=torch.float64)
    assert rel_err(lse, ref_lse) < 1e-6
    assert rel_err(grad, ref_grad) < 1e-5


def test_metrics_and_loss_over_counted_rows_only():
    case = Case(N, 48, 300)
    hidden, weight, bias, targets = blocky(case)
    loss, got = fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
    want_loss, want = reference.linear_cross_entropy(hidden, weight, targets, return_metrics=True,
                                                     compute_dtype=torch.float64)
    assert rel_err(loss, want_loss) < 1e-6
    assert got["mean_token_accuracy"].item() == pytest.approx(want["mean_token_accuracy"].item(), abs=1e-6)
    assert rel_err(got["entropy"], want["entropy"]) < 1e-5


class _Counter:
    """Wraps a module's ``logit_tile`` (a jitted function the interpreter calls as Python) and counts
    the calls: one per logit tile computed."""

    def __init__(self, module, monkeypatch):
        self.calls = 0
        inner = module.logit_tile

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(module, "logit_tile", counted)


@pytest.mark.skipif(ON_GPU, reason="counts the interpreter's calls of the logit tile (CPU only)")
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("chunk_bytes", [None, 2 * B * 300 * 2])
def test_ignored_blocks_compute_no_logit_tile(strategy, chunk_bytes, monkeypatch):
    """Per path and budget, the logit tiles computed with the ignored blocks against the same call
    with every row counted: fewer by exactly the ignored blocks' share, in the forward and in the
    backward. The partly ignored block computes all of its tiles."""
    case = Case(N, 48, 300, torch.float16)
    hidden, weight, bias, counted_targets = make_inputs(case)
    _, _, _, targets = blocky(case)
    blocks = -(-N // B)
    dead = 3

    def tiles(t):
        fwd, bwd = _Counter(sweep_kernels, monkeypatch), _Counter(recompute, monkeypatch)
        h = hidden.detach().clone().requires_grad_(True)
        w = weight.detach().clone().requires_grad_(True)
        loss = fused_linear_cross_entropy(h, w, t, chunk_bytes=chunk_bytes, strategy=strategy)
        forward_calls = fwd.calls
        loss.backward()
        monkeypatch.undo()
        return forward_calls, bwd.calls, fwd.calls - forward_calls

    # Blocks of B rows: 0 counted; 1, 2 ignored; 3 and 4 partly ignored; 5 (the last 3 rows) ignored.
    counted = targets != case.ignore_index
    assert [bool(counted[i * B : (i + 1) * B].any()) for i in range(blocks)] == [True, False, False, True, True, False]
    full, skipped = tiles(counted_targets), tiles(targets)
    assert full[0] > 0 and (full[1] > 0) == (strategy == "recompute")  # chunked: no backward tile
    live_share = (blocks - dead) / blocks
    assert skipped[0] == pytest.approx(full[0] * live_share, abs=0), (skipped, full)
    assert skipped[1] == pytest.approx(full[1] * live_share, abs=0), (skipped, full)
    assert skipped[2] == full[2] == 0  # the backward never runs the sweep again


def test_a_zero_upstream_gradient_computes_no_backward_tile(monkeypatch):
    """The dlogits kernel skips by coefficients, not targets: a zero upstream gradient on every row
    (reduction="none") computes no logit tile in the backward, and gives exact zeros."""
    if ON_GPU:
        pytest.skip("counts the interpreter's calls of the logit tile (CPU only)")
    case = Case(N, 48, 300)
    hidden, weight, _, targets = make_inputs(case)
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    loss = fused_linear_cross_entropy(h, w, targets, reduction="none", strategy="recompute")
    bwd = _Counter(recompute, monkeypatch)
    loss.backward(torch.zeros_like(loss))
    assert bwd.calls == 0
    assert torch.equal(h.grad, torch.zeros_like(h.grad)) and torch.equal(w.grad, torch.zeros_like(w.grad))

