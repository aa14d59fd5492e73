"""Tool calling through the official openai client: tool_choice required and a named function
give arguments that parse and validate every time, streamed calls reassemble into the
non-streamed ones, tool turns in the history render, and bad tools are 400s."""

import concurrent.futures
import json

import jsonschema
import openai
import pytest

from conftest import MODEL

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string", "maxLength": 32}},
    "required": ["tz"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a zone",
                                      "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(message):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _each_seed(seeds, ask):
    # Four at a time: the session's server batches four sequences, and its answers do not
    # depend on the batch, so this is the sequential loop's work in fewer steps.
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        return list(ex.map(ask, range(seeds)))


def test_required_gives_parseable_arguments_every_time(client):
    def ask(seed):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed)
    for r in _each_seed(20, ask):
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None
        assert len(c.message.tool_calls) == 1
        _check_calls(c.message)


def test_required_with_parallel_calls_parses_whenever_the_list_ends(client):
    # With parallel calls allowed the grammar lets the list grow, and the 135M model sometimes
    # keeps adding calls until max_tokens; every list it closes is valid calls.
    def ask(seed):
        return client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
            max_tokens=400, temperature=1.0, seed=seed).choices[0]
    closed = 0
    for c in _each_seed(10, ask):
        if c.finish_reason == "tool_calls":
            _check_calls(c.message)
            closed += 1
        else:
            assert c.finish_reason == "length" and c.message.content.startswith("["), c
    assert closed >= 3, closed


def test_a_named_function_is_called_with_valid_arguments(client):
    choice = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(5):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
            max_tokens=100, temperature=1.0, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "stop"
        assert [t.function.name for t in c.message.tool_calls] == ["get_time"]
        _check_calls(c.message)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_into_the_non_streamed_ones(client, tool_choice):
    kwargs = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=tool_choice,
                  max_tokens=200, temperature=0.8, seed=4)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.function.name, "a call opens with its id and name"
                calls[tc.index] = [tc.function.name, ""]
            calls[tc.index][1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    want = [[t.function.name, t.function.arguments] for t in whole.message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == want
    assert finish == whole.finish_reason


def test_tool_turns_in_the_history_render_and_the_model_answers(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       max_tokens=20, temperature=0)
    c = r.choices[0]
    assert c.message.content and c.finish_reason in {"stop", "length"}


def test_tool_choice_none_and_auto_without_a_call_answer_in_text(client):
    for choice in ["none", "auto"]:
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                           tool_choice=choice, max_tokens=16, temperature=0)
        c = r.choices[0]
        assert c.message.content and not c.message.tool_calls
        assert c.finish_reason in {"stop", "length"}


@pytest.mark.parametrize("kwargs,param", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice"),
    (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "has space"}}]), "tools[0]"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools[1]"),
    (dict(tools=[{"type": "retrieval", "function": {"name": "f"}}]), "tools[0]"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "tool_choice"),
])
def test_bad_tools_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, **kwargs)
    body = ei.value.response.json()["error"]
    assert body["code"] == 400 and body["param"] == param, body
