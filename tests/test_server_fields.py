"""What clients built for OpenAI and vLLM send (``lora_graph/server/fields.py``): the
field policy, the request bodies of SGLang's and vLLM's benchmark clients, list prompts,
chat-template controls, the defaults clients assume, and vLLM's extra routes. The server
runs in-process (Starlette's test client, which the ``openai`` SDK also drives); every
served token is checked against the offline engine's greedy output."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
from fastapi.testclient import TestClient  # noqa: E402

from lora_graph import server as S  # noqa: E402
from lora_graph.engine import Request, SamplingParams  # noqa: E402
from lora_graph.launch import build_engine  # noqa: E402
from lora_graph.server.fields import FIELDS, markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "examples" / "assets"
MODEL = "demo"
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if shout %}LOUD {% endif %}{% if add_generation_prompt %}assistant:{% endif %}"
)


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
DAYS = {"type": "integer", "minimum": 1, "maximum": 7}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": DAYS},
    "required": ["city", "days"]}}}  # fmt: skip
ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": ZONE}}


class Server:
    def __init__(self) -> None:
        self.engine, self.tokenizer = build_engine(
            str(ASSETS / "base"), [f"pirate={ASSETS / 'adapters' / 'pirate'}"], max_loras=2,
            max_lora_rank=64, dtype="float32", device="cpu", max_batch_size=8,
            max_seq_len=None, max_num_batched_tokens=64, progress=False,
        )  # fmt: skip
        self.config = S.ServerConfig(model_name=MODEL, chat_template=TEMPLATE)
        self._n = 0

    def greedy(self, ids: list[int], adapter: str | None, n: int, **kw) -> list[int]:
        """The offline engine's greedy tokens (before the server owns the engine)."""
        return self.offline(ids, adapter, n, **kw).token_ids

    def offline(self, ids: list[int], adapter: str | None, n: int, **kw):
        """The offline engine's output (its logprobs are checked against peft's in
        test_logprobs.py)."""
        self._n += 1
        req = Request(f"ref{self._n}", list(ids), adapter, SamplingParams(n, **kw))
        out = self.engine.generate([req])[0]
        assert out.error is None, out.error
        return out

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def chat_ids(self, messages: list[dict], template: str = TEMPLATE, **kw) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, **kw
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def srv():
    s = Server()
    prompts = ["Once upon a time", "The little dog"]
    s.ids = [s.tokenizer(p)["input_ids"] for p in prompts]
    s.prompts = prompts
    s.refs = {(i, a): s.greedy(s.ids[i], a, 6) for i in range(2) for a in (None, "pirate")}
    hello = [{"role": "user", "content": "Hello"}]
    s.chat_ref = s.greedy(s.chat_ids(hello, add_generation_prompt=True), "pirate", 6)
    s.loud_ref = s.greedy(s.chat_ids(hello, add_generation_prompt=True, shout=True), None, 6)
    partial = [*hello, {"role": "assistant", "content": "Ahoy"}]
    s.continue_ref = s.greedy(s.chat_ids(partial, continue_final_message=True), None, 6)
    s.context_ids = s.chat_ids(hello, add_generation_prompt=True)
    s.lp = {a: s.offline(s.ids[0], a, 6, logprobs=3, prompt_logprobs=3) for a in (None, "pirate")}
    s.chat_lp = s.offline(s.context_ids, "pirate", 6, logprobs=2)
    first = int(s.refs[(1, "pirate")][0])
    s.controls = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3,
                      logit_bias=((first, -100.0),), min_tokens=3)  # fmt: skip
    s.controlled = s.greedy(s.ids[1], "pirate", 6, **s.controls)
    with_tools = s.chat_ids(
        hello, TOOLS_TEMPLATE, tools=[WEATHER, TIME], add_generation_prompt=True
    )
    s.tools_ref = s.greedy(with_tools, "pirate", 8)
    app = S.create_app(s.engine, s.tokenizer, s.config)
    with TestClient(app) as http:
        s.http = http
        yield s


def post(srv, route: str, body: dict, status: int = 200) -> dict:
    r = srv.http.post(route, json=body)
    assert r.status_code == status, r.text
    return r.json()


def client(srv):
    return openai.OpenAI(base_url=str(srv.http.base_url) + "/v1", api_key="unused",
                         http_client=srv.http, max_retries=0)  # fmt: skip


# ---- the field policy ----------------------------------------------------------------
def test_benchmark_clients_bodies_are_served(srv):
    """SGLang's bench_serving sends ``best_of: 1`` with every completion; recent ``vllm
    bench serve`` sends ``repetition_penalty: 1.0`` and vLLM's other no-op defaults; both
    answered 400 before. Each body below is what that client sends."""
    sglang = {"model": MODEL, "prompt": srv.prompts[0], "temperature": 0.0, "best_of": 1,
              "max_tokens": 6, "stream": False, "ignore_eos": False}  # fmt: skip
    vllm = {"model": "pirate", "prompt": srv.prompts[0], "temperature": 0.0,
            "repetition_penalty": 1.0, "max_tokens": 6, "logprobs": None, "stream": True,
            "stream_options": {"include_usage": True}, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "ignore_eos": False}  # fmt: skip
    out = post(srv, "/v1/completions", sglang)
    assert out["choices"][0]["text"] == srv.text(srv.refs[(0, None)])
    r = srv.http.post("/v1/completions", json=vllm)
    assert r.status_code == 200, r.text
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert chunks[-1]["usage"]["completion_tokens"] == len(srv.refs[(0, "pirate")])
    assert text == srv.text(srv.refs[(0, "pirate")])


def test_unknown_fields_are_ignored_once_logged_or_refused_when_strict(srv, caplog):
    body = {"model": MODEL, "prompt": srv.prompts[1], "max_tokens": 6, "temperature": 0,
            "frobnicate": {"x": 1}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="lora_graph.server"):
        for _ in range(2):
            out = post(srv, "/v1/completions", body)
            assert out["choices"][0]["text"] == srv.text(srv.refs[(1, None)])
    assert sum("frobnicate" in r.getMessage() for r in caplog.records) <= 1
    srv.config.strict_fields = True
    try:
        err = post(srv, "/v1/completions", body, 400)["error"]
        assert err["message"] == "unknown field 'frobnicate'" and err["param"] == "frobnicate"
    finally:
        srv.config.strict_fields = False


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"best_of": 17}, "best_of must be in [n, 16] (n is 1), got 17"),
        ({"best_of": 2, "stream": True}, "best_of cannot be streamed"),
        ({"suffix": "x"}, 'suffix "x" is not supported'),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern is not supported"),
        ({"guided_json": {"type": "bogus"}}, 'cannot be compiled: Unsupported type "bogus"'),
        ({"guided_regex": "(x", "guided_choice": ["a"]}, "give one of guided_regex and"),
        ({"logits_processors": ["x"]}, "logits_processors is not supported"),
        ({"use_beam_search": True}, "use_beam_search true is not supported"),
        ({"priority": 1}, "priority 1 is not supported"),
        ({"top_k": "4"}, "top_k: Input should be a valid integer"),  # types stay strict
        ({"repetition_penalty": True}, "repetition_penalty"),
    ],
)
def test_fields_at_other_than_their_no_op_value_are_refused_by_name(srv, extra, message):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, **extra}
    err = post(srv, "/v1/completions", body, 400)["error"]
    assert message in err["message"] and err["param"] in extra, err


def test_chat_only_fields_refused_by_name(srv):
    msgs = [{"role": "user", "content": "Hi"}]
    for extra, message in [
        ({"audio": {"voice": "x"}}, "audio is not supported: text only"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"chat_template": "{{ x }}"}, "--chat-template"),
        ({"store": True}, "store true is not supported"),
    ]:
        err = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": msgs, **extra}, 400)
        assert message in err["error"]["message"], (extra, err)
    # their no-op values are served
    body = {"model": "pirate", "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 6, "temperature": 0, "tools": [], "tool_choice": "none",
            "store": False, "metadata": {"a": "b"}, "user": "u1", "service_tier": "auto",
            "response_format": {"type": "text"}, "parallel_tool_calls": True}  # fmt: skip
    out = post(srv, "/v1/chat/completions", body)
    assert out["choices"][0]["message"]["content"] == srv.text(srv.chat_ref)


def test_every_declared_field_has_a_rule_and_the_readme_shows_the_table():
    bodies = (S.protocol.CompletionBody, S.protocol.ChatBody)
    declared = set().union(*(b.model_fields for b in bodies))
    assert declared == set(FIELDS)
    assert markdown_table() in (ROOT / "README.md").read_text(encoding="utf-8")


# ---- what clients assume -------------------------------------------------------------
def test_unknown_model_is_404_model_not_found(srv):
    with pytest.raises(openai.NotFoundError) as e:
        client(srv).completions.create(model="nope", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "'nope' does not exist" in str(e.value)
    r = srv.http.get("/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client(srv).models.retrieve("pirate").parent == MODEL
    assert srv.http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL


@pytest.mark.parametrize(
    "messages, message",
    [
        ([{"role": "user", "content": None}], "messages[0].content is missing or null"),
        ([{"role": "user"}], "messages[0].content is missing or null"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0] is a 'image_url' part; this model takes text parts only",
        ),
        ([{"role": "user", "content": 5}], "messages[0].content must be text, a list of"),
        ([{"role": "robot", "content": "x"}], "messages[0].role 'robot' is not one of"),
        ([], None),  # (an empty conversation is the template's to refuse or render)
    ],
)
def test_messages_refused_in_words(srv, messages, message):
    body = {"model": MODEL, "messages": messages, "max_tokens": 1}
    if message is None:
        srv.http.post("/v1/chat/completions", json=body)  # no crash either way
        return
    err = post(srv, "/v1/chat/completions", body, 400)["error"]
    assert message in err["message"], err
    assert "Input should be" not in err["message"]


def test_a_body_that_is_not_a_json_object_is_named(srv):
    r = srv.http.post("/v1/completions", content=b"model=demo&prompt=hi",
                      headers={"Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "the body must be a JSON object, sent with Content-Type: application/json"
    )
    r = srv.http.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400 and "must be a JSON object" in r.json()["error"]["message"]
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/tokenize"):  # (no body)
        r = srv.http.post(route, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            "the body is empty; send a JSON object"
        ), r.text


def test_a_list_of_prompts_gets_a_choice_set_each(srv):
    """OpenAI's ``prompt`` as a list: choices ``p * n + i`` in order, each equal to the
    prompt served alone; texts and token lists alike."""
    for prompt in (srv.prompts, srv.ids):
        body = {"model": "pirate", "prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2}
        out = post(srv, "/v1/completions", body)
        texts = [c["text"] for c in out["choices"]]
        want = [srv.text(srv.refs[(i, "pirate")]) for i in (0, 0, 1, 1)]
        assert texts == want and [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        assert out["usage"]["prompt_tokens"] == sum(map(len, srv.ids))
        assert out["usage"]["completion_tokens"] == 2 * sum(
            len(srv.refs[(i, "pirate")]) for i in (0, 1)
        )
    body = json.dumps({"model": MODEL, "prompt": ["ok", "a\ud800"]}).encode()
    r = srv.http.post("/v1/completions", content=body,
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and "prompt[1] is not valid Unicode text" in r.text


def test_chat_without_max_tokens_runs_to_the_context(srv):
    """OpenAI and vLLM: a chat without ``max_tokens`` may use the rest of the context
    (completions keep OpenAI's 16); the default ``max_seq_len`` is the model's context."""
    assert srv.engine.max_seq_len == 512  # the demo model's max_position_embeddings
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}],
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    out = post(srv, "/v1/chat/completions", body)
    assert out["usage"]["completion_tokens"] == 512 - len(srv.context_ids)
    assert out["choices"][0]["finish_reason"] == "length"
    out = post(srv, "/v1/completions", {"model": MODEL, "prompt": "hi", "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16


def test_chat_template_controls(srv):
    """vLLM's ``chat_template_kwargs``, ``add_generation_prompt`` and
    ``continue_final_message``, through the ``--chat-template`` template."""
    hello = [{"role": "user", "content": "Hello"}]
    body = {"model": MODEL, "messages": hello, "max_tokens": 6, "temperature": 0,
            "chat_template_kwargs": {"shout": True}}  # fmt: skip
    out = post(srv, "/v1/chat/completions", body)
    assert out["choices"][0]["message"]["content"] == srv.text(srv.loud_ref)
    partial = [*hello, {"role": "assistant", "content": "Ahoy"}]
    body = {"model": MODEL, "messages": partial, "max_tokens": 6, "temperature": 0,
            "continue_final_message": True, "add_generation_prompt": False}  # fmt: skip
    out = post(srv, "/v1/chat/completions", body)
    assert out["choices"][0]["message"]["content"] == srv.text(srv.continue_ref)
    body["add_generation_prompt"] = True
    err = post(srv, "/v1/chat/completions", body, 400)["error"]
    assert "cannot both be true" in err["message"]
    body = {"model": MODEL, "messages": hello, "chat_template_kwargs": {"tokenize": True}}
    assert "may not set 'tokenize'" in post(srv, "/v1/chat/completions", body, 400)["error"][
        "message"]  # fmt: skip


def test_tokenize_detokenize_version_and_open_metrics(srv):
    out = post(srv, "/v1/tokenize", {"model": MODEL, "prompt": srv.prompts[0]})
    assert out == {"count": len(srv.ids[0]), "max_model_len": 512, "tokens": srv.ids[0]}
    hello = [{"role": "user", "content": "Hello"}]
    out = post(srv, "/tokenize", {"messages": hello})
    assert out["tokens"] == srv.context_ids
    out = post(srv, "/v1/detokenize", {"tokens": srv.ids[1]})
    assert out["prompt"] == srv.tokenizer.decode(srv.ids[1])
    assert "tokens must be in [0, " in post(srv, "/detokenize", {"tokens": [-1]}, 400)[
        "error"]["message"]  # fmt: skip
    assert post(srv, "/v1/tokenize", {"model": "nope", "prompt": "x"}, 404)
    assert srv.http.get("/version").json()["version"]
    srv.config.api_key = "k"
    try:
        assert srv.http.get("/metrics").status_code == 200
        assert srv.http.get("/v1/models").status_code == 401
    finally:
        srv.config.api_key = None


# ---- logprobs and echo ---------------------------------------------------------------
def test_completion_logprobs_whole_and_streamed(srv):
    """OpenAI's completions ``logprobs`` object: each token's logprob, the top ``k`` and
    the chosen token, text offsets; streamed chunks carry their tokens' entries."""
    want = srv.lp["pirate"]
    body = {"model": "pirate", "prompt": srv.prompts[0], "max_tokens": 6, "temperature": 0,
            "logprobs": 3}  # fmt: skip
    choice = post(srv, "/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    assert lp["tokens"] == [srv.tokenizer.decode([t]) for t in want.token_ids]
    assert lp["token_logprobs"] == [e.logprob for e in want.logprobs]
    for top, e in zip(lp["top_logprobs"], want.logprobs, strict=True):
        assert len(top) == 3 and max(top.values()) == e.top[0][1]
        assert top[srv.tokenizer.decode([e.token])] == e.logprob  # the chosen token's too
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    stream = list(client(srv).completions.create(stream=True, **body))
    got = [x for c in stream if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]  # fmt: skip
    assert got == lp["token_logprobs"]
    # the offsets too, while text is held back for a possible stop string (a helper found
    # them restarting at the text sent so far); echo puts the prompt's tokens first
    stop = srv.text(want.token_ids[2:4])
    for extra in ({"stop": [stop + "\u0000"]}, {"echo": True}):
        whole = post(srv, "/v1/completions", {**body, **extra})["choices"][0]["logprobs"]
        stream = list(client(srv).completions.create(stream=True, **body, **extra))
        offsets = [x for c in stream if c.choices and c.choices[0].logprobs
                   for x in c.choices[0].logprobs.text_offset]  # fmt: skip
        assert offsets == whole["text_offset"] == sorted(offsets), extra


def test_echo_with_logprobs_as_lm_evaluation_harness_asks(srv):
    """lm-evaluation-harness's ``local-completions`` scores a continuation with ``echo``,
    ``logprobs: 1``, ``max_tokens: 1`` over a batch of token-id prompts: the prompt's
    tokens' logprobs come first (the first ``null``), then the generated token's."""
    body = {"model": MODEL, "prompt": [srv.ids[0], srv.ids[0]], "max_tokens": 1,
            "temperature": 0, "logprobs": 1, "echo": True, "seed": 1234}  # fmt: skip
    for adapter in (None, "pirate"):
        out = post(srv, "/v1/completions", {**body, "model": adapter or MODEL})
        want = srv.lp[adapter]
        for choice in out["choices"]:
            lp = choice["logprobs"]
            n = len(srv.ids[0])
            prompt = [None] + [e.logprob for e in want.prompt_logprobs[1:]]
            # (batched with the other choice: float32 sums in another order)
            assert lp["token_logprobs"] == pytest.approx([*prompt, want.logprobs[0].logprob],
                                                         abs=1e-5)  # fmt: skip
            assert lp["top_logprobs"][0] is None and len(lp["tokens"]) == n + 1
            assert choice["text"].startswith(srv.tokenizer.decode(srv.ids[0]))
            for p in range(1, n):  # top-1 and the prompt token's own entry
                e = want.prompt_logprobs[p]
                top = lp["top_logprobs"][p][srv.tokenizer.decode([e.top[0][0]])]
                assert top == pytest.approx(e.top[0][1], abs=1e-5)
    # vLLM's prompt scoring: max_tokens 0 with echo returns the prompt alone
    body = {"model": "pirate", "prompt": srv.ids[0], "max_tokens": 0, "logprobs": 1, "echo": True}
    out = post(srv, "/v1/completions", body)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(srv.ids[0]) and lp["token_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [e.logprob for e in srv.lp["pirate"].prompt_logprobs[1:]], abs=1e-5
    )
    assert out["choices"][0]["text"] == srv.tokenizer.decode(srv.ids[0])
    assert out["usage"]["completion_tokens"] == 0
    err = post(srv, "/v1/completions", {**body, "echo": False}, 400)["error"]
    assert "max_tokens must be at least 1" in err["message"]
    body = {"model": MODEL, "prompt": srv.prompts[1], "max_tokens": 6, "temperature": 0}
    text = post(srv, "/v1/completions", {**body, "echo": True})
    assert text["choices"][0]["text"] == srv.prompts[1] + srv.text(srv.refs[(1, None)])


def test_vllm_prompt_logprobs_and_chat_logprobs(srv):
    want = srv.lp[None]
    body = {"model": MODEL, "prompt": srv.prompts[0], "max_tokens": 6, "temperature": 0,
            "prompt_logprobs": 3}  # fmt: skip
    got = post(srv, "/v1/completions", body)["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(srv.ids[0])
    for p in range(1, len(got)):
        e = want.prompt_logprobs[p]
        decoded = srv.tokenizer.decode([e.token])
        assert got[p][str(e.token)] == {"logprob": e.logprob, "rank": e.rank,
                                        "decoded_token": decoded}  # fmt: skip
        assert len(got[p]) in (3, 4)
    r = client(srv).chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == [e.logprob for e in srv.chat_lp.logprobs]
    assert [[t.logprob for t in c.top_logprobs] for c in content] == [
        [v for _, v in e.top] for e in srv.chat_lp.logprobs
    ]
    stream = client(srv).chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": "Hello"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    got = [x.logprob for c in stream if c.choices and c.choices[0].logprobs
           for x in c.choices[0].logprobs.content]  # fmt: skip
    assert got == [e.logprob for e in srv.chat_lp.logprobs]
    err = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user",
               "content": "x"}], "top_logprobs": 2}, 400)["error"]  # fmt: skip
    assert err["message"] == "top_logprobs needs logprobs: true"
    err = post(srv, "/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400)
    assert err["error"]["message"] == "logprobs must be in [0, 20], got 21"


def test_penalties_and_logit_bias_through_the_sdk(srv):
    """The controls reach the engine as given (the engine's against transformers' own
    processors in test_penalties.py); ``logit_bias`` keys are JSON strings."""
    c = srv.controls
    bias = {str(t): b for t, b in c["logit_bias"]}
    r = client(srv).completions.create(
        model="pirate", prompt=srv.prompts[1], max_tokens=6, temperature=0,
        presence_penalty=c["presence_penalty"], frequency_penalty=c["frequency_penalty"],
        logit_bias=bias, extra_body={"repetition_penalty": c["repetition_penalty"],
                                     "min_tokens": c["min_tokens"]},
    )  # fmt: skip
    assert r.choices[0].text == srv.text(srv.controlled)
    assert srv.controlled[0] != srv.refs[(1, "pirate")][0]  # (the bias bit)
    for extra, message in [
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids, got 'x'"),
        ({"presence_penalty": 3}, "presence_penalty must be a number in [-2, 2], got 3"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens must be an integer in [0, max_tokens]"),
    ]:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **extra}
        err = post(srv, "/v1/completions", body, 400)["error"]
        assert message in err["message"] and err["param"] == next(iter(extra)), err


def test_best_of_returns_the_n_with_the_highest_cumulative_logprob(srv):
    """``best_of: 4, n: 2`` samples 4 candidates (candidate ``i`` with ``seed + i``, the
    same draws as ``n: 4``) and returns the 2 whose tokens' logprobs sum highest."""
    body = {"model": "pirate", "prompt": srv.prompts[0], "max_tokens": 8, "temperature": 1.0,
            "seed": 3, "logprobs": 0}  # fmt: skip
    all4 = post(srv, "/v1/completions", {**body, "n": 4})["choices"]
    sums = [sum(c["logprobs"]["token_logprobs"]) for c in all4]
    assert len(set(sums)) > 1  # (the candidates differ: the pick means something)
    order = sorted(range(4), key=lambda i: -sums[i])[:2]
    for logprobs in (0, None):
        out = post(srv, "/v1/completions", {**body, "n": 2, "best_of": 4, "logprobs": logprobs})
        assert [c["text"] for c in out["choices"]] == [all4[i]["text"] for i in order]
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert out["usage"]["completion_tokens"] == sum(len(c["logprobs"]["tokens"]) for c in all4)
        if logprobs is None:
            assert all(c["logprobs"] is None for c in out["choices"])
    err = post(srv, "/v1/completions", {**body, "n": 3, "best_of": 2}, 400)["error"]
    assert err["message"] == "best_of must be in [n, 16] (n is 3), got 2"


def test_constraints_that_allow_no_token_fail_alone_and_the_engine_serves_on(srv):
    """A complete grammar while min_tokens holds EOS back: the grammar's end wins (it
    killed the engine thread before); min_tokens with every token a stop token likewise;
    the server serves on."""
    pytest.importorskip("xgrammar")
    for extra in ({"guided_choice": ["a"], "min_tokens": 5},
                  {"guided_choice": ["a"], "min_tokens": 5, "temperature": 0},
                  {"min_tokens": 3, "stop_token_ids": list(range(1024))}):  # fmt: skip
        out = post(srv, "/v1/completions", {"model": MODEL, "prompt": "Once", "max_tokens": 30,
                                             **extra})  # fmt: skip
        assert out["choices"][0]["finish_reason"] == "stop", (extra, out)
        if "guided_choice" in extra:
            assert out["choices"][0]["text"] == "a"
    assert srv.http.get("/health").status_code == 200
    out = post(srv, "/v1/completions", {"model": MODEL, "prompt": srv.prompts[1],
                                         "max_tokens": 6, "temperature": 0})  # fmt: skip
    assert out["choices"][0]["text"] == srv.text(srv.refs[(1, None)])


# ---- structured output ----------------------------------------------------------------
def test_structured_output_through_the_sdk(srv):
    """``response_format`` ``json_schema`` (the ``openai`` SDK's), vLLM's
    ``guided_choice`` and ``guided_regex``: each output follows its grammar (the engine's
    200-request check is in test_structured.py)."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    n = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": n},
              "required": ["ok", "n"]}  # fmt: skip
    r = client(srv).chat.completions.create(
        model="pirate", messages=[{"role": "user", "content": "Hello"}], max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client(srv).completions.create(
        model=MODEL, prompt=srv.prompts[0], max_tokens=20, n=3, seed=1,
        extra_body={"guided_choice": ["red", "green", "blue"]},
    )  # fmt: skip
    assert all(c.text in ("red", "green", "blue") for c in r.choices)
    out = post(srv, "/v1/completions", {"model": "pirate", "prompt": srv.prompts[1],
               "max_tokens": 20, "guided_regex": r"\d{3}-\d{2}"})  # fmt: skip
    assert re.fullmatch(r"\d{3}-\d{2}", out["choices"][0]["text"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    for fmt, message in [({"type": "xml"}, "response_format type must be text, json_object"),
                         ({"type": "json_schema"}, "needs json_schema.schema")]:  # fmt: skip
        err = post(srv, "/v1/chat/completions", {**body, "response_format": fmt}, 400)
        assert message in err["error"]["message"]


# ---- tools ------------------------------------------------------------------------------
def test_hermes_tool_calls_are_parsed():
    from lora_graph.server.tools import parse_tool_calls

    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}'
            "</tool_call><tool_call>not json</tool_call>")  # fmt: skip
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.<tool_call>not json</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"zone": "UTC"})]  # fmt: skip
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here") == ("no calls here", [])


def test_tool_choice_named_required_auto_and_streamed(srv):
    """A named function and ``required`` go through structured output: one call whose
    arguments follow its schema; ``auto`` lets the model write (this tiny model writes no
    call: the content is its greedy text over the template with the tools); streamed, the
    call comes as a ``tool_calls`` delta at the end."""
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("xgrammar")
    hello = [{"role": "user", "content": "Hello"}]
    srv.config.chat_template = TOOLS_TEMPLATE
    try:
        sdk = client(srv)
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            r = sdk.chat.completions.create(model="pirate", messages=hello, max_tokens=90,
                                            tools=[WEATHER, TIME], tool_choice=choice)  # fmt: skip
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and c.message.content is None
            (call,) = c.message.tool_calls
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments),
                                tool["function"]["parameters"])  # fmt: skip
            if choice != "required":
                assert call.function.name == "get_weather"
        # the call still read with the ending EOS's text kept after its JSON (a helper found
        # it dropped: the text did not parse as JSON with "</s>" after it)
        r = sdk.chat.completions.create(
            model="pirate", messages=hello, max_tokens=90, tools=[WEATHER], tool_choice="required",
            extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True},
        )  # fmt: skip
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
        r = sdk.chat.completions.create(model="pirate", messages=hello, max_tokens=8,
                                        temperature=0, tools=[WEATHER, TIME])  # fmt: skip
        assert r.choices[0].message.content == srv.text(srv.tools_ref)
        assert not r.choices[0].message.tool_calls
        chunks = list(sdk.chat.completions.create(
            model="pirate", messages=hello, max_tokens=90, tools=[WEATHER], stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}))  # fmt: skip
        assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        last = [c for c in chunks if c.choices][-1].choices[0]
        assert last.finish_reason == "tool_calls"
        assert last.delta.tool_calls[0].function.name == "get_weather"
        json.loads(last.delta.tool_calls[0].function.arguments)
        # a function of no parameters (left out, or {}: OpenAI's rule) is called with {}
        for ping in ({"name": "ping"}, {"name": "ping", "parameters": {}}):
            r = sdk.chat.completions.create(model="pirate", messages=hello, max_tokens=40,
                                            tools=[{"type": "function", "function": ping}],
                                            tool_choice="required")  # fmt: skip
            assert r.choices[0].message.tool_calls[0].function.arguments == "{}"
        for body, message in [
            (
                {
                    "tools": [WEATHER],
                    "tool_choice": {"type": "function", "function": {"name": "nope"}},
                },
                "tool_choice names no given tool",
            ),  # fmt: skip
            ({"tool_choice": "required"}, "tool_choice needs tools"),
            ({"tools": [{"type": "function", "function": {}}]}, "function.name is missing"),
        ]:
            err = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": hello, **body},
                       400)  # fmt: skip
            assert message in err["error"]["message"], err
    finally:
        srv.config.chat_template = TEMPLATE
    err = post(srv, "/v1/chat/completions", {"model": MODEL, "messages": hello,
               "tools": [WEATHER]}, 400)  # fmt: skip
    assert "the model's chat template takes no tools" in err["error"]["message"]


def test_stop_tokens_add_no_text_and_stop_strings_wait_for_min_tokens(srv):
    """vLLM's rules, which a helper found broken: a ``stop_token_ids`` token ends the choice
    and stays in its tokens, but its text is not returned (it was), whole or streamed; stop
    strings are not looked for before ``min_tokens`` tokens (one stopped the choice at its
    first token)."""
    ref = srv.refs[(0, None)]
    stop = next(i for i in range(1, 6) if ref[i] not in ref[:i])
    body = {"model": MODEL, "prompt": srv.prompts[0], "max_tokens": 6, "temperature": 0}
    out = post(srv, "/v1/completions", {**body, "stop_token_ids": [ref[stop]]})
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["choices"][0]["text"] == srv.text(ref[:stop]) != srv.text(ref[: stop + 1])
    assert out["usage"]["completion_tokens"] == stop + 1
    r = srv.http.post(
        "/v1/completions", json={**body, "stop_token_ids": [ref[stop]], "stream": True}
    )
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    assert "".join(c["text"] for ch in chunks for c in ch["choices"]) == srv.text(ref[:stop])
    first = srv.text(ref[:1])
    out = post(srv, "/v1/completions", {**body, "stop": [first]})
    assert out["choices"][0]["text"] == "" and out["usage"]["completion_tokens"] == 1
    out = post(srv, "/v1/completions", {**body, "stop": [first], "min_tokens": 3})
    assert out["usage"]["completion_tokens"] >= 3
    assert out["choices"][0]["text"].startswith(first + srv.text(ref[1:3]))
    # vLLM's count: stop strings once more than min_tokens tokens are out (one in the first
    # token stopped the choice at min_tokens 1: a helper found it one token early)
    for stops in ([first], [first, "z" * 30]):  # (a longer stop widened every stop's window)
        out = post(srv, "/v1/completions", {**body, "stop": stops, "min_tokens": 1})
        assert out["usage"]["completion_tokens"] >= 2, stops
        assert out["choices"][0]["text"].startswith(first), stops


def _streamed(srv, body: dict) -> str:
    r = srv.http.post("/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    chunks = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    return "".join(c["text"] for ch in chunks for c in ch["choices"])


def test_include_stop_str_in_output_and_skip_special_tokens_false(srv):
    """vLLM's two text fields, a 400 before for anything but their defaults: with
    ``include_stop_str_in_output`` the stop string (or stop token's text) that ended the
    choice stays in it, whole and streamed; with ``skip_special_tokens: false`` special
    tokens keep their text (an ending EOS's is still cut, unless kept as above)."""
    ref = srv.refs[(0, None)]
    body = {"model": MODEL, "prompt": srv.prompts[0], "max_tokens": 6, "temperature": 0}
    text = srv.text(ref)
    # two characters across a token boundary (the first sent before the second is known)
    ends = [len(srv.text(ref[:k])) for k in range(1, len(ref))]
    at = next(
        b - 1
        for b in ends
        if 0 < b < len(text) - 1
        and text.find(text[b - 1 : b + 1]) == b - 1
        and text.find(text[b]) == b  # (its second character alone: first there too)
    )
    stop = text[at : at + 2]
    for include, want in ((False, text[:at]), (True, text[: at + len(stop)])):
        both = {**body, "stop": ["\u0000never", stop], "include_stop_str_in_output": include}
        out = post(srv, "/v1/completions", both)["choices"][0]
        assert (out["text"], out["finish_reason"]) == (want, "stop"), (include, out)
        assert _streamed(srv, both) == want
    # two stop strings found in one token: the first listed wins, as in vLLM (the earliest
    # in the text did), whether or not it starts first
    for stops, want in (([stop[1], stop], text[: at + 1]), ([stop, stop[1]], text[:at])):
        out = post(srv, "/v1/completions", {**body, "stop": stops})["choices"][0]
        assert out["text"] == want == _streamed(srv, {**body, "stop": stops}), stops
    # a stop token's text is kept with it
    stop_at = next(i for i in range(1, 6) if ref[i] not in ref[:i])
    keep = {**body, "stop_token_ids": [ref[stop_at]], "include_stop_str_in_output": True}
    assert post(srv, "/v1/completions", keep)["choices"][0]["text"] == srv.text(ref[: stop_at + 1])
    assert _streamed(srv, keep) == srv.text(ref[: stop_at + 1])
    # special tokens: every token EOS (biased), generated past it or ending the choice
    eos = srv.tokenizer.eos_token_id
    forced = {**body, "max_tokens": 3, "logit_bias": {str(eos): 100}}
    eos_text = srv.tokenizer.decode([eos], skip_special_tokens=False)
    assert eos_text == "</s>"
    cases = [
        ({"ignore_eos": True}, ""),
        ({"ignore_eos": True, "skip_special_tokens": False}, eos_text * 3),
        ({"skip_special_tokens": False}, ""),
        ({"skip_special_tokens": False, "include_stop_str_in_output": True}, eos_text),
    ]
    for extra, want in cases:
        out = post(srv, "/v1/completions", {**forced, **extra})
        assert out["choices"][0]["text"] == want, (extra, out)
        assert _streamed(srv, {**forced, **extra}) == want, extra


@pytest.mark.parametrize("chars_a_token, read", [(100, [512, 700]), (10, [512])])
def test_a_text_prompt_of_long_tokens_is_read_whole(chars_a_token, read):
    """A text prompt is read 64 characters a position past ``max_seq_len`` first (a huge
    one need not be tokenized whole to be refused); the rest was dropped silently, but
    tokens can be longer (SmolLM2's runs of spaces and symbols: a helper's 443-token prompt
    was served as its first 405). Now a first part that fits means all of it is read."""
    import asyncio
    from types import SimpleNamespace

    from lora_graph.server.handlers import OpenAIServing

    lengths = []

    def tokenizer(text, add_special_tokens):
        lengths.append(len(text))
        return {"input_ids": list(range(len(text) // chars_a_token))}

    serving = SimpleNamespace(tokenizer=tokenizer, engine=SimpleNamespace(max_seq_len=8))
    ids = asyncio.run(OpenAIServing._tokenize(serving, "x" * 700, "prompt", True))  # type: ignore[arg-type]
    assert lengths == read and len(ids) == read[-1] // chars_a_token


def test_values_vllm_takes_are_taken_as_vllm_takes_them(srv):
    """A temperature in (0, 0.01) (AutoGen sends 1e-5) is raised to 0.01, a seed of -1 is
    no seed (vLLM's ``SamplingParams``: clients send it for "random"; it was a fixed seed
    here, the same text every call), another negative seed wraps mod 2**64, and ``4.0`` is
    taken for an integer, as vLLM takes them; each was refused (400) at first."""
    body = {"model": "pirate", "prompt": srv.prompts[0], "max_tokens": 6}

    def text(**kw):
        return post(srv, "/v1/completions", {**body, **kw})["choices"][0]["text"]

    assert text(temperature=1e-5, seed=3) == text(temperature=0.01, seed=3)
    assert text(temperature=1.0, seed=-2) == text(temperature=1.0, seed=2**64 - 2)
    assert text(temperature=1.0, seed=-2) != text(temperature=1.0, seed=1)
    assert len({text(temperature=1.0, seed=-1) for _ in range(3)}) > 1
    err = post(srv, "/v1/completions", {**body, "seed": -(2**63) - 1}, 400)["error"]
    assert "seed must be an integer in [-2**63, 2**64)" in err["message"]
    # an integral float for an integer (vLLM's lax models take it): 4.0 is 4; 4.5 is not
    out = post(srv, "/v1/completions", {**body, "max_tokens": 4.0, "n": 2.0, "ignore_eos": True})
    assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 8
    err = post(srv, "/v1/completions", {**body, "max_tokens": 4.5}, 400)["error"]
    assert err["param"] == "max_tokens", err
    # and inside lists of token ids (they were refused: "Input should be a valid integer")
    ids = srv.ids[0]
    as_ints = post(srv, "/v1/completions", {**body, "prompt": ids, "temperature": 0})
    as_floats = {**body, "prompt": [float(t) for t in ids], "temperature": 0,
                 "stop_token_ids": [float(srv.tokenizer.eos_token_id)]}  # fmt: skip
    want = as_ints["choices"][0]["text"]
    assert post(srv, "/v1/completions", as_floats)["choices"][0]["text"] == want
    two = post(srv, "/v1/completions", {**as_floats, "prompt": [as_floats["prompt"]] * 2})
    assert [c["text"] for c in two["choices"]] == [want] * 2
    out = post(srv, "/v1/detokenize", {"tokens": [float(t) for t in ids]})
    assert out == post(srv, "/v1/detokenize", {"tokens": ids})
    err = post(srv, "/v1/completions", {**body, "prompt": [5.5]}, 400)["error"]
    assert err["param"] == "prompt", err
    # a limit given as chat's max_completion_tokens is named so (it was called max_tokens)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    err = post(srv, "/v1/chat/completions", {**chat, "max_completion_tokens": 0}, 400)["error"]
    assert err["param"] == "max_completion_tokens" and "max_tokens" not in err["message"], err
    # the engine's refusals name their field (it was null)
    err = post(srv, "/v1/completions", {**body, "stop_token_ids": [99999]}, 400)["error"]
    assert err["param"] == "stop_token_ids" and "must be in [0, " in err["message"], err
