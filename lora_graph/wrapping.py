"""Module surgery: put LoRA layers in place of a model's target linears and embeddings,
each holding its views of the slot pool; and map checkpoint keys onto the wrapped model."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from lora_graph.layers import LoRAEmbedding, LoRALinear, slot_stack
from lora_graph.layout import SlotLayout
from lora_graph.ops import Kernels
from lora_graph.targets import LoraTarget

WeightsAdapter = Callable[[dict[str, Tensor]], dict[str, Tensor]]
LoRALayer = LoRALinear | LoRAEmbedding


def wrap_model(
    model: nn.Module,
    targets: dict[str, LoraTarget],
    *,
    num_layers: int,
    module_path: Callable[[str, int], str],
    layout: SlotLayout,
    pool: Tensor,
    kernels: Kernels,
    ranks: Tensor | None = None,
) -> dict[tuple[str, int], LoRALayer]:
    """Replace, in place, every target module of ``model`` with its LoRA layer.

    Each layer gets stacked views of its blocks in ``pool`` ``[num_slots, layout.numel]``:
    ``a`` ``[num_slots, S * R, in_features]`` (an embedding: ``[num_slots, vocab, R]``) and
    ``b`` ``[num_slots, out_features, R]``; and ``ranks`` ``[num_slots]``, each slot's rank
    (:attr:`lora_graph.slots.SlotPool.ranks`; None: every slot read to ``R``).

    Returns:
        the LoRA layers by ``(target, layer)``.

    Raises:
        TypeError: if a target path holds another kind of module.
    """
    r = layout.max_rank
    layers: dict[tuple[str, int], LoRALayer] = {}
    for name, target in targets.items():
        for layer in target.layer_ids(num_layers):
            path = module_path(name, layer)
            parent_path, _, attr = path.rpartition(".")
            parent = model.get_submodule(parent_path) if parent_path else model
            base = getattr(parent, attr)
            a_off, b_off = layout.blocks[(name, layer)]
            b = slot_stack(pool, b_off, (target.out_features, r))
            lora: LoRALayer
            if target.kind == "embedding":
                if not isinstance(base, nn.Embedding):
                    raise TypeError(f"{path} is a {type(base).__name__}, not an nn.Embedding")
                a = slot_stack(pool, a_off, (target.in_features, r))
                lora = LoRAEmbedding(base, target_name=name, target=target, layer=layer, a=a, b=b,
                                     kernels=kernels, ranks=ranks)  # fmt: skip
            else:
                if not isinstance(base, nn.Linear):
                    raise TypeError(f"{path} is a {type(base).__name__}, not an nn.Linear")
                a = slot_stack(pool, a_off, (target.num_slices * r, target.in_features))
                lora = LoRALinear(base, target_name=name, target=target, layer=layer, a=a, b=b,
                                  kernels=kernels, ranks=ranks)  # fmt: skip
            setattr(parent, attr, lora)
            layers[(name, layer)] = lora
    return layers


def lora_weight_adapter(
    base_adapter: WeightsAdapter, wrapped_paths: set[str], *, wrapper_prefix: str = ""
) -> WeightsAdapter:
    """Wrap a checkpoint key adapter so its output loads into the wrapped model: the base
    module of each LoRA layer (path in ``wrapped_paths``) sits at ``<path>.base``, and every
    key gets ``wrapper_prefix.`` in front when one is given."""
    wrapped = {p + "." for p in wrapped_paths}

    def adapter(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        out = {}
        for key, value in base_adapter(state_dict).items():
            module, _, leaf = key.rpartition(".")
            if module + "." in wrapped:
                key = f"{module}.base.{leaf}"
            out[f"{wrapper_prefix}.{key}" if wrapper_prefix else key] = value
        return out

    return adapter
