"""The Hopper ping-pong sweep (``pingpong.py``, Gluon): which calls take it, and on an sm_90 GPU that
its statistics are the Triton sweep's (``sweep.lse_sweep_kernel``) and float64's.

Gluon has no interpreter: on the CPU these tests check the dispatch rule and that the CPU path never
takes it; ``tests/kernel/test_registers.py`` compiles the kernel for sm_90 offline (no spill). The
kernel's own arithmetic runs in the GPU tests below only (skipped without a compute-capability-9.0 GPU).
"""

import pytest
import torch

from conftest import ON_GPU, rel_err
from fused_linear_ce import configs, fused_linear_cross_entropy, fused_linear_logprobs, parallel, pingpong, plan, sweep
from fused_linear_ce.validate import Options

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and pingpong.HAVE_GLUON
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and Gluon (Triton >= 3.5)")
DEV = "cuda"
LOG_PROBS = Options(reduction="none", outputs=("log_probs",))  # what a reference model's forward asks


@pytest.mark.parametrize("facts, expected", [
    (dict(), True),
    (dict(h=configs.pingpong(1).max_h + 64), False),  # outside the bucket: the Triton sweep is faster there
    (dict(capability=(10, 0)), False),  # Blackwell: no wgmma
    (dict(capability=(8, 0)), False),
    (dict(dtype=torch.float32), False),
    (dict(plain=False), False),  # the loss, the metrics' sums, bias, softcap, class weights
    (dict(tma=False), False),  # a layout TMA descriptors cannot take
], ids=["hopper-bf16", "large-h", "blackwell", "ampere", "fp32", "not-plain", "no-tma"])
def test_the_rule_takes_plain_16bit_calls_on_hopper_at_small_h(facts, expected):
    args = dict(capability=(9, 0), dtype=torch.bfloat16, h=1024, plain=True, tma=True) | facts
    assert pingpong.rule(args.pop("capability"), args.pop("dtype"), args.pop("h"), **args) is expected
    if expected:
        assert pingpong.rule((9, 0), torch.float16, 1024, plain=True, tma=True)


def test_only_with_the_triton_releases_it_was_tested_on():
    assert pingpong.triton_tested("3.6.0") and pingpong.triton_tested("3.6.1+git1234")
    assert not pingpong.triton_tested("3.5.1") and not pingpong.triton_tested("3.7.0")
    assert not pingpong.triton_tested("main")
    assert pingpong.HAVE_GLUON == (pingpong.triton_tested() and hasattr(pingpong, "pingpong_sweep_kernel"))


def test_never_on_the_cpu_or_the_interpreter():
    h = torch.randn(8, 64).bfloat16()
    assert not pingpong.eligible(h, torch.randn(32, 64).bfloat16(), True)


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setattr(pingpong.device, "interpreted", lambda: False)
    monkeypatch.setenv("FUSED_LINEAR_CE_PINGPONG", "0")
    h = torch.randn(8, 64).bfloat16()
    assert not pingpong.eligible(h, torch.randn(32, 64).bfloat16(), True)


def _spy(monkeypatch):
    calls = []
    launch = pingpong.launch
    monkeypatch.setattr(pingpong, "launch", lambda *a, **k: calls.append(1) or launch(*a, **k))
    return calls


def _stats(hidden, weight, targets, opts, monkeypatch, on: bool, shard=None):
    monkeypatch.setenv("FUSED_LINEAR_CE_PINGPONG", "1" if on else "0")
    calls = _spy(monkeypatch)
    out = sweep.sweep(hidden, weight, targets, None, None, opts, shard)[0]
    assert bool(calls) is on, "the ping-pong sweep ran where it should not, or not where it should"
    return out


def _inputs(n, h, v, dtype, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = (torch.randn(n, h, device=DEV, generator=g) * 0.5).to(dtype)
    weight = (torch.randn(v, h, device=DEV, generator=g) * (4.0 / h) ** 0.5).to(dtype)
    targets = torch.randint(0, v, (n,), device=DEV, generator=g)
    return hidden, weight, targets


def _float64(hidden, weight, targets):
    z = hidden.double() @ weight.double().T
    return torch.logsumexp(z, dim=1), z.gather(1, targets[:, None])[:, 0]


@on_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n, h, v, splits", [
    (300, 320, 1000, 1),  # ragged rows, K and vocabulary; consumer 1 one tile short
    (257, 512, 1024, 2),  # V a multiple of the tiles
    (1000, 2048, 5003, 3),  # the bucket's largest H; three splits, six consumers' planes
    (64, 128, 256, 1),  # one tile: consumer 1 has none
], ids=["ragged", "even-v", "h2048-3splits", "one-tile"])
def test_matches_float64_and_the_triton_sweep(dtype, n, h, v, splits, monkeypatch):
    hidden, weight, targets = _inputs(n, h, v, dtype)
    monkeypatch.setattr(plan, "vocab_splits", lambda *a, **k: splits)
    gluon = _stats(hidden, weight, targets, LOG_PROBS, monkeypatch, True)
    triton_ = _stats(hidden, weight, targets, LOG_PROBS, monkeypatch, False)
    lse, zt = _float64(hidden, weight, targets)
    for got in (gluon, triton_):
        assert (got.lse.double() - lse).abs().max() < 2e-5
        assert (got.z_target.double() - zt).abs().max() < 2e-5
    # The same products in fp32: the two kernels agree far inside the float64 bound.
    assert (gluon.lse - triton_.lse).abs().max() < 5e-6
    assert (gluon.z_target - triton_.z_target).abs().max() < 5e-6


@on_hopper
@pytest.mark.parametrize("opts", [Options(), Options(return_metrics=True), Options(outputs=("log_probs", "entropy")),
                                  Options(outputs=("log_probs", "mean_logits"))],
                         ids=["loss", "loss-metrics", "entropy", "mean-logits"])
def test_the_loss_and_the_other_per_token_fields_stay_on_the_triton_sweep(opts, monkeypatch):
    hidden, weight, targets = _inputs(256, 512, 2000, torch.bfloat16)
    monkeypatch.delenv("FUSED_LINEAR_CE_PINGPONG", raising=False)
    calls = _spy(monkeypatch)
    sweep.sweep(hidden, weight, targets, None, None, opts)
    assert not calls


@on_hopper
def test_a_vocabulary_shard_and_ignored_blocks(monkeypatch):
    n, h, v = 256, 256, 1100
    hidden, weight, targets = _inputs(n, h, v, torch.bfloat16)
    targets = targets + v  # rank 1's classes: in its shard
    targets[:70] = 5  # rank 0's: not in this shard (z_target 0)
    targets[128:192] = -100  # one whole block of 64 rows ignored: no tile runs for it
    monkeypatch.setattr(parallel, "merge_stats", lambda *a, **k: None)
    shard = parallel.Shard(group=None, rank=1, world=2, v_local=v)
    gluon = _stats(hidden, weight, targets, LOG_PROBS, monkeypatch, True, shard)
    triton_ = _stats(hidden, weight, targets, LOG_PROBS, monkeypatch, False, shard)
    live = targets != -100
    assert torch.equal(gluon.z_target[:70], torch.zeros(70, device=DEV))
    assert (gluon.z_target[live] - triton_.z_target[live]).abs().max() < 5e-6
    assert (gluon.lse[live] - triton_.lse[live]).abs().max() < 5e-6
    assert torch.isfinite(gluon.lse).all()  # the ignored block's neutral statistics


@on_hopper
def test_the_per_token_log_probs_take_it_forward_and_backward(monkeypatch):
    monkeypatch.delenv("FUSED_LINEAR_CE_PINGPONG", raising=False)
    calls = _spy(monkeypatch)
    hidden, weight, targets = _inputs(700, 1024, 5000, torch.bfloat16)
    targets[:100] = -100
    upstream = torch.randn(700, device=DEV)
    hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_linear_logprobs(hd, wd, targets, strategy="recompute")["log_probs"]
    (out * upstream).sum().backward()
    assert calls, "the per-token log-probs did not take the ping-pong sweep"
    hr, wr = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    z = hr @ wr.T
    ref = (z.gather(1, targets.clamp(min=0)[:, None])[:, 0] - torch.logsumexp(z, dim=1)) * (targets != -100)
    (ref * upstream).sum().backward()
    live = targets != -100
    assert (out[live].double() - ref[live]).abs().max() < 2e-5
    assert rel_err(hd.grad, hr.grad) < 3e-3 and rel_err(wd.grad, wr.grad) < 3e-3
    calls.clear()
    with torch.no_grad():
        fused_linear_logprobs(hidden, weight, targets, outputs=("log_probs", "entropy"))
        fused_linear_cross_entropy(hidden, weight, targets)
    assert not calls, "the entropy and the loss are the Triton sweep's"
