"""Structured outputs through the official openai client: response_format json_schema and
json_object, the SDK's pydantic parse, vLLM's guided_* extensions, streaming, n > 1, and the
400s for grammars that cannot be used."""

import concurrent.futures
import json
import time

import httpx
import jsonschema
import openai
import pydantic
import pytest

from conftest import API_KEY, MODEL, Server

ASK = [{"role": "user", "content": "Describe a person as JSON: name, age, city and a few tags."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Tokyo", "Lima", "Nairobi"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}


def schema_format(schema, name="person"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def fast_client():
    # The default (repacked) weights and 8 sequences at once: the 100 requests below take a
    # fifth of the time they take on the session's bitwise-invariant server.
    s = Server(["--max-num-seqs", "8"])
    yield openai.OpenAI(base_url=f"{s.base}/v1", api_key=API_KEY, max_retries=0)
    s.stop()


def test_json_schema_outputs_validate_100_of_100(fast_client):
    # Sampled at temperature 1, so each of the 100 takes its own path through the schema.
    def one(seed):
        r = fast_client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=200, temperature=1.0, seed=seed,
            response_format=schema_format(PERSON))
        return r.choices[0]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        choices = list(ex.map(one, range(100)))
    texts = set()
    for c in choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), PERSON)
        texts.add(c.message.content)
    assert len(texts) > 50, "sampled outputs should differ"


def test_the_sdks_pydantic_parse_gets_a_typed_object(client):
    # Bounded fields: unbounded strings let a 135M model ramble past max_tokens now and then.
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=24)
        country: str = pydantic.Field(max_length=24)
        population: int = pydantic.Field(ge=0, le=100_000_000)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=MODEL, max_tokens=200, temperature=0.7, seed=3,
              messages=[{"role": "user", "content": "Tell me about Paris as JSON."}],
              response_format=City)
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r
    assert r.choices[0].finish_reason == "stop"


def test_json_object_on_chat_and_completions(client):
    ask = [{"role": "user", "content": "Reply with a JSON object with one key, ok."}]
    finished = 0
    for seed in range(4):
        c = client.chat.completions.create(
            model=MODEL, max_tokens=100, temperature=1.0, seed=seed, messages=ask,
            response_format={"type": "json_object"}).choices[0]
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
            finished += 1
        else:
            assert c.message.content.startswith("{"), c
    # The small model rambles inside an object now and then, but not every time.
    assert finished >= 1
    # vLLM reads response_format on completions too.
    r = client.completions.create(
        model=MODEL, prompt="A JSON object describing a cat:", max_tokens=300, temperature=0,
        extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:
        assert r.choices[0].text.startswith("{")


def test_streamed_structured_output_equals_the_whole_one(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0.8, seed=11,
                  response_format=schema_format(PERSON))
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), PERSON)


def test_each_of_n_choices_follows_the_schema(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=200, temperature=1.0, seed=5, n=3,
        response_format=schema_format(PERSON))
    assert len(r.choices) == 3
    for c in r.choices:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in r.choices}) > 1


def test_vllm_guided_choice_regex_and_grammar(client):
    for seed in range(5):
        r = client.chat.completions.create(
            model=MODEL, max_tokens=10, temperature=1.0, seed=seed,
            messages=[{"role": "user", "content": "Is the sky blue?"}],
            extra_body={"guided_choice": ["yes", "no", "it depends"]})
        assert r.choices[0].message.content in {"yes", "no", "it depends"}
        assert r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=30, temperature=1.0, seed=1,
        extra_body={"guided_regex": r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"})
    text = r.choices[0].text
    assert len(text) == 14 and text[0] == "(" and text[4:6] == ") " and text[9] == "-", text
    grammar = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    r = client.completions.create(
        model=MODEL, prompt="What is 6 times 7?", max_tokens=20, temperature=0,
        extra_body={"guided_grammar": grammar})
    text = r.choices[0].text
    assert text.startswith("The answer is ") and text.endswith("."), text
    assert text[len("The answer is "):-1].isdigit()
    r = client.completions.create(
        model=MODEL, prompt="Pick a fruit:", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["apple", "pear"]}})
    assert r.choices[0].text in {"apple", "pear"}


def _error(excinfo, param):
    e = excinfo.value
    assert e.status_code == 400
    body = e.response.json()["error"]
    assert body["code"] == 400 and body["type"] == "invalid_request_error", body
    assert body["param"] == param, body
    return body["message"]


@pytest.mark.parametrize("kwargs,param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format"),
    (dict(response_format=schema_format({"type": "object", "properties": {
        "a": {"$ref": "#/$defs/missing"}}})), "response_format"),
    (dict(response_format={"type": "structural_tag"}), "response_format"),
    (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
    (dict(extra_body={"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
    (dict(extra_body={"guided_choice": []}), "guided_choice"),
    (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
     "guided_regex"),
])
def test_unusable_grammars_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **kwargs)
    assert _error(ei, param)


def test_hostile_grammars_are_refused_within_the_limits_and_the_server_goes_on(client, server):
    # A regex whose lexer would need a million states; a choice list past its byte limit.
    cases = [
        ({"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
        ({"guided_choice": [f"option number {i}" for i in range(5000)]}, "guided_choice"),
    ]
    for body, param in cases:
        t0 = time.monotonic()
        with pytest.raises(openai.BadRequestError) as ei:
            client.completions.create(model=MODEL, prompt="x", max_tokens=64, extra_body=body)
        e = ei.value
        assert e.status_code == 400 and e.response.json()["error"]["code"] == 400
        # Refused up front it names the field; refused partway (the limits are per step)
        # it says what went past them.
        err = e.response.json()["error"]
        assert err["param"] == param or "structured output" in err["message"], err
        assert time.monotonic() - t0 < 30
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=100, temperature=0,
        response_format=schema_format(PERSON))
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert httpx.get(f"{server.base}/health").status_code == 200


def test_constrained_and_free_requests_share_a_batch(client):
    # Free requests beside constrained ones come out as they do alone (greedy).
    free = dict(model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0)
    alone = client.completions.create(**free).choices[0].text

    def constrained(seed):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=200, temperature=1.0, seed=seed,
            response_format=schema_format(PERSON)).choices[0].message.content
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        futures = [ex.submit(constrained, s) for s in range(2)]
        beside = ex.submit(lambda: client.completions.create(**free).choices[0].text)
        outs = [f.result() for f in futures]
        assert beside.result() == alone
    for o in outs:
        jsonschema.validate(json.loads(o), PERSON)
