"""Where users already are: custom ops under torch.compile, autocast, (..., H) shapes, causal shift,
a global token divisor, metric sums, CUDA graphs (GPU)."""

import pytest
import torch
import torch.nn.functional as F

from cases import Case, make_inputs
from conftest import DEVICE, ON_GPU, rel_err
from fused_linear_ce import fused_linear_cross_entropy, opargs, ops, plan
from fused_linear_ce.validate import Options


def _problem(b=3, t=7, h=32, v=200, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g).to(dtype).to(DEVICE)
    weight = (torch.randn(v, h, generator=g) * 0.3).to(dtype).to(DEVICE)
    targets = torch.randint(0, v, (b, t), generator=g).to(DEVICE)
    targets[0, :2] = -100
    return hidden, weight, targets


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_custom_ops_pass_opcheck(strategy):
    """Schema, fake (meta) implementations, autograd registration: torch's own checker, on both
    paths (the chunked one returns the gradients from the forward op)."""
    hidden, weight, targets = _problem()
    h2 = hidden.reshape(-1, 32).requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    return_lse = strategy == "recompute"
    opts = Options(label_smoothing=0.1, z_loss=1e-3, return_metrics=True, return_lse=return_lse, strategy=strategy)
    p = plan.plan_loss(opts, h2.shape[0], w.shape[0], h2.shape[1], h2.dtype, (True, True, False))
    assert (p.mode == plan.RECOMPUTE) == (strategy == "recompute")
    args = (h2, w, None, targets.reshape(-1), None, None, ops.scalars(opts), -100, "mean", True, return_lse, None, 0,
            p.mode, opargs.encode(p), True, True, False)
    torch.library.opcheck(ops.forward, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_compiled_training_step_has_no_graph_break_and_matches_eager(strategy):
    hidden, weight, targets = _problem()
    proj = torch.randn(32, 32, device=DEVICE) * 0.2

    def step(x, w, p):
        h = torch.tanh(x @ p)
        loss, metrics = fused_linear_cross_entropy(h, w, targets, return_metrics=True, shift=True, strategy=strategy)
        return loss, metrics["mean_token_accuracy"]

    leaves = lambda: (hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True), proj.clone().requires_grad_(True))  # noqa: E731
    eager = leaves()
    loss_e, acc_e = step(*eager)
    loss_e.backward()
    torch._dynamo.reset()
    compiled = leaves()
    loss_c, acc_c = torch.compile(step, fullgraph=True)(*compiled)
    loss_c.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    assert acc_c.item() == acc_e.item()
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6)


def test_autocast_casts_operands_like_f_linear_and_keeps_parameter_dtype():
    hidden, weight, targets = _problem()
    low = torch.bfloat16
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with torch.autocast(DEVICE.type, dtype=low):
        loss = fused_linear_cross_entropy(h1, w1, targets)
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    want = fused_linear_cross_entropy(h2.to(low), w2.to(low), targets)
    want.backward()
    assert loss.dtype == torch.float32 and torch.equal(loss, want)
    assert w1.grad.dtype == torch.float32 and h1.grad.dtype == torch.float32
    assert torch.equal(h1.grad, h2.grad)
    # The fp32 weight stays fp32 into the op (a master weight, tests/kernel/test_master_weight.py):
    # its gradient is the same sum, not rounded to 16 bits.
    assert not torch.equal(w1.grad, w2.grad)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=2**-8, atol=1e-6)
    b1 = torch.zeros(weight.shape[0], device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE.type, dtype=low):  # a bias is cast as F.linear casts it
        fused_linear_cross_entropy(h1, w1, targets, bias=b1).backward()
    assert b1.grad.dtype == torch.float32


def test_leading_dims_keep_their_shape():
    hidden, weight, targets = _problem()
    loss = fused_linear_cross_entropy(hidden, weight, targets, reduction="none")
    flat = fused_linear_cross_entropy(hidden.reshape(-1, 32), weight, targets.reshape(-1), reduction="none")
    assert loss.shape == targets.shape
    assert torch.equal(loss.reshape(-1), flat)
    _, lse = fused_linear_cross_entropy(hidden, weight, targets, return_lse=True)
    assert lse.shape == targets.shape


def test_shift_scores_each_position_against_the_next_target():
    hidden, weight, targets = _problem()
    hidden.requires_grad_(True)
    loss = fused_linear_cross_entropy(hidden, weight, targets, shift=True, reduction="none")
    manual = fused_linear_cross_entropy(hidden[:, :-1].reshape(-1, 32), weight, targets[:, 1:].reshape(-1),
                                        reduction="none")
    assert torch.equal(loss[:, -1], torch.zeros_like(loss[:, -1]))
    torch.testing.assert_close(loss[:, :-1].reshape(-1), manual, rtol=1e-6, atol=1e-6)
    loss.sum().backward()
    assert torch.equal(hidden.grad[:, -1], torch.zeros_like(hidden.grad[:, -1]))


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_num_items_in_batch_divides_the_summed_loss(as_tensor):
    hidden, weight, targets = _problem()
    total = fused_linear_cross_entropy(hidden, weight, targets, reduction="sum")
    n_items = torch.tensor(37, device=DEVICE) if as_tensor else 37
    got = fused_linear_cross_entropy(hidden, weight, targets, num_items_in_batch=n_items)
    torch.testing.assert_close(got, total / 37)
    with pytest.raises(ValueError, match="reduction='none'"):
        fused_linear_cross_entropy(hidden, weight, targets, reduction="none", num_items_in_batch=3)


@pytest.mark.tier
@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
def test_num_items_in_batch_gradients_on_both_paths(strategy):
    """The divisor is inside the op and is applied to the products (recompute: in fp32, one rounding;
    chunked: right after them, two independent roundings), never rounded into da, where one rounding
    error would repeat on every row (tests/kernel/test_rounding.py): each gradient is within 1.6x the error
    of the exact gradient rounded once (1.8x on the chunked path, which also rounds exp(z - m_tile);
    measured on CPU 1.53x / 1.67x), and no worse than dividing outside the op."""
    case = Case(40, 32, 300, torch.bfloat16, "sum", ignored=0.2)
    hidden, weight, _, targets = make_inputs(case)
    exact = [t.detach().double().requires_grad_(True) for t in (hidden, weight)]
    (F.cross_entropy(exact[0] @ exact[1].T, targets, reduction="sum") / 37).backward()

    def errors(folded):
        leaves = [t.clone().requires_grad_(True) for t in (hidden, weight)]
        if folded:
            fused_linear_cross_entropy(*leaves, targets, num_items_in_batch=37, strategy=strategy).backward()
        else:  # the division outside the op: an upstream gradient of 1/37
            (fused_linear_cross_entropy(*leaves, targets, reduction="sum", strategy=strategy) / 37).backward()
        return [rel_err(got.grad, want.grad) for got, want in zip(leaves, exact)]

    folded, outside = errors(True), errors(False)
    once = [rel_err(t.grad.to(torch.bfloat16), t.grad) for t in exact]
    bound = 1.8 if strategy == "chunked" else 1.6
    assert all(f <= bound * o for f, o in zip(folded, once)), (folded, once)
    assert all(f <= o for f, o in zip(folded, outside)), (folded, outside)


def test_metric_sums_add_up_across_shards():
    """Sums and counts from two halves of a batch reduce to the metrics of the whole batch."""
    hidden, weight, _, targets = make_inputs(Case(40, 32, 100, ignored=0.2))
    _, whole = fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
    parts = [fused_linear_cross_entropy(hidden[s], weight, targets[s], return_metrics=True)[1]
             for s in (slice(0, 17), slice(17, 40))]
    correct = sum(p["num_correct"] for p in parts)
    counted = sum(p["num_counted"] for p in parts)
    entropy = sum(p["entropy_sum"] for p in parts)
    assert counted.item() == (targets != -100).sum().item()
    torch.testing.assert_close(correct / counted, whole["mean_token_accuracy"])
    torch.testing.assert_close(entropy / counted, whole["entropy"])


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.tier
def test_cuda_graph_capture_and_replay_on_new_data():
    hidden, weight, targets = _problem(b=4, t=64, h=256, v=5000, dtype=torch.bfloat16)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    static_t = targets.clone()

    def step():
        loss = fused_linear_cross_entropy(h, w, static_t, shift=True)
        loss.backward()
        return loss

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # warm-up (compiles kernels) off the capture
            h.grad = w.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    h.grad = w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    new_h, new_w, new_t = _problem(b=4, t=64, h=256, v=5000, dtype=torch.bfloat16, seed=1)
    with torch.no_grad():
        h.copy_(new_h)
        w.copy_(new_w)
    static_t.copy_(new_t)
    graph.replay()
    h2, w2 = new_h.clone().requires_grad_(True), new_w.clone().requires_grad_(True)
    want = fused_linear_cross_entropy(h2, w2, new_t, shift=True)
    want.backward()
    torch.testing.assert_close(static_loss, want)
    assert rel_err(h.grad, h2.grad) < 1e-2 and rel_err(w.grad, w2.grad) < 1e-2
