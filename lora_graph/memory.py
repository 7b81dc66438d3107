"""The memory budget: what a pipeline's weights, adapter slots, activations and KV cache
take, and how many KV cache pages fit, as plain functions of sizes (nothing here
allocates; the pipeline calls them before it builds anything large).

On CUDA the KV cache gets what ``gpu_memory_utilization`` of the device leaves after the
memory already in use, the weights, the slots and an activation bound (vLLM's option of
the same name); elsewhere, and when ``kv_cache_tokens`` is given, every request at full
length, refused before allocation if the host's free memory cannot hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from lora_graph.config import LoRAConfig
from lora_graph.layout import SlotLayout
from lora_graph.targets import LoraTarget

GIB = 2**30


class MemoryBudgetError(ValueError):
    """The requested sizes do not fit the device's free memory; the message says what would
    be allocated and what fits."""


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory where ``device``'s tensors live: ``torch.cuda.mem_get_info`` on CUDA,
    ``MemAvailable`` of ``/proc/meminfo`` on the CPU; None where neither can be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def slot_bytes(
    lora: LoRAConfig | None,
    targets: Mapping[str, LoraTarget],
    num_layers: int,
    dtype: torch.dtype,
) -> int:
    """Bytes of the adapter slot pool ``lora`` configures over the model's ``targets``
    (those ``lora.targets`` keeps), in ``lora.dtype`` or the model's ``dtype``; 0 without
    LoRA."""
    if lora is None:
        return 0
    if lora.targets is not None:
        targets = {k: v for k, v in targets.items() if k in lora.targets}
    itemsize = (lora.dtype or dtype).itemsize
    return SlotLayout(dict(targets), num_layers, lora.max_rank).numel * lora.num_slots * itemsize


def weight_bytes(build: Callable[[], nn.Module], dtype: torch.dtype) -> int:
    """Parameter bytes of the module ``build()`` returns, built on the meta device in
    ``dtype`` (nothing allocated); a tied weight counted once."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            module = build()
    finally:
        torch.set_default_dtype(previous)
    seen = {id(p): p for p in module.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values())


def activation_bytes(
    *,
    hidden_size: int,
    intermediate_size: int,
    vocab_size: int,
    max_num_batched_tokens: int,
    max_batch_size: int,
) -> int:
    """A generous bound on one step's activations: float32 temporaries of
    ``8 * hidden + 4 * intermediate`` per token, and two ``[max_batch_size, vocab]`` logits."""
    per_token = (8 * hidden_size + 4 * intermediate_size) * 4
    return max_num_batched_tokens * per_token + 2 * max_batch_size * vocab_size * 4


def kv_cache_pages(
    *,
    device: torch.device,
    page_bytes: int,
    page_size: int,
    max_seq_len: int,
    max_batch_size: int,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    slots: int,
    fixed_bytes: Callable[[], int],
) -> int:
    """KV cache pages (the scratch page included) for the budget, refusing sizes that cannot
    be allocated before allocating them (a typo such as ``kv_cache_tokens=10**9`` would
    otherwise end in an allocator traceback).

    Args:
        page_bytes: bytes one page takes over all layers (0: no KV cache).
        slots: bytes of the adapter slot pool (:func:`slot_bytes`).
        fixed_bytes: the weights and activation bound, in bytes; called only on CUDA when
            ``kv_cache_tokens`` is None (the budget then subtracts it).

    Returns:
        at most ``max_batch_size`` requests of ``max_seq_len`` plus the scratch page; on
        CUDA without ``kv_cache_tokens``, what ``gpu_memory_utilization`` leaves; with it,
        ``kv_cache_tokens`` rounded up to pages.

    Raises:
        MemoryBudgetError: saying what would be allocated, what is free, and what fits.
        ValueError: if ``kv_cache_tokens`` cannot hold one request of ``max_seq_len``.
    """
    per_request = -(-max_seq_len // page_size)
    most = max_batch_size * per_request + 1  # every request at full length
    if kv_cache_tokens is None and device.type == "cuda" and page_bytes:
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_memory_utilization * total - (total - free) - fixed_bytes() - slots
        pages = min(most, int(budget // page_bytes))
        if pages < per_request + 1:
            raise MemoryBudgetError(
                f"gpu_memory_utilization {gpu_memory_utilization} leaves "
                f"{max(budget, 0) / GIB:.2f} GiB for the KV cache on {device}, less than one "
                f"request of max_seq_len {max_seq_len} needs "
                f"({(per_request + 1) * page_bytes / GIB:.2f} GiB)"
            )
        return pages
    pages = most
    if kv_cache_tokens is not None:
        pages = min(most, -(-kv_cache_tokens // page_size) + 1)
        if pages < per_request + 1:
            raise ValueError(
                f"kv_cache_tokens {kv_cache_tokens} cannot hold one request of max_seq_len "
                f"{max_seq_len}"
            )
    kv = pages * page_bytes
    free_now = free_memory_bytes(device)
    if free_now is None or kv + slots <= free_now:
        return pages
    fits = max(0, (free_now - slots) // page_bytes - 1) * page_size if page_bytes else 0
    raise MemoryBudgetError(
        f"the KV cache of {(pages - 1) * page_size} token positions (max_batch_size "
        f"{max_batch_size} x max_seq_len {max_seq_len}, or kv_cache_tokens) "
        f"needs {kv / GIB:.1f} GiB"
        + (f" and the adapter slots {slots / GIB:.1f} GiB" if slots else "")
        + f", but {free_now / GIB:.1f} GiB is free on {device.type}"
        + (f"; at most kv_cache_tokens {fits} fits" if fits else "")
    )


def cpu_kv_cache_tokens(
    device: torch.device,
    page_bytes: int,
    page_size: int,
    slots: int,
    *,
    max_batch_size: int,
    context: int,
) -> int | None:
    """Off CUDA (where the pool is every request at full length), the KV cache a model's
    default ``max_seq_len`` may use: a quarter of the free memory (``page_size`` token
    positions per ``page_bytes``). None where every request at its full ``context`` fits
    it, on CUDA, where the free memory cannot be read, and below a page per running
    request (such sizes are refused as before)."""
    free_now = free_memory_bytes(device)
    if device.type == "cuda" or free_now is None or not page_bytes:
        return None
    cap = max(0, int((free_now // 4 - slots) // page_bytes)) * page_size
    return cap if max_batch_size * page_size <= cap < max_batch_size * context else None


def fit_seq_len(
    *,
    context: int,
    device: torch.device,
    page_bytes: int,
    page_size: int,
    kv_cache_tokens: int | None,
    gpu_memory_utilization: float,
    slots: int,
    fixed_bytes: Callable[[], int],
) -> int:
    """The default ``max_seq_len``: the model's ``context``, bounded by the KV cache that
    :func:`kv_cache_pages` would allocate (one request of it must fit): ``kv_cache_tokens``
    if given, else on CUDA what ``gpu_memory_utilization`` leaves. At least 2 (a smaller
    budget is then refused by :func:`kv_cache_pages`, naming the sizes)."""
    if not page_bytes:
        return context
    if kv_cache_tokens is not None:
        pages = -(-kv_cache_tokens // page_size)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = gpu_memory_utilization * total - (total - free) - fixed_bytes() - slots
        pages = int(budget // page_bytes) - 1
    else:
        return context
    return max(2, min(context, pages * page_size))


def check_slots_fit(device: torch.device, slots: int) -> None:
    """For a model without a KV cache (an encoder): the slot pool must fit the free memory.

    Raises:
        MemoryBudgetError: naming the sizes.
    """
    free_now = free_memory_bytes(device)
    if free_now is not None and slots > free_now:
        raise MemoryBudgetError(
            f"the adapter slots need {slots / GIB:.1f} GiB, but {free_now / GIB:.1f} GiB is "
            f"free on {device.type}"
        )
