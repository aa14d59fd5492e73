"""/v1/embeddings through the `openai` client, against llama.cpp's embeddings of the same token
ids (runtime/tests/fixtures/llama_server_embeddings.json, scripts/record-llama-embeddings.py):
the last token's state by default and the mean with `--pooler-config`, both L2-normalised."""

import base64
import json
import os
import struct

import httpx
import openai
import pytest

from conftest import API_KEY, MODEL, Server

FIXTURE = os.path.join(
    os.path.dirname(__file__), "../../../runtime/tests/fixtures/llama_server_embeddings.json"
)
REF = json.load(open(FIXTURE))
IDS = [t["ids"] for t in REF["texts"]]
HIDDEN = 576


def cos(a, b):
    return sum(x * y for x, y in zip(a, b))


def check_against_llama(vectors, pooling):
    ref = REF["pooling"][pooling]
    assert len(vectors) == len(ref)
    for i, v in enumerate(vectors):
        assert len(v) == HIDDEN
        assert abs(cos(v, v) - 1) < 1e-4, "not unit length"
        sims = [cos(v, r) for r in ref]
        # Its own text's vector from llama.cpp, and clearly closer to it than to any other
        # (texts 0 and 1 say the same thing in other words: 0.93-0.98 apart).
        assert sims[i] > 0.998, (pooling, i, sims)
        assert all(sims[i] > s + 0.01 for j, s in enumerate(sims) if j != i), (pooling, i, sims)


def _error(r, status, param=None):
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == status
    if param:
        assert body["param"] == param, body
    return body


def post(server, body):
    return httpx.post(f"{server.base}/v1/embeddings", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.fixture(scope="module")
def last_client():
    # Without the session server's queue limit of 4: the reference has 5 inputs.
    s = Server(["--weights", "quantized"])
    yield openai.OpenAI(base_url=f"{s.base}/v1", api_key=API_KEY, max_retries=0)
    s.stop()


def test_last_token_embeddings_match_llama_cpp(last_client):
    client = last_client
    # The SDK asks for base64 unless told otherwise, and decodes it.
    r = client.embeddings.create(model=MODEL, input=IDS)
    assert [d.index for d in r.data] == list(range(len(IDS)))
    check_against_llama([d.embedding for d in r.data], "last")
    assert r.usage.prompt_tokens == sum(len(i) for i in IDS) == r.usage.total_tokens
    assert r.model == MODEL


def test_float_and_base64_carry_the_same_values(client, server):
    floats = client.embeddings.create(model=MODEL, input=IDS[0], encoding_format="float")
    raw = post(server, {"model": MODEL, "input": IDS[0], "encoding_format": "base64"}).json()
    packed = base64.b64decode(raw["data"][0]["embedding"])
    # JSON numbers are f32 values written shortest-first: as f32 again they are the same bits.
    as_f32 = struct.unpack(f"<{HIDDEN}f", struct.pack(f"<{HIDDEN}f", *floats.data[0].embedding))
    assert struct.unpack(f"<{HIDDEN}f", packed) == as_f32
    # Text input is tokenized as the completions endpoint does.
    text = client.embeddings.create(model=MODEL, input=REF["texts"][0]["text"])
    assert len(text.data[0].embedding) == HIDDEN


def test_an_input_gets_the_same_vector_alone_and_in_a_batch(client):
    alone = client.embeddings.create(model=MODEL, input=IDS[2], encoding_format="float")
    batch = client.embeddings.create(model=MODEL, input=IDS[:4], encoding_format="float")
    assert batch.data[2].embedding == alone.data[0].embedding


@pytest.mark.parametrize("body,param,words", [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [[1, 2], [10**9]]}, "input", "vocabulary"),
    ({"input": "word " * 600}, "input", "maximum context length is 512"),
    ({"input": "hi", "dimensions": 64}, "dimensions", "Matryoshka"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "base64"),
    ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "between"),
    ({"input": "hi", "model": "gpt-17"}, "model", "gpt-17"),
    # The session server queues at most 4 sequences: 5 inputs could never be admitted.
    ({"input": ["a", "b", "c", "d", "e"]}, "input", "queues at most 4"),
])
def test_bad_requests_are_400_with_the_parameter(server, body, param, words):
    e = _error(post(server, {"model": MODEL, **body}), 400, param)
    assert words in e["message"], e


def test_truncation_keeps_the_last_tokens(client, server):
    long_ids = (IDS[0] * 60)[:600]
    r = post(server, {"model": MODEL, "input": long_ids, "truncate_prompt_tokens": 500,
                      "encoding_format": "float"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 500
    tail = client.embeddings.create(model=MODEL, input=long_ids[-500:], encoding_format="float")
    assert r.json()["data"][0]["embedding"] == tail.data[0].embedding


def test_embeddings_need_the_api_key(server):
    r = httpx.post(f"{server.base}/v1/embeddings", json={"model": MODEL, "input": "hi"})
    _error(r, 401)


@pytest.fixture(scope="module")
def mean_server():
    s = Server(["--weights", "quantized", "--pooler-config", '{"pooling_type": "MEAN"}'])
    yield s
    s.stop()


def test_mean_embeddings_match_llama_cpp(mean_server):
    c = openai.OpenAI(base_url=f"{mean_server.base}/v1", api_key=API_KEY, max_retries=0)
    r = c.embeddings.create(model=MODEL, input=IDS)
    check_against_llama([d.embedding for d in r.data], "mean")
