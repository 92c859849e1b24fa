"""Recipe: TRL's SFTTrainer with fused-linear-ce as the loss, logging TRL's metrics.

    from kernels import get_kernel
    flce = get_kernel("trl-lib/fused-linear-ce", version=1, trust_remote_code=True)
    trainer = FusedLossSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds, fused_kernel=flce)
    trainer.train()

``compute_loss`` runs the decoder to its final hidden states, then the fused loss against the
lm-head weight (the (N, V) logits never exist), with causal shift and TRL's global token count
(``num_items_in_batch``) as the divisor. ``mean_token_accuracy`` and ``entropy`` come from the same
kernel sweep (``return_metrics=True``) and are logged the way SFTTrainer logs them: sums gathered
across processes, divided by the gathered token count. Tested single-process in
``tests/integrations/test_trl.py`` against SFTTrainer's own loss and metrics.
"""

import torch
from trl import SFTTrainer


class FusedLossSFTTrainer(SFTTrainer):
    def __init__(self, *args, fused_kernel, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused_kernel = fused_kernel

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("FusedLossSFTTrainer computes no logits; return_outputs=True is not supported")
        mode = "train" if self.model.training else "eval"
        unwrapped = self.accelerator.unwrap_model(model)
        decoder_inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        hidden = unwrapped.get_decoder()(**decoder_inputs, use_cache=False).last_hidden_state
        head = unwrapped.get_output_embeddings()
        loss, metrics = self.fused_kernel.fused_linear_cross_entropy(
            hidden, head.weight, inputs["labels"], getattr(head, "bias", None), shift=True,
            num_items_in_batch=num_items_in_batch, return_metrics=True,
        )
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes  # as Trainer: DDP averages the gradients

        gather = self.accelerator.gather_for_metrics
        counted = gather(metrics["num_counted"].detach()).sum()
        entropy = gather(metrics["entropy_sum"].detach()).sum()
        correct = gather(metrics["num_correct"].detach()).sum()
        self._metrics[mode]["entropy"].append((entropy / counted).item() if counted > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append((correct / counted).item() if counted > 0 else 0.0)
        return loss


__all__ = ["FusedLossSFTTrainer", "torch"]
