"""The OpenAI-compatible API driven by the official `openai` Python client."""

import concurrent.futures

import httpx
import openai
import pytest

from conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.model == MODEL
    assert len(r.choices) == 1
    assert "Paris" in r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 5  # SmolLM2 adds no BOS: The| capital| of| France| is
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_completion(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.content.strip()
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 0 < r.usage.completion_tokens <= 20
    # The prompt is the model's own chat template (ChatML), as /tokenize renders it.
    assert r.usage.prompt_tokens > 10


def test_streaming_chat_with_usage_matches_non_streaming(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20,
                                          temperature=0)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == full.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    # The usage chunk comes last, with no choices.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_ends_with_done(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", f"{server.base}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        data = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert len(data) >= 2


def _count(server, text):
    return httpx.post(f"{server.base}/tokenize", json={"prompt": text},
                      headers=AUTH).json()["count"]


def test_n_choices_differ_and_each_replays_with_seed(client, server):
    kw = dict(model=MODEL, prompt="My favourite animal is", max_tokens=12,
              temperature=1.0, n=2, seed=1234, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.choices[0].text != a.choices[1].text
    # The prompt counts once, not once per choice.
    assert a.usage.prompt_tokens == _count(server, "My favourite animal is")
    assert a.usage.completion_tokens == 24
    assert all(c.finish_reason == "length" for c in a.choices)


def test_seed_reproducible_and_different_seeds_differ(client):
    def run(seed):
        return client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=24, temperature=1.2, top_p=0.95,
            seed=seed).choices[0].message.content
    assert run(7) == run(7)
    assert len({run(7), run(8), run(9)}) > 1


def test_stop_string_is_not_leaked(client):
    base = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=8, temperature=0).choices[0].text
    assert "Paris" in base
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0, stop=["aris"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:base.index("aris")]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
        stop=["aris"], stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_stop_token_ids_and_ignore_eos(client, server):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 30
    first = client.completions.create(model=MODEL, prompt="The capital of France is",
                                      max_tokens=1, temperature=0, logprobs=0)
    first_id_text = first.choices[0].logprobs.tokens[0]
    toks = httpx.post(f"{server.base}/tokenize", headers=AUTH,
                      json={"prompt": first_id_text, "add_special_tokens": False}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=10, temperature=0,
                                  extra_body={"stop_token_ids": toks[:1]})
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 1


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, p, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert p <= 0 and len(top) == 3
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(p)
    c = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_models_tokenize_detokenize(client, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    t = httpx.post(f"{server.base}/tokenize", json={"prompt": "Hello world"},
                   headers=AUTH).json()
    assert t["count"] == len(t["tokens"]) > 0 and t["max_model_len"] == 512
    d = httpx.post(f"{server.base}/detokenize", json={"tokens": t["tokens"]},
                   headers=AUTH).json()
    assert d["prompt"] == "Hello world"
    # The tokenizer endpoints spend CPU on the client's text: they need the key too.
    assert httpx.post(f"{server.base}/tokenize", json={"prompt": "Hi"}).status_code == 401


def test_continue_final_message_continues_the_assistants_turn(client, server):
    """vLLM's `continue_final_message`: the last (assistant) message is left open, and greedy
    generation from the first tokens of an answer gives the rest of that answer (what a router
    resuming a broken stream relies on)."""
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24,
                                          temperature=0, extra_body={"ignore_eos": True})
    chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices]
    head = "".join(chunks[:8])
    assert head and full.choices[0].message.content.startswith(head)
    partial = CHAT + [{"role": "assistant", "content": head}]
    rest = client.chat.completions.create(
        model=MODEL, messages=partial, max_tokens=24 - 7, temperature=0,
        extra_body={"ignore_eos": True, "continue_final_message": True,
                    "add_generation_prompt": False})
    assert head + rest.choices[0].message.content == full.choices[0].message.content
    # The open turn, as /tokenize renders it: no end-of-turn after the partial content.
    opened = httpx.post(f"{server.base}/tokenize", headers=AUTH, json={
        "messages": partial, "continue_final_message": True,
        "add_generation_prompt": False}).json()
    closed = httpx.post(f"{server.base}/tokenize", headers=AUTH, json={
        "messages": partial, "add_generation_prompt": False}).json()
    assert opened["count"] < closed["count"]
    text = httpx.post(f"{server.base}/detokenize", headers=AUTH,
                      json={"tokens": opened["tokens"]}).json()["prompt"]
    assert text.endswith(head), text
    # Both flags, or a last message that is not the assistant's: 400 naming the flag.
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=partial, max_tokens=2,
                                       extra_body={"continue_final_message": True})
    _error(e, 400, "continue_final_message")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=2,
            extra_body={"continue_final_message": True, "add_generation_prompt": False})
    _error(e, 400, "continue_final_message")


def _error(excinfo, status, param=None):
    e = excinfo.value
    assert e.status_code == status
    body = e.response.json()["error"]
    assert body["code"] == status and body["message"] and body["type"]
    if param is not None:
        assert body["param"] == param, body
    return body


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=3.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=10_000), "max_tokens"),
    (dict(presence_penalty=5), "presence_penalty"),
    (dict(extra_body={"top_k": -5}), "top_k"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
])
def test_invalid_parameters_are_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="Hi", **{"max_tokens": 4, **kwargs})
    body = _error(ei, 400, param)
    assert body["type"] == "invalid_request_error"


def test_unknown_model_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model="gpt-17", messages=CHAT, max_tokens=4)
    assert "gpt-17" in _error(ei, 400, "model")["message"]


def test_prompt_longer_than_max_model_len_is_400(client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="word " * 600, max_tokens=4)
    assert "maximum context length is 512" in _error(ei, 400, "prompt")["message"]


def test_bad_api_key_is_401(server):
    bad = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert _error(ei, 401)["type"] == "authentication_error"
    r = httpx.post(f"{server.base}/v1/completions", json={"prompt": "Hi"})
    assert r.status_code == 401
    # Probes stay open for kubelet.
    assert httpx.get(f"{server.base}/health").status_code == 200


@pytest.mark.parametrize("body", [
    b"{not json", b"", b"[]", b'{"prompt": 5}', b'{"prompt": "hi", "max_tokens": "x"}',
    b'{"prompt": "hi", "stream": "yes"}', "{\"prompt\": \"\u00e9\"".encode(),
])
def test_malformed_bodies_are_400_json_and_the_server_survives(server, body):
    h = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
    r = httpx.post(f"{server.base}/v1/completions", content=body, headers=h)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_queue_over_max_queue_len_is_503_with_retry_after(server, client):
    # 4 sequences run at once and 4 may wait: a burst of 24 long requests overflows the queue.
    def one(i):
        return httpx.post(f"{server.base}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True},
            headers={"Authorization": f"Bearer {API_KEY}"})
    with concurrent.futures.ThreadPoolExecutor(24) as ex:
        results = list(ex.map(one, range(24)))
    codes = [r.status_code for r in results]
    assert set(codes) <= {200, 503}, codes
    refused = [r for r in results if r.status_code == 503]
    assert refused and codes.count(200) >= 4, codes
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "server_overloaded"
    # Accepted requests all completed in full.
    assert all(r.json()["usage"]["completion_tokens"] == 48
               for r in results if r.status_code == 200)
