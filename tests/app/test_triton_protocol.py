"""Triton generate bodies: spellings, batches of one, parameters, and refusals naming the field."""
import pytest

from app.engine import InvalidRequestError
from app.protocol.triton import parse_generate, parse_stop


def _parse(body, model="ensemble"):
    return parse_generate(model, body, "smollm2-135m", 64)


def test_spellings_and_batches_of_one_map_to_one_request():
    job, req = _parse({"text_input": ["hi"], "parameters": {"runtime_top_k": [[5]], "len_penalty": 0.5},
                       "request_output_len": [[7]], "streaming": True, "stop_words": [["a", "b"]]})
    assert job.prompt == "hi" and job.params.max_tokens == 7 and job.params.top_k == 5
    assert job.params.length_penalty == 0.5 and req.stream and job.stop == ["a", "b"]
    assert job.params.temperature == 1.0  # top_k set: sampling


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
])
def test_refusals_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        _parse(body)
    assert err.value.field == field


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
