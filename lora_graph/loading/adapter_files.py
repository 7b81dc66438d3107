"""Reading PEFT LoRA checkpoints: locating, validating from the header, normalising.

The format is PEFT's: ``adapter_config.json`` beside ``adapter_model.safetensors`` (or
``adapter_model.bin``), keys ``<prefix>.<module>.lora_A[.<adapter name>].weight``
``[r, in]`` and ``...lora_B...weight`` ``[out, r]``, and the delta
``y += scale * x @ A.T @ B.T`` with ``scale = lora_alpha / r`` (Hu et al., 2021) or
``lora_alpha / sqrt(r)`` with ``use_rslora`` (Kalajdzievski, 2023). An embedding's pair
is ``<module>.lora_embedding_A`` ``[r, vocab]`` and ``lora_embedding_B`` ``[dim, r]``, and
PEFT saves the targeted embedding's and LM head's base weights beside them as
``<module>.base_layer.weight`` (``<module>.weight`` when not targeted, with
``save_embedding_layers=True``): those must be the served model's own.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from safetensors import safe_open
from torch import Tensor

from lora_graph.config import AdapterError, AdapterInfo
from lora_graph.layout import AdapterImage, SlotLayout
from lora_graph.loading.adapter_keys import pair_keys, tied_keys
from lora_graph.loading.peft_config import (
    BASE_CHANGING_INITS,
    CONFIG_FIELDS,
    PEFT_DEFAULT_ALPHA,
    PEFT_DEFAULT_R,
    pattern_value,
    peft_untargeted_reason,
    peft_weight_ties,
    read_adapter_config,
    with_ties,
)
from lora_graph.targets import LoraModuleRef, LoraTarget, checkpoint_modules

ModuleMap = Callable[[str], LoraModuleRef | None]

_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class AdapterSource:
    """A located adapter: its PEFT config (``{}`` for a bare file) and its weights file."""

    path: str
    config: dict[str, Any]
    weights_path: str

    def digest(self) -> str:
        """Hex sha256 of the weights file and the config: the adapter's identity."""
        h = hashlib.sha256()
        with open(self.weights_path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(json.dumps(self.config, sort_keys=True).encode())
        return h.hexdigest()


def resolve_adapter(path: str) -> AdapterSource:
    """Locate an adapter: a PEFT directory, a bare ``.safetensors``/``.bin`` file (its
    ``adapter_config.json`` read from beside it if there), or a Hugging Face repo id
    (fetched through ``huggingface_hub``, which honours ``HF_HUB_OFFLINE`` and its cache).

    A PEFT directory must hold ``adapter_config.json`` (PEFT refuses one without it: the
    scale ``lora_alpha / r`` is unknown). A bare weights file without a config beside it is
    served with scale 1, its B taken as already scaled. The config is type-checked field by
    field (:func:`check_config_types`).

    Raises:
        AdapterError: if nothing usable is found at ``path``, the directory has no
            ``adapter_config.json``, or the config is not valid JSON of PEFT's shape (the
            message names the file and the field).
    """
    if os.path.isfile(path):
        if os.path.basename(path) == "adapter_config.json" or path.endswith(".json"):
            raise AdapterError(
                f"{path}: this is the adapter's config; give the adapter directory that holds it "
                "(or its adapter_model.safetensors)"
            )
        if not path.endswith((".safetensors", ".bin")):
            raise AdapterError(
                f"{path}: expected a PEFT adapter directory, a .safetensors file or a .bin file"
            )
        directory, weights, bare = os.path.dirname(path) or ".", path, True
    elif os.path.isdir(path):
        directory, bare = path, False
        found = [
            os.path.join(path, f) for f in _WEIGHT_FILES if os.path.isfile(os.path.join(path, f))
        ]
        if not found:
            raise AdapterError(
                f"{path}: no adapter_model.safetensors or adapter_model.bin in the directory"
            )
        weights = found[0]
    elif path.count("/") == 1 and not path.startswith((".", "/")):
        directory = _download(path)
        return resolve_adapter(directory)
    else:
        raise AdapterError(f"{path}: no such file or directory")
    config: dict[str, Any] = {}
    config_path = os.path.join(directory, "adapter_config.json")
    if os.path.isfile(config_path):
        config = read_adapter_config(config_path)
    elif not bare:
        raise AdapterError(
            f"{path}: no adapter_config.json in the adapter directory (PEFT saves it beside the "
            "weights; without it the scale lora_alpha / r is unknown)"
        )
    return AdapterSource(path, config, weights)


def _download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["adapter_config.json", *_WEIGHT_FILES])
    except Exception as e:  # the hub raises many kinds; the cause goes into the message
        raise AdapterError(
            f"{repo_id}: not a local path, and fetching it from the Hugging Face hub failed ({e})"
        ) from e


def _read_shapes(weights_path: str) -> dict[str, tuple[int, ...]]:
    if weights_path.endswith(".bin"):
        return {k: tuple(v.shape) for k, v in _load_bin(weights_path).items()}
    try:
        with safe_open(weights_path, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except Exception as e:
        raise AdapterError(f"{weights_path}: not a readable safetensors file ({e})") from e


def _load_bin(weights_path: str) -> dict[str, Tensor]:
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise AdapterError(f"{weights_path}: not a readable torch checkpoint ({e})") from e
    if not isinstance(state, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in state.items()
    ):
        raise AdapterError(f"{weights_path}: not a state dict (a dict of names to tensors)")
    return state


def _load_tensors(weights_path: str) -> dict[str, Tensor]:
    if weights_path.endswith(".bin"):
        return _load_bin(weights_path)
    from safetensors.torch import load_file

    try:
        return load_file(weights_path)
    except Exception as e:  # safetensors raises its own error types for a bad file
        raise AdapterError(f"{weights_path}: not a readable safetensors file ({e})") from e


def _span(layers: tuple[int, ...]) -> str:
    return (
        f"{layers[0]}..{layers[-1]}"
        if layers == tuple(range(layers[0], layers[-1] + 1))
        else str(list(layers))
    )


@dataclass(frozen=True)
class LoraModule:
    """One checkpoint module's LoRA pair and where it lands."""

    module: str
    ref: LoraModuleRef
    a_key: str
    b_key: str
    rank: int
    scale: float


def _check_finite(name: str, key: str, tensor: Tensor) -> None:
    """Refuse a LoRA tensor holding a NaN or an infinity: every request on the adapter
    would produce NaN logits.

    Raises:
        AdapterError: naming the tensor, how many values are bad, and the first one's index.
    """
    finite = torch.isfinite(tensor)
    if bool(finite.all()):
        return
    bad = (~finite).nonzero()
    first = tuple(int(i) for i in bad[0])
    value = tensor[first].item()
    raise AdapterError(
        f"adapter {name!r}: tensor {key} holds {len(bad)} non-finite value"
        f"{'s' if len(bad) > 1 else ''} ({value} at {list(first)})"
    )


class AdapterReader:
    """Validates and normalises adapters for one model's targets.

    Args:
        targets: the served targets, by name.
        module_map: places a checkpoint module name on a target slice (None: unmapped).
        num_layers: layers of the model.
        ignored: checkpoint modules whose LoRA pairs cannot change what the model serves
            (a BERT pooler under sentence embeddings): skipped, not refused.
        tied: checkpoint modules the model ties to its input embedding, each to the
            embedding's module (``{"lm_head": "model.embed_tokens"}`` when it ties word
            embeddings): PEFT's ``ensure_weight_tying`` (:func:`peft_weight_ties`).
    """

    def __init__(
        self,
        targets: dict[str, LoraTarget],
        module_map: ModuleMap,
        num_layers: int,
        ignored: frozenset[str] = frozenset(),
        tied: Mapping[str, str] | None = None,
    ) -> None:
        self.targets = targets
        self.module_map = module_map
        self.num_layers = num_layers
        self.ignored = ignored
        self.tied = dict(tied or {})

    def check_config(self, name: str, config: dict[str, Any]) -> None:
        """Refuse PEFT features this engine does not serve as plain LoRA.

        Raises:
            AdapterError: for ``use_dora``, a ``bias`` PEFT does not know,
                ``modules_to_save``, a PEFT type other than LoRA, an initialisation that
                rewrites the base weights (PiSSA, OLoRA, LoftQ, CorDA, LoRA-GA), or any
                other config field set away from its default (a LoRA variant).
        """
        peft_type = config.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise AdapterError(f"adapter {name!r}: peft_type {peft_type!r} is not LoRA")
        if config.get("use_dora"):
            raise AdapterError(f"adapter {name!r}: use_dora (DoRA) is not supported")
        # "all" / "lora_only" train base biases, saved as tensors beside the pairs, which
        # are refused by name; a file without them is plain LoRA (a model without biases)
        if config.get("bias", "none") not in ("none", "all", "lora_only"):
            raise AdapterError(
                f"adapter {name!r}: bias={config['bias']!r} is not one of PEFT's 'none', 'all', "
                "'lora_only'"
            )
        if isinstance(config.get("target_modules"), str):  # (LoraConfig refuses these)
            for field in ("layers_to_transform", "layers_pattern"):
                if config.get(field) is not None:
                    raise AdapterError(
                        f"adapter {name!r}: adapter_config.json's {field!r} cannot be used when "
                        "'target_modules' is a string (PEFT refuses this config)"
                    )
        if config.get("layers_pattern") and config.get("layers_to_transform") is None:
            raise AdapterError(
                f"adapter {name!r}: adapter_config.json's 'layers_pattern' is set but "
                "'layers_to_transform' is not (PEFT refuses this config)"
            )
        if config.get("modules_to_save"):
            raise AdapterError(
                f"adapter {name!r}: modules_to_save {config['modules_to_save']} is not supported"
            )
        init = config.get("init_lora_weights", True)
        if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
            raise AdapterError(
                f"adapter {name!r}: init_lora_weights={init!r} rewrites the base weights; "
                "convert it to plain LoRA first (PEFT: save_pretrained(..., "
                "path_initial_model_for_weight_conversion=...))"
            )
        for key, value in config.items():
            if key not in CONFIG_FIELDS and value not in (None, False, 0, "", [], {}):
                raise AdapterError(
                    f"adapter {name!r}: adapter_config.json sets {key}={value!r}, a LoRA variant "
                    "this engine does not serve"
                )

    def modules(
        self, name: str, src: AdapterSource, shapes: dict[str, tuple[int, ...]]
    ) -> tuple[list[LoraModule], AdapterInfo, dict[LoraModuleRef, str]]:
        """Pair the A and B of each module, place it, and compute its rank and scale.

        Returns:
            the modules that land on served targets, the adapter's :class:`AdapterInfo`,
            and the keys of the base weights PEFT saved beside them, by where they land.

        Raises:
            AdapterError: if a module lacks its A or B.
        """
        cfg = src.config
        ties = peft_weight_ties(cfg, self.tied) if cfg else {}
        tied_cfg = with_ties(cfg, ties)
        pairs, base_layers = pair_keys(name, shapes, self._known_module)
        # PEFT's defaults when the config omits r or lora_alpha; a bare file (no config):
        # r is the tensors' rank and the scale is 1
        r_default = cfg.get("r", PEFT_DEFAULT_R) if cfg else None
        alpha_default = cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA) if cfg else None
        rank_pattern = cfg.get("rank_pattern") or {}
        alpha_pattern = cfg.get("alpha_pattern") or {}
        modules: list[LoraModule] = []
        unmapped: list[str] = []
        misfits: list[str] = []
        placed: dict[tuple[str, int, int], str] = {}  # (target, layer, slice) -> module
        max_rank = 0
        for module, ab in sorted(pairs.items()):
            embedding = "embedding_A" in ab or "embedding_B" in ab
            a_name, b_name = ("embedding_A", "embedding_B") if embedding else ("A", "B")
            if a_name not in ab or b_name not in ab or len(ab) != 2:
                missing = next((n for n in (a_name, b_name) if n not in ab), None)
                what = (
                    f"has lora_{missing} missing"
                    if missing
                    else f"mixes {sorted('lora_' + k for k in ab)}"
                )
                raise AdapterError(f"adapter {name!r}: module {module} {what}")
            a_shape, b_shape = shapes[ab[a_name]], shapes[ab[b_name]]
            rank = a_shape[0] if a_shape else 0
            if rank == 0:
                raise AdapterError(
                    f"adapter {name!r}: module {module} has rank-0 tensors "
                    f"(lora_{a_name} {list(a_shape)})"
                )
            if module in self.ignored:
                max_rank = max(max_rank, rank)
                continue
            ref = self.module_map(module)
            if ref is None or ref.target not in self.targets:
                unmapped.append(module)
                continue
            target = self.targets[ref.target]
            try:
                slices = target.module_slices(ref.shard_id)
            except KeyError:
                unmapped.append(module)
                continue
            why = peft_untargeted_reason(tied_cfg, module) if cfg and module not in ties else None
            if why is not None:
                raise AdapterError(
                    f"adapter {name!r}: module {module} has LoRA weights, but {why} (PEFT "
                    "would load the adapter without them)"
                )
            if embedding != (target.kind == "embedding"):
                article = "an" if target.kind == "embedding" else "a"
                misfits.append(
                    f"{module} (lora_{a_name}/lora_{b_name} on {article} {target.kind} target)"
                )
                continue
            if ref.layer not in target.layer_ids(self.num_layers):
                misfits.append(
                    f"{module} (layer {ref.layer}: the model's {ref.target} has layers "
                    f"{_span(target.layer_ids(self.num_layers))}; trained with layer_replication "
                    "or on a deeper model?)"
                )
                continue
            expected_a = (rank, target.in_features)
            expected_b = (sum(target.out_slices[s] for s in slices), rank)
            if (
                len(a_shape) != 2
                or len(b_shape) != 2
                or tuple(a_shape) != expected_a
                or tuple(b_shape) != expected_b
            ):
                vocab = target.kind == "embedding" or target.per_segment
                cause = "a resized vocabulary" if vocab else "another model size"
                misfits.append(
                    f"{module} (A {list(a_shape)}, B {list(b_shape)}; expected A "
                    f"{list(expected_a)}, B {list(expected_b)}: {cause}?)"
                )
                continue
            for s in slices:  # (two names for one slice would overwrite each other's rows)
                other = placed.setdefault((ref.target, ref.layer, s), module)
                if other != module:
                    raise AdapterError(
                        f"adapter {name!r}: modules {other} and {module} both land on "
                        f"{target.slice_names[s]} of layer {ref.layer}'s {ref.target}"
                    )
            max_rank = max(max_rank, rank)
            r_cfg = int(pattern_value(rank_pattern, module, r_default or rank))
            if r_cfg != rank:  # PEFT refuses this with a size mismatch
                said = (
                    f"rank_pattern gives {r_cfg}"
                    if pattern_value(rank_pattern, module, None) is not None
                    else f"r is {r_cfg}"
                    if "r" in cfg
                    else f"r is missing (PEFT's default: {r_cfg})"
                )
                raise AdapterError(
                    f"adapter {name!r}: module {module} has rank-{rank} tensors (lora_{a_name} "
                    f"{list(a_shape)}) but adapter_config.json's {said}"
                )
            alpha = float(
                pattern_value(
                    alpha_pattern, module, alpha_default if alpha_default is not None else r_cfg
                )
            )
            scale = alpha / math.sqrt(r_cfg) if cfg.get("use_rslora") else alpha / r_cfg
            modules.append(LoraModule(module, ref, ab[a_name], ab[b_name], rank, scale))
        misfits += self._base_misfits(name, base_layers, shapes, unmapped)
        saved = {cast(LoraModuleRef, self.module_map(m)): key for m, key in base_layers.items()}
        return modules, AdapterInfo(max_rank, tuple(unmapped), tuple(misfits)), saved

    def _base_misfits(
        self,
        name: str,
        base_layers: dict[str, str],
        shapes: dict[str, tuple[int, ...]],
        unmapped: list[str],
    ) -> list[str]:
        """The saved base weights (``{module: key}``, :func:`pair_keys`) whose shape is not
        their target's, each described for :meth:`check`; a module outside the served
        targets is added to ``unmapped``.

        Raises:
            AdapterError: for a saved base weight of a linear (PEFT saves only the
                embedding's and the LM head's: a full layer trained beside the adapter).
        """
        misfits = []
        for module, key in base_layers.items():
            ref = self.module_map(module)
            assert ref is not None  # (_known_module)
            target = self.targets.get(ref.target)
            if target is None:
                if module not in unmapped:
                    unmapped.append(module)
                continue
            if not (target.kind == "embedding" or target.per_segment):
                raise AdapterError(
                    f"adapter {name!r}: tensor {key} is a saved weight of the linear {module} "
                    "(PEFT saves only the embedding's and the LM head's beside an adapter: a "
                    "layer trained with it?); only LoRA pairs can be served"
                )
            expected = (
                (target.in_features, target.out_features)
                if target.kind == "embedding"
                else (target.out_features, target.in_features)
            )
            if tuple(shapes[key]) != expected:
                misfits.append(
                    f"{module} (saved base weight {list(shapes[key])}; the model's is "
                    f"{list(expected)}: a resized vocabulary?)"
                )
        return misfits

    def _known_module(self, module: str) -> bool:
        """Whether ``module`` is one of the model's LoRA target modules (whose saved base
        weight :meth:`_base_misfits` places)."""
        return self.module_map(module) is not None

    def info(self, name: str, src: AdapterSource) -> AdapterInfo:
        """The adapter's :class:`AdapterInfo`, read from its config and header alone."""
        shapes = _read_shapes(src.weights_path)
        self._complete_ties(name, src, shapes, lambda shape: tuple(reversed(shape)))
        return self.modules(name, src, shapes)[1]

    def _complete_ties(
        self, name: str, src: AdapterSource, values: dict[str, Any], transpose: Callable
    ) -> None:
        """Give the half of a tied pair (:func:`peft_weight_ties`) the file lacks the other
        half transposed, as PEFT's tying does on load; with both halves, refuse them unless
        equal (PEFT would serve whichever it loaded last).

        Raises:
            AdapterError: naming the two tensors that should be one.
        """
        ties = peft_weight_ties(src.config, self.tied) if src.config else {}
        for key, other in tied_keys(name, list(values), ties):
            if key in values and other in values:
                a, b = values[key], values[other]
                same = (
                    a == transpose(b)
                    if isinstance(a, tuple)
                    else a.shape == transpose(b).shape and bool(torch.equal(a, transpose(b)))
                )
                if not same:
                    raise AdapterError(
                        f"adapter {name!r}: tensors {key} and {other} are tied "
                        "(ensure_weight_tying) but are not each other's transpose"
                    )
            elif key in values:
                values[other] = transpose(values[key])
            elif other in values:
                values[key] = transpose(values[other])

    def check(self, name: str, info: AdapterInfo, *, max_rank: int) -> None:
        """Refuse an adapter this deployment cannot serve.

        Raises:
            AdapterError: a module outside the served targets, a shape that does not fit
                its target, no LoRA tensors, or a rank above ``max_rank`` (in that order: a
                transposed A is named as a misfit, not as a rank).
        """
        if info.unmapped:
            raise AdapterError(
                f"adapter {name!r}: module {info.unmapped[0]} is outside the served targets "
                f"({', '.join(checkpoint_modules(self.targets))})"
                + (
                    ", as is 1 more module"
                    if len(info.unmapped) == 2
                    else f", as are {len(info.unmapped) - 1} more modules"
                    if len(info.unmapped) > 2
                    else ""
                )
            )
        if info.misfits:
            raise AdapterError(f"adapter {name!r}: module {info.misfits[0]} does not fit the model")
        if info.rank == 0:
            raise AdapterError(
                f"adapter {name!r}: no LoRA tensors (lora_A/lora_B) in the checkpoint"
            )
        if info.rank > max_rank:
            raise AdapterError(f"adapter {name!r}: rank {info.rank} is above max_rank {max_rank}")

    def load(
        self,
        name: str,
        src: AdapterSource,
        layout: SlotLayout,
        *,
        max_rank: int,
        dtype: torch.dtype,
    ) -> tuple[AdapterImage, int, dict[LoraModuleRef, Tensor]]:
        """Validate and normalise an adapter into its slot image.

        The :class:`~lora_graph.layout.AdapterImage` (``dtype``, CPU) holds the A and B of
        each ``(target, layer)`` the adapter has, at the adapter's rank (a module of a
        lower rank zero-padded to it), with ``scale`` folded into a copy of B; the
        checkpoint's tensors are not modified.

        Returns:
            ``(image, rank, saved_base)``: ``saved_base`` holds the base weights PEFT saved
            in the file (``*.base_layer.weight``), by where they land, for the caller to
            compare with the served model's.

        Raises:
            AdapterError: for anything :meth:`check_config` or :meth:`check` refuses, a LoRA
                tensor holding a NaN or an infinity, or an A or a scaled B that overflows
                ``dtype`` (each named).
        """
        self.check_config(name, src.config)
        tensors = _load_tensors(src.weights_path)
        self._complete_ties(name, src, tensors, lambda t: t.T)
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        modules, info, saved_keys = self.modules(name, src, shapes)
        self.check(name, info, max_rank=max_rank)
        for m in modules:
            for key in (m.a_key, m.b_key):
                _check_finite(name, key, tensors[key])
        blocks = sorted({(m.ref.target, m.ref.layer) for m in modules})
        image = AdapterImage(layout, blocks, info.rank, dtype)
        largest = torch.finfo(dtype).max
        for m in modules:
            target = self.targets[m.ref.target]
            a = image.a(m.ref.target, m.ref.layer)
            b = image.b(m.ref.target, m.ref.layer)
            a_t, b_t = tensors[m.a_key].float(), tensors[m.b_key].float() * m.scale
            for key, t, what in (
                (m.a_key, a_t, ""),
                (m.b_key, b_t, f" times its scale {m.scale:g}"),
            ):
                lo, hi = torch.aminmax(t)
                if max(-float(lo), float(hi)) > largest:  # (an infinity in the slot)
                    raise AdapterError(
                        f"adapter {name!r}: tensor {key}{what} overflows "
                        f"{str(dtype).removeprefix('torch.')}"
                    )
            if target.kind == "embedding":  # stored transposed: [vocab, max_rank]
                a[:, : m.rank].copy_(a_t.T)
                b[:, : m.rank].copy_(b_t)
                continue
            row = 0  # a packed module: each slice takes its A and its rows of B
            for s in target.module_slices(m.ref.shard_id):
                start, size = target.slice_rows(s)
                a[s, : m.rank].copy_(a_t)
                b[start : start + size, : m.rank].copy_(b_t[row : row + size])
                row += size
        # (each a served embedding's or LM head's: check() passed)
        saved_base = {ref: tensors[key] for ref, key in saved_keys.items()}
        return image, info.rank, saved_base
