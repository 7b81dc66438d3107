"""Capture keys: one per captured graph.

A node's own key says what shape of step a graph serves (phase, batch bucket, tokens per
row); :class:`LoraBaseOnly` wraps it for the twin graph of steps where no row names an
adapter, which records no LoRA op at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True, order=True)
class CaptureKey:
    """The node's own key: ``phase``, ``batch`` rows (the bucket), ``seq_len`` tokens a row."""

    phase: Literal["prefill", "decode"]
    batch: int
    seq_len: int = 1

    def __str__(self) -> str:
        return f"{self.phase}(batch={self.batch}, seq_len={self.seq_len})"


@dataclass(frozen=True)
class LoraBaseOnly:
    """The capture key of a step none of whose rows names an adapter: ``key`` wrapped."""

    key: Any = None

    def __str__(self) -> str:
        return f"base-only {self.key}"


def node_capture_key(key: Any) -> Any:
    """The node's own key in a capture key, without its :class:`LoraBaseOnly`."""
    return key.key if isinstance(key, LoraBaseOnly) else key


def is_base_only(key: Any) -> bool:
    return isinstance(key, LoraBaseOnly)
