"""Guided decoding over real HTTP: the openai client's response_format with varied JSON schemas
(every answer validates), vLLM's guided_* extras, Triton's guided_decoding_* inputs, and a 400
naming the field for a guide that does not compile."""
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
]


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
        jsonschema.validate(json.loads(choice.message.content), schema)


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
    r = http.post("/v2/models/ensemble/generate", json={**body, "guided_decoding_guide_type": "structural_tag"})
    assert r.status_code == 400 and "guided_decoding_guide_type" in r.json()["error"]


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
