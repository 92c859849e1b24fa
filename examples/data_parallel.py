"""Data parallelism with the fused loss: DDP and FSDP2 (``fully_shard``), any number of processes.

    torchrun --nproc-per-node 2 examples/data_parallel.py --mode ddp     # or --mode fsdp2
    (CPU: add --backend gloo; the kernels then need TRITON_INTERPRET=1)

Each rank takes its slice of the global batch and divides its summed loss by the global number of
counted tokens (``num_items_in_batch``), times the world size because DDP / FSDP average gradients
over ranks: the gradients then equal one process on the whole batch (``tests/integrations/test_parallel.py``).
The loss sees plain tensors: DDP keeps full parameters, FSDP2 all-gathers them before the forward
of the unit that owns them (see ``wrap`` for the lm-head).
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
from fused_linear_ce import fused_linear_cross_entropy  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab=96, hidden=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, labels, num_items_in_batch, world):
        hidden = self.body(self.embed(ids))
        loss = fused_linear_cross_entropy(hidden, self.lm_head.weight, labels, shift=True,
                                          num_items_in_batch=num_items_in_batch)
        return loss * world


def batch(seed=0, rows=6, length=9, vocab=96):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[::2, :3] = -100
    return ids, labels


def global_count(labels):
    return (labels[:, 1:] != -100).sum()


def wrap(model, mode):
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for layer in (model.embed, model.body):
        fully_shard(layer)
    # The loss reads lm_head.weight without calling lm_head's forward, so the lm-head stays in the root
    # unit, which all-gathers it before TinyLM.forward (a separately sharded lm_head would still be a
    # DTensor shard there; call lm_head.unshard() first if you shard it on its own).
    return fully_shard(model)


def grads_of(model):
    """Full (unsharded) gradients by parameter name."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name.replace("module.", "")] = g.full_tensor() if hasattr(g, "full_tensor") else g
    return out


def train_step(mode, seed=0, device="cpu"):
    """One step on this rank's slice (on ``device``); returns (global loss, full gradients)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    model = wrap(TinyLM().to(device), mode)
    ids, labels = (t.to(device) for t in batch(seed))
    n_items = global_count(labels)
    rows = slice(rank * len(ids) // world, (rank + 1) * len(ids) // world)
    loss = model(ids[rows], labels[rows], n_items, world)
    loss.backward()
    total = loss.detach() / world
    dist.all_reduce(total)
    return total, grads_of(model)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["ddp", "fsdp2"], default="ddp")
    ap.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    args = ap.parse_args()
    dist.init_process_group(args.backend)
    device = "cpu"
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    loss, _ = train_step(args.mode, device=device)
    if dist.get_rank() == 0:
        print(f"{args.mode}: loss {loss.item():.6f} on {dist.get_world_size()} processes")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
