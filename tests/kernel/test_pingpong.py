"""The Hopper ping-pong sweep (``pingpong.py``, Gluon): which calls take it, and on an sm_90 GPU that
its statistics are the Triton sweep's (``sweep_kernels.lse_sweep_kernel``) and float64's.

Gluon has no interpreter: on the CPU these tests check the dispatch rule and that the CPU path never
takes it; ``tests/kernel/test_registers.py`` compiles the kernel for sm_90 offline (no spill). The
kernel's own arithmetic runs in the GPU tests below only (skipped without a compute-capability-9.0 GPU).
"""

import pytest
import torch

from conftest import ON_GPU, rel_err
from fused_linear_ce import configs, fused_linear_cross_entropy, fused_linear_logprobs, parallel, pingpong, sweep
from fused_linear_ce import vocab_split
from fused_linear_ce.validate import Options

HOPPER = ON_GPU and torch.cuda.get_device_capability() == (9, 0) and pingpong.HAVE_GLUON
on_hopper = pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU and Gluon (Triton >= 3.5)")
DEV = "cuda"
LOG_PROBS = Options(reduction="none", outputs=("log_probs",))  # what a reference model's forward asks
SFT = Options(reduction="none", outputs=("log_probs", "entropy", "is_top1"))  # the metrics' sums too


@pytest.mark.tier_if(lambda expected: expected)  # the call the rule takes
@pytest.mark.parametrize("facts, expected", [
    (dict(), True),
    (dict(h=configs.pingpong(1).max_h + 64), False),  # outside the bucket: the Triton sweep is faster there
    (dict(capability=(10, 0)), False),  # Blackwell: no wgmma
    (dict(capability=(8, 0)), False),
    (dict(dtype=torch.float32), False),
    (dict(plain=False), False),  # the loss, label smoothing's or the squares' sums, bias, softcap, class weights
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
    lse = torch.logsumexp(z, dim=1)
    return lse, z.gather(1, targets[:, None])[:, 0], lse - (torch.exp(z - lse[:, None]) * z).sum(dim=1)


@on_hopper
@pytest.mark.tier_if(lambda dtype: dtype == torch.bfloat16)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n, h, v, splits", [
    (300, 320, 1000, 1),  # ragged rows, K and vocabulary; consumer 1 one tile short
    (257, 512, 1024, 2),  # V a multiple of the tiles
    (1000, 2048, 5003, 3),  # the bucket's largest H; three splits, six consumers' planes
    (64, 128, 256, 1),  # one tile: consumer 1 has none
], ids=["ragged", "even-v", "h2048-3splits", "one-tile"])
def test_matches_float64_and_the_triton_sweep(dtype, n, h, v, splits, monkeypatch):
    hidden, weight, targets = _inputs(n, h, v, dtype)
    monkeypatch.setattr(vocab_split, "vocab_splits", lambda *a, **k: splits)
    gluon = _stats(hidden, weight, targets, SFT, monkeypatch, True)
    triton_ = _stats(hidden, weight, targets, SFT, monkeypatch, False)
    lse, zt, ent = _float64(hidden, weight, targets)
    for got in (gluon, triton_):
        assert (got.lse.double() - lse).abs().max() < 2e-5
        assert (got.z_target.double() - zt).abs().max() < 2e-5
        assert (got.entropy.double() - ent).abs().max() < 5e-5
    # The same products in fp32: the two kernels agree far inside the float64 bound, and on the argmax.
    assert (gluon.lse - triton_.lse).abs().max() < 5e-6
    assert (gluon.z_target - triton_.z_target).abs().max() < 5e-6
    assert torch.equal(gluon.argmax, triton_.argmax)
    assert (gluon.best - triton_.best).abs().max() < 5e-6
    # The metrics' sums change nothing else: the lse and target logit bit for bit without them.
    plain = _stats(hidden, weight, targets, LOG_PROBS, monkeypatch, True)
    assert torch.equal(plain.lse2, gluon.lse2) and torch.equal(plain.z_target, gluon.z_target)


@on_hopper
def test_argmax_is_the_first_class_on_ties_across_consumers_and_splits(monkeypatch):
    n, h, v = 64, 128, 1500
    hidden, weight, targets = _inputs(n, h, v, torch.bfloat16)
    for cls in (700, 300, 1290):  # tiles 2, 1, 5 of 256 columns: both consumers, and both splits
        weight[cls] = 4 * hidden[0]  # one logit far above the rest of row 0, three times
    monkeypatch.setattr(vocab_split, "vocab_splits", lambda *a, **k: 2)
    got = _stats(hidden, weight, targets, SFT, monkeypatch, True)
    assert got.argmax[0].item() == 300


@on_hopper
@pytest.mark.parametrize("opts", [Options(), Options(return_metrics=True), Options(outputs=("log_probs", "mean_logits")),
                                  Options(outputs=("log_probs", "log_sum_sq_probs"))],
                         ids=["loss", "loss-metrics", "mean-logits", "log-sum-sq"])
def test_the_loss_and_the_sums_only_the_triton_sweep_carries_stay_there(opts, monkeypatch):
    hidden, weight, targets = _inputs(256, 512, 2000, torch.bfloat16)
    monkeypatch.delenv("FUSED_LINEAR_CE_PINGPONG", raising=False)
    calls = _spy(monkeypatch)
    sweep.sweep(hidden, weight, targets, None, None, opts)
    assert not calls


@on_hopper
@pytest.mark.tier
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
@pytest.mark.tier
def test_the_per_token_fields_take_it_forward_and_backward(monkeypatch):
    monkeypatch.delenv("FUSED_LINEAR_CE_PINGPONG", raising=False)
    calls = _spy(monkeypatch)
    hidden, weight, targets = _inputs(700, 1024, 5000, torch.bfloat16)
    targets[:100] = -100
    upstream = torch.randn(700, device=DEV)
    hd, wd = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    out = fused_linear_logprobs(hd, wd, targets, strategy="recompute", outputs=("log_probs", "entropy"))
    (out["log_probs"] * upstream - 0.1 * out["entropy"]).sum().backward()
    assert calls, "the per-token fields did not take the ping-pong sweep"
    hr, wr = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    z = hr @ wr.T
    live = targets != -100
    logp = z.log_softmax(dim=1)
    ref_lp = logp.gather(1, targets.clamp(min=0)[:, None])[:, 0] * live
    ref_ent = -(logp.exp() * logp).sum(dim=1) * live
    (ref_lp * upstream - 0.1 * ref_ent).sum().backward()
    assert (out["log_probs"][live].double() - ref_lp[live]).abs().max() < 2e-5
    assert (out["entropy"][live].double() - ref_ent[live]).abs().max() < 5e-5
    assert rel_err(hd.grad, hr.grad) < 3e-3 and rel_err(wd.grad, wr.grad) < 3e-3
    calls.clear()
    with torch.no_grad():
        fused_linear_cross_entropy(hidden, weight, targets, return_metrics=True)
    assert not calls, "the loss is the Triton sweep's"
