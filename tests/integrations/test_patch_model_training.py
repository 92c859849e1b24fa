"""patch_model where a model trains: the real transformers.Trainer for 3 steps with gradient
accumulation (Llama; Gemma-2 with its softcap and tied embeddings; Llama with bf16=True), PEFT LoRA,
DTensor weights and FSDP2 on a 1-rank gloo mesh (with bf16 autocast over fp32 parameters too). Tiny
random models (tests/integrations/patch_pairs.py), the patched model against an unpatched copy from
the same weights: the same losses and gradients. The model's forward itself: test_patch_model.py."""

import copy
import datetime
import socket

import pytest
import torch
from torch import nn

from conftest import DEVICE, ON_GPU, rel_err

transformers = pytest.importorskip("transformers")
pytest.register_assert_rewrite("patch_pairs")

from fused_linear_ce import patch_model, patching  # noqa: E402
from patch_pairs import (  # noqa: E402
    SMALL, TOL, T, V, assert_same_grads, batch, kernel_inputs, llama, pair, step, with_bias,
)


def gemma2(cap=2.0):
    """Gemma-2 ties its head to the embeddings. The weights are scaled so that the logits have a trained
    model's spread, where a softcap of 2 changes the loss."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=cap)
    model = transformers.Gemma2ForCausalLM(config).to(DEVICE).float()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)
    return model


# --- the real Trainer -----------------------------------------------------------------------------------


class _Rows(torch.utils.data.Dataset):
    """12 rows with varying counted tokens, so num_items_in_batch differs between micro-batches."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.rows = []
        for i in range(12):
            ids = torch.randint(0, V, (T,), generator=g)
            labels = ids.clone()
            labels[: 2 + i % 5] = -100
            mask = torch.ones(T, dtype=torch.int64)
            if i % 3 == 0:
                mask[-3:] = 0
                labels[-3:] = -100
            self.rows.append({"input_ids": ids, "attention_mask": mask, "labels": labels})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def train(model, tmp_path, steps=3, bf16=False):
    """3 optimizer steps of transformers.Trainer with 2 micro-batches each: the per-micro-batch losses,
    the accumulated gradients before each optimizer step, what the forward returned. Plain SGD: Adam
    divides by the root of the squared gradient, which turns roundoff in gradients near zero into
    differences of a whole learning rate."""
    record = {"loss": [], "grads": [], "num_items": [], "logits": []}

    class Grads(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            record["grads"].append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                                    if p.grad is not None})

    class Recording(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            record["loss"].append(loss.detach().clone())
            record["num_items"].append(num_items_in_batch)
            record["logits"].append(outputs.get("logits"))
            return (loss, outputs) if return_outputs else loss

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=steps,
        optim="sgd", learning_rate=0.5, logging_steps=1, report_to=[], save_strategy="no", use_cpu=not ON_GPU, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, bf16=bf16,
    )
    trainer = Recording(model=model, args=args, train_dataset=_Rows(), callbacks=[Grads()])
    trainer.train()
    return record


@pytest.mark.parametrize("make", [llama, gemma2], ids=["llama", "gemma2-softcap-tied"])
def test_trainer_steps_give_the_unpatched_losses_and_gradients(make, tmp_path):
    theirs, ours = pair(make)
    if make is gemma2:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied
    want = train(theirs, tmp_path / "plain")
    got = train(ours, tmp_path / "patched")
    assert len(got["loss"]) == len(want["loss"]) == 6 and len(got["grads"]) == len(want["grads"]) == 3
    # Trainer passed num_items_in_batch (gradient accumulation), and it varies between steps.
    assert all(n is not None for n in got["num_items"]) and len({int(n) for n in got["num_items"]}) > 1
    assert all(lg is None for lg in got["logits"]) and all(lg is not None for lg in want["logits"])
    for a, b in zip(got["loss"], want["loss"]):
        torch.testing.assert_close(a, b.float(), rtol=TOL, atol=1e-6)
    for g_ours, g_theirs in zip(got["grads"], want["grads"]):
        assert g_ours.keys() == g_theirs.keys()
        for name in g_theirs:
            assert rel_err(g_ours[name], g_theirs[name]) < TOL, name
    if make is gemma2:  # the softcap matters at this spread: uncapped, the loss is far from the model's
        uncapped = patch_model(gemma2(cap=None))
        ids, labels, mask = batch()
        with torch.no_grad():
            capped = patch_model(gemma2())(input_ids=ids, attention_mask=mask, labels=labels).loss
            assert abs(uncapped(input_ids=ids, attention_mask=mask, labels=labels).loss - capped) > 0.1


def test_trainer_with_bf16_on_an_fp32_model_sums_the_head_gradient_in_fp32(tmp_path, monkeypatch):
    """Trainer(bf16=True) on an fp32 model (its forward under bf16 autocast): the kernel gets the head's
    fp32 weight as a master weight on every micro-batch, and the losses and accumulated gradients
    follow the unpatched model's to bf16's precision (its head rounds logits and gradients to bf16)."""
    seen = kernel_inputs(monkeypatch)
    theirs, ours = pair(llama)
    want = train(theirs, tmp_path / "plain", steps=2, bf16=True)
    got = train(ours, tmp_path / "patched", steps=2, bf16=True)
    assert seen == [(torch.bfloat16, torch.float32, False)] * 4
    assert all(lg is None for lg in got["logits"])
    for a, b in zip(got["loss"], want["loss"]):
        assert rel_err(a, b.float()) < 1e-2
    for g_ours, g_theirs in zip(got["grads"], want["grads"]):
        assert g_ours["lm_head.weight"].dtype == torch.float32
        for name in g_theirs:
            assert rel_err(g_ours[name], g_theirs[name]) < 5e-2, name


# --- PEFT ---------------------------------------------------------------------------------------------------


def _lora(model, targets=("q_proj", "v_proj")):
    peft = pytest.importorskip("peft")
    torch.manual_seed(7)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), task_type="CAUSAL_LM",
                             init_lora_weights=False)
    return peft.get_peft_model(model, config)


@pytest.mark.parametrize("when", ["after-wrapping", "before-wrapping"])
def test_peft_lora(when):
    theirs = _lora(llama())
    ours = patch_model(_lora(llama())) if when == "after-wrapping" else _lora(patch_model(llama()))
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert got.logits is None
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    lora = [n for n, p in ours.named_parameters() if p.grad is not None]
    assert lora and all("lora_" in n for n in lora)
    assert_same_grads(theirs, ours)


def test_peft_lora_on_the_lm_head_is_refused():
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        patch_model(_lora(llama(), ("q_proj", "lm_head")))
    model = _lora(patch_model(llama()), ("q_proj", "lm_head"))
    ids, labels, _ = batch()
    with pytest.raises(ValueError, match="not a plain torch.nn.Linear"):
        model(input_ids=ids, labels=labels)


# --- DTensor weights ---------------------------------------------------------------------------------------------


@pytest.fixture
def gloo_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialised")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(ON_GPU, reason="CPU/gloo test (Triton interpreter); the kernel's NCCL path: test_parallel_nccl.py")
def test_dtensor_weights_on_a_one_rank_mesh(gloo_mesh, monkeypatch):
    """Shard(0) is vocabulary parallelism over the mesh's group, Replicate the local tensor; gradients
    reach the DTensor parameters. Other placements raise."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    groups = []
    kernel = patching.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        groups.append(kwargs["process_group"])
        return kernel(*args, **kwargs)

    monkeypatch.setattr(patching, "fused_linear_cross_entropy", spy)
    ids, labels, mask = batch()
    theirs = with_bias()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    for placement, group in ((Shard(0), gloo_mesh.get_group()), (Replicate(), None)):
        ours = copy.deepcopy(theirs)
        ours.zero_grad()
        for name in ("weight", "bias"):
            param = getattr(ours.lm_head, name)
            setattr(ours.lm_head, name, nn.Parameter(distribute_tensor(param.detach(), gloo_mesh, [placement])))
        patch_model(ours)
        got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
        assert groups.pop() is group
        torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
        assert type(ours.lm_head.weight.grad).__name__ == "DTensor"
        assert_same_grads(theirs, ours)
    ours = copy.deepcopy(theirs)
    ours.lm_head.weight = nn.Parameter(distribute_tensor(ours.lm_head.weight.detach(), gloo_mesh, [Shard(1)]))
    ours.lm_head.bias = None
    with pytest.raises(ValueError, match=r"placements \(Shard\(dim=1\),\)"):
        patch_model(ours)(input_ids=ids, labels=labels)


@pytest.mark.skipif(ON_GPU, reason="CPU/gloo test (Triton interpreter)")
def test_fsdp2_root_unit_gives_plain_weights_in_the_forward(gloo_mesh, monkeypatch):
    """fully_shard on the layers and the root (which holds the lm head): the loss runs inside the root's
    forward, where the weights are unsharded plain tensors (no process group), and the gradients reach
    the sharded parameters. An lm head sharded as a unit of its own is refused."""
    from torch.distributed.fsdp import fully_shard

    groups = []
    kernel = patching.fused_linear_cross_entropy
    monkeypatch.setattr(patching, "fused_linear_cross_entropy",
                        lambda *a, **k: groups.append(k["process_group"]) or kernel(*a, **k))
    theirs = llama()
    ours = copy.deepcopy(theirs)
    for layer in ours.model.layers:
        fully_shard(layer, mesh=gloo_mesh)
    fully_shard(ours, mesh=gloo_mesh)
    assert type(ours.lm_head.weight).__name__ == "DTensor"
    patch_model(ours)
    ids, labels, mask = batch()
    want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
    got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert groups == [None]
    torch.testing.assert_close(got.loss, want.loss, rtol=TOL, atol=1e-6)
    assert_same_grads(theirs, ours)
    alone = copy.deepcopy(theirs)
    fully_shard(alone.lm_head, mesh=gloo_mesh)
    with pytest.raises(ValueError, match="FSDP unit of its own"):
        patch_model(alone)


@pytest.mark.skipif(ON_GPU, reason="CPU/gloo test (Triton interpreter)")
def test_fsdp2_with_fp32_parameters_under_bf16_autocast_hands_the_kernel_a_master_weight(gloo_mesh, monkeypatch):
    """FSDP2 over fp32 parameters (no param_dtype: the master weights are the parameters) with the
    forward under bf16 autocast: inside the root's forward the lm head's unsharded weight is a plain
    fp32 tensor, which the kernel takes as a master weight (gradient summed in fp32); the sharded
    parameters get fp32 gradients that agree with the unpatched model's to bf16's precision."""
    from torch.distributed.fsdp import fully_shard

    seen = kernel_inputs(monkeypatch)
    theirs = llama()
    ours = copy.deepcopy(theirs)
    for layer in ours.model.layers:
        fully_shard(layer, mesh=gloo_mesh)
    fully_shard(ours, mesh=gloo_mesh)
    patch_model(ours)
    ids, labels, mask = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = step(theirs, input_ids=ids, attention_mask=mask, labels=labels)
        got = step(ours, input_ids=ids, attention_mask=mask, labels=labels)
    assert seen == [(torch.bfloat16, torch.float32, False)]
    assert rel_err(got.loss, want.loss) < 1e-2
    grad = ours.lm_head.weight.grad
    assert type(grad).__name__ == "DTensor" and grad.dtype == torch.float32
    assert_same_grads(theirs, ours, tol=5e-2)
