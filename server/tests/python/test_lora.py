"""LoRA adapters through the official openai client: served by name, listed with their parent,
loaded and unloaded on the running server (vLLM's endpoints), mixed in one batch, reported in
vllm:lora_requests_info. The adapters are made by scripts/lora-adapter.py for the test model."""

import concurrent.futures
import os
import subprocess
import sys

import httpx
import openai
import pytest

from conftest import API_KEY, MODEL, Server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
QUESTION = "Name three rivers in Africa."
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def make_adapter(out, seed):
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts/lora-adapter.py"), str(out),
         "--model", os.environ["FERRITE_MODEL"], "--seed", str(seed)],
        check=True, stdout=subprocess.DEVNULL,
    )
    return out


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    base = tmp_path_factory.mktemp("lora")
    return {seed: make_adapter(base / f"seed{seed}", seed) for seed in (1, 2, 3)}


@pytest.fixture(scope="module")
def lora_server(adapters):
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        s = Server([
            "--lora-modules", f"sql={adapters[1] / 'peft'}", f"chat={adapters[2] / 'peft'}",
            "--max-loras", "1", "--max-cpu-loras", "3", "--max-num-seqs", "8",
        ])
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lc(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.base}/v1", api_key=API_KEY, max_retries=0)


def answer(client, model, question=QUESTION):
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}],
        max_tokens=24, temperature=0,
    )
    assert r.model == model
    return r.choices[0].message.content


def test_models_lists_the_adapters_under_the_base(lc):
    cards = {m.id: m for m in lc.models.list().data}
    assert set(cards) == {MODEL, "sql", "chat"}
    assert cards[MODEL].parent is None
    assert cards["sql"].parent == MODEL and cards["chat"].parent == MODEL
    assert cards["sql"].root.endswith("peft")


def test_an_adapter_is_called_by_name_and_changes_the_answer(lc):
    base, sql = answer(lc, MODEL), answer(lc, "sql")
    assert sql != base
    # Greedy and batch invariant: the same request gives the same text again.
    assert answer(lc, "sql") == sql
    # Streaming carries the adapter's name and the same text.
    chunks = list(lc.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": QUESTION}],
        max_tokens=24, temperature=0, stream=True,
    ))
    assert {c.model for c in chunks} == {"sql"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == sql
    # Completions take adapter names too.
    c = lc.completions.create(model="chat", prompt="The capital of France is", max_tokens=8,
                              temperature=0)
    assert c.model == "chat"


def test_an_unknown_model_is_refused(lc):
    with pytest.raises(openai.BadRequestError) as e:
        answer(lc, "no-such-adapter")
    assert "does not exist" in str(e.value)


def test_adapters_load_and_unload_on_the_running_server(lora_server, lc, adapters):
    url = lora_server.base
    sql = answer(lc, "sql")
    # The GGUF form of sql's adapter, added at runtime, is the same adapter.
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "sql-gguf", "lora_path": str(adapters[1] / "adapter.gguf")})
    assert r.status_code == 200, r.text
    assert "added successfully" in r.text
    assert "sql-gguf" in {m.id for m in lc.models.list().data}
    assert answer(lc, "sql-gguf") == sql
    # Loading a name twice, a base-model name or a model that is no adapter is refused with
    # the reason; the key is required.
    again = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": "sql-gguf", "lora_path": str(adapters[3] / "peft")})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    clash = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH,
                       json={"lora_name": MODEL, "lora_path": str(adapters[3] / "peft")})
    assert clash.status_code == 400 and "base model" in clash.json()["error"]["message"]
    no_key = httpx.post(f"{url}/v1/load_lora_adapter",
                        json={"lora_name": "x", "lora_path": str(adapters[3] / "peft")})
    assert no_key.status_code == 401
    # Unloading frees the slot; the name is then unknown.
    r = httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "sql-gguf"})
    assert r.status_code == 200 and "removed successfully" in r.text
    with pytest.raises(openai.BadRequestError):
        answer(lc, "sql-gguf")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "sql-gguf"})
    assert gone.status_code == 404
    bad = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                     json={"lora_name": "third", "lora_path": os.environ["FERRITE_MODEL"]})
    assert bad.status_code == 400 and "not a LoRA adapter" in bad.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                   json={"lora_name": "third", "lora_path": str(adapters[3] / "peft")})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{url}/v1/unload_lora_adapter", headers=AUTH, json={"lora_name": "third"})
    assert r.status_code == 200


def test_adapters_past_max_cpu_loras_are_paged_in_on_use(adapters):
    """With --max-cpu-loras 1, three adapters are served: each request pages its adapter in
    (the least recently used one out) and gets the answer it gets when it stays in memory."""
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        s = Server([
            "--lora-modules", f"one={adapters[1] / 'peft'}", f"two={adapters[2] / 'adapter.gguf'}",
            "--max-loras", "1", "--max-cpu-loras", "1",
        ])
    finally:
        del os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]
    try:
        c = openai.OpenAI(base_url=f"{s.base}/v1", api_key=API_KEY, max_retries=0)
        r = httpx.post(f"{s.base}/v1/load_lora_adapter", headers=AUTH, timeout=60,
                       json={"lora_name": "three", "lora_path": str(adapters[3] / "peft")})
        assert r.status_code == 200, r.text
        assert {m.id for m in c.models.list().data} == {MODEL, "one", "two", "three"}
        first = {m: answer(c, m) for m in ("one", "two", "three")}
        assert len(set(first.values())) == 3, first
        again = {m: answer(c, m) for m in ("three", "one", "two", "one")}
        assert all(again[m] == first[m] for m in again), (first, again)
        log = s.log()
        assert log.count("LoRA adapter paged in") >= 4, log[-2000:]
    finally:
        s.stop()


def test_requests_of_several_adapters_share_batches_and_keep_their_answers(lc, lora_server):
    # With --max-loras 1 a request of the second adapter waits until the first adapter's are
    # done; the base model's run beside either.
    models = [MODEL, "sql", "chat", "sql", MODEL, "chat"]
    questions = ["Why is the sky blue?", QUESTION, "What is 17 times 23?",
                 "Why is the sky blue?", QUESTION, QUESTION]
    alone = [answer(lc, m, q) for m, q in zip(models, questions)]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        together = list(pool.map(lambda mq: answer(lc, *mq), zip(models, questions)))
    assert together == alone
    metrics = httpx.get(f"{lora_server.base}/metrics").text
    info = [l for l in metrics.splitlines() if l.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1, info
    assert 'max_lora="1"' in info[0]
    assert float(info[0].rsplit(" ", 1)[1]) > 1.7e9, "the value is the time of the last step"


def test_runtime_updates_are_off_by_default(server):
    r = httpx.post(f"{server.base}/v1/load_lora_adapter", headers=AUTH,
                   json={"lora_name": "x", "lora_path": "/nonexistent"})
    assert r.status_code == 404
