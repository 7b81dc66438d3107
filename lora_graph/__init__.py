"""lora_graph: one base model, many LoRA adapters, one batch, a compiled step.

The names below are imported when first used (PEP 562), so ``import lora_graph`` does not
import torch: the ``lora-graph`` command (:mod:`lora_graph.__main__`) can then answer a
Ctrl-C while torch still imports as it answers a later one.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lora_graph.config import AdapterError, AdapterInfo, LoRAConfig, LoraReqConfig
    from lora_graph.layers import LoRALinear
    from lora_graph.manager import LoRAManager, LoRAStatus, NoFreeSlotError
    from lora_graph.routing import Routing
    from lora_graph.targets import LoraModuleRef, LoraTarget

_WHERE = {
    "AdapterError": "lora_graph.config",
    "AdapterInfo": "lora_graph.config",
    "LoRAConfig": "lora_graph.config",
    "LoraReqConfig": "lora_graph.config",
    "LoRALinear": "lora_graph.layers",
    "LoRAManager": "lora_graph.manager",
    "LoRAStatus": "lora_graph.manager",
    "NoFreeSlotError": "lora_graph.manager",
    "Routing": "lora_graph.routing",
    "LoraModuleRef": "lora_graph.targets",
    "LoraTarget": "lora_graph.targets",
}

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "LoRAConfig",
    "LoRALinear",
    "LoRAManager",
    "LoRAStatus",
    "LoraModuleRef",
    "LoraReqConfig",
    "LoraTarget",
    "NoFreeSlotError",
    "Routing",
]


def __getattr__(name: str) -> Any:
    """A name of ``__all__``, or a submodule (``lora_graph.config``), imported now."""
    module = _WHERE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # (the next use finds it directly)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
