"""Vocabulary-parallel loss on 2 GPUs against the single-GPU loss on the same global shape (issue 6).

    python3 benchmarks/parallel.py [--shape N H V] [--out DIR]      # spawns one process per GPU

Per setting: forward+backward time (median of timed steps, all ranks in lockstep through the
collectives), peak extra memory per rank (above inputs and the gradients themselves, MiB), and the
bytes this rank sends into all-reduces per step (counted by wrapping ``parallel.all_reduce``). The
single-GPU row runs on rank 0 before the sharded ones. Writes parallel_h200x2.json and .md.
"""

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))

MiB = 1 << 20
SETTINGS = {"recompute (default)": dict(), "chunked, 256 MiB chunks": dict(strategy="chunked"),
            # The per-token outputs (fused_linear_logprobs), log-probs and entropy both carrying gradient as
            # in GRPO: the vocabulary-parallel statistics stay O(N) (issue 23).
            "per-token log-probs + entropy": dict(per_token=True)}


def _time(step, reps=20, warmup=3):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _loss(h, w, targets, kwargs, group):
    """The setting's scalar loss: the mean loss, or for ``per_token`` -sum(log_probs) / N plus 0.01 x
    the mean entropy (both per-token fields carry gradient)."""
    from fused_linear_ce import fused_linear_cross_entropy, fused_linear_logprobs

    kwargs = dict(kwargs)
    if kwargs.pop("per_token", False):
        out = fused_linear_logprobs(h, w, targets, outputs=("log_probs", "entropy"), process_group=group, **kwargs)
        n = targets.numel()
        return -out["log_probs"].sum() / n + 0.01 * out["entropy"].sum() / n
    return fused_linear_cross_entropy(h, w, targets, process_group=group, **kwargs)


def _measure(hidden, weight, targets, kwargs, group, counter):
    def step():
        h = hidden.detach().requires_grad_(True)
        w = weight.detach().requires_grad_(True)
        _loss(h, w, targets, kwargs, group).backward()
        return h.grad, w.grad

    step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    counter.clear()
    step()
    torch.cuda.synchronize()
    grads = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()
    extra = (torch.cuda.max_memory_allocated() - base - grads) / MiB
    sent, calls = sum(counter), len(counter)  # one step's, before the timed ones add theirs
    return dict(fwdbwd_ms=_time(step), extra_mib=extra, allreduce_mib=sent / MiB, allreduce_calls=calls)


def _worker(rank, world, port, shape, out):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    from fused_linear_ce import parallel

    counter = []
    real = parallel.all_reduce

    def counting(t, shard, *args, **kwargs):
        counter.append(t.numel() * t.element_size())
        return real(t, shard, *args, **kwargs)

    parallel.all_reduce = counting
    n, h, v = shape
    device = torch.device("cuda", rank)
    g = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(n, h, device=device, generator=g).bfloat16()
    weight = (torch.randn(v, h, device=device, generator=g) * (4.0 / h) ** 0.5).bfloat16()
    targets = torch.randint(0, v, (n,), device=device, generator=g)
    rows = []
    for name, kwargs in SETTINGS.items():
        if rank == 0:
            rows.append(dict(setting=name, gpus=1, **_measure(hidden, weight, targets, kwargs, None, counter)))
        dist.barrier()
        shard = weight[rank * v // world:(rank + 1) * v // world].contiguous()
        r = _measure(hidden, shard, targets, kwargs, dist.group.WORLD, counter)
        gathered = [None] * world
        dist.all_gather_object(gathered, r)
        if rank == 0:
            rows.append(dict(setting=name, gpus=world, **{k: max(x[k] for x in gathered) for k in r},
                             per_rank=gathered))
        del shard
        torch.cuda.empty_cache()
    if rank == 0:
        import triton

        meta = dict(gpu=torch.cuda.get_device_name(), gpus=world, torch=torch.__version__, triton=triton.__version__,
                    nccl=".".join(map(str, torch.cuda.nccl.version())), date=time.strftime("%Y-%m-%d"),
                    N=n, H=h, V=v, dtype="bfloat16")
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "parallel_h200x2.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        lines = [f"{meta['gpus']} x {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}, NCCL "
                 f"{meta['nccl']}, {meta['date']}; N={n} H={h} V={v} bf16 (sharded: V/{world} rows per rank).", "",
                 "| setting | GPUs | fwd+bwd ms | extra MiB (max over ranks) | all-reduce MiB per rank per step | calls |",
                 "|---|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(f"| {r['setting']} | {r['gpus']} | {r['fwdbwd_ms']:.1f} | {r['extra_mib']:.0f} | "
                         f"{r['allreduce_mib']:.1f} | {r['allreduce_calls']} |")
        (Path(out) / "parallel_h200x2.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=3, default=[8192, 4096, 128256])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = torch.cuda.device_count()
    mp.spawn(_worker, args=(world, port, tuple(args.shape), args.out), nprocs=world, join=True)


if __name__ == "__main__":
    main()
