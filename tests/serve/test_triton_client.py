"""Triton's own HTTP client against /infer: the binary tensor data extension it uses by default."""
import json
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from app.protocol.triton_binary import HEADER

PROMPT = "What is machine learning?"


@pytest.fixture(scope="module")
def client(server):
    with httpclient.InferenceServerClient(server.removeprefix("http://"), network_timeout=120) as c:
        yield c


def _input(name, value, datatype, binary=True):
    tensor = httpclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value, binary_data=binary)
    return tensor


def _prompt(binary=True):
    return [_input("text_input", np.array([[PROMPT.encode()]], dtype=np.object_), "BYTES", binary),
            _input("max_tokens", np.array([[12]], dtype=np.int32), "INT32", binary)]


@pytest.fixture(scope="module")
def json_answer(server):
    """The same greedy request on the JSON route."""
    import httpx

    body = {"inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [PROMPT]},
                       {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [12]}]}
    r = httpx.post(f"{server}/v2/models/ensemble/infer", json=body, timeout=120)
    assert r.status_code == 200 and HEADER.lower() not in r.headers, r.text
    (text,) = [t["data"][0] for t in r.json()["outputs"] if t["name"] == "text_output"]
    assert text
    return text


def test_client_sees_the_server(client):
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("ensemble")
    assert "binary_tensor_data" in client.get_server_metadata()["extensions"]


def test_default_binary_inputs_and_outputs(client, json_answer):
    result = client.infer("ensemble", _prompt(), request_id="9")
    assert result.get_response()["id"] == "9"
    assert all("binary_data_size" in t["parameters"] for t in result.get_response()["outputs"])
    assert result.as_numpy("text_output").tolist() == [[json_answer.encode()]]
    assert result.as_numpy("sequence_end").tolist() == [[True]]


def test_json_inputs_binary_outputs(client, json_answer):
    result = client.infer("ensemble", _prompt(binary=False))
    assert result.as_numpy("text_output")[0][0].decode() == json_answer


def test_binary_inputs_json_outputs(client, json_answer):
    outputs = [httpclient.InferRequestedOutput("text_output", binary_data=False),
               httpclient.InferRequestedOutput("cum_log_probs")]
    result = client.infer("ensemble", _prompt(), outputs=outputs)
    text, logprob = result.get_response()["outputs"]
    assert text["data"] == [json_answer] and "data" not in logprob and logprob["datatype"] == "FP32"
    assert result.as_numpy("cum_log_probs").shape == (1, 1)


def test_token_ids_both_ways(client, http):
    ids = [1, 1780, 314, 3767, 2181, 47]
    inputs = [_input("input_ids", np.array([ids], dtype=np.int32), "INT32"),
              _input("request_output_len", np.array([[6]], dtype=np.int32), "INT32")]
    binary = client.infer("tensorrt_llm", inputs, outputs=[httpclient.InferRequestedOutput("output_ids")])
    body = {"inputs": [{"name": "input_ids", "shape": [1, len(ids)], "datatype": "INT32", "data": ids},
                       {"name": "request_output_len", "shape": [1, 1], "datatype": "INT32", "data": [6]}],
            "outputs": [{"name": "output_ids"}]}
    (expected,) = http.post("/v2/models/tensorrt_llm/infer", json=body).json()["outputs"]
    assert binary.as_numpy("output_ids").dtype == np.int64
    assert binary.as_numpy("output_ids").flatten().tolist() == expected["data"]


def test_client_errors_name_the_field(client):
    with pytest.raises(InferenceServerException) as err:
        client.infer("ensemble", [*_prompt(), _input("top_k", np.array([[-1]], dtype=np.int32), "INT32")])
    assert err.value.status() == "400" and "top_k" in err.value.message()


def _raw(tensors, tail: bytes, header_length=None):
    header = json.dumps({"inputs": tensors}).encode()
    return header + tail, str(len(header)) if header_length is None else header_length


TEXT = {"name": "text_input", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": 6}}
HI = struct.pack("<I", 2) + b"Hi"


@pytest.mark.parametrize("body, header_length, says", [
    (*_raw([TEXT], HI, header_length="1e3"), f"{HEADER}: must be a number of bytes"),
    (*_raw([TEXT], HI, header_length="100000"), f"{HEADER}: 100000 bytes is more than the whole body"),
    (*_raw([TEXT], HI + b"extra"), f"{HEADER}: 11 bytes follow the JSON but the inputs' binary_data_size add up to 6"),
    (*_raw([TEXT], HI[:5]), "inputs.0.parameters.binary_data_size: 6 bytes run past the end of the body"),
    (*_raw([TEXT], struct.pack("<I", 50) + b"Hi"), "inputs.0.data: BYTES element 0 is 50 bytes long"),
    (*_raw([{**TEXT, "data": ["Hi"]}], HI), "inputs.0.data: must be absent when binary_data_size is given"),
    (*_raw([{**TEXT, "shape": [2]}], HI), "inputs.0.shape: [2] holds 2 elements but the binary data has 1"),
    (*_raw([{"name": "max_tokens", "shape": [1, 2], "datatype": "INT32", "parameters": {"binary_data_size": 4}}],
           b"\0" * 4), "inputs.0.parameters.binary_data_size: is 4 bytes but [1, 2] of INT32 is 8"),
    (_raw([TEXT], HI)[0], None, "body: is not valid JSON"),
])
def test_malformed_binary_bodies_get_400_naming_the_field(http, body, header_length, says):
    headers = {"Content-Type": "application/octet-stream"}
    if header_length is not None:
        headers[HEADER] = header_length
    r = http.post("/v2/models/ensemble/infer", content=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"].startswith(says), r.text


def test_body_limit_holds_for_binary_bodies(http, client, json_answer):
    big = "x" * (1 << 20)
    tensor = {**TEXT, "parameters": {"binary_data_size": 4 + len(big)}}
    body, header_length = _raw([tensor], struct.pack("<I", len(big)) + big.encode())
    for content in (body, iter([body])):  # with a Content-Length, and chunked without one
        r = http.post("/v2/models/ensemble/infer", content=content, headers={HEADER: header_length})
        assert r.status_code == 413 and "limit" in r.json()["error"], r.text
    # Nothing above broke the replica.
    assert client.infer("ensemble", _prompt()).as_numpy("text_output")[0][0].decode() == json_answer
