"""Capture keys: one per captured graph.

A key says what width of packed step a graph serves (:mod:`lora_graph.step`: ``tokens``
positions, ``seqs`` requests) and whether it runs the LoRA layers' deltas: every bucket has
a twin graph for steps where no request names an adapter (``lora=False``, "base-only"),
which records no LoRA op at all. (The seeds' ``LoraBaseOnly`` wrapper is this flag.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, order=True)
class CaptureKey:
    """A packed step of ``tokens`` token positions and ``seqs`` request rows (its bucket),
    with the LoRA deltas (``lora``) or base-only."""

    tokens: int
    seqs: int
    lora: bool = True

    def base_only(self) -> CaptureKey:
        """The key of the same width's base-only twin."""
        return replace(self, lora=False)

    def __str__(self) -> str:
        width = f"step(tokens={self.tokens}, seqs={self.seqs})"
        return width if self.lora else f"base-only {width}"
