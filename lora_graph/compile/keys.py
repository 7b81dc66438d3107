"""Capture keys: one per captured graph.

A node's own key says what width of packed step a graph serves (:mod:`lora_graph.step`:
``tokens`` positions, ``seqs`` requests); :class:`LoraBaseOnly` wraps it for the twin
graph of steps where no request names an adapter, which records no LoRA op at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, order=True)
class CaptureKey:
    """The node's own key: a packed step of ``tokens`` token positions and ``seqs``
    request rows (its bucket)."""

    tokens: int
    seqs: int

    def __str__(self) -> str:
        return f"step(tokens={self.tokens}, seqs={self.seqs})"


@dataclass(frozen=True)
class LoraBaseOnly:
    """The capture key of a step none of whose requests names an adapter: ``key`` wrapped."""

    key: Any = None

    def __str__(self) -> str:
        return f"base-only {self.key}"


def node_capture_key(key: Any) -> Any:
    """The node's own key in a capture key, without its :class:`LoraBaseOnly`."""
    return key.key if isinstance(key, LoraBaseOnly) else key


def is_base_only(key: Any) -> bool:
    return isinstance(key, LoraBaseOnly)
