"""PEFT's tensor names in an adapter file: a LoRA pair's keys
(``base_model.model.<module>.lora_A[.<adapter name>].weight``, ``...lora_embedding_A``),
the base weights PEFT saves beside them, and the ties between keys."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

from lora_graph.config import AdapterError

# lora_A / lora_B are Linear weights (``.weight``); lora_embedding_A / _B bare parameters;
# either may carry PEFT's adapter-name infix (``lora_A.default.weight``)
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.lora_(?:(?P<ab>A|B)(?:\.(?P<name>[^.]+))?\.weight"
    r"|(?P<emb>embedding_A|embedding_B)(?:\.(?P<ename>[^.]+))?)$"
)
_BASE_LAYER_KEY = re.compile(r"^(?P<module>.+?)(?:\.base_layer)?\.weight$")
_PREFIXES = ("base_model.model.",)


def parse_lora_key(key: str) -> tuple[str, str, str | None] | None:
    """``(module, "A"|"B"|"embedding_A"|"embedding_B", adapter name infix or None)`` of a
    PEFT key, or None if the key is not a LoRA weight. The module loses PEFT's
    ``base_model.model.`` prefix:
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight`` gives
    ``("model.layers.0.self_attn.q_proj", "A", "default")``.

    Raises:
        AdapterError: for a LoRA key without the ``base_model.model.`` prefix (PEFT would
            not load it).
    """
    m = _LORA_KEY.match(key)
    if m is None:
        return None
    module = m.group("module")
    if not module.startswith(_PREFIXES):
        raise AdapterError(
            f"tensor {key} lacks PEFT's 'base_model.model.' prefix (PEFT would not load it)"
        )
    for prefix in _PREFIXES:
        module = module.removeprefix(prefix)
    return module, m.group("ab") or m.group("emb"), m.group("name") or m.group("ename")


def parse_base_layer_key(key: str) -> str | None:
    """The module of what may be a base weight PEFT saved beside the adapter
    (``base_model.model.lm_head.base_layer.weight`` gives ``"lm_head"``: PEFT saves the
    embedding and LM head this way when they are targeted, and as
    ``base_model.model.lm_head.weight`` with ``save_embedding_layers=True`` when they are
    not), or None for a key of neither form (a LoRA key is not passed here)."""
    m = _BASE_LAYER_KEY.match(key)
    if m is None or not m.group("module").startswith(_PREFIXES):
        return None
    return m.group("module").removeprefix(_PREFIXES[0])


def tied_keys(name: str, keys: Collection[str], ties: Mapping[str, str]) -> list[tuple[str, str]]:
    """The tensor pairs PEFT's tying makes one: ``(tied module's lora_A, embedding's
    lora_embedding_B)`` and ``(tied module's lora_B, embedding's lora_embedding_A)``, each
    the other transposed; a key the file lacks is named as PEFT saves it.

    Raises:
        AdapterError: naming adapter ``name``, as :func:`parse_lora_key`.
    """
    found: dict[tuple[str, str], str] = {}
    for key in keys:
        try:
            parsed = parse_lora_key(key)
        except AdapterError as e:
            raise AdapterError(f"adapter {name!r}: {e}") from None
        if parsed is not None:
            found[parsed[:2]] = key
    pairs = []
    for module, embedding in ties.items():
        for ab, emb in (("A", "embedding_B"), ("B", "embedding_A")):
            pairs.append(
                (
                    found.get((module, ab), f"{_PREFIXES[0]}{module}.lora_{ab}.weight"),
                    found.get((embedding, emb), f"{_PREFIXES[0]}{embedding}.lora_{emb}"),
                )
            )
    return pairs


def pair_keys(
    name: str, keys: Collection[str], saved_base: Callable[[str], bool]
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """A file's LoRA keys by module (``{module: {"A" | "B" | "embedding_A" | ...: key}}``)
    and its saved base weights by module: those of the modules ``saved_base`` accepts
    (the model's LoRA target modules; PEFT saves the embedding's and the LM head's).

    Raises:
        AdapterError: for a key of another named adapter, a module with two A (or B)
            tensors, or a tensor that is neither (a LoRA bias, a DoRA magnitude, a saved
            layer PEFT would not save, ...).
    """
    pairs: dict[str, dict[str, str]] = {}
    base_layers: dict[str, str] = {}
    unknown: list[str] = []
    for key in sorted(keys):
        try:
            parsed = parse_lora_key(key)
        except AdapterError as e:
            raise AdapterError(f"adapter {name!r}: {e}") from None
        if parsed is not None:
            module, ab, infix = parsed
            if infix not in (None, "default"):  # PEFT loads a file's keys as adapter "default"
                raise AdapterError(
                    f"adapter {name!r}: tensor {key} belongs to an adapter named {infix!r} "
                    "(PEFT loads only unnamed or 'default' keys); save that adapter on its own"
                )
            if ab in pairs.get(module, {}):
                raise AdapterError(
                    f"adapter {name!r}: module {module} has two lora_{ab} tensors "
                    f"({pairs[module][ab]} and {key}); save each adapter on its own"
                )
            pairs.setdefault(module, {})[ab] = key
        elif (base := parse_base_layer_key(key)) is not None and saved_base(base):
            if base in base_layers:
                raise AdapterError(
                    f"adapter {name!r}: module {base} has two saved base weights "
                    f"({base_layers[base]} and {key})"
                )
            base_layers[base] = key
        else:
            unknown.append(key)
    if unknown and pairs:  # (no pairs at all: check() says there are no LoRA tensors)
        raise AdapterError(
            f"adapter {name!r}: tensor {unknown[0]} is not a LoRA A/B weight (a trained bias, "
            "a LoRA bias, DoRA magnitude, trainable tokens or a saved full layer?); only plain "
            "LoRA can be served"
        )
    return pairs, base_layers
