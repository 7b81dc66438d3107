"""What a model declares about the linears an adapter may touch."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple


class LoraModuleRef(NamedTuple):
    """Where one checkpoint module's adapter lands: a target, a layer, and the slice's
    checkpoint name (``"q_proj"``), or None for a single-slice target."""

    target: str
    layer: int
    shard_id: str | int | None = None


@dataclass(frozen=True)
class LoraTarget:
    """One family of linears an adapter may touch, e.g. every layer's fused ``qkv_proj``.

    Shapes are the unsharded linear's. ``out_slices`` lists the output widths of a fused
    projection in order (``(q, k, v)``); each slice has its own A ``[r, in_features]`` and
    B ``[out_slice, r]``, named in a checkpoint by its entry in ``slice_names``. A plain
    linear has one slice.

    ``parallel`` says how the base linear is split across tensor-parallel ranks:
    ``"column"`` splits output rows (A replicated, B split by rows of each slice);
    ``"row"`` splits input columns (A split along the input, B replicated; the delta is a
    partial sum added before the layer's all-reduce); ``"none"`` keeps it whole.
    ``slice_units`` counts the shardable units (heads) of each slice: a slice with fewer
    units than ranks is replicated, as GQA's K/V are. ``layers`` names the layers the
    target exists on (None: all; a target outside the layer stack, as an embedding or LM
    head, names ``(0,)``).

    ``module_path`` is the attribute path of the target's module in the model, with
    ``{layer}`` for its layer (``"layers.{layer}.self_attn.qkv_proj"``);
    ``checkpoint_names`` are the module names an adapter's keys carry (PEFT's, after
    ``base_model.model.``), with ``{layer}`` and ``{slice}`` (each pack name, and each
    slice name no pack holds): ``"model.layers.{layer}.self_attn.{slice}"``.
    :func:`module_map` and :func:`module_path` derive the model's module map and paths
    from them.

    ``slice_packs`` names checkpoint modules that pack several slices into one tensor, as
    ``(module name, (slice name, ...))``: Phi-3's fused ``qkv_proj`` is ``[q | k | v]``.
    Such a module has one A, which each of its slices takes, and a B whose rows are those
    slices' in order (``B @ A`` is then exactly the packed module's delta). A packed
    slice has no module of its own (Phi-3 has no ``q_proj``: PEFT finds none to target),
    so an adapter naming one is refused, never written over the pack's rows.

    ``kind="embedding"`` is a token embedding: ``in_features`` is the vocabulary, a row's
    input is its token id, and the shrink gathers A's column for it (``x @ A.T`` of the
    token's one-hot), as PEFT's ``lora_embedding_A`` ``[r, vocab]`` and
    ``lora_embedding_B`` ``[embedding_dim, r]`` define it; it has one slice.

    ``per_segment`` is a linear that sees one row per request, in batch order (an LM head
    over each request's last token): given a 2-D input ``[requests, in_features]`` it is
    routed by request, given ``[B, T, in_features]`` (every token's logits) by token.
    """

    in_features: int
    out_slices: tuple[int, ...]
    parallel: Literal["column", "row", "none"] = "column"
    slice_names: tuple[str | int, ...] = ()
    slice_units: tuple[int, ...] | None = None
    slice_packs: tuple[tuple[str | int, tuple[str | int, ...]], ...] | None = None
    layers: tuple[int, ...] | None = None
    kind: Literal["linear", "embedding"] = "linear"
    per_segment: bool = False
    module_path: str = ""
    checkpoint_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.out_slices or any(w <= 0 for w in self.out_slices):
            raise ValueError(f"out_slices must be positive widths, got {self.out_slices}")
        if self.slice_names and len(self.slice_names) != len(self.out_slices):
            raise ValueError(
                f"slice_names {self.slice_names} do not match out_slices {self.out_slices}"
            )
        if self.kind == "embedding" and (self.num_slices != 1 or self.per_segment):
            raise ValueError("an embedding target has one slice and is routed per token")
        for pack, members in self.slice_packs or ():
            if not members or any(m not in self.slice_names for m in members):
                raise ValueError(f"slice pack {pack!r} names slices {members} not all in "
                                 f"slice_names {self.slice_names}")  # fmt: skip

    @property
    def num_slices(self) -> int:
        return len(self.out_slices)

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)

    def slice_index(self, shard_id: str | int | None) -> int:
        """Which slice a checkpoint module lands on, from its slice name.

        Raises:
            KeyError: if ``shard_id`` names no slice of this target.
        """
        if shard_id is None or (self.num_slices == 1 and not self.slice_names):
            if self.num_slices != 1:
                raise KeyError(
                    f"a slice name is needed for a fused target with slices {self.slice_names}"
                )
            return 0
        if shard_id in self.slice_names:
            return self.slice_names.index(shard_id)
        if isinstance(shard_id, int) and 0 <= shard_id < self.num_slices:
            return shard_id
        raise KeyError(f"no slice {shard_id!r} in {self.slice_names}")

    def module_slices(self, shard_id: str | int | None) -> tuple[int, ...]:
        """The slices a checkpoint module lands on, in the order its B's rows hold them:
        several for a ``slice_packs`` name, else the one :meth:`slice_index` gives.

        Raises:
            KeyError: if ``shard_id`` names no slice or pack of this target.
        """
        for pack, members in self.slice_packs or ():
            if shard_id == pack:
                return tuple(self.slice_names.index(m) for m in members)
        return (self.slice_index(shard_id),)

    def slice_rows(self, slice_idx: int) -> tuple[int, int]:
        """``(start, size)`` of slice ``slice_idx``'s rows in the fused output."""
        return sum(self.out_slices[:slice_idx]), self.out_slices[slice_idx]

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        return tuple(range(num_layers)) if self.layers is None else self.layers


def module_map(
    targets: dict[str, LoraTarget], num_layers: int
) -> Callable[[str], LoraModuleRef | None]:
    """Where each checkpoint module lands, from the targets' ``checkpoint_names``: a name
    matching a template, with any layer number for ``{layer}`` (a layer the model lacks is
    refused later, naming it) and a pack name or a slice name no pack holds for
    ``{slice}``; None for a module no target names.

    Raises:
        ValueError: if two targets name the same module.
    """
    patterns: list[tuple[re.Pattern[str], str, str | int | None]] = []
    seen: dict[str, str] = {}
    for name, t in targets.items():
        for key, shard in _checkpoint_names(t):
            if seen.setdefault(key, name) != name:
                raise ValueError(f"module {key} is named by both {seen[key]} and {name}")
            body = re.escape(key)
            regex = re.compile("^" + body.replace(re.escape("{layer}"), r"(\d+)") + "$")
            patterns.append((regex, name, shard))

    def lookup(module: str) -> LoraModuleRef | None:
        for regex, name, shard in patterns:
            m = regex.match(module)
            if m is not None:
                layer = int(m.group(1)) if m.groups() else targets[name].layer_ids(num_layers)[0]
                return LoraModuleRef(name, layer, shard)
        return None

    return lookup


def _checkpoint_names(t: LoraTarget) -> list[tuple[str, str | int | None]]:
    """``(name template, slice or pack)`` of each module name ``t``'s ``checkpoint_names``
    stand for: ``{slice}`` made each pack name and each slice name no pack holds."""
    packed = {m for _, members in t.slice_packs or () for m in members}
    packs = [pack for pack, _ in t.slice_packs or ()]
    slices = [*packs, *(s for s in t.slice_names if s not in packed)]
    return [
        (template.replace("{slice}", str(shard)), shard)
        for template in t.checkpoint_names
        for shard in (slices if "{slice}" in template else [None])
    ]


def checkpoint_modules(targets: dict[str, LoraTarget]) -> list[str]:
    """The module names (their last part) an adapter's keys may carry for ``targets``, in
    table order: ``["q_proj", "k_proj", ..., "lm_head"]`` for a Llama."""
    names = (key.rsplit(".", 1)[-1] for t in targets.values() for key, _ in _checkpoint_names(t))
    return list(dict.fromkeys(names))


def module_path(targets: dict[str, LoraTarget]) -> Callable[[str, int], str]:
    """A target's module path at a layer, from its ``module_path`` template.

    Raises:
        KeyError: for a target without one.
    """

    def path(target: str, layer: int) -> str:
        template = targets[target].module_path
        if not template:
            raise KeyError(f"target {target!r} has no module_path")
        return template.format(layer=layer)

    return path
