"""PEFT's adapter_config.json as PEFT reads it: the file's field types
(:func:`check_config_types`), which modules a config targets (:func:`peft_untargeted_reason`,
:func:`peft_weight_ties`), rank and alpha patterns, and the fields plain LoRA serving may
ignore (every other one names a LoRA variant)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Any

from lora_graph.config import AdapterError, is_finite_number, is_int


def read_adapter_config(config_path: str) -> dict[str, Any]:
    """Read and type-check a PEFT ``adapter_config.json``.

    Raises:
        AdapterError: naming the file and the cause: unreadable, not UTF-8, not JSON, not a
            JSON object, or a field of the wrong type (:func:`check_config_types`).
    """
    try:
        with open(config_path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise AdapterError(f"{config_path}: cannot be read ({e.strerror or e})") from e
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise AdapterError(
            f"{config_path}: not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})"
        ) from e
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise AdapterError(f"{config_path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise AdapterError(
            f"{config_path}: expected a JSON object of PEFT's LoraConfig fields, got a "
            f"{_json_type(config)}"
        )
    check_config_types(config, config_path)
    return config


def _json_type(value: Any) -> str:
    return {
        dict: "object",
        list: "list",
        str: "string",
        bool: "boolean",
        int: "integer",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


# PEFT's TaskType values (PEFT refuses others)
_TASK_TYPES = (
    "SEQ_CLS",
    "SEQ_2_SEQ_LM",
    "CAUSAL_LM",
    "TOKEN_CLS",
    "QUESTION_ANS",
    "FEATURE_EXTRACTION",
)

# field -> (check, what the field must be); None is PEFT's default for the optional ones
_CONFIG_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "peft_type": (lambda v: isinstance(v, str), "a string"),
    "task_type": (
        lambda v: v is None or v in _TASK_TYPES,
        f"null or one of {', '.join(_TASK_TYPES)}",
    ),
    "base_model_name_or_path": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "revision": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "peft_version": (lambda v: v is None or isinstance(v, str), "a string or null"),
    "inference_mode": (lambda v: isinstance(v, bool), "true or false"),
    "auto_mapping": (lambda v: v is None or isinstance(v, dict), "an object or null"),
    "r": (lambda v: is_int(v) and v >= 1, "a positive integer"),
    "lora_alpha": (is_finite_number, "a finite number"),
    "lora_dropout": (lambda v: is_finite_number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "use_rslora": (lambda v: isinstance(v, bool), "true or false"),
    "target_modules": (
        lambda v: v is None or isinstance(v, str) or _is_str_list(v),
        "a string, a list of strings or null",
    ),
    "exclude_modules": (
        lambda v: v is None or isinstance(v, str) or _is_str_list(v),
        "a string, a list of strings or null",
    ),
    "layers_to_transform": (
        lambda v: v is None or is_int(v) or (isinstance(v, list) and all(map(is_int, v))),
        "an integer, a list of integers or null",
    ),
    "layers_pattern": (
        lambda v: v is None or isinstance(v, str) or _is_str_list(v),
        "a string, a list of strings or null",
    ),
    "rank_pattern": (
        lambda v: (
            v is None or (isinstance(v, dict) and all(is_int(x) and x >= 1 for x in v.values()))
        ),
        "an object of positive integers",
    ),
    "alpha_pattern": (
        lambda v: v is None or (isinstance(v, dict) and all(map(is_finite_number, v.values()))),
        "an object of finite numbers",
    ),
    "fan_in_fan_out": (lambda v: isinstance(v, bool), "true or false"),
    "init_lora_weights": (lambda v: isinstance(v, (bool, str)), "true, false or a string"),
    "bias": (lambda v: isinstance(v, str), "a string"),
    # (null: PEFT reads it as false, ``if self.use_dora``)
    "use_dora": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "modules_to_save": (lambda v: v is None or _is_str_list(v), "a list of strings or null"),
}


def check_config_types(config: dict[str, Any], where: str) -> None:
    """Type-check the ``adapter_config.json`` fields this engine reads, as PEFT's
    ``LoraConfig`` declares them; ``peft_type`` is required (PEFT reads it first), and a
    ``lora_alpha`` given must be a number (``null`` is refused: PEFT fails on it).

    Raises:
        AdapterError: ``"<where>: field 'r' must be a positive integer, got 'abc'"``.
    """
    if "peft_type" not in config:
        raise AdapterError(
            f"{where}: field 'peft_type' is missing (a PEFT adapter_config.json names it, e.g. "
            '"LORA")'
        )
    if isinstance(config["peft_type"], str) and config["peft_type"] != "LORA":
        # (before LoRA's fields: a prompt-tuning config has no target_modules to name)
        raise AdapterError(f"{where}: peft_type {config['peft_type']!r} is not LoRA")
    for key, (ok, what) in _CONFIG_TYPES.items():
        if key in config and not ok(config[key]):
            raise AdapterError(f"{where}: field {key!r} must be {what}, got {config[key]!r}")
    if config.get("target_modules") is None:
        raise AdapterError(
            f"{where}: field 'target_modules' is missing or null (PEFT would fill in its default "
            "targets for the model type; name them)"
        )
    # strings are regexes: target/exclude_modules matched whole, layers_pattern embedded
    for field in ("target_modules", "exclude_modules", "layers_pattern"):
        patterns = config.get(field)
        for pattern in [patterns] if isinstance(patterns, str) else patterns or []:
            try:
                re.compile(
                    rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\."
                    if field == "layers_pattern"
                    else pattern
                )
            except re.error as e:
                raise AdapterError(
                    f"{where}: field {field!r} holds {pattern!r}, not a valid regular expression "
                    f"({e})"
                ) from e
    for field in ("rank_pattern", "alpha_pattern"):  # keys: regexes, PEFT's get_pattern_key
        for pattern in config.get(field) or {}:
            try:
                re.compile(rf"(.*\.)?({pattern})$")
            except re.error as e:
                raise AdapterError(
                    f"{where}: field {field!r} has key {pattern!r}, not a valid regular "
                    f"expression ({e})"
                ) from e


def peft_untargeted_reason(config: dict[str, Any], module: str) -> str | None:
    """None when PEFT would put a LoRA layer on ``module`` (a base-model module name such
    as ``model.layers.0.self_attn.q_proj``) under this config, else which field leaves it
    out, as ``"adapter_config.json's <field> <value> <why>"``. PEFT's
    ``check_target_module_exists`` for ``target_modules`` (a regex string matched whole,
    ``"all-linear"``, or names matched as the key or its dotted tail), ``exclude_modules``,
    ``layers_to_transform`` and ``layers_pattern``. PEFT ignores the weights of a module it
    does not target, so an adapter carrying such weights is refused rather than served with
    them."""
    where = "adapter_config.json's"
    exclude = config.get("exclude_modules")
    if exclude and _excluded(exclude, module):
        return f"{where} exclude_modules {exclude!r} excludes it"
    targets = config.get("target_modules")
    unselected = f"{where} target_modules {targets!r} does not select it"
    if isinstance(targets, str) and targets.lower() == "all-linear":  # (PEFT lower-cases it)
        # PEFT expands it to every linear but the output layer
        return None if module.rsplit(".", 1)[-1] not in ("lm_head", "embed_tokens") else unselected
    if isinstance(targets, str):
        return None if re.fullmatch(targets, module) is not None else unselected
    if not targets:
        return unselected
    if module in targets:
        return None
    if not any(module.endswith(f".{t}") for t in targets):
        return unselected
    return _layer_reason(config, module)


def _excluded(exclude: str | list[str], module: str) -> bool:
    """PEFT's ``exclude_modules``: a regex matched whole, or names matched as the key or
    its dotted tail."""
    if isinstance(exclude, str):
        return re.fullmatch(exclude, module) is not None
    return module in exclude or any(module.endswith(f".{e}") for e in exclude)


def _layer_reason(config: dict[str, Any], module: str) -> str | None:
    """None when ``layers_to_transform`` (with ``layers_pattern``) keeps ``module``'s
    layer, else why not (PEFT's layer index rule)."""
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    patterns = config.get("layers_pattern")
    match = None
    if not patterns:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module)
    else:
        for pattern in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", module)
            if match is not None:
                break
    layer_fields = f"adapter_config.json's layers_to_transform {layers!r}" + (
        f" (layers_pattern {patterns!r})" if patterns else ""
    )
    if match is None:
        return f"{layer_fields} finds no layer index in its name"
    index = int(match.group("idx"))
    if index == layers if isinstance(layers, int) else index in layers:
        return None
    return f"{layer_fields} leaves out its layer {index}"


# PEFT's EMBEDDING_LAYER_NAMES: a target_modules entry ending in one of them (or a regex
# matching one whole) asks for the tied pair under ensure_weight_tying
_EMBEDDING_LAYER_NAMES = ("embed_tokens", "lm_head")


def peft_weight_ties(config: dict[str, Any], tied: Mapping[str, str]) -> dict[str, str]:
    """The ties PEFT (0.21, ``LoraConfig.ensure_weight_tying``) applies under ``config``:
    ``{tied module: input embedding module}`` (``{"lm_head": "model.embed_tokens"}``), or
    ``{}``. ``tied`` is what the model ties to its input embedding (empty when the
    checkpoint's ``tie_word_embeddings`` is false, as PEFT reads it).

    PEFT's ``_check_tied_modules``: with ``ensure_weight_tying`` on a tied model whose
    ``target_modules`` names an embedding layer (an entry whose last part is
    ``embed_tokens`` or ``lm_head``; a regex string matching one of those whole), it adapts
    the input embedding (adding it to ``target_modules``) and gives each tied module a LoRA
    layer whose A and B *are* the embedding's B and A transposed (``target_modules_to_tie``),
    whatever ``target_modules`` says of it. It saves ``target_modules`` so rewritten: the
    LM head's weights are in the file, its name no longer in the config."""
    if not config.get("ensure_weight_tying") or not tied:
        return {}
    targets = config.get("target_modules")
    if isinstance(targets, str):
        asked = any(re.fullmatch(targets, n) for n in _EMBEDDING_LAYER_NAMES)
    else:
        asked = any(t.split(".")[-1] in _EMBEDDING_LAYER_NAMES for t in targets or [])
    return dict(tied) if asked else {}


def with_ties(config: dict[str, Any], ties: Mapping[str, str]) -> dict[str, Any]:
    """``config`` with ``target_modules`` as PEFT's ``_add_targets_to_tie`` rewrites it: the
    input embedding added (the tied modules are targeted through their tie)."""
    if not ties:
        return config
    targets = config.get("target_modules")
    embeddings = sorted(set(ties.values()))
    if isinstance(targets, str):
        extra = "|".join(f"^{re.escape(e)}$" for e in embeddings)
        return {**config, "target_modules": f"(?:{targets}|{extra})"}
    return {**config, "target_modules": [*(targets or []), *embeddings]}


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the first pattern key matching the module's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


# adapter_config.json fields that plain LoRA serving reads or may ignore: every other field
# must hold its PEFT default (None, False, empty), or the adapter is refused: it names a
# LoRA variant (aLoRA, trainable tokens, LoRA bias, layer replication, QALoRA, ...) that
# would be served wrong as plain LoRA.
CONFIG_FIELDS = frozenset(
    {
        "peft_type",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "inference_mode",
        "auto_mapping",
        "peft_version",
        "r",
        "lora_alpha",
        "lora_dropout",
        "use_rslora",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "fan_in_fan_out",
        "init_lora_weights",
        "bias",
        "use_dora",
        "modules_to_save",
        "ensure_weight_tying",
        "megatron_core",
        "qalora_group_size",
        # an initialisation's own settings: PEFT ignores each unless init_lora_weights names
        # its initialisation (those that rewrite the base weights are refused by name)
        "eva_config",
        "loftq_config",
        "corda_config",
        "lora_ga_config",
        # where PEFT offloads DoRA's and some initialisations' work (LoraRuntimeConfig): it
        # changes no plain LoRA's weights or outputs, and PEFT does not save it
        "runtime_config",
    }
)
# initialisations that rewrite the base weights (the adapter then needs that modified base)
BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda", "lora_ga")
PEFT_DEFAULT_ALPHA = 8  # LoraConfig.lora_alpha's default
PEFT_DEFAULT_R = 8  # LoraConfig.r's default
