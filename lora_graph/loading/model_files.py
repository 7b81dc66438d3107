"""Reading a base model: its directory (local, or fetched from the Hugging Face hub), its
checkpoint's tensors, and the dtype names the command line and the Python API take."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"|"bfloat16"|"float16"`` (or a dtype) to a ``torch.dtype``.

    Raises:
        ValueError: for any other name.
    """
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r} (one of {', '.join(_DTYPES)})") from None


def resolve_model_path(path: str) -> str:
    """A local model directory, or a Hugging Face repo id fetched with
    ``huggingface_hub.snapshot_download`` (which honours ``HF_HUB_OFFLINE`` and its cache).

    Raises:
        FileNotFoundError: if ``path`` is neither a directory with ``config.json`` nor a
            repo id that can be fetched.
    """
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        return path
    if path.startswith(("/", ".", "~")) or os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such model directory")
    if path.count("/") != 1:
        raise FileNotFoundError(f"{path}: not a model directory or a Hugging Face repo id")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(
            path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt"]
        )
    except Exception as e:  # the hub raises many kinds; the cause goes into the message
        raise FileNotFoundError(
            f"{path}: not a local directory, and fetching it from the Hugging Face hub failed ({e})"
        ) from e


#: which part of a checkpoint tensor to read, from its name and shape: the index of each
#: piece (concatenated along dim 0), or None for zeros of its shape (tensor parallelism's
#: shares: :func:`lora_graph.parallel.checkpoint_share`)
Select = Callable[[str, tuple[int, ...]], "list[tuple[slice, ...]] | None"]


def read_checkpoint(model_dir: str, select: Select | None = None) -> dict[str, Tensor]:
    """All tensors of the model's checkpoint: ``model.safetensors``, the shards a
    ``model.safetensors.index.json`` names, or, where there is no safetensors checkpoint,
    ``pytorch_model.bin`` or the shards of ``pytorch_model.bin.index.json`` (read with
    ``torch.load(weights_only=True)``, which unpickles tensors and plain containers only).

    With ``select``, each tensor is only the part it names: a safetensors file is then
    read piece by piece (``safe_open(...).get_slice``), so a tensor-parallel rank reads
    only its share; a ``.bin`` file is read whole and cut.

    Raises:
        FileNotFoundError: if the directory has none of them.
        ValueError: if a file cannot be read as its format (the message names it).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    def read(path: str) -> dict[str, Tensor]:
        try:
            if path.endswith(".bin"):
                state = torch.load(path, map_location="cpu", weights_only=True)
                return state if select is None else select_state(state, select)
            if select is None:
                return load_file(path)
            with safe_open(path, framework="pt") as f:
                return {
                    name: _take(part, select(name, tuple(part.get_shape())))
                    for name, part in ((n, f.get_slice(n)) for n in f.keys())  # noqa: SIM118
                }
        except (
            Exception
        ) as e:  # safetensors and torch.load raise many kinds; the cause goes into the message
            raise ValueError(
                f"{path}: not a readable {'torch' if path.endswith('.bin') else 'safetensors'} "
                f"checkpoint ({e})"
            ) from e

    for single, index in (
        ("model.safetensors", "model.safetensors.index.json"),
        ("pytorch_model.bin", "pytorch_model.bin.index.json"),
    ):
        if os.path.isfile(os.path.join(model_dir, single)):
            return read(os.path.join(model_dir, single))
        if os.path.isfile(os.path.join(model_dir, index)):
            try:
                with open(os.path.join(model_dir, index)) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise ValueError(
                    f"{os.path.join(model_dir, index)}: not a checkpoint index ({e})"
                ) from e
            state: dict[str, Tensor] = {}
            for shard in shards:
                state.update(read(os.path.join(model_dir, shard)))
            return state
    raise FileNotFoundError(
        f"{model_dir}: no model.safetensors, pytorch_model.bin or their sharded index"
    )


def select_state(state: Mapping[str, Tensor], select: Select) -> dict[str, Tensor]:
    """The parts of an in-memory state dict ``select`` names (as :func:`read_checkpoint`);
    each tensor read from ``state`` once."""
    return {name: _take(t, select(name, tuple(t.shape))) for name, t in state.items()}


def _take(tensor: Any, pieces: list[tuple[slice, ...]] | None) -> Tensor:
    """The ``pieces`` of a tensor (or of a safetensors slice, read piece by piece),
    concatenated along dim 0; None: zeros of its shape."""
    if pieces is None:
        return torch.zeros_like(tensor[:])
    return torch.cat([tensor[index] for index in pieces])
