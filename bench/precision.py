"""Half-precision error of the engine against transformers + peft in the same dtype.

Builds the test suite's tiny model and adapters (large B, so deltas show), and prints the
relative error ``||logits - ref|| / ||ref||`` of each row of the interleaved batch, where
``ref`` is float32 transformers + peft on the CPU, for: the engine per backend and device,
and transformers + peft itself, in bfloat16, each with adapter weights in the model dtype
(engine slots ``LoRAConfig.dtype=None``; peft ``autocast_adapter_dtype=False``) and in
float32 (``LoRAConfig.dtype=torch.float32``; peft's default, which keeps adapters in float32
under a half-precision base).

    python bench/precision.py [--dtype bfloat16|float16]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

from lora_graph import LoRAConfig
from lora_graph.architectures import LlamaPipeline


def _test_helpers():
    """tests/conftest.py (the suite's tiny model, adapters and reference), from its file."""
    path = Path(__file__).resolve().parents[1] / "tests" / "conftest.py"
    spec = importlib.util.spec_from_file_location("lora_graph_test_helpers", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


_helpers = _test_helpers()
ADAPTERS, PeftReference, Tiny = _helpers.ADAPTERS, _helpers.PeftReference, _helpers.Tiny
make_hf_model, make_peft_adapter, prompts = (
    _helpers.make_hf_model,
    _helpers.make_peft_adapter,
    _helpers.prompts,
)
run_prefill = _helpers.run_prefill
MIX = ["A", None, "B", "A", None, "C", "D"]  # tests/test_parity.py's interleaved batch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument(
        "--smoke", action="store_true", help="the CPU only (the model is tiny either way)"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    root = Path(tempfile.mkdtemp())
    make_hf_model("gqa").save_pretrained(root / "base")
    adapters = {
        n: make_peft_adapter(root / "base", root / n, seed=i + 10, factor=f, **kw)
        for i, (n, (kw, f)) in enumerate(ADAPTERS.items())
    }
    tiny = Tiny("gqa", root / "base", adapters, 128)
    ref = PeftReference(tiny)
    batch = prompts(len(MIX), seed=9)
    want = [ref.logits(ids, a) for ids, a in zip(batch, MIX, strict=True)]
    rows: dict[str, list[float]] = {}

    def err(got: list[torch.Tensor]) -> list[float]:
        return [
            float((g.float().cpu() - w).norm() / w.norm()) for g, w in zip(got, want, strict=True)
        ]

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() and not args.smoke else [])
    for device in devices:
        for label, slot_dtype, autocast in (
            ("adapters " + args.dtype, None, False),
            ("adapters float32", torch.float32, True),
        ):
            same = PeftReference(tiny, dtype=dtype, device=device, autocast_adapter_dtype=autocast)
            rows[f"peft {device} {args.dtype}, {label}"] = err(
                [same.logits(ids, a) for ids, a in zip(batch, MIX, strict=True)]
            )
            for backend in ("torch", "triton") if device == "cuda" else ("torch",):
                pipe = LlamaPipeline(
                    str(tiny.base),
                    dtype=dtype,
                    device=device,
                    max_batch_size=8,
                    max_seq_len=64,
                    lora=LoRAConfig(max_slots=4, max_rank=16, backend=backend, dtype=slot_dtype),
                )
                for name, path in adapters.items():
                    pipe.manager.load_adapter(str(path), name=name)
                rows[f"engine {device} {args.dtype} {backend}, {label}"] = err(
                    run_prefill(pipe, batch, MIX)
                )
    print("| run | " + " | ".join(str(a) for a in MIX) + " |")
    print("|---|" + "---|" * len(MIX))
    for name, errs in rows.items():
        print(f"| {name} | " + " | ".join(f"{e:.4f}" for e in errs) + " |")


if __name__ == "__main__":
    main()
