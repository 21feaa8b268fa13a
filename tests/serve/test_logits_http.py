"""return_context_logits / return_generation_logits over real HTTP: generate, generate_stream and
/infer (Triton's client, binary FP32 tensors), shaped as TensorRT-LLM's, equal to transformers'
logits; a request over the limit is refused by name."""
import json

import httpx
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient

from app.engine.config import EngineConfig

VOCAB = 49152
PROMPT_IDS = [504, 3575, 282, 4649, 314]  # SmolLM2 tokens of "The capital of France is"
MAX_TOKENS = 4
DEFAULT_LOGITS_FLOATS = EngineConfig.max_logits_floats  # the server runs with the default
BOTH = {"return_context_logits": True, "return_generation_logits": True, "exclude_input_in_output": True}


def _events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


@pytest.fixture(scope="module")
def answer(server):
    """The greedy answer, with both logits, from /generate on the ids model."""
    r = httpx.post(f"{server}/v2/models/tensorrt_llm/generate", timeout=120,
                   json={"input_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS, **BOTH})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["output_ids"], np.array(body["context_logits"], np.float32), \
        np.array(body["generation_logits"], np.float32)


def test_generate_returns_them_shaped_and_equal_to_transformers(answer, smollm2_hf):
    """context_logits [prompt tokens][vocab]; generation_logits [outputs][output tokens][vocab]; the
    rows are transformers' logits at the prompt's positions and at each generated token's."""
    ids, context, generation = answer
    assert context.shape == (len(PROMPT_IDS), VOCAB) and generation.shape == (1, MAX_TOKENS, VOCAB)
    with torch.inference_mode():
        expected = smollm2_hf(torch.tensor([PROMPT_IDS + ids])).logits[0].float().numpy()
    np.testing.assert_allclose(context, expected[:len(PROMPT_IDS)], atol=2e-3, rtol=0)
    np.testing.assert_allclose(generation[0], expected[len(PROMPT_IDS) - 1:-1], atol=2e-3, rtol=0)
    assert ids == generation[0].argmax(-1).tolist()  # greedy: each token is its row's argmax


def test_generate_stream_sends_each_chunks_rows_with_it(http, answer):
    """The context with the first chunk; each chunk's generation rows with its tokens, adding up
    to the whole answer's."""
    with http.stream("POST", "/v2/models/tensorrt_llm/generate_stream",
                     json={"input_ids": PROMPT_IDS, "max_tokens": MAX_TOKENS, **BOTH}) as r:
        r.read()
    assert r.status_code == 200
    events = _events(r)
    assert "context_logits" in events[0] and not any("context_logits" in e for e in events[1:])
    rows = []
    for e in events:
        (chunk_rows,) = e["generation_logits"]  # one output
        assert len(chunk_rows) == len(e["output_ids"])
        rows += chunk_rows
    ids, context, generation = answer
    assert [t for e in events for t in e["output_ids"]] == ids
    np.testing.assert_allclose(np.array(events[0]["context_logits"], np.float32), context, atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.array(rows, np.float32), generation[0], atol=1e-6, rtol=0)


def test_infer_binary_returns_fp32_tensors(server, answer):
    """tritonclient's default binary outputs: [1, prompt, vocab] and [1, outputs, tokens, vocab]."""
    def tensor(name, value, datatype):
        t = httpclient.InferInput(name, list(value.shape), datatype)
        t.set_data_from_numpy(value, binary_data=True)
        return t

    inputs = [tensor("input_ids", np.array([PROMPT_IDS], np.int32), "INT32"),
              tensor("request_output_len", np.array([[MAX_TOKENS]], np.int32), "INT32"),
              tensor("return_context_logits", np.array([[True]]), "BOOL"),
              tensor("return_generation_logits", np.array([[True]]), "BOOL"),
              tensor("exclude_input_in_output", np.array([[True]]), "BOOL")]
    with httpclient.InferenceServerClient(server.removeprefix("http://"), network_timeout=120) as client:
        result = client.infer("tensorrt_llm", inputs)
    outputs = {o["name"]: o for o in result.get_response()["outputs"]}
    for name in ("context_logits", "generation_logits"):
        assert outputs[name]["datatype"] == "FP32" and "binary_data_size" in outputs[name]["parameters"]
    context, generation = result.as_numpy("context_logits"), result.as_numpy("generation_logits")
    assert context.dtype == np.float32 and context.shape == (1, len(PROMPT_IDS), VOCAB)
    assert generation.shape == (1, 1, MAX_TOKENS, VOCAB)
    ids, expected_context, expected_generation = answer
    assert result.as_numpy("output_ids").tolist() == [ids]
    np.testing.assert_allclose(context[0], expected_context, atol=1e-6, rtol=0)
    np.testing.assert_allclose(generation[0], expected_generation, atol=1e-6, rtol=0)


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [300] * (DEFAULT_LOGITS_FLOATS // VOCAB + 1), "max_tokens": 1, "return_context_logits": True},
     "return_context_logits"),
    ({"input_ids": PROMPT_IDS, "max_tokens": DEFAULT_LOGITS_FLOATS // VOCAB, **BOTH}, "return_generation_logits"),
])
def test_over_the_limit_is_refused_by_name(http, body, field):
    r = http.post("/v2/models/tensorrt_llm/generate", json=body)
    assert r.status_code == 400 and r.json()["error"].startswith(f"{field}: ")
    assert f"max_logits_floats ({DEFAULT_LOGITS_FLOATS})" in r.json()["error"]
