"""Tool calling on /v1/chat/completions over real HTTP, through the official openai client, with the
embedded SmolLM2 (its chat template knows no tools: they reach it as text, tools.for_template).
Forced calls (tool_choice required or named) always parse and validate against their tool's
schema, streamed calls assemble in the client, a history with calls and results is rendered,
answers under auto are well-formed whatever the model writes, and bad requests get 400s naming
the field."""
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

MODEL = "smollm2-135m"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CONVERT = {"type": "function", "function": {
    "name": "convert_currency", "description": "Convert an amount of money",
    "parameters": {"type": "object", "properties": {"amount": {"type": "integer", "minimum": 0, "maximum": 10**6},
                                                    "to": {"type": "string", "pattern": "^[A-Z]{3}$"}},
                   "required": ["amount", "to"]}}}
TOOLS = [WEATHER, CONVERT]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is the weather in Paris?", "How much is 20 dollars in euros?", "Is it raining in Tokyo right now?",
           "Convert 150 USD to JPY.", "Tell me a joke."]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _check_calls(choice, names=tuple(SCHEMAS)) -> None:
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice.message
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_calls_a_tool_with_valid_arguments(client):
    def ask(i):
        return client.chat.completions.create(model=MODEL, messages=_user(PROMPTS[i % len(PROMPTS)]), tools=TOOLS,
                                              tool_choice="required", max_tokens=200, temperature=0.8 * (i % 2),
                                              seed=i).choices[0]

    with ThreadPoolExecutor(8) as pool:
        for choice in pool.map(ask, range(8)):
            _check_calls(choice)
    one = client.chat.completions.create(model=MODEL, messages=_user(PROMPTS[0]), tools=TOOLS, max_tokens=200,
                                         tool_choice="required", parallel_tool_calls=False, temperature=0)
    _check_calls(one.choices[0])
    assert len(one.choices[0].message.tool_calls) == 1


def test_a_named_function_is_the_one_called(client):
    for prompt in PROMPTS[:3]:
        r = client.chat.completions.create(model=MODEL, messages=_user(prompt), tools=TOOLS, max_tokens=200,
                                           tool_choice={"type": "function", "function": {"name": "convert_currency"}})
        _check_calls(r.choices[0], names=("convert_currency",))
        assert r.choices[0].message.content is None


def test_streamed_calls_assemble_in_the_client_as_the_whole_response(client):
    kwargs = dict(model=MODEL, messages=_user(PROMPTS[1]), max_tokens=200, temperature=0, tool_choice="required")
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]
    with client.chat.completions.stream(tools=strict, **kwargs) as stream:
        streamed = stream.get_final_completion().choices[0]
    _check_calls(streamed)
    whole = client.chat.completions.create(tools=TOOLS, **kwargs).choices[0]
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
           [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert streamed.message.tool_calls[0].function.parsed_arguments == json.loads(whole.message.tool_calls[0]
                                                                                  .function.arguments)


def test_a_history_with_calls_and_results_is_rendered(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = [*_user(PROMPTS[0]), {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 degrees."}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=40, temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        _check_calls(choice)
    else:
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    # The call is in the prompt (as text, for this template), not dropped.
    without = [*history[:1], {"role": "assistant", "content": ""}, {"role": "user", "content": "Sunny, 24 degrees."}]
    bare = client.chat.completions.create(model=MODEL, messages=without, tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens > bare.usage.prompt_tokens


def test_auto_answers_are_well_formed_streamed_or_not(client):
    def ask(prompt):
        kwargs = dict(model=MODEL, messages=_user(prompt), tools=TOOLS, max_tokens=60, temperature=0)
        whole = client.chat.completions.create(**kwargs).choices[0]
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        return whole, chunks

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        for whole, chunks in pool.map(ask, PROMPTS):
            if whole.message.tool_calls:
                _check_calls(whole)
            else:
                assert whole.finish_reason in ("stop", "length") and isinstance(whole.message.content, str)
                assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
            assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
                   [whole.finish_reason]
    r = client.chat.completions.create(model=MODEL, messages=_user(PROMPTS[0]), tools=TOOLS, tool_choice="none",
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("change, param", [
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"messages": [{"role": "tool", "tool_call_id": "call_9", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "string", "pattern": "("}}}}}], "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tool_requests_get_400_naming_the_field(server, change, param):
    body = {"model": MODEL, "messages": _user("Hi"), "tools": TOOLS, "max_tokens": 8, **change}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{server}/v1/completions", json={"model": MODEL, "prompt": "Hi", "tools": TOOLS}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
