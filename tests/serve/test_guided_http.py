"""Guided decoding over real HTTP: the openai client's response_format with 20 varied JSON schemas
(every answer validates), vLLM's guided_* extras, Triton's guided_decoding_* inputs, structural
tags on both routes, and a 400 naming the field for a guide that does not compile."""
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                      "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "population"]},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                                 "maxItems": 3}}, "required": ["colors"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"book": {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer"}}, "required": ["title", "year"]}},
     "required": ["book"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
     "required": ["code"]},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"pets": {"type": "array", "items": {
        "type": "object", "properties": {"kind": {"type": "string", "enum": ["cat", "dog"]},
                                         "legs": {"type": "integer"}}, "required": ["kind", "legs"]},
        "maxItems": 2}}, "required": ["pets"]},
    {"type": "object", "properties": {"nickname": {"type": ["string", "null"]}, "id": {"type": "integer"}},
     "required": ["nickname", "id"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "rating": {"type": "integer", "minimum": 1, "maximum": 5}},
     "required": ["temperature", "rating"]},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 3, "maxLength": 20}},
     "required": ["title"]},
    {"type": "object", "properties": {"version": {"const": 2}, "level": {"enum": [1, 2, 3]}},
     "required": ["version", "level"]},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
     "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "string", "maxLength": 30}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                      "email": {"type": "string", "format": "email"}}, "required": ["date", "email"]},
    {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": {"type": "number"}},
         "required": ["kind", "radius"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
         "required": ["kind", "side"], "additionalProperties": False}]}}, "required": ["shape"]},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "verified": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                               "maxItems": 3}}, "required": ["name"]},
    {"type": "string", "enum": ["low", "medium", "high"]},
]

# SmolLM2 fences the JSON it writes: free text around the fence, the schema's object inside it
FENCE = {"structures": [{"begin": "```json\n", "schema": SCHEMAS[0], "end": "\n```"}], "triggers": ["```json"]}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def _ask(client, schema):
    r = client.chat.completions.create(
        model="smollm2-135m", temperature=0, max_tokens=120,
        messages=[{"role": "user", "content": "Answer in JSON: tell me about something you like."}],
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}})
    return r.choices[0]


def test_every_schema_is_met(client):
    with ThreadPoolExecutor(len(SCHEMAS)) as pool:
        choices = list(pool.map(lambda s: _ask(client, s), SCHEMAS))
    for schema, choice in zip(SCHEMAS, choices):
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_and_vllm_extras(client):
    r = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=120,
                                       messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model="smollm2-135m", prompt="Is the sky blue? Answer:", max_tokens=5,
                                  temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model="smollm2-135m", prompt="A year:", max_tokens=8, temperature=0,
                                  extra_body={"guided_regex": "[12][0-9]{3}"})
    assert len(r.choices[0].text) == 4 and r.choices[0].text.isdigit()


def test_streamed_guided_output_assembles_to_valid_json(client):
    stream = client.chat.completions.create(
        model="smollm2-135m", temperature=0, max_tokens=120, stream=True,
        messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[0]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_triton_guided_decoding_inputs(http):
    body = {"text_input": "A person, as JSON:", "max_tokens": 120, "temperature": 0.0,
            "guided_decoding_guide_type": "json_schema", "guided_decoding_guide": json.dumps(SCHEMAS[0])}
    r = http.post("/v2/models/ensemble/generate", json=body)
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["text_output"]), SCHEMAS[0])


def _fenced(text: str) -> dict:
    """The object between the fence's begin and end, checked against its schema."""
    inside = text.partition("```json\n")[2].partition("\n```")[0]
    jsonschema.validate(json.loads(inside), SCHEMAS[0])
    return json.loads(inside)


def test_structural_tags_on_both_routes(client, http):
    r = client.chat.completions.create(
        model="smollm2-135m", temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "Describe a cat as JSON in a ```json code block, with its name and age."}],
        response_format={"type": "structural_tag", **FENCE})
    _fenced(r.choices[0].message.content)
    body = {"text_input": "Here is a cat, as JSON:\n", "max_tokens": 40, "temperature": 0.0,
            "guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": json.dumps(FENCE)}
    r = http.post("/v2/models/ensemble/generate", json=body)
    assert r.status_code == 200, r.text
    text = r.json()["text_output"]
    assert text.startswith("\n```json\n")  # the model's own text before the trigger
    _fenced(text)


def test_a_malformed_structural_tag_is_a_400_naming_its_field(client, http):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2-135m", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                       response_format={"type": "structural_tag", "triggers": ["<f="]})
    assert err.value.body["param"] == "response_format" and "structures must be" in err.value.body["message"]
    body = {"text_input": "x", "max_tokens": 4, "guided_decoding_guide_type": "structural_tag",
            "guided_decoding_guide": json.dumps({**FENCE, "triggers": ["<f="]})}
    r = http.post("/v2/models/ensemble/generate", json=body)
    assert r.status_code == 400 and r.json()["error"].startswith("guided_decoding_guide: does not compile")
    r = http.post("/v2/models/ensemble/generate", json={**body, "guided_decoding_guide": json.dumps(SCHEMAS[0])})
    assert r.status_code == 400 and r.json()["error"].startswith("guided_decoding_guide: structural tag:")


def test_a_guide_that_does_not_compile_is_a_400_naming_its_field(client, http):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="smollm2-135m", prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "(unclosed"})
    assert err.value.body["param"] == "guided_regex" and "does not compile" in err.value.body["message"]
    r = http.post("/v2/models/ensemble/generate", json={
        "text_input": "x", "max_tokens": 4, "guided_decoding_guide_type": "json_schema",
        "guided_decoding_guide": "{not json"})
    assert r.status_code == 400 and r.json()["error"].startswith("guided_decoding_guide: does not compile")
    assert http.get("/v2/health/ready").status_code == 200
