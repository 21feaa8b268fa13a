"""/v1 bodies: fields this server does not implement are refused by name, never silently ignored;
their neutral values (what clients send by default) pass; chat content may be text parts; guides
(response_format, vLLM's guided_*) become one engine Guide; tool calls are parsed from the output
(Hermes and Llama 3 JSON formats, or the JSON a forced tool_choice guides to), malformed ones stay text;
logprobs, top_logprobs and logit_bias reach the engine and come back in OpenAI's two shapes; completions'
echo puts the prompt (and its logprobs) first, max_tokens 0 with it leaves the prompt alone, and best_of
returns the n likeliest of its outputs."""
import json

import pytest

from app.config import ServiceConfig
from app.engine import InvalidRequestError
from app.protocol import tools
from app.protocol.messages import PromptText, TextChunk, TextOutput, TokenText, merge_chunks
from app.protocol.openai import (CompletionChoices, StreamState, completion_response, parse_chat, parse_completion,
                                 tool_calls)

BASE = {"model": "m", "prompt": "Hi"}
CHAT_ONE = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("top_logprobs", 2),  # a chat field; /v1/completions asks with logprobs: N
    ("functions", [{"name": "f"}]),
    ("made_up", 1),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**BASE, field: value}, 16)
    assert err.value.field == field and "not supported" in err.value.message


def test_neutral_values_and_labels_pass():
    job, req = parse_completion({**BASE, "response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1,
                                 "tools": [], "user": "u-1", "stream": True, "stream_options": {"include_usage": True},
                                 "suffix": None}, 16)
    assert job.prompt == "Hi" and req.user == "u-1" and req.stream_options.include_usage


def test_no_max_tokens_means_the_end_of_the_context_unless_the_config_says():
    """OpenAI's default: a request naming no max_tokens runs to the end of the context (the engine
    fills it in); a config's max_tokens_default, and max_completion_tokens, come first."""
    assert ServiceConfig().max_tokens_default is None
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat(chat, None)[0].params.max_tokens is None
    assert parse_chat(chat, 64)[0].params.max_tokens == 64
    assert parse_completion({"model": "m", "prompt": "hi", "max_completion_tokens": 9}, 64)[0].params.max_tokens == 9


def test_logprobs_and_logit_bias_reach_the_engine():
    job, _ = parse_chat({**CHAT_ONE, "logprobs": True, "top_logprobs": 3, "logit_bias": {"42": -100, "7": 2.5}}, 16)
    p = job.params
    assert (p.logprobs, p.top_logprobs, p.logit_bias) == (True, 3, {42: -100.0, 7: 2.5})
    job, _ = parse_completion({**BASE, "logprobs": 3, "logit_bias": {}}, 16)
    assert (job.params.logprobs, job.params.top_logprobs, job.params.logit_bias) == (True, 3, {})
    job, _ = parse_completion({**BASE, "logprobs": 0}, 16)
    assert (job.params.logprobs, job.params.top_logprobs) == (True, 0)
    job, _ = parse_chat({**CHAT_ONE, "top_logprobs": 0}, 16)  # the neutral value clients send
    assert (job.params.logprobs, job.params.top_logprobs) == (False, 0)


@pytest.mark.parametrize("parse, body, field", [
    (parse_chat, {"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    (parse_chat, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (parse_completion, {"logprobs": 6}, "logprobs"),
    (parse_completion, {"logit_bias": {"x": 1}}, "logit_bias.x"),
    (parse_completion, {"logit_bias": ["1"]}, "logit_bias"),
])
def test_logprob_and_bias_requests_out_of_range_are_refused_by_field(parse, body, field):
    with pytest.raises(InvalidRequestError) as err:
        parse({**(CHAT_ONE if parse is parse_chat else BASE), **body}, 16)
    assert err.value.field == field


def _logprob_output(index: int = 0) -> TextOutput:
    """Two tokens as the detokenizer sends them: the second is the first byte of a 3-byte character,
    and its likeliest alternative shares its text."""
    tokens = [TokenText(" café", b" caf\xc3\xa9", 0, [(" café", b" caf\xc3\xa9", -0.1), (" cafe", b" cafe", -2.5)]),
              TokenText("\ufffd", b"\xe2", 5, [("\ufffd", b"\xe6", -0.7), ("!", b"!", -1.0)])]
    return TextOutput(index, " café", [101, 102], [-0.1, -1.2], -1.3, "length", None, tokens)


def test_chat_logprobs_carry_token_text_bytes_and_alternatives():
    chunk = TextChunk([_logprob_output()], True, 3)
    (choice,) = completion_response("id", "m", chunk, True)["choices"]
    first, second = choice["logprobs"]["content"]
    assert first == {"token": " café", "logprob": -0.1, "bytes": [32, 99, 97, 102, 195, 169], "top_logprobs": [
        {"token": " café", "logprob": -0.1, "bytes": [32, 99, 97, 102, 195, 169]},
        {"token": " cafe", "logprob": -2.5, "bytes": [32, 99, 97, 102, 101]}]}
    assert second["bytes"] == [0xE2] and [t["bytes"] for t in second["top_logprobs"]] == [[0xE6], [33]]
    assert json.dumps(choice)  # plain JSON types throughout


def test_completion_logprobs_take_the_legacy_shape():
    chunk = TextChunk([_logprob_output()], True, 3)
    (choice,) = completion_response("id", "m", chunk, False)["choices"]
    assert choice["text"] == " café"
    assert choice["logprobs"] == {
        "tokens": [" café", "\ufffd"], "token_logprobs": [-0.1, -1.2], "text_offset": [0, 5],
        # the likeliest tokens plus the chosen one; same texts share the likelier entry
        "top_logprobs": [{" café": -0.1, " cafe": -2.5}, {"\ufffd": -0.7, "!": -1.0}]}


# "Say" as the detokenizer sends it with prompt logprobs: the first token has none (nothing before it)
PROMPT = PromptText("Say", [TokenText("S", b"S", 0, []), TokenText("ay", b"ay", 1, [("ay", b"ay", -0.3)])],
                    [None, -0.3])


def _echo(body: dict, chunks: list[TextChunk], stream: bool = False) -> list[dict]:
    job, req = parse_completion({**BASE, "echo": True, **body}, 16)
    choices = CompletionChoices(req)
    state = StreamState(req, "id", "m", False) if stream else None
    return [completion_response("id", "m", c, False, state, completion=choices) for c in chunks]


def test_echo_puts_the_prompt_and_its_logprobs_first():
    """echo with logprobs: the prompt's text before the completion's, and its tokens before the
    completion's (a null logprob and null alternatives first, as OpenAI's legacy API); offsets count
    from the prompt's start. The engine is asked for the prompt's logprobs with as many alternatives."""
    job, _ = parse_completion({**BASE, "echo": True, "logprobs": 2}, 16)
    assert job.echo and job.params.prompt_logprobs == 2
    assert parse_completion({**BASE, "logprobs": 2}, 16)[0].params.prompt_logprobs is None  # not without echo
    (out,) = _echo({"logprobs": 2}, [TextChunk([_logprob_output()], True, 2, prompt=PROMPT)])
    (choice,) = out["choices"]
    assert choice["text"] == "Say café"
    assert choice["logprobs"] == {
        "tokens": ["S", "ay", " café", "\ufffd"], "token_logprobs": [None, -0.3, -0.1, -1.2],
        "top_logprobs": [None, {"ay": -0.3}, {" café": -0.1, " cafe": -2.5}, {"\ufffd": -0.7, "!": -1.0}],
        "text_offset": [0, 1, 3, 8]}
    (text_only,) = _echo({}, [TextChunk([TextOutput(0, " there", [5], None, -1.0, "stop")], True, 2,
                                        prompt=PromptText("Say"))])
    assert text_only["choices"][0]["text"] == "Say there" and text_only["choices"][0]["logprobs"] is None


def test_streamed_echo_comes_once_per_choice_in_its_first_chunk():
    """Each choice's first streamed chunk starts with the prompt, whichever chunk that is, and later
    chunks' offsets still count from the prompt's start."""
    first, second = _logprob_output(), _logprob_output()
    first.tokens, first.logprobs, first.text = first.tokens[:1], first.logprobs[:1], " café"
    second.tokens, second.logprobs, second.text = second.tokens[1:], second.logprobs[1:], "!"
    chunks = [TextChunk([first], False, 2, prompt=PROMPT), TextChunk([second, _logprob_output(1)], True, 2)]
    a, b = _echo({"logprobs": 2, "n": 2, "stream": True}, chunks, stream=True)
    assert [c["text"] for c in a["choices"]] == ["Say café"]
    assert [c["text"] for c in b["choices"]] == ["!", "Say café"]
    assert b["choices"][0]["logprobs"]["text_offset"] == [8]
    assert b["choices"][1]["logprobs"]["tokens"] == ["S", "ay", " café", "\ufffd"]


def test_echo_with_max_tokens_0_is_the_prompt_alone():
    """vLLM's extension: the engine generates one token (the prompt's last step samples), which the
    answer leaves out; usage counts no completion tokens. Without echo, max_tokens 0 is refused."""
    job, _ = parse_completion({**BASE, "echo": True, "logprobs": 1, "max_tokens": 0}, 16)
    assert job.params.max_tokens == 1
    (out,) = _echo({"logprobs": 1, "max_tokens": 0}, [TextChunk([_logprob_output()], True, 2, prompt=PROMPT)])
    (choice,) = out["choices"]
    assert choice["text"] == "Say" and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == ["S", "ay"] and choice["logprobs"]["token_logprobs"] == [None, -0.3]
    assert out["usage"]["completion_tokens"] == 0
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**BASE, "max_tokens": 0}, 16)
    assert err.value.field == "max_tokens" and "echo" in err.value.message


def test_best_of_generates_more_and_returns_the_likeliest():
    """best_of outputs are generated (the engine's n), the n with the highest cumulative logprob
    come back, best first, numbered 0..n-1."""
    job, _ = parse_completion({**BASE, "best_of": 4, "n": 2, "temperature": 0.8}, 16, max_return_sequences=4)
    assert job.params.n == 4
    outputs = [TextOutput(i, f"t{i}", [i], None, lp, "length") for i, lp in enumerate([-3.0, -1.0, -4.0, -2.0])]
    _, req = parse_completion({**BASE, "best_of": 4, "n": 2}, 16)
    out = completion_response("id", "m", TextChunk(outputs, True, 2), False, completion=CompletionChoices(req))
    assert [(c["index"], c["text"]) for c in out["choices"]] == [(0, "t1"), (1, "t3")]


@pytest.mark.parametrize("body, message", [
    ({"best_of": 1, "n": 2}, "at least n"),
    ({"best_of": 3, "stream": True}, "stream"),
    ({"best_of": 5}, "max_return_sequences of 4"),
])
def test_best_of_out_of_range_is_refused_by_name(body, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        parse_completion({**BASE, **body}, 16, max_return_sequences=4)
    assert err.value.field == "best_of"


def test_chat_has_no_echo():
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({**CHAT_ONE, "echo": True}, 16)
    assert err.value.field == "echo"
    parse_chat({**CHAT_ONE, "echo": False}, 16)  # the neutral value passes


def test_streamed_logprob_chunks_merge_in_order():
    first, second = _logprob_output(), _logprob_output()
    first.tokens, first.logprobs, first.token_ids = first.tokens[:1], first.logprobs[:1], first.token_ids[:1]
    second.tokens, second.logprobs, second.token_ids = second.tokens[1:], second.logprobs[1:], second.token_ids[1:]
    merged = merge_chunks(TextChunk([first], False, 3), TextChunk([second], True, 3)).outputs[0]
    assert merged.tokens == _logprob_output().tokens and merged.logprobs == [-0.1, -1.2]


def test_chat_text_parts_join_and_other_parts_are_refused():
    job, _ = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]}]}, 16)
    assert job.messages == [{"role": "user", "content": "Hello, there"}]
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 16)
    assert err.value.field == "messages.0.content" and "image_url" in err.value.message


@pytest.mark.parametrize("extra, kind, spec, field", [
    ({"response_format": {"type": "json_object"}}, "json", "", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"},
                                                                 "strict": True}}},
     "json_schema", '{"type": "object"}', "response_format.json_schema"),
    ({"guided_json": {"type": "array"}}, "json_schema", '{"type": "array"}', "guided_json"),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+", "guided_regex"),
    ({"guided_choice": ["a.b", "c"]}, "regex", r"(a\.b)|(c)", "guided_choice"),
    ({"guided_grammar": 'root ::= "x"'}, "ebnf", 'root ::= "x"', "guided_grammar"),
])
def test_guides_become_one_engine_guide(extra, kind, spec, field):
    job, _ = parse_completion({**BASE, **extra}, 16)
    guide = job.params.guide
    assert (guide.kind, guide.spec, guide.field) == (kind, spec, field)


def test_two_guides_or_a_schema_type_without_its_schema_are_refused():
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**BASE, "response_format": {"type": "json_object"}, "guided_regex": "x"}, 16)
    assert err.value.field == "guided_regex" and "only one guide" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**BASE, "response_format": {"type": "json_schema"}}, 16)
    assert err.value.field == "response_format.json_schema"


@pytest.mark.parametrize("fmt, field", [
    ({"type": "json_object", "json_schema": {"name": "n", "schema": {}}}, "response_format.json_schema"),
    ({"type": "text", "structures": []}, "response_format.structures"),
    ({"type": "json_schema", "json_schema": {"name": "n", "schema": {}}, "triggers": ["<"]}, "response_format.triggers"),
])
def test_a_response_format_key_of_another_type_is_refused_not_ignored(fmt, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**BASE, "response_format": fmt}, 16)
    assert err.value.field == field and "belongs to type" in err.value.message


# -- tool calls (app/protocol/tools.py) -----------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
NAMES = ["get_weather", "get_time"]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER, TIME]}


@pytest.mark.parametrize("parser, text, content, calls", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', "",
     [("get_weather", {"city": "Paris"})]),
    ("hermes", 'Let me look.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Let me look.\n\n",
     [("get_weather", {"city": "Oslo"}), ("get_time", {})]),
    ("hermes", '<tool_call>{"name": "get_time"}', "", [("get_time", {})]),  # cut before its end tag
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": '
                    '{"city": "a;b"}}', "", [("get_time", {}), ("get_weather", {"city": "a;b"})]),
    # Arguments as a JSON string (OpenAI's wire form), as some models write them.
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Quito\\"}"}</tool_call>', "",
     [("get_weather", {"city": "Quito"})]),
    # A block naming no tool of the request stays in the text beside the call that does.
    ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>', [("get_time", {})]),
    # The answer in a Markdown code block.
    ("llama3_json", '```json\n{"name": "get_weather", "parameters": {"city": "Lagos"}}\n```', "",
     [("get_weather", {"city": "Lagos"})]),
])
def test_calls_are_parsed_from_either_format(parser, text, content, calls):
    found = tools.PARSERS[parser].parse(text, NAMES)
    assert found == (content, [{"name": n, "arguments": a} for n, a in calls])
    assert tools.PARSERS[parser].parse(tools.PARSERS[parser].render(found[1]), NAMES)[1] == found[1]


@pytest.mark.parametrize("parser, text", [
    ("hermes", "Just text, no call."),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # not one of the tools
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "now"}</tool_call>'),  # arguments not an object
    ("llama3_json", '{"name": "get_time", "parameters": {}} and some words'),
    ("llama3_json", '{"city": "Paris"}'),
    ("llama3_json", "[" * 5000),
    ("llama3_json", '```python\nprint({"name": "get_time"})\n```'),  # a code block, but no call
])
def test_malformed_calls_are_not_parsed(parser, text):
    assert tools.PARSERS[parser].parse(text, NAMES) is None


def _chunks(req_body: dict, deltas: list[str], parser="hermes", stream=True, finish="stop") -> list[dict]:
    _, req = parse_chat(req_body, 16)
    calls = tool_calls(req, parser)
    state = StreamState(req, "id", "m", True) if stream else None
    return [completion_response("id", "m", TextChunk([TextOutput(0, d, [1], None, 0.0, finish if last else None)],
                                                     last, 3), True, state, calls=calls)["choices"][0]
            for last, d in ((i == len(deltas) - 1, d) for i, d in enumerate(deltas))]


def test_streamed_text_passes_until_a_call_starts_then_calls_come_at_the_end():
    choices = _chunks(CHAT, ["Let me ", "check <tool", '_call>{"name": "get_weather", ',
                             '"arguments": {"city": "Oslo"}}', "</tool_call>"])
    assert [c["delta"]["content"] for c in choices[:-1]] == ["Let me ", "check ", "", ""]
    last = choices[-1]
    assert last["finish_reason"] == "tool_calls" and last["delta"]["content"] is None
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # A partial marker that turns out to be text is released; output without calls ends as it began.
    choices = _chunks(CHAT, ["a <tool", "box> b"])
    assert "".join(c["delta"]["content"] for c in choices) == "a <toolbox> b" and choices[-1]["finish_reason"] == "stop"
    # llama3_json: an answer that starts as JSON is held; if it is no call, it comes out as text at the end.
    choices = _chunks(CHAT, ['{"answer": ', "42}"], parser="llama3_json")
    assert [c["delta"]["content"] for c in choices] == ["", '{"answer": 42}']
    # A code block is held from its first backtick, and a call inside it is one; a block of another
    # language streams as soon as its first line says so.
    choices = _chunks(CHAT, ["`", '``json\n{"name": "get_time", ', '"parameters": {}}\n```'], parser="llama3_json")
    assert [c["delta"]["content"] for c in choices[:-1]] == ["", ""] and choices[-1]["finish_reason"] == "tool_calls"
    deltas = ["```python\n", "print(1)\n", "```\nThat prints 1."]
    choices = _chunks(CHAT, deltas, parser="llama3_json")
    assert [c["delta"]["content"] for c in choices] == deltas and choices[-1]["finish_reason"] == "stop"
    # Cut by max_tokens after one whole call: no calls, the text as it is, finish_reason length.
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_weather", "argu'
    (choice,) = _chunks(CHAT, [text], stream=False, finish="length")
    assert choice["message"]["content"] == text and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "length"


def test_whole_response_carries_message_tool_calls_and_parallel_false_keeps_the_first():
    two = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2
    (choice,) = _chunks(CHAT, [two], stream=False)
    assert len(choice["message"]["tool_calls"]) == 2 and "index" not in choice["message"]["tool_calls"][0]
    assert choice["message"]["tool_calls"][0]["id"] != choice["message"]["tool_calls"][1]["id"]
    (choice,) = _chunks({**CHAT, "parallel_tool_calls": False}, [two], stream=False)
    assert len(choice["message"]["tool_calls"]) == 1
    # tool_choice none: nothing is parsed (and the tools are not rendered).
    job, _ = parse_chat({**CHAT, "tool_choice": "none"}, 16)
    assert job.tools is None and job.params.guide is None
    (choice,) = _chunks({**CHAT, "tool_choice": "none"}, [two], stream=False)
    assert choice["message"]["content"] == two and "tool_calls" not in choice["message"]


def test_required_and_named_choices_become_a_json_guide_whose_output_parses():
    job, _ = parse_chat({**CHAT, "tool_choice": "required", "parallel_tool_calls": False}, 16)
    schema = json.loads(job.params.guide.spec)
    assert job.params.guide.kind == "json_schema" and job.params.guide.field == "tool_choice"
    assert schema["minItems"] == schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": n} for n in NAMES]
    assert schema["items"]["anyOf"][1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    (choice,) = _chunks({**CHAT, "tool_choice": "required"}, ['[{"name": "get_time", "arguments": {}}]'], stream=False)
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    named = {**CHAT, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    job, _ = parse_chat(named, 16)
    assert json.loads(job.params.guide.spec) == WEATHER["function"]["parameters"]
    (choice,) = _chunks(named, ['{"city": "Lima"}'], stream=False)
    assert choice["message"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Lima"}'}
    (choice,) = _chunks(named, ['{"city": "Li'], stream=False)  # cut by max_tokens: text, as it is
    assert choice["message"]["content"] == '{"city": "Li' and "tool_calls" not in choice["message"]


def test_history_with_calls_and_results_goes_to_the_template_in_transformers_form():
    job, _ = parse_chat({**CHAT, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, 16)
    assert job.messages[1:] == [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1", "name": "get_weather"}]
    assert job.tools == [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}}}}]


CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("change, field", [
    ({"tools": [{"type": "retrieval", "function": WEATHER["function"]}]}, "tools.0.type"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [WEATHER["function"]]}, "functions"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [CALL]}]}, "messages.0.tool_calls"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c9"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
    ({"messages": [{"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{"}}]}]},
     "messages.0.tool_calls.0.function.arguments"),
])
def test_tool_requests_are_refused_by_field(change, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({**CHAT, **change}, 16)
    assert err.value.field == field, err.value.message


def test_parser_is_picked_from_the_template_and_its_choices_are_the_configs():
    assert tools.pick_parser("auto", "{{ '<tool_call>' }} \"parameters\"") == "hermes"
    assert tools.pick_parser("auto", "{{- '\"parameters\": ' }}") == "llama3_json"
    assert tools.pick_parser("auto", "<|python_tag|>") == "llama3_json"
    assert tools.pick_parser("auto", None) == tools.pick_parser("auto", "{{ messages }}") == "hermes"
    assert tools.pick_parser("llama3_json", "<tool_call>") == "llama3_json"
    choices = ServiceConfig.model_fields["tool_call_parser"].annotation.__args__
    assert set(choices) == {"auto", *tools.PARSERS} and ServiceConfig().tool_call_parser == "auto"


def test_a_template_without_tools_gets_them_as_text_and_a_tool_aware_one_as_they_are():
    job, _ = parse_chat({**CHAT, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "On it.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}]}, 16)
    messages, functions = tools.for_template(job.messages, job.tools, "{{ messages }}", "hermes")
    assert functions is None and messages[0]["content"].startswith("Be brief.\n\nYou can call these functions")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tool_call>" in messages[0]["content"]
    assert messages[1] == {"role": "assistant", "content": 'On it.\n<tool_call>\n{"name": "get_time", "arguments": {}}'
                                                          '\n</tool_call>'}
    native = "{% for t in tools %}{% endfor %}{{ message.tool_calls }}"
    assert tools.for_template(job.messages, job.tools, native, "hermes") == (job.messages, job.tools)


def test_a_stream_keeps_created_sends_the_role_once_and_usage_only_when_asked():
    chunks = [TextChunk([TextOutput(0, "Hel", [1], None, 0.0), TextOutput(1, "Yo", [2, 3], None, 0.0)], False, 3),
              TextChunk([TextOutput(0, "lo", [4], None, 0.0, "stop")], True, 3)]  # no metrics: a stop string ended it
    for include in (False, True):
        _, req = parse_chat({**CHAT_ONE, "n": 2, "stream": True, "stream_options": {"include_usage": include}}, 16)
        state = StreamState(req, "id", "m", True)
        out = [completion_response("id", "m", c, True, state) for c in chunks]
        roles = [[c["delta"].get("role") for c in o["choices"]] for o in out]
        assert roles == [["assistant", "assistant"], [None]] and out[0]["created"] == out[1]["created"]
        trailer = state.usage_chunk()
        if include:
            assert all(o["usage"] is None for o in out) and trailer["choices"] == []
            assert trailer["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
        else:
            assert all("usage" not in o for o in out) and trailer is None


def test_history_fields_clients_send_back_are_taken():
    """LangChain-style histories: a developer message (OpenAI's newer system), a participant's name,
    an earlier answer's null refusal. A refusal with text is refused by name."""
    job, _ = parse_chat({"model": "m", "messages": [
        {"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bob"},
        {"role": "assistant", "content": "Hello", "refusal": None}, {"role": "user", "content": "Bye"}]}, 16)
    assert job.messages[:3] == [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi", "name": "bob"},
                                {"role": "assistant", "content": "Hello"}]
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"model": "m", "messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, 16)
    assert err.value.field == "messages.0.refusal"
