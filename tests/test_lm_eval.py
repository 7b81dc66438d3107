"""lm-evaluation-harness, unmodified, against ``lora-graph serve``: its ``local-completions``
model (``echo`` + ``logprobs`` on ``/v1/completions``, a batch of token-id prompts a
request) scores a small multiple-choice task defined in the repository
(``tests/data/tiny_mc.jsonl``), under an adapter and the base model; every choice's
log-likelihood equals lm-evaluation-harness's own ``hf`` model with ``peft=`` on the same
model and adapter (within 1e-4), and so does the accuracy.

lm-eval is installed with ``--no-deps`` (the README's test command): its client needs only
``requests`` and ``aiohttp`` (the test extra), not its task datasets' stack."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("aiohttp")
uvicorn = pytest.importorskip("uvicorn")

from lm_eval.api.instance import Instance  # noqa: E402

from lora_graph import server as S  # noqa: E402
from lora_graph.launch import build_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "examples" / "assets"
TASK = ROOT / "tests" / "data" / "tiny_mc.jsonl"


def instances() -> tuple[list[Instance], list[dict]]:
    """The task as lm-eval's multiple-choice requests: one loglikelihood request a choice
    (what its ``output_type: multiple_choice`` tasks build)."""
    docs = [json.loads(line) for line in TASK.read_text(encoding="utf-8").splitlines()]
    out = []
    for d, doc in enumerate(docs):
        for i, choice in enumerate(doc["choices"]):
            out.append(Instance("loglikelihood", doc, (doc["context"], choice), i, doc_id=d))
    return out, docs


def accuracy(lls: list[float], docs: list[dict]) -> float:
    """lm-eval's ``acc``: the choice of the highest log-likelihood is the gold one."""
    right, k = 0, 0
    for doc in docs:
        scores = lls[k : k + len(doc["choices"])]
        k += len(doc["choices"])
        right += max(range(len(scores)), key=scores.__getitem__) == doc["gold"]
    return right / len(docs)


@pytest.fixture(scope="module")
def server():
    engine, tokenizer = build_engine(
        str(ASSETS / "base"), [f"pirate={ASSETS / 'adapters' / 'pirate'}"], max_loras=2,
        max_lora_rank=64, dtype="float32", device="cpu", max_batch_size=8, max_seq_len=128,
        max_num_batched_tokens=64, progress=False,
    )  # fmt: skip
    app = S.create_app(engine, tokenizer, S.ServerConfig(model_name="demo"))
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1/completions"
    srv.should_exit = True
    thread.join(30)


def scores(server: str, adapter: str | None) -> tuple[list, list]:
    """``(local-completions', hf's)`` ``(log-likelihood, is greedy)`` of every choice."""
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    reqs, docs = instances()
    ours = LocalCompletionsAPI(
        base_url=server, model=adapter or "demo", tokenizer=str(ASSETS / "base"),
        tokenizer_backend="huggingface", tokenized_requests=True, num_concurrent=1,
        max_retries=1, batch_size=4, max_length=128, add_bos_token=True,
    ).loglikelihood(reqs)  # fmt: skip
    peft = {"peft": str(ASSETS / "adapters" / adapter)} if adapter else {}
    ref = HFLM(
        pretrained=str(ASSETS / "base"), device="cpu", dtype="float32", batch_size=4,
        add_bos_token=True, **peft,
    ).loglikelihood(reqs)  # fmt: skip
    return ours, ref


@pytest.mark.parametrize("adapter", ["pirate", None])
def test_local_completions_equals_hf_with_peft(server, adapter):
    reqs, docs = instances()
    ours, ref = scores(server, adapter)
    assert len(ours) == len(ref) == len(reqs)
    for (ll, greedy), (want, want_greedy), r in zip(ours, ref, reqs, strict=True):
        assert abs(ll - want) <= 1e-4, (r.arguments, ll, want)
        assert greedy == want_greedy, r.arguments
    lls, want = [ll for ll, _ in ours], [ll for ll, _ in ref]
    assert accuracy(lls, docs) == accuracy(want, docs)


def test_the_adapter_moves_the_scores(server):
    """(The comparison above tells adapters apart: the adapter's scores are not the base
    model's.)"""
    a, b = scores(server, "pirate")[0], scores(server, None)[0]
    assert max(abs(x - y) for (x, _), (y, _) in zip(a, b, strict=True)) > 0.1
