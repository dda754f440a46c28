"""Tensor and expert parallelism's plumbing: joining the ranks under torchrun, the collectives a layer calls.
nano_nsa.py's section "Tensor and expert parallelism" says what is split and where the parts are summed; a
reader can skip how torch.distributed does it. At one rank (no torchrun) every function here is the identity
or a constant."""

import os

import torch
import torch.distributed as dist


def init_distributed(device: torch.device) -> torch.device:
    """Under torchrun (WORLD_SIZE > 1): join the ranks once (NCCL on CUDA, gloo on CPU); take GPU
    LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def tp_size():
    """The number of ranks the model is split over (1 without torchrun)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce(x, op=dist.ReduceOp.SUM):
    """x summed (or op) over ranks, in place; nothing at one rank."""
    if tp_size() > 1:
        dist.all_reduce(x, op)
    return x


def all_gather(x):
    """x [..., n] of every rank concatenated in rank order -> [..., ranks * n] (the vocabulary slices of
    logits)."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, -1)


def rank_slice(full, part):
    """The index of this rank's part of a checkpoint tensor of shape `full`, for a parameter of shape
    `part`: along the dimension the layer split (where part is smaller), the rank-th block of that size;
    the rest whole."""
    r = tp_rank()
    return tuple(slice(None) if f == p else slice(r * p, r * p + p) for f, p in zip(full, part, strict=True))


def rank_local(idx, n):
    """Indices into n-row shards held in rank order (vocabulary rows, routed experts) -> (idx - this rank's
    first, whether this rank holds it)."""
    local = idx - tp_rank() * n
    return local, (local >= 0) & (local < n)
