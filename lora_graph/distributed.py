"""Tensor parallelism's process group and the collective a sharded step calls, on
``torch.distributed`` (NCCL on GPUs, gloo on the CPU).

:func:`tp_all_reduce` is the custom op ``lora_graph::tp_all_reduce``: the sum of a tensor
over the ranks of the tensor-parallel group (a row-parallel layer's partial outputs, their
LoRA deltas already added: :mod:`lora_graph.parallel`), the input itself when no group is
set or it has one rank. As a custom op it is one opaque node to ``torch.compile``; on CUDA
an NCCL all-reduce inside it is captured by CUDA graphs.

The runner that shards a model and starts the ranks is not built yet (issue #30); this
module is its first piece, tested with gloo on 2 CPU processes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lora_graph.parallel import TPRank

_RANK: TPRank | None = None


def init_tensor_parallel(
    rank: int, size: int, *, init_method: str, backend: str | None = None
) -> TPRank:
    """Join a tensor-parallel group of ``size`` ranks as ``rank`` (one process each): the
    default process group, ``backend`` NCCL where CUDA is available else gloo, rendezvous
    at ``init_method`` (``"tcp://host:port"`` or ``"file:///path"``).

    Raises:
        ValueError: for a rank outside ``[0, size)``; RuntimeError: if a group is set.
    """
    tp = TPRank(rank, size)
    global _RANK
    if _RANK is not None:
        raise RuntimeError(f"this process is rank {_RANK.rank} of a group already")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size)
    _RANK = tp
    return tp


def tensor_parallel() -> TPRank | None:
    """This process's rank in its tensor-parallel group (None: no group)."""
    return _RANK


def close_tensor_parallel() -> None:
    """Leave the group (destroys the default process group)."""
    global _RANK
    if _RANK is not None:
        dist.destroy_process_group()
        _RANK = None


@torch.library.custom_op("lora_graph::tp_all_reduce", mutates_args=())
def tp_all_reduce(x: Tensor) -> Tensor:
    """The sum of ``x`` over the tensor-parallel ranks (a new tensor, ``x``'s shape and
    dtype); ``x`` copied when there is no group or one rank."""
    out = x.clone()
    if _RANK is not None and _RANK.size > 1:
        dist.all_reduce(out)
    return out


@tp_all_reduce.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty_like(x)


__all__ = ["close_tensor_parallel", "init_tensor_parallel", "tensor_parallel", "tp_all_reduce"]
