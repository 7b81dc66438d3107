"""Structured output: a request's output held to a grammar (a JSON schema, any JSON value,
a regular expression, a choice of strings, an EBNF grammar) by masking, at each step, the
logits of the tokens that cannot continue it.

Built on xgrammar (the library vLLM, SGLang and TensorRT-LLM use; measured against
llguidance in ``bench/RESULTS.md``: faster token masks, 2-13 us a token on SmolLM2's
vocabulary against 30-140 us). :class:`GrammarCompiler` compiles for one tokenizer
(thread-safe: the server compiles off its event loop, so a long schema never stalls the
engine); a :class:`Grammar` is a compiled grammar a request carries in
:attr:`SamplingParams.grammar <lora_graph.requests.SamplingParams>`; the engine makes one
matcher a request (:meth:`Grammar.matcher`), fills its rows' token bitmasks on the host,
masks those rows' logits on the device (:func:`apply_bitmask`; other rows untouched) and
advances each matcher by the token drawn.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class GrammarError(ValueError):
    """A schema, regex or grammar the library refuses; the message names the cause."""


@dataclass(frozen=True, eq=False)
class Grammar:
    """A compiled grammar (an xgrammar ``CompiledGrammar``) and what it was compiled from
    (``kind``: ``json``, ``json_schema``, ``regex``, ``choice``, ``ebnf``)."""

    compiled: Any
    kind: str
    source: str

    def matcher(self) -> Any:
        """A fresh matcher (xgrammar ``GrammarMatcher``): ``fill_next_token_bitmask``,
        ``accept_token``, ``is_terminated``."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compiled)


class GrammarCompiler:
    """Compiles grammars for one tokenizer and vocabulary.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's).
        stop_token_ids: the tokens that end a request (the engine's EOS ids): a grammar
            that is complete allows only these.

    Raises:
        ImportError: without xgrammar (``pip install xgrammar``).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=True)
        self.vocab_size = vocab_size

    def _compile(self, kind: str, source: str, fn: Any, *args: Any, **kwargs: Any) -> Grammar:
        try:
            return Grammar(fn(*args, **kwargs), kind, source)
        except (RuntimeError, ValueError, TypeError) as e:  # the library's own message
            why = re.sub(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?", "", str(e))
            why = why.strip().split("\n")[0]
            raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {why}") from e

    def json_schema(self, schema: dict[str, Any] | str) -> Grammar:
        """Output is JSON valid under ``schema`` (a dict or its JSON text)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return self._compile(
            "json_schema", text, self._compiler.compile_json_schema, text, any_whitespace=False
        )

    def json(self) -> Grammar:
        """Output is any JSON object (OpenAI's ``json_object`` mode)."""
        schema = '{"type": "object"}'
        return self._compile(
            "json", schema, self._compiler.compile_json_schema, schema, any_whitespace=False
        )

    def regex(self, pattern: str) -> Grammar:
        """Output matches ``pattern`` as a whole."""
        return self._compile("regex", pattern, self._compiler.compile_regex, pattern)

    def choice(self, choices: list[str]) -> Grammar:
        """Output is exactly one of ``choices``."""
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise GrammarError("the choices must be a non-empty list of non-empty strings")
        # (ensure_ascii off: JSON escapes a character past U+FFFF as two surrogates, which
        # xgrammar reads as two invalid characters, forcing six bytes of no text)
        ebnf = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return self._compile("choice", ebnf, self._compiler.compile_grammar, ebnf)

    def ebnf(self, grammar: str) -> Grammar:
        """Output is a sentence of the EBNF ``grammar`` (xgrammar's GBNF dialect, rule
        ``root``)."""
        return self._compile("ebnf", grammar, self._compiler.compile_grammar, grammar)


def allocate_bitmask(rows: int, vocab_size: int) -> Tensor:
    """A host int32 ``[rows, ceil(vocab / 32)]`` token bitmask (bit ``t % 32`` of word
    ``t // 32``: token ``t`` allowed)."""
    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: Tensor, bitmask: Tensor) -> Tensor:
    """``logits`` ``[R, vocab]`` with the tokens whose bit is 0 in ``bitmask``
    ``[R, ceil(vocab / 32)]`` (int32, on ``logits``' device) set to -inf."""
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask
    allowed = ((words[:, :, None] >> bits) & 1).bool().flatten(1)[:, : logits.shape[1]]
    return logits.masked_fill(~allowed, float("-inf"))
