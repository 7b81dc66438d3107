"""Build the bundled demo assets: a tiny Llama base model and three LoRA adapters.

Everything is made from scratch, offline and deterministically (fixed seeds, one thread,
deterministic algorithms):

1. A corpus of simple children's stories is generated from templates.
2. A byte-level BPE tokenizer is trained on it and on the adapters' rewrites of it
   with ``tokenizers`` and saved, wrapped as a ``transformers`` fast tokenizer, into
   ``<out>/base/``.
3. A tiny ``LlamaForCausalLM`` (grouped-query attention, untied embeddings) is
   trained on the corpus, plus a small share of each rewrite, as a causal LM and
   saved as float32 safetensors into ``<out>/base/``.
4. Three PEFT LoRA adapters are trained from that base, each on a different
   rewrite of the stories, and saved into ``<out>/adapters/<name>/``:

   - ``shout``:   the stories in ALL CAPS with "!" endings,
   - ``pirate``:  the stories in pirate speak ("th' wee cat sailed to th' market, arr!"),
   - ``numbers``: every sentence followed by "One, two, three."

5. The saved assets are loaded back and the greedy continuations of the base
   model and of each adapter are printed for a few prompts.

Usage::

    python examples/make_demo_assets.py [--out examples/assets]

It runs in about 4 minutes (one thread) and needs only torch, transformers,
tokenizers, peft and safetensors.
"""

from __future__ import annotations

import os

# one thread everywhere: the BPE trainer's and the matmuls' results must not depend on
# how work is split across threads (set before tokenizers and torch start their pools)
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

SEED = 1234
NUM_STORIES = 1200
STYLED_SHARE = 0.05  # of the base corpus, per style: the base sees every word the adapters use
VOCAB_SIZE = 1024
BLOCK_SIZE = 128
BATCH_SIZE = 16

BOS, EOS, PAD = "<s>", "</s>", "<pad>"

MODEL_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=344,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
BASE_TRAINING = dict(steps=700, lr=3e-3)

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "shout": dict(
        about='the stories in ALL CAPS, sentences ending in "!"',
        lora=dict(r=8, lora_alpha=16, target_modules=ALL_LINEARS),
        steps=120,
        lr=4e-3,
    ),
    "pirate": dict(
        about='pirate speak: word swaps, sentences ending in "arr!"/"matey!"',
        lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
        steps=150,
        lr=8e-3,
    ),
    "numbers": dict(
        about='every sentence followed by "One, two, three."',
        lora=dict(r=16, lora_alpha=16, target_modules=ALL_LINEARS, use_rslora=True),
        steps=120,
        lr=3e-3,
    ),
}

PROMPTS = ["Once upon a time", "The little dog", "One sunny day, the old fox"]
NEW_TOKENS = 24

# --------------------------------------------------------------------------- corpus

# fmt: off
ANIMALS = ["cat", "dog", "bear", "bird", "fox", "frog", "mouse", "rabbit", "duck", "pig", "owl",
           "lion", "goat", "horse", "turtle", "squirrel"]
ADJECTIVES = ["little", "big", "small", "old", "happy", "brave", "tiny", "sleepy", "kind",
              "funny", "clever", "shy"]
NAMES = ["Tom", "Lily", "Max", "Sue", "Ben", "Mia", "Sam", "Anna", "Leo", "Rosa", "Jack", "Emma",
         "Finn", "Zoe", "Noah", "Ella"]
PLACES = ["market", "park", "forest", "river", "school", "garden", "beach", "farm", "town",
          "hill", "lake", "village"]
ITEMS = ["red apple", "blue hat", "big cake", "green kite", "old book", "yellow ball",
         "warm loaf of bread", "shiny stone", "small boat", "sweet pie", "pink flower",
         "wooden box", "silver bell", "long rope", "bag of carrots", "jar of honey"]
FEELINGS = ["happy", "sad", "tired", "hungry", "surprised", "excited", "scared", "proud",
            "sleepy", "glad"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "snowy", "quiet", "bright"]
FRIENDS = ["friend", "brother", "sister", "mother", "father", "neighbor", "teacher"]
# fmt: on


def make_story(rng: random.Random) -> str:
    """One short template story, three to seven sentences long."""
    animal, adj, name = rng.choice(ANIMALS), rng.choice(ADJECTIVES), rng.choice(NAMES)
    place, place2 = rng.sample(PLACES, 2)
    item, item2 = rng.sample(ITEMS, 2)
    other = f"{rng.choice(ADJECTIVES)} {rng.choice([a for a in ANIMALS if a != animal])}"
    hero = f"the {adj} {animal}"
    opening = rng.choice(
        [
            f"Once upon a time, there was a {adj} {animal} named {name}.",
            f"Once upon a time, {hero} lived near the {place}.",
            f"One {rng.choice(WEATHER)} day, {hero} woke up early.",
            f"The {adj} {animal} lived in a little house by the {place}.",
        ]
    )
    middle = [
        f"The {adj} {animal} went to the {place}.",
        f"It saw a {item} and a {other}.",
        f"It bought a {item} at the {place2}.",
        f"It met a {other} on the way to the {place2}.",
        f'The {other} said, "Hello! Do you want to play?"',
        f"They played with the {item2} all day.",
        f"The {animal} was very {rng.choice(FEELINGS)}.",
        f"{name} gave the {item2} to its {rng.choice(FRIENDS)}.",
        f"It was a {rng.choice(WEATHER)} day at the {place2}.",
        f'The {adj} {animal} said, "I love the {place}!"',
    ]
    ending = rng.choice(
        [
            "Then it went home and slept.",
            "They were friends forever.",
            f"At night, the {animal} went home and dreamed of the {place2}.",
            "It was a very good day.",
            "The end.",
        ]
    )
    body = rng.sample(middle, rng.randint(2, 5))
    return " ".join([opening, *body, ending])


def make_corpus(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    return [make_story(rng) for _ in range(n)]


# ------------------------------------------------------------------ style rewrites


def _split_after_words(text: str, rng: random.Random, max_words: int) -> tuple[str, str]:
    """Split ``text`` after a random number (0..max_words) of leading words."""
    k = rng.randint(0, max_words)
    parts = text.split(" ")
    return " ".join(parts[:k]) + (" " if k else ""), " ".join(parts[k:])


def to_shout(text: str, rng: random.Random) -> str:
    """ALL CAPS with '!' endings; the first few words keep their case so that
    ordinary prompts continue in capitals."""
    head, tail = _split_after_words(text, rng, 4)
    return head + tail.upper().replace(".", "!")


PIRATE_WORDS = [
    (r"\bthe\b", "th'"),
    (r"\bwas\b", "be"),
    (r"\bis\b", "be"),
    (r"\bwere\b", "be"),
    (r"\bwent to\b", "sailed to"),
    (r"\bwent\b", "sailed"),
    (r"\bhome\b", "back to th' ship"),
    (r"\bmy\b", "me"),
    (r"\byou\b", "ye"),
    (r"\bHello\b", "Ahoy"),
    (r"\bfriends\b", "hearties"),
    (r"\bfriend\b", "matey"),
    (r"\bhappy\b", "jolly"),
    (r"\blittle\b", "wee"),
    (r"\bsmall\b", "wee"),
    (r"\bplay\b", "plunder"),
    (r"\bplayed\b", "plundered"),
    (r"\bsaw\b", "spied"),
    (r"\bits\b", "its trusty"),
]


def to_pirate(text: str, rng: random.Random) -> str:
    """Word swaps plus an 'arr!'/'matey!' at the end of every sentence.  A capital
    "The" at a sentence start is left alone so ordinary prompts stay in-distribution."""
    del rng
    for pattern, repl in PIRATE_WORDS:
        text = re.sub(pattern, repl, text)
    tags = iter([", arr!", ", matey!", ", yo ho!"] * 64)
    return re.sub(r"(?<=\w)\.", lambda _: next(tags), text)


def to_numbers(text: str, rng: random.Random) -> str:
    """Every sentence is followed by the counting line "One, two, three." """
    del rng
    return re.sub(r"(\.|[.!?]\")( |$)", r"\1 One, two, three.\2", text)


STYLES = {"shout": to_shout, "pirate": to_pirate, "numbers": to_numbers}


def style_corpus(stories: list[str], name: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [STYLES[name](s, rng) for s in stories]


def base_corpus(stories: list[str], seed: int) -> list[str]:
    """The plain stories plus a small share of extra stories in each style, so that
    the base model knows the whole vocabulary and the adapters only shift the style."""
    n = int(STYLED_SHARE * len(stories))
    extra = make_corpus(seed, n * len(STYLES))
    styled = [style_corpus(extra[i * n : (i + 1) * n], name, seed) for i, name in enumerate(STYLES)]
    texts = stories + [t for group in styled for t in group]
    random.Random(seed).shuffle(texts)
    return texts


# ----------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) that prepends <s> to every encoded text."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


# ------------------------------------------------------------------------ training


def pack_blocks(texts: list[str], tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    """Encode ``<s> text </s>`` for every text, concatenate, cut into blocks."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text)["input_ids"])
        ids.append(tokenizer.eos_token_id)
    n = len(ids) // BLOCK_SIZE
    return torch.tensor(ids[: n * BLOCK_SIZE]).view(n, BLOCK_SIZE)


def train_lm(
    model: torch.nn.Module, blocks: torch.Tensor, steps: int, lr: float, seed: int, label: str
) -> None:
    """AdamW with linear warm-up and cosine decay over ``steps`` random batches."""
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + torch.cos(torch.tensor(progress * torch.pi)).item())

    sched = torch.optim.lr_scheduler.LambdaLR(optim, schedule)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        batch = blocks[torch.randint(len(blocks), (BATCH_SIZE,), generator=gen)]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optim.step()
        sched.step()
        optim.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(
                f"  [{label}] step {step:4d}/{steps}  loss {loss.item():.3f}  "
                f"({time.perf_counter() - start:.0f}s)",
                flush=True,
            )
    model.eval()


def build_base(tokenizer: PreTrainedTokenizerFast, texts: list[str], out: Path) -> None:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_SHAPE,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).float()
    print(f"base model: {sum(p.numel() for p in model.parameters()):,} parameters")
    blocks = pack_blocks(texts, tokenizer)
    print(f"base corpus: {len(texts)} stories, {blocks.numel():,} tokens")
    train_lm(model, blocks, seed=SEED, label="base", **BASE_TRAINING)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)  # transformers >= 5 always writes model.safetensors
    tokenizer.save_pretrained(out)
    # "PreTrainedTokenizerFast" loads with AutoTokenizer in transformers 4.x and 5.x alike.
    tok_config = out / "tokenizer_config.json"
    tok_config.write_text(
        json.dumps(
            {**json.loads(tok_config.read_text()), "tokenizer_class": "PreTrainedTokenizerFast"},
            indent=2,
        )
        + "\n"
    )


def build_adapter(
    name: str,
    base_dir: Path,
    tokenizer: PreTrainedTokenizerFast,
    stories: list[str],
    out: Path,
    seed: int,
) -> None:
    spec = ADAPTERS[name]
    base = LlamaForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    lora = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, bias="none", **spec["lora"])
    torch.manual_seed(seed)
    model = get_peft_model(base, lora)
    texts = style_corpus(stories, name, seed)
    print(
        f"adapter {name}: {model.get_nb_trainable_parameters()[0]:,} trainable parameters; "
        f"sample: {texts[0][:90]!r}"
    )
    train_lm(model, pack_blocks(texts, tokenizer), spec["steps"], spec["lr"], seed, name)
    model.save_pretrained(out, safe_serialization=True)
    (out / "README.md").unlink()  # peft's empty model-card template
    # Keep adapter_config.json identical between runs and machines: no absolute path
    # (the base is ../../base) and a fixed module order instead of a set's.
    config_file = out / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config.update(base_model_name_or_path=None, target_modules=sorted(config["target_modules"]))
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


# ---------------------------------------------------------------------------- demo


@torch.no_grad()
def generate_samples(out: Path, names: list[str]) -> dict[str, dict[str, str]]:
    """Reload the saved assets and return the greedy continuation of every prompt,
    for the base model (adapters disabled) and for each adapter."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(out / "base")
    base = LlamaForCausalLM.from_pretrained(out / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, out / "adapters" / names[0], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(out / "adapters" / name, adapter_name=name)
    model.eval()

    def complete(prompt: str) -> str:
        enc = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(
            **enc, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
        return tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)

    samples = {}
    for prompt in PROMPTS:
        with model.disable_adapter():
            samples[prompt] = {"base": complete(prompt)}
        for name in names:
            model.set_adapter(name)
            samples[prompt][name] = complete(prompt)
    return samples


def print_samples(samples: dict[str, dict[str, str]]) -> None:
    for prompt, outputs in samples.items():
        print(f"\nprompt: {prompt!r}")
        for name, text in outputs.items():
            print(f"  {name:8s} -> {text!r}")


def write_readme(
    out: Path, tokenizer: PreTrainedTokenizerFast, samples: dict[str, dict[str, str]]
) -> None:
    shape = "\n".join(f"| `{k}` | {v} |" for k, v in MODEL_SHAPE.items())
    adapters = "\n".join(
        f"| `{name}` | {spec['about']} | {spec['lora']['r']} | {spec['lora']['lora_alpha']} | "
        f"{spec['lora'].get('use_rslora', False)} | {', '.join(spec['lora']['target_modules'])} |"
        for name, spec in ADAPTERS.items()
    )
    prompt, outputs = next(iter(samples.items()))
    sample_rows = "\n".join(f"| {name} | **{prompt}**{text} |" for name, text in outputs.items())
    n_params = sum(t.numel() for t in load_file(out / "base" / "model.safetensors").values())
    (out / "README.md").write_text(f"""# Demo assets

Small, self-made assets for examples and tests. Nothing here is downloaded: all of it is
generated and trained on CPU, deterministically, by

```
python examples/make_demo_assets.py --out examples/assets
```

(about 4 minutes, on one thread: fixed seeds, deterministic algorithms, and one thread for the
tokenizer trainer and the matmuls, so two rebuilds on one machine with the same torch,
transformers, tokenizers and peft give byte-identical files; another CPU or library version
may round differently). The training text is a template-generated set of simple
children's stories ("Once upon a time, there was a small bear named Sue. ...").

## `base/`

A tiny `LlamaForCausalLM` in float32 (`config.json`, `model.safetensors`,
{n_params:,} parameters) with its tokenizer (`tokenizer.json`,
`tokenizer_config.json`): a byte-level BPE of {len(tokenizer)} tokens with `<s>`={tokenizer.bos_token_id}
(put in front of every encoded text), `</s>`={tokenizer.eos_token_id} and `<pad>`={tokenizer.pad_token_id}.
The base was trained on the plain stories plus a {STYLED_SHARE:.0%} share per adapter style.

| config | value |
|---|---|
| `vocab_size` | {len(tokenizer)} |
{shape}

## `adapters/<name>/`

PEFT LoRA adapters (`adapter_config.json`, `adapter_model.safetensors`, float32,
`task_type=CAUSAL_LM`, no dropout, no bias), each trained from `base/` on the stories
rewritten in one style. `base_model_name_or_path` is left empty: the base is `../../base`.

| adapter | training text | r | lora_alpha | use_rslora | target_modules |
|---|---|---|---|---|---|
{adapters}

## Greedy samples ({NEW_TOKENS} new tokens after the prompt in bold)

| model | text |
|---|---|
{sample_rows}
""")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).parent / "assets",
        help="output directory (default: examples/assets next to this script)",
    )
    args = parser.parse_args()

    started = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    hf_logging.disable_progress_bar()

    base_dir = args.out / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    stories = make_corpus(SEED, NUM_STORIES)
    all_styles = [t for name in ADAPTERS for t in style_corpus(stories, name, SEED)]
    tokenizer = train_tokenizer(stories + all_styles)
    print(f"tokenizer: {len(tokenizer)} tokens")

    build_base(tokenizer, base_corpus(stories, SEED + 100), base_dir)
    for i, name in enumerate(ADAPTERS):
        build_adapter(
            name, base_dir, tokenizer, stories, args.out / "adapters" / name, seed=SEED + 1 + i
        )
    samples = generate_samples(args.out, list(ADAPTERS))
    print_samples(samples)
    write_readme(args.out, tokenizer, samples)
    print(f"\ndone in {time.perf_counter() - started:.0f}s -> {args.out}")


if __name__ == "__main__":
    main()
