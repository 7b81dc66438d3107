"""Configuration of the adapter pool, per-request adapter choice, and adapter facts."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import torch

from lora_graph.kernels.policy import KernelPolicy

# an adapter's name, as the server's runtime loads and the command line's --lora take it
ADAPTER_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def is_int(v: Any) -> bool:
    """An int that is not a bool (JSON's true/false are not counts)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_finite_number(v: Any) -> bool:
    """A finite int or float, not a bool; an int too large for a float is not (it overflows)."""
    if isinstance(v, float):
        return math.isfinite(v)
    return is_int(v) and abs(v) < 2**1000


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the adapter and the cause.

    ``adapter`` is the routing key of a registered adapter that failed while serving (its
    weights could not be read back into a slot), so the engine can fail its requests alone;
    None for a refusal at load time.
    """

    def __init__(self, message: str, *, adapter: str | None = None) -> None:
        super().__init__(message)
        self.adapter = adapter


class AdapterInfo(NamedTuple):
    """What validation needs to know about an adapter checkpoint, read without its weights.

    ``rank`` is the largest rank of any LoRA module in the file; ``unmapped`` names modules
    that land on no served target; ``misfits`` names modules whose shapes do not fit their
    target (an adapter trained on another size of the model).
    """

    rank: int
    unmapped: tuple[str, ...]
    misfits: tuple[str, ...] = ()


@dataclass
class LoRAConfig:
    """How the adapter pool is sized and which adapters are served.

    Attributes:
        max_slots: adapters resident on the device at once (besides the zero adapter that
            base rows use); a batch names at most this many distinct adapters.
        max_rank: the largest LoRA rank served; every slot is sized for it.
        cpu_capacity: adapters kept normalised in host memory (pinned on CUDA); others are
            read from disk again when needed.
        adapters: adapters to load at start-up, ``name -> path`` (PEFT directory, bare
            safetensors file, or Hugging Face repo id).
        adapter_digests: expected weight digests (hex sha256), ``name -> digest``; a
            mismatch is refused.
        targets: the model's target names to serve (None: all).
        dtype: slot dtype (None: the model's dtype).
        backend: shrink/expand kernels: ``"auto"`` (Triton on CUDA when available, else the
            torch reference), ``"torch"`` or ``"triton"``.
        kernel_policy: which path each LoRA layer's call takes (the side-stream delta at
            decode, the fused gate/up activation; :class:`~lora_graph.kernels.policy.
            KernelPolicy`), fixed when the layers are built.
    """

    max_slots: int = 4
    max_rank: int = 16
    cpu_capacity: int = 16
    adapters: dict[str, str] = field(default_factory=dict)
    adapter_digests: dict[str, str] = field(default_factory=dict)
    targets: tuple[str, ...] | None = None
    dtype: torch.dtype | None = None
    backend: Literal["auto", "torch", "triton"] = "auto"
    kernel_policy: KernelPolicy = field(default_factory=KernelPolicy)

    def __post_init__(self) -> None:
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, got {self.max_slots}")
        if self.max_rank < 1:
            raise ValueError(f"max_rank must be at least 1, got {self.max_rank}")
        if self.cpu_capacity < 1:
            raise ValueError(f"cpu_capacity must be at least 1, got {self.cpu_capacity}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be auto, torch or triton, got {self.backend!r}")
        if not isinstance(self.kernel_policy, KernelPolicy):
            raise ValueError(f"kernel_policy must be a KernelPolicy, got {self.kernel_policy!r}")

    @property
    def num_slots(self) -> int:
        """Device slots, the zero adapter's (slot 0) included."""
        return self.max_slots + 1


@dataclass(frozen=True)
class LoraReqConfig:
    """The adapter a request runs under; None runs the base model."""

    adapter: str | None = None

    def validate(self, loaded: list[str] | set[str] | tuple[str, ...]) -> None:
        """Refuse, before the request is queued, an adapter name that is not loaded.

        Raises:
            ValueError: if ``adapter`` is not a non-empty string naming a loaded adapter.
        """
        if self.adapter is None:
            return
        if not isinstance(self.adapter, str) or not self.adapter:
            raise ValueError(f"adapter must be a non-empty string or null, got {self.adapter!r}")
        if self.adapter not in loaded:
            known = ", ".join(sorted(loaded)) or "none"
            raise ValueError(f"unknown adapter {self.adapter!r} (loaded: {known})")


def package_version() -> str:
    """This package's installed version (``lora-graph --version``, the server's
    ``/version``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lora_graph")
    except PackageNotFoundError:
        return "unknown (not installed)"
