"""lora_graph: one base model, many LoRA adapters, one batch, a compiled step."""

from lora_graph.config import AdapterError, AdapterInfo, LoRAConfig, LoraReqConfig
from lora_graph.layers import LoRALinear
from lora_graph.manager import LoRAManager, LoRAStatus, NoFreeSlotError
from lora_graph.routing import Routing
from lora_graph.targets import LoraModuleRef, LoraTarget

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
