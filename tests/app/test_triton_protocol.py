"""Triton generate bodies: spellings, batches of one, parameters, and refusals naming the field."""
import json
import math

import numpy as np
import pytest

from app.engine import InvalidRequestError
from app.protocol.messages import TextChunk, TextOutput
from app.engine.outputs import RequestMetrics
from app.protocol.triton import OUTPUTS, generate_response, infer_to_generate_body, parse_generate, parse_stop, to_json


def _parse(body, model="ensemble", streams=False):
    return parse_generate(model, body, "smollm2-135m", 64, streams)


def test_spellings_and_batches_of_one_map_to_one_request():
    job, req = _parse({"text_input": ["hi"], "parameters": {"runtime_top_k": [[5]], "len_penalty": 0.5},
                       "request_output_len": [[7]], "streaming": True, "stop_words": [["a", "b"]]}, streams=True)
    assert job.prompt == "hi" and job.params.max_tokens == 7 and job.params.top_k == 5
    assert job.params.length_penalty == 0.5 and req.stream and job.stop == ["a", "b"]
    assert job.params.temperature == 1.0  # top_k set: sampling


def test_stream_true_is_refused_where_the_endpoint_answers_once():
    """generate and infer answered a streaming request whole, saying nothing; Triton refuses it."""
    with pytest.raises(InvalidRequestError, match="stream: true needs the generate_stream endpoint"):
        _parse({"text_input": "hi", "stream": True})
    assert _parse({"text_input": "hi", "stream": False})[1].stream is False
    assert _parse({"text_input": "hi", "stream": True}, streams=True)[1].stream


def test_no_sampling_knob_means_greedy_as_in_tensorrt_llm():
    job, _ = _parse({"text_input": "hi"})
    assert job.params.greedy and job.params.max_tokens == 64


def test_llmapi_fields():
    job, req = _parse({"text_input": "hi", "sampling_param_max_tokens": 9, "sampling_param_temperature": 0.7,
                       "sampling_param_return_perf_metrics": True}, model="tensorrt_llm")
    assert job.params.max_tokens == 9 and job.params.temperature == 0.7 and req.return_perf_metrics


def test_best_of_equal_to_what_is_returned_is_accepted():
    job, _ = _parse({"text_input": "hi", "best_of": 2, "num_return_sequences": 2, "temperature": 0.5})
    assert job.params.n == 2


@pytest.mark.parametrize("body, field", [
    ([1, 2], "body"),
    ({"text_input": "hi", "parameters": [1]}, "parameters"),
    ({"text_input": "hi", "top_k": -1}, "top_k"),
    ({"text_input": "hi", "lora_path": "x"}, "lora_path"),
    ({"text_input": "hi", "lora_id": 3}, "lora_id"),
    ({"input_ids": [1, 2]}, "input_ids"),
    ({"text_input": "hi", "best_of": 3}, "best_of"),  # generating 3 to return the likeliest 1 is not built
    ({"text_input": "hi", "best_of": 4, "num_return_sequences": 2}, "best_of"),
    # Never silently ignored: a batch of more than one, a field given twice with two values, the
    # prompt sent two ways, input_lengths without ids or past them, a schema under guide type json.
    ({"text_input": "hi", "stop_words": [["a"], ["b"]]}, "stop_words"),
    ({"text_input": "hi", "max_tokens": 5, "request_output_len": 100}, "request_output_len"),
    ({"text_input": "hi", "max_tokens": 5, "parameters": {"max_tokens": 6}}, "max_tokens"),
    ({"text_input": "hi", "parameters": False}, "parameters"),
    ({"text_input": "hi", "parameters": []}, "parameters"),
    ({"text_input": "hi", "input_lengths": 1}, "input_lengths"),
    ({"text_input": "hi", "guided_decoding_guide_type": "json", "guided_decoding_guide": '{"type": "integer"}'},
     "guided_decoding_guide"),
])
def test_refusals_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        _parse(body)
    assert err.value.field == field


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [[1, 2], [3, 4]]}, "input_ids"),
    ({"input_ids": [1, 2], "text_input": "hi"}, "text_input"),
    ({"input_ids": [1, 2, 3], "input_lengths": 4}, "input_lengths"),
    ({"input_ids": [1, -1]}, "input_ids.1"),
    ({"input_ids": [True, 2]}, "input_ids.0"),
    ({"input_ids": [1.0, 2]}, "input_ids.0"),
])
def test_token_id_refusals_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        _parse(body, model="tensorrt_llm")
    assert err.value.field == field


def test_input_lengths_cut_the_padding_and_one_value_twice_is_one_value():
    job, _ = _parse({"input_ids": [[1, 2, 3, 0, 0]], "input_lengths": [[3]], "max_tokens": 4,
                     "parameters": {"request_output_len": [[4]], "bad_words": "", "end_id": 2}, "bad_words": [],
                     "end_id": [2]}, model="tensorrt_llm")
    assert job.prompt_token_ids == [1, 2, 3] and job.params.max_tokens == 4 and job.params.end_id == 2


@pytest.mark.parametrize("body, field", [
    ({"inputs": [{"name": "text_input", "data": ["hi"], "parameters": {"shared_memory_region": "r0"}}]},
     "inputs.0.parameters.shared_memory_region"),
    ({"inputs": [{"name": "text_input", "data": ["hi"]}],
      "outputs": [{"name": "text_output", "parameters": {"classification": 3}}]},
     "outputs.0.parameters.classification"),
])
def test_infer_refuses_tensor_parameters_it_does_not_act_on(body, field):
    """They were dropped silently: shared memory and classification outputs are not served. Keys
    Triton itself ignores (an Open Inference Protocol codec's content_type) are ignored here too."""
    with pytest.raises(InvalidRequestError) as err:
        infer_to_generate_body(body)
    assert err.value.field == field
    body["inputs"][0]["parameters"] = {"content_type": "str"}
    body.pop("outputs", None)
    assert infer_to_generate_body(body)[0]["text_input"] == "hi"


def test_infer_refuses_an_output_the_model_does_not_have():
    tensor = {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["hi"]}
    with pytest.raises(InvalidRequestError) as err:
        infer_to_generate_body({"inputs": [tensor], "outputs": [{"name": "text_output"}, {"name": "txt_output"}]})
    assert err.value.field == "outputs.1.name" and "txt_output" in str(err.value)
    chunk = TextChunk([TextOutput(0, "x", [5], [-0.5], -0.5, "length", None)], True, 1,
                      RequestMetrics(1, 2, 3, 4, 1, 1, 0, 1))
    _, req = _parse({"input_ids": [1], "return_perf_metrics": True, "return_log_probs": True}, model="tensorrt_llm")
    produced = generate_response("tensorrt_llm", req, chunk, "", [1], final=True)
    assert set(produced) - {"model_name", "model_version"} <= set(OUTPUTS)


def test_a_stop_request_names_its_id_and_the_rest_is_ignored():
    # The inflight_batcher client sends placeholder inputs (request_output_len 0) with stop.
    body = {"input_ids": [[0]], "input_lengths": [[1]], "request_output_len": [[0]], "stop": [[True]],
            "parameters": {"request_id": "r7"}}
    assert parse_stop("tensorrt_llm", body, "smollm2-135m") == "r7"
    assert parse_stop("ensemble", {"text_input": "hi", "stop": False, "request_id": "r7"}, "smollm2-135m") is None
    assert parse_stop("ensemble", {"text_input": "hi"}, "smollm2-135m") is None


@pytest.mark.parametrize("body, field", [
    ({"stop": True}, "request_id"),
    ({"stop": True, "request_id": ""}, "request_id"),
    ({"stop": True, "request_id": 7}, "request_id"),
    ({"stop": "yes", "request_id": "r7"}, "stop"),
])
def test_stop_refusals_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        parse_stop("ensemble", body, "smollm2-135m")
    assert err.value.field == field and err.value.status == 400


def test_a_generated_request_id_is_bounded():
    with pytest.raises(InvalidRequestError) as err:
        _parse({"text_input": "hi", "request_id": "x" * 257})
    assert err.value.field == "request_id"


def test_logits_flags_reach_the_engine_and_their_rows_come_back_shaped():
    job, req = _parse({"text_input": "hi", "return_context_logits": [[True]], "parameters":
                       {"return_generation_logits": True}})
    assert job.params.return_context_logits and job.params.return_generation_logits
    context = np.linspace(-3, 3, 8, dtype=np.float32).reshape(2, 4)
    chunk = TextChunk([TextOutput(0, "a", [5, 6], None, 0.0, "length", None, None, context[::-1].copy())], True, 2,
                      context_logits=context)
    out = json.loads(to_json(generate_response("ensemble", req, chunk, "hi", [1, 2], final=True)))
    assert np.array(out["context_logits"], np.float32).tolist() == context.tolist()  # [prompt][vocab], exact
    # [outputs][tokens][vocab]
    assert np.array(out["generation_logits"], np.float32).tolist() == [context[::-1].tolist()]
    assert out["text_output"] == "a" and out["sequence_end"] is True
    plain, _ = _parse({"text_input": "hi"})
    assert not plain.params.return_context_logits and not plain.params.return_generation_logits


def test_to_json_prints_like_json_dumps_and_non_finite_values_as_null():
    obj = {"a": "é", "b": [1, 2.5, None], "c": [{"d": np.array([1.0, 0.1, -2e-9], np.float32)}]}
    assert json.loads(to_json(obj))["b"] == [1, 2.5, None]
    assert json.loads(to_json({"a": "é", "b": [1, 2.5, None]})) == {"a": "é", "b": [1, 2.5, None]}
    assert to_json({"a": "é"}) == json.dumps({"a": "é"}, ensure_ascii=False, separators=(",", ":")).encode()
    values = json.loads(to_json(obj))["c"][0]["d"]
    assert np.array(values, np.float32).tolist() == np.array([1.0, 0.1, -2e-9], np.float32).tolist()
    assert json.loads(to_json(np.array([1.0, math.inf, math.nan], np.float32))) == [1.0, None, None]


def test_a_last_chunk_without_outputs_is_answered():
    """With n > 1 every output may have ended before the request's last chunk, which then carries
    none: reading its first output was an IndexError (a 500, or an error event ending the stream)."""
    _, req = _parse({"text_input": "hi", "num_return_sequences": 2, "temperature": 0.5})
    out = generate_response("ensemble", req, TextChunk([], True, 1), "hi", [1], final=True)
    assert out["sequence_end"] and out["text_output"] == [] and "finish_reason" not in out
