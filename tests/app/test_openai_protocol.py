"""/v1 bodies: fields this server does not implement are refused by name, never silently ignored;
their neutral values (what clients send by default) pass; chat content may be text parts; guides
(response_format, vLLM's guided_*) become one engine Guide."""
import pytest

from app.engine import InvalidRequestError
from app.protocol.openai import parse_chat, parse_completion

BASE = {"model": "m", "prompt": "Hi"}


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]),
    ("tool_choice", "auto"),
    ("logit_bias", {"42": 100}),
    ("best_of", 3),
    ("top_logprobs", 2),
    ("functions", [{"name": "f"}]),
    ("made_up", 1),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError) as err:
        parse_completion({**BASE, field: value}, 16)
    assert err.value.field == field and "not supported" in err.value.message


def test_neutral_values_and_labels_pass():
    job, req = parse_completion({**BASE, "response_format": {"type": "text"}, "logit_bias": {}, "best_of": 1,
                                 "tools": [], "user": "u-1", "stream_options": {"include_usage": True},
                                 "suffix": None}, 16)
    assert job.prompt == "Hi" and req.user == "u-1" and req.stream_options.include_usage


def test_chat_text_parts_join_and_other_parts_are_refused():
    job, _ = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "there"}]}]}, 16)
    assert job.messages == [{"role": "user", "content": "Hello, there"}]
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 16)
    assert err.value.field == "messages.0.content" and "image_url" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 16)
    assert err.value.field == "messages.0.name"


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
