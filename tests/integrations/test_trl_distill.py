"""The TRL distillation drop-in (``trl_distill``): TRL 1.16's own ``ChunkedDivergenceFunction`` and
``_chunked_divergence_loss``, run as black boxes, against ours: the same per-token divergences and
entropies, losses, entropy sums, counts and student gradients, and the same ``DistillationTrainer`` run
(a tiny student and a wider tiny teacher) before and after ``use_in_trl()``.

CPU cases are fp32 and fp16 (TRL's head runs its torch path on the CPU); bf16 is covered by the GPU
case (``test_bf16_loss_and_head_on_gpu``): the interpreter's ``tl.dot`` is wrong for bf16 operands (Triton
issue 11584).
"""

import inspect

import pytest
import torch

from conftest import DEVICE, ON_GPU, rel_err

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
datasets = pytest.importorskip("datasets")

import trl.trainer.distillation_trainer as trl_distillation  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction as TheirHead  # noqa: E402

import fused_linear_ce  # noqa: E402
from fused_linear_ce import trl_distill  # noqa: E402
from fused_linear_ce.plan import LOGIT_PAIR_BYTES  # noqa: E402

THEIR_LOSS = trl_distillation._chunked_divergence_loss
N, HS, HT, V = (40, 32, 48, 300)
B, K = 5, 8  # N = B x K completion positions
# fp32: both sides fp32 sums of fp32 logits (1e-6 seen); fp16: the same fp16 operands, the gradients
# rounded to fp16 by each (5e-4 seen on the bias).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.fixture
def restore_trl(monkeypatch):
    """Whatever a test installs into TRL is put back after it."""
    for name in trl_distill.TRL_DISTILL_NAMES:
        monkeypatch.setattr(trl_distillation, name, getattr(trl_distillation, name))
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", trl_utils._ChunkedLogProbFunction)


def _inputs(dtype, seed=0, bias=(True, True), device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    hs, ht = torch.randn(B, K, HS, generator=g), torch.randn(B, K, HT, generator=g)
    ws, wt = torch.randn(V, HS, generator=g) / HS**0.25, torch.randn(V, HT, generator=g) / HT**0.25
    bs, bt = torch.randn(V, generator=g), torch.randn(V, generator=g)
    mask = (torch.rand(B, K, generator=g) > 0.3).long()
    mask[1] = 0  # a sequence without completion tokens
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return (cast(hs), cast(ht), cast(ws), cast(wt), cast(bs) if bias[0] else None, cast(bt) if bias[1] else None,
            mask.to(device))


def _run_loss(fn, inputs, beta, **kwargs):
    hs, ht, ws, wt, bs, bt, mask = inputs
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (hs, ws, bs)]
    teacher_weight = wt.clone().requires_grad_()  # a teacher parameter: neither side gives it a gradient
    loss, entropy_sum, n_valid = fn(leaves[0], ht, leaves[1], teacher_weight, mask, beta,
                                    student_lm_head_bias=leaves[2], teacher_lm_head_bias=bt, **kwargs)
    loss.backward()
    assert teacher_weight.grad is None and not entropy_sum.requires_grad
    return loss, entropy_sum, n_valid, [t.grad if t is not None else None for t in leaves]


LOSS_CASES = {
    "plain": dict(),
    "temp0.7": dict(temperature=0.7),
    "caps-scales": dict(student_final_logit_softcapping=4.0, teacher_final_logit_softcapping=6.0,
                        student_logit_scale=1.3, teacher_logit_scale=0.8, temperature=1.2),
    "items": dict(num_items_in_batch=torch.tensor(57)),
}


# (dtype, beta, case): each beta, case and dtype at least once (the interpreter is slow: not the product).
LOSS_GRID = [(torch.float32, 0.0, "plain"), (torch.float32, 0.4, "caps-scales"), (torch.float32, 1.0, "temp0.7"),
             (torch.float16, 0.4, "items"), (torch.float16, 1.0, "caps-scales"), (torch.float16, 0.0, "temp0.7")]


@pytest.mark.parametrize("dtype, beta, case", LOSS_GRID,
                         ids=[f"{str(d)[-7:]}-beta{b}-{c}" for d, b, c in LOSS_GRID])
def test_loss_matches_trls(dtype, beta, case):
    inputs = _inputs(dtype, seed=int(beta * 10), bias=(True, case != "plain"))
    theirs = _run_loss(THEIR_LOSS, inputs, beta, **LOSS_CASES[case])
    mine = _run_loss(trl_distill.chunked_divergence_loss, inputs, beta, **LOSS_CASES[case])
    assert mine[0].dtype == theirs[0].dtype == torch.float32 and mine[0].shape == ()
    assert rel_err(mine[0], theirs[0]) < TOL[dtype]
    assert rel_err(mine[1], theirs[1]) < TOL[dtype]
    assert torch.equal(mine[2], theirs[2]) and mine[2].dtype == theirs[2].dtype
    for name, a, b in zip(("hidden", "weight", "bias"), mine[3], theirs[3]):
        assert a.dtype == b.dtype == dtype, name
        assert rel_err(a, b) < TOL[dtype], name


def test_loss_edge_cases_match_trls():
    """A fully masked batch (0, not 0/0), a batch of one row with an int num_items_in_batch, mixed dtypes
    (an fp16 teacher with an fp32 student and weights in another dtype than their hidden states)."""
    inputs = _inputs(torch.float32, seed=3)
    masked = (*inputs[:-1], torch.zeros_like(inputs[-1]))
    one_row = [t[:1, :1] if t is not None and t.dim() >= 2 and t.shape[0] == B else t for t in inputs]
    for args, kwargs in (((masked, 0.5), dict(num_items_in_batch=None)), ((one_row, 0.2), dict(num_items_in_batch=3))):
        theirs, mine = _run_loss(THEIR_LOSS, *args, **kwargs), _run_loss(trl_distill.chunked_divergence_loss, *args,
                                                                         **kwargs)
        assert rel_err(mine[0], theirs[0]) < 2e-5 and rel_err(mine[1], theirs[1]) < 2e-5
        assert torch.equal(mine[2], theirs[2])
        for a, b in zip(mine[3], theirs[3]):
            assert rel_err(a, b) < 2e-5
    hs, ht, ws, wt, bs, bt, mask = _inputs(torch.float32, seed=4)
    for mixed, tol in (((hs, ht.half(), ws.half(), wt, bs, bt.half(), mask), 2e-5),  # teacher weight -> fp16
                       ((hs.half(), ht, ws, wt.half(), bs.half(), bt, mask), TOL[torch.float16])):  # student's
        theirs, mine = _run_loss(THEIR_LOSS, mixed, 0.6), _run_loss(trl_distill.chunked_divergence_loss, mixed, 0.6)
        assert rel_err(mine[0], theirs[0]) < 1e-6 and rel_err(mine[1], theirs[1]) < 1e-6  # the same operands
        for a, b in zip(mine[3], theirs[3]):
            assert a.dtype == b.dtype and rel_err(a, b) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_loss_nothing_counted_over_zero_items_has_zero_gradients(dtype):
    """A fully masked batch divided by num_items_in_batch=0 (a tensor, as the trainer passes it): the
    loss is 0 / 0 = NaN, and every student gradient exactly 0 (``fused_linear_divergence``'s rule for
    no counted row), not NaN."""
    hs, ht, ws, wt, bs, bt, mask = _inputs(dtype, seed=6)
    loss, entropy_sum, n_valid, grads = _run_loss(trl_distill.chunked_divergence_loss,
                                                  (hs, ht, ws, wt, bs, bt, torch.zeros_like(mask)), 0.5,
                                                  num_items_in_batch=torch.tensor(0))
    assert torch.isnan(loss) and entropy_sum == 0 and n_valid == 0
    for name, grad in zip(("hidden", "weight", "bias"), grads):
        assert grad.dtype == dtype and (grad == 0).all(), name


def _run_head(apply, inputs, beta, args):
    hs, ht, ws, wt, bs, bt, _ = inputs
    leaves = [t.reshape(-1, t.shape[-1]).clone().requires_grad_() if t.dim() == 3 else t.clone().requires_grad_()
              for t in (hs, ws, bs)]
    div, entropy = apply(leaves[0], leaves[1], leaves[2], ht.reshape(N, HT), wt, bt, beta, *args)
    upstream = torch.randn(N, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    (div * upstream).sum().backward()
    assert not entropy.requires_grad and div.shape == entropy.shape == (N,)
    return div, entropy, [t.grad for t in leaves]


CAPS = (0.8, 1.2, 5.0, 0.9, 3.0)  # temperature, student scale and softcap, teacher scale and softcap
HEAD_GRID = [(torch.float32, 0.0, ()), (torch.float32, 0.4, CAPS), (torch.float32, 1.0, (1.3,)),
             (torch.float16, 0.0, CAPS), (torch.float16, 0.4, ()), (torch.float16, 1.0, CAPS)]


@pytest.mark.parametrize("dtype, beta, args", HEAD_GRID,
                         ids=[f"{str(d)[-7:]}-beta{b}-{len(a)}args" for d, b, a in HEAD_GRID])
def test_per_token_head_matches_trls(dtype, beta, args):
    """``ChunkedDivergenceFunction.apply``, TRL's positional arguments, a random upstream gradient per token."""
    inputs = _inputs(dtype, seed=5)
    theirs = _run_head(TheirHead.apply, inputs, beta, args)
    mine = _run_head(fused_linear_ce.trl_distill.ChunkedDivergenceFunction.apply, inputs, beta, args)
    for a, b in zip(mine[:2], theirs[:2]):
        assert a.dtype == b.dtype == torch.float32 and rel_err(a, b) < TOL[dtype]
    for a, b in zip(mine[2], theirs[2]):
        assert a.dtype == b.dtype == dtype and rel_err(a, b) < TOL[dtype]


def test_autocast_computes_in_the_autocast_dtype_as_trls():
    """Under a 16-bit autocast both take the fp16 operands (TRL's head rounds its logits to fp16 there
    too, ours keeps them fp32: 2e-5 apart), and the fp32 tensors get fp32 gradients."""
    inputs = _inputs(torch.float32, seed=6)
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        theirs = _run_loss(THEIR_LOSS, inputs, 0.5, temperature=0.9)
        mine = _run_loss(trl_distill.chunked_divergence_loss, inputs, 0.5, temperature=0.9)
    in_fp16 = _run_loss(trl_distill.chunked_divergence_loss, [t.half() if t.is_floating_point() else t for t in inputs],
                        0.5, temperature=0.9)
    assert rel_err(mine[0], theirs[0]) < TOL[torch.float16] and rel_err(mine[1], theirs[1]) < TOL[torch.float16]
    assert rel_err(mine[0], in_fp16[0]) < 1e-6 and rel_err(mine[1], in_fp16[1]) < 1e-6
    for a, b, c in zip(mine[3], theirs[3], in_fp16[3]):
        assert a.dtype == b.dtype == torch.float32 and rel_err(a, b) < TOL[torch.float16]
        assert rel_err(a, c) < 1e-3  # ours rounds them to fp16 without autocast


def test_contracts_and_use_in_trl_installs_and_restores(restore_trl, monkeypatch):
    theirs = list(inspect.signature(TheirHead.forward).parameters.values())[1:]
    mine = list(inspect.signature(trl_distill.ChunkedDivergenceFunction.apply).parameters.values())
    assert [(p.name, p.default) for p in mine] == [(p.name, p.default) for p in theirs]
    their_loss = inspect.signature(THEIR_LOSS).parameters.values()
    my_loss = inspect.signature(trl_distill.chunked_divergence_loss).parameters.values()
    assert [(p.name, p.default) for p in my_loss] == [(p.name, p.default) for p in their_loss]
    originals = {name: getattr(trl_distillation, name) for name in trl_distill.TRL_DISTILL_NAMES}
    replaced = fused_linear_ce.use_in_trl()
    assert trl_distillation.ChunkedDivergenceFunction is trl_distill.ChunkedDivergenceFunction
    assert trl_distillation._chunked_divergence_loss is trl_distill.chunked_divergence_loss
    assert replaced["trl.trainer.distillation_trainer._chunked_divergence_loss"] is THEIR_LOSS
    assert replaced["trl.trainer.distillation_trainer.ChunkedDivergenceFunction"] is TheirHead
    replaced.restore()
    assert {name: getattr(trl_distillation, name) for name in originals} == originals
    assert trl_utils._ChunkedLogProbFunction is replaced["trl.trainer.utils._ChunkedLogProbFunction"]
    budget = 24 * V * LOGIT_PAIR_BYTES  # 24 rows of the divergence's two fp32 logit rows
    fused_linear_ce.use_in_trl(chunk_bytes=budget)
    head, loss = trl_distillation.ChunkedDivergenceFunction, trl_distillation._chunked_divergence_loss
    assert head.chunk_bytes == budget
    assert [p.name for p in inspect.signature(head.apply).parameters.values()] == [p.name for p in theirs]
    assert [p.name for p in inspect.signature(loss).parameters.values()] == [p.name for p in their_loss]
    seen = []

    def spy(*args, **kwargs):  # what the budgeted drop-ins hand fused_linear_divergence
        seen.append((kwargs["chunk_bytes"], kwargs["reduction"]))
        return torch.zeros(()), {"entropy": torch.zeros(N)}

    monkeypatch.setattr(trl_distill, "fused_linear_divergence", spy)
    hs, ht, ws, wt, bs, bt, mask = _inputs(torch.float32, seed=7)
    loss(hs, ht, ws, wt, mask, 0.3)
    head.apply(hs.reshape(N, HS), ws, bs, ht.reshape(N, HT), wt, bt, 0.3)
    trl_distill.chunked_divergence_loss(hs, ht, ws, wt, mask, 0.3)
    assert seen == [(budget, "sum"), (budget, "none"), (None, "sum")]



def test_use_in_trl_takes_a_budget_per_head(restore_trl):
    """``divergence_chunk_bytes`` is the distillation drop-ins' budget and ``chunk_bytes`` the LM head's,
    each where it is given; the divergence's follows ``chunk_bytes`` only without its own."""
    lm, div = 48 * V * LOGIT_PAIR_BYTES, 24 * V * LOGIT_PAIR_BYTES
    fused_linear_ce.use_in_trl(chunk_bytes=lm, divergence_chunk_bytes=div)
    assert trl_utils._ChunkedLogProbFunction.chunk_bytes == lm
    assert trl_distillation.ChunkedDivergenceFunction.chunk_bytes == div
    fused_linear_ce.use_in_trl(divergence_chunk_bytes=div)
    assert trl_utils._ChunkedLogProbFunction is fused_linear_ce.ChunkedLogProbFunction  # the LM head's default
    assert trl_distillation.ChunkedDivergenceFunction.chunk_bytes == div
    with pytest.raises(ValueError, match="chunk_bytes"):
        fused_linear_ce.use_in_trl(divergence_chunk_bytes=0)

# --- DistillationTrainer, end to end ------------------------------------------------------------------

VOCAB = 64


def _model(hidden, seed):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, pad_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                                      tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).float().to(DEVICE)


def _tokenizer():
    vocab = {f"t{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                padding_side="left")


def _dataset():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 7, (12,), generator=g).tolist()
    prompts = [" ".join(f"t{i}" for i in torch.randint(0, VOCAB - 2, (n,), generator=g).tolist()) for n in lengths]
    return datasets.Dataset.from_dict({"prompt": prompts})


class _Grads(transformers.TrainerCallback):
    """The student's gradients just before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def _train(tmp_path, name):
    args = trl.DistillationConfig(output_dir=str(tmp_path / name), report_to=[], save_strategy="no",
                                  use_cpu=DEVICE.type == "cpu", bf16=False, per_device_train_batch_size=4, max_steps=3,
                                  learning_rate=1e-2, logging_steps=1, seed=0, data_seed=0, max_completion_length=6,
                                  beta=0.4, temperature=0.9, gradient_checkpointing=False, shuffle_dataset=False)
    grads = _Grads()
    trainer = trl.DistillationTrainer(model=_model(32, seed=0), teacher_model=_model(48, seed=1), args=args,
                                      train_dataset=_dataset(), processing_class=_tokenizer(), callbacks=[grads])
    trainer.train()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return [e for e in trainer.state.log_history if "loss" in e], grads.steps, params


def test_distillation_trainer_with_use_in_trl_matches_trls_own_head(tmp_path, restore_trl, monkeypatch):
    calls = []
    real = trl_distill._loss

    def counted(*args):
        calls.append(args[6])  # num_items_in_batch
        return real(*args)

    monkeypatch.setattr(trl_distill, "_loss", counted)
    plain_logs, plain_grads, plain_params = _train(tmp_path, "plain")
    assert not calls
    fused_linear_ce.use_in_trl()
    fused_logs, fused_grads, fused_params = _train(tmp_path, "fused")
    assert len(calls) == 3, "DistillationTrainer did not call our loss"
    assert all(isinstance(items, torch.Tensor) for items in calls)  # the Trainer's count of completion tokens
    assert len(fused_logs) == len(plain_logs) == 3
    for mine, theirs in zip(fused_logs, plain_logs):
        for key in ("loss", "entropy", "grad_norm"):
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (key, mine, theirs)
    assert len(fused_grads) == len(plain_grads) == 3
    for mine, theirs in zip(fused_grads, plain_grads):
        assert mine.keys() == theirs.keys() and "lm_head.weight" in mine
        for name in theirs:
            assert rel_err(mine[name], theirs[name]) < 1e-4, name
    # AdamW moves each entry by ~lr whatever its gradient's size, so entries whose gradients are near
    # rounding level (1e-9 against 1e-2) move by different amounts: 1.1e-4 seen on the embedding.
    for name in plain_params:
        assert rel_err(fused_params[name], plain_params[name]) < 1e-3, name


@pytest.mark.skipif(not ON_GPU, reason="bf16 tl.dot is wrong under the interpreter (Triton issue 11584)")
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bf16_loss_and_head_on_gpu(beta):
    inputs = _inputs(torch.bfloat16, seed=8)
    theirs = _run_loss(THEIR_LOSS, inputs, beta, temperature=0.9, student_final_logit_softcapping=5.0)
    mine = _run_loss(trl_distill.chunked_divergence_loss, inputs, beta, temperature=0.9,
                     student_final_logit_softcapping=5.0)
    assert rel_err(mine[0], theirs[0]) < TOL[torch.bfloat16] and rel_err(mine[1], theirs[1]) < TOL[torch.bfloat16]
    assert torch.equal(mine[2], theirs[2])
    for a, b in zip(mine[3], theirs[3]):
        assert a.dtype == torch.bfloat16 and rel_err(a, b) < TOL[torch.bfloat16]
    theirs = _run_head(TheirHead.apply, inputs, beta, CAPS)
    mine = _run_head(trl_distill.ChunkedDivergenceFunction.apply, inputs, beta, CAPS)
    for a, b in zip((*mine[:2], *mine[2]), (*theirs[:2], *theirs[2])):
        assert rel_err(a, b) < TOL[torch.bfloat16]
