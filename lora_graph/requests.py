"""What a request is (:class:`Request`, :class:`SamplingParams`), what comes back
(:class:`RequestOutput`), and a request's state while it is served (:class:`RequestState`)."""

from __future__ import annotations

import numbers
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch

from lora_graph.config import is_finite_number, is_int
from lora_graph.grammar import Grammar
from lora_graph.registry import AdapterRef


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens.

    Attributes:
        max_new_tokens: the most tokens to generate.
        temperature: 0 for greedy; otherwise logits are divided by it before sampling.
        top_k: keep the k most likely tokens (0, or vLLM's -1: all).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        seed: seeds the request's own generator (None, or vLLM's -1: drawn from
            ``torch``'s global RNG).
        stop_token_ids: tokens that end the request (kept in the output), besides EOS.
        ignore_eos: keep generating past EOS.
        logprobs: None, or return each generated token's log-probability and the ``k``
            most likely tokens' (``0 <= k <= 20``), as :class:`TokenLogprob`: the
            log-softmax of the logits the token was drawn from (after the request's
            adapter, before temperature, top-k/top-p and any logits processing; vLLM's
            default, ``raw_logprobs``).
        prompt_logprobs: None, or the same for every prompt token (the first has none): the
            log-softmax at the position before it. A step computing such a prompt runs as
            any other (captured or not); then the LM head runs again for those prompt
            positions alone, from the hidden states the step left.
        presence_penalty, frequency_penalty: OpenAI's, in [-2, 2]: each token's logit
            minus ``frequency_penalty`` times its count among the generated tokens, minus
            ``presence_penalty`` if it occurs there at all.
        repetition_penalty: the CTRL rule (Keskar et al. 2019) as transformers' and vLLM's,
            > 0: the logit of every token of the prompt or the output is divided by it if
            positive, multiplied by it if negative (1: off).
        logit_bias: ``(token id, bias)`` pairs added to those logits (OpenAI's, each bias
            in [-100, 100]).
        min_tokens: EOS and ``stop_token_ids`` cannot end the request before this many
            tokens (their logits are -inf until then; vLLM's).
        min_p: drop the tokens whose probability (after temperature) is below ``min_p``
            times the most likely token's (Nguyen et al. 2024; 0: off; no effect on greedy).
        grammar: a compiled :class:`~lora_graph.grammar.Grammar` the output must follow
            (its rows' logits masked on the device each step; None: free).

    Processing order (vLLM's): ``logit_bias`` and ``min_tokens``, then the repetition,
    frequency and presence penalties (these on the device, for the rows that ask only; a
    step holding such a row is read back before the next is scheduled, so each sees its
    whole history); then temperature, ``min_p``, top-k, top-p.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    min_p: float = 0.0
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        """vLLM's readings: a seed of -1 is no seed; numbers of other integer and real
        types (numpy's ``int64``, ``float32``) are taken as Python's ``int`` and ``float``
        (anything else is left for :meth:`validate` to refuse)."""
        for name in _NUMBERS:
            v = getattr(self, name)
            if isinstance(v, bool) or type(v) in (int, float):
                continue
            if isinstance(v, numbers.Integral):
                object.__setattr__(self, name, int(v))
            elif isinstance(v, numbers.Real):
                object.__setattr__(self, name, float(v))
        ids = self.stop_token_ids
        if isinstance(ids, (tuple, list)) and all(_integral(t) for t in ids):
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        bias = self.logit_bias
        if isinstance(bias, (tuple, list)) and all(
            isinstance(p, (tuple, list)) and len(p) == 2 and _integral(p[0]) and _real(p[1])
            for p in bias
        ):
            object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        flag: Any = self.ignore_eos  # (numpy's bool_ is no bool)
        if getattr(getattr(flag, "dtype", None), "kind", None) == "b" and flag.shape == ():
            object.__setattr__(self, "ignore_eos", bool(flag))
        if is_int(self.seed) and self.seed == -1:
            object.__setattr__(self, "seed", None)

    def stop_tokens(self, eos_token_ids: Collection[int]) -> frozenset[int]:
        """The tokens that end a request under these parameters, as the engine ends it
        (``LLMEngine._finish_reason``): ``stop_token_ids``, and EOS unless ``ignore_eos``.
        Such a last token adds no text to the output (vLLM's rule)."""
        return frozenset(self.stop_token_ids) | frozenset(() if self.ignore_eos else eos_token_ids)

    @property
    def processes_logits(self) -> bool:
        """Whether its logits change before its token is drawn (a penalty, a bias,
        ``min_tokens``); ``min_p`` acts in :func:`~lora_graph.sampling.sample`."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
            or self.grammar is not None
        )

    def validate(self) -> None:
        """Refuse any value that could make the sampling distribution invalid, so that
        :func:`sample` never fails for a request that was admitted.

        Raises:
            ValueError: naming the first bad field and its value.
        """
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(
                f"max_new_tokens must be a positive integer, got {self.max_new_tokens!r}"
            )
        if not is_finite_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"temperature {self.temperature!r} is below {MIN_TEMPERATURE}, where sampling is "
                "numerically unstable; use 0 for greedy"
            )
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (or -1: all), got {self.top_k!r}")
        if not is_finite_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(
                f"seed must be an integer in [0, 2**64), null or -1 (none), got {self.seed!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, (tuple, list)) or not all(
            map(is_int, self.stop_token_ids)
        ):
            raise ValueError(f"stop_token_ids must be integers, got {self.stop_token_ids!r}")
        self._validate_processing()

    def _validate_processing(self) -> None:
        """The logits-processing fields (penalties, bias, ``min_tokens``, ``min_p``) and
        the logprob counts."""
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_finite_number(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not is_finite_number(r) or r <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {r!r}")
        if not is_finite_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_new_tokens], got {self.min_tokens!r}"
            )
        if not isinstance(self.logit_bias, (tuple, list)):  # (OpenAI's dict: its items())
            raise ValueError(
                f"logit_bias must be (token id, bias) pairs, got {self.logit_bias!r}"[:200]
            )
        for pair in self.logit_bias:
            if (
                not isinstance(pair, (tuple, list))
                or len(pair) != 2
                or not is_int(pair[0])
                or not is_finite_number(pair[1])
            ):
                raise ValueError(f"logit_bias must map token ids to numbers, got {pair!r}")
            if not -100 <= pair[1] <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {pair[1]!r}")
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise ValueError(f"grammar must be a compiled Grammar, got {type(self.grammar)}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise ValueError(
                    f"{name} must be an integer in [0, {MAX_LOGPROBS}] or null, got {k!r}"
                )


_NUMBERS = ("max_new_tokens", "temperature", "top_k", "top_p", "seed", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "min_tokens", "min_p", "logprobs",
            "prompt_logprobs")  # fmt: skip


def _integral(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


# the most top log-probabilities a token may ask for (OpenAI's completions limit)
MAX_LOGPROBS = 20

# below it, logits / temperature overflows float32 for ordinary logits (vLLM clamps here)
MIN_TEMPERATURE = 1e-2


def check_text(text: str, what: str) -> None:
    """Refuse text no tokenizer can encode, naming ``what`` (a request's prompt, a
    message, an input to embed): a Python ``str`` may hold lone surrogates (a JSON
    ``"\\ud800"`` escape; a command line's undecodable bytes, kept by Python's
    ``surrogateescape``), which are not Unicode scalar values and have no UTF-8 form.

    Raises:
        ValueError: ``"{what} is not valid Unicode text ({reason} at {index})"``.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode text ({e.reason} at {e.start})") from None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability and the most likely tokens' at its position.

    Attributes:
        token: the token id.
        logprob: its natural-log probability (float32 log-softmax, as a Python float).
        rank: 1 for the most likely token; 1 + the number of tokens more likely.
        top: the ``k`` most likely ``(token id, logprob)``, most likely first (the token
            itself among them only if it is one of them).
    """

    token: int
    logprob: float
    rank: int = 1
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class Request:
    """One generation request: prompt token ids and the adapter it runs under (None: base).
    ``cache_salt`` (vLLM's field): its prefix cache pages are shared only with requests of
    the same salt (a tenant's secret keeps others from timing its prompts)."""

    id: str
    prompt_token_ids: list[int]
    adapter: str | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None


@dataclass
class RequestOutput:
    """A finished request: generated ``token_ids`` (prompt excluded), or ``error``.

    ``arrival_time`` (when :meth:`LLMEngine.add_request` took it) and ``token_times`` (when
    each token was sampled) are ``time.perf_counter()`` seconds.
    """

    id: str
    adapter: str | None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", or None with an error
    error: str | None = None
    arrival_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one a generated token, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one a prompt token, if asked
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admission)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token (None without one)."""
        if self.arrival_time is None or not self.token_times:
            return None
        return self.token_times[0] - self.arrival_time


@dataclass(eq=False)  # compared by identity: two requests may hold equal tokens
class RequestState:
    """A request as the engine serves it: its tokens so far, what it holds (its adapter
    version, its pages), how far its KV cache is computed, and what the device still owes
    it (asynchronous scheduling)."""

    request: Request
    generator: torch.Generator | None
    tokens: list[int]  # prompt and generated tokens
    generated: list[int] = field(default_factory=list)
    hold: AdapterRef | None = None  # the adapter version it is bound to (from arrival)
    arrival: float = 0.0
    token_times: list[float] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # its block table
    computed: int = 0  # tokens whose K and V are in its pages
    bypassed: int = 0  # later requests admitted while it waited for a slot
    pending: int = 0  # tokens sampled on the device that the host has not read yet
    done: bool = False  # finished (a step still in flight skips it)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # if its sampling asks
    matcher: Any = None  # its grammar's matcher (xgrammar), advanced by each token read
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # by position
    # prefix caching (lora_graph.prefix_cache): its identity's chain root (salted), its
    # owner (the unsalted root, by which an unload drops its pages), its full pages'
    # keys so far, how many of its pages are keyed, and the prompt tokens it reused when
    # first admitted (None before)
    root: bytes | None = None
    owner: bytes = b""  # its identity's unsalted root (set with root)
    page_keys: list[bytes] = field(default_factory=list)
    keyed: int = 0
    cached_tokens: int | None = None

    @property
    def known(self) -> int:
        """Its length counting the tokens still on the device."""
        return len(self.tokens) + self.pending

    def ends_with_pending(self, max_seq_len: int) -> bool:
        """Whether the tokens still on the device end it by length (it is not run again)."""
        return self.pending > 0 and (
            len(self.generated) + self.pending >= self.request.sampling.max_new_tokens
            or self.known >= max_seq_len
        )

    @property
    def adapter(self) -> str | None:
        """The routing key of its rows: the adapter version it holds."""
        return self.hold.key if self.hold is not None else self.request.adapter
