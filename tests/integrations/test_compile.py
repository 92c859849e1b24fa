"""``torch.compile(fullgraph=True)`` over a schedule: the batch size, the logit scale (a temperature
schedule), the softcap and the label smoothing change from call to call. No graph break, results
equal to eager, and recompiles only per class (a softcap or none; the first call's specialisation
before torch marks what changed as dynamic), never per value."""

import random

import pytest
import torch

from conftest import DEVICE, ON_GPU
from fused_linear_ce import fused_linear_cross_entropy

# Inductor compiles C++ for CPU graphs (slow on CI's 2 cores); what is tested here is Dynamo's
# tracing and guards, which aot_eager shares. On the GPU the default backend runs.
BACKEND = "inductor" if ON_GPU else "aot_eager"
H, V = 32, 96


def _schedule(seed, calls=5, softcap=True):
    """Random calls: (N, logit_scale, softcap, label_smoothing), floats over orders of magnitude."""
    rng = random.Random(seed)
    return [(rng.randint(3, 40), 10 ** rng.uniform(-1, 0.7), 10 ** rng.uniform(0, 3) if softcap else None,
             rng.uniform(0.01, 0.3)) for _ in range(calls)]


def _inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g).to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE)
    targets = torch.randint(0, V, (n,), generator=g).to(DEVICE)
    return hidden, weight, targets


def _step(hidden, weight, targets, scale, cap, smoothing, strategy):
    loss, metrics = fused_linear_cross_entropy(hidden, weight, targets, logit_scale=scale, softcap=cap,
                                               label_smoothing=smoothing, return_metrics=True, strategy=strategy)
    return loss, metrics["mean_token_accuracy"]


def _run(fn, calls, strategy):
    out = []
    for i, (n, scale, cap, smoothing) in enumerate(calls):
        hidden, weight, targets = _inputs(n, i)
        h, w = hidden.requires_grad_(True), weight.requires_grad_(True)
        loss, acc = fn(h, w, targets, scale, cap, smoothing, strategy)
        loss.backward()
        out.append((loss.detach(), acc, h.grad, w.grad))
    return out


@pytest.mark.parametrize("strategy", ["recompute", "chunked"])
@pytest.mark.parametrize("dynamic", [True, None], ids=["dynamic", "automatic"])
@pytest.mark.parametrize("seed", [0])
def test_changing_floats_and_shapes_compile_once_per_class(strategy, dynamic, seed):
    calls = _schedule(seed)
    if strategy == "chunked":  # it does not take a softcap with label smoothing
        calls = [(n, s, None, ls) for n, s, _, ls in calls]
    eager = _run(_step, calls, strategy)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = _run(torch.compile(_step, fullgraph=True, dynamic=dynamic, backend=BACKEND), calls, strategy)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    # dynamic=True: shapes and floats symbolic from the first call; automatic: the first call
    # specialised, one recompile marks what changed (shapes, floats) dynamic.
    assert graphs <= (1 if dynamic else 2), f"{graphs} graphs for {len(calls)} calls"
    assert not torch._dynamo.utils.counters["graph_break"]
    for (loss_c, acc_c, dh_c, dw_c), (loss_e, acc_e, dh_e, dw_e) in zip(compiled, eager):
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
        assert acc_c.item() == acc_e.item()
        torch.testing.assert_close(dh_c, dh_e, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(dw_c, dw_e, rtol=1e-4, atol=1e-6)


def test_turning_the_softcap_on_and_off_is_one_class_each():
    calls = [(12, 1.0, 30.0, 0.1), (12, 1.0, None, 0.1), (12, 0.5, 20.0, 0.1), (12, 0.7, None, 0.2),
             (12, 0.9, 25.0, 0.2)]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    _run(torch.compile(_step, fullgraph=True, dynamic=True, backend=BACKEND), calls, "recompute")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 2


def test_the_planner_traces_for_a_gpu_without_tracing_its_queries(monkeypatch):
    """The planner runs inside traced code (the op's ``apply``) and asks what the GPU is. Each question
    (capability, SM count, shared memory) is a constant to torch.compile: traced code gets its answer and
    never traces into the query. The simulated H100's queries break any graph that traces them."""
    from types import SimpleNamespace

    from fused_linear_ce import device, opargs, plan
    from fused_linear_ce.validate import Options
    from simulated_gpu import fresh_device_probes

    def untraceable(answer):
        def query(index=None):
            torch._dynamo.graph_break()  # a no-op when called, fatal to fullgraph when traced
            return answer
        return query

    props = SimpleNamespace(multi_processor_count=132, shared_memory_per_block_optin=232448, name="H100")
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", untraceable((9, 0)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", untraceable(props))
    monkeypatch.setattr(device, "_INTERPRETED", False)
    fresh_device_probes(monkeypatch.setattr, device)
    gpu = torch.device("cuda", 0)

    def planned(x):
        p = plan.plan_loss(Options(), x.shape[0], 128256, 4096, torch.bfloat16, [True, True, False], where=gpu)
        return x + sum(opargs.encode(p))

    torch._dynamo.reset()
    x = torch.zeros(8192)
    assert torch.equal(torch.compile(planned, fullgraph=True, backend="eager")(x), planned(x))
