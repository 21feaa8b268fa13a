"""/v1 bodies: fields this server does not implement are refused by name, never silently ignored;
their neutral values (what clients send by default) pass; chat content may be text parts."""
import pytest

from app.engine import InvalidRequestError
from app.protocol.openai import parse_chat, parse_completion

BASE = {"model": "m", "prompt": "Hi"}


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "json_object"}),
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
