"""The binary tensor data codec against tritonclient's own encoder and decoder, and its refusals."""
import json
import struct

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.http._utils import _get_inference_request

from app.engine import InvalidRequestError
from app.protocol.triton import infer_to_generate_body, infer_response, to_json
from app.protocol.triton_binary import HEADER, BinaryOutputs, decode_request, encode_response

HI = "Hi, é"


def _client_body(binary_inputs: bool, outputs=None) -> tuple[bytes, str | None]:
    """A request body and its Inference-Header-Content-Length as tritonclient builds them."""
    tensors = [("text_input", np.array([[HI.encode()]], dtype=np.object_), "BYTES"),
               ("max_tokens", np.array([[5]], dtype=np.int32), "INT32"),
               ("temperature", np.array([[0.7]], dtype=np.float32), "FP32"),
               ("top_k", np.array([[3]], dtype=np.uint64), "UINT64"),
               ("ignore_eos", np.array([[True]]), "BOOL"),
               ("stop_words", np.array([[b"a", b"bc"]], dtype=np.object_), "BYTES")]
    inputs = []
    for name, value, datatype in tensors:
        tensor = httpclient.InferInput(name, list(value.shape), datatype)
        tensor.set_data_from_numpy(value, binary_data=binary_inputs)
        inputs.append(tensor)
    body, json_size = _get_inference_request(inputs, "7", outputs, 0, False, False, 0, None, None)
    return (body.encode() if isinstance(body, str) else body), None if json_size is None else str(json_size)


def test_binary_inputs_decode_to_what_json_inputs_give():
    body, binary = decode_request(*_client_body(binary_inputs=True))
    assert not any("binary_data_size" in t["parameters"] for t in body["inputs"])
    fields, request_id, wanted = infer_to_generate_body(body)
    assert (fields, request_id, wanted) == infer_to_generate_body(decode_request(*_client_body(False))[0])
    assert fields == {"text_input": HI, "max_tokens": 5, "temperature": pytest.approx(0.7), "top_k": 3,
                      "ignore_eos": True, "stop_words": ["a", "bc"]}
    assert request_id == "7" and wanted is None
    assert binary.wants("text_output")  # no outputs named: tritonclient asks binary_data_output


def test_outputs_binary_as_asked():
    outputs = [httpclient.InferRequestedOutput("text_output", binary_data=False),
               httpclient.InferRequestedOutput("cum_log_probs")]
    body, binary = decode_request(*_client_body(True, outputs))
    assert not binary.wants("text_output") and binary.wants("cum_log_probs")
    raw = json.dumps({"inputs": [{"name": "text_input", "data": ["x"]}], "outputs": [{"name": "text_output"}],
                      "parameters": {"binary_data_output": True, "max_tokens": 2}}).encode()
    body, binary = decode_request(raw, None)
    assert binary.wants("text_output") and body["parameters"] == {"max_tokens": 2}
    assert not decode_request(b'{"inputs": []}', None)[1].wants("text_output")


def test_response_reads_back_with_tritonclient():
    generated = {"text_output": HI, "output_ids": [[1, 2, 3]], "cum_log_probs": -1.5, "sequence_end": True,
                 "output_log_probs": []}
    response = infer_response("ensemble", "7", generated, None)
    _, binary = decode_request(b'{"inputs": [], "outputs": [{"name": "text_output"}], '
                               b'"parameters": {"binary_data_output": true}}', None)
    content, json_length = encode_response(response, binary)
    result = httpclient.InferResult.from_response_body(content, header_length=json_length)
    assert result.as_numpy("text_output").tolist() == [[HI.encode()]]
    assert result.as_numpy("output_ids").tolist() == [[1, 2, 3]]
    assert result.as_numpy("cum_log_probs").tolist() == [[-1.5]]
    assert result.as_numpy("sequence_end").tolist() == [[True]]
    assert result.as_numpy("output_log_probs").shape == (1, 0)
    assert result.get_response()["id"] == "7"
    json_only = infer_response("ensemble", None, generated, None)
    assert encode_response(json_only, decode_request(b'{"inputs": []}', None)[1]) is None
    assert json_only["outputs"][0]["data"] == [HI]


def test_logits_go_as_fp32_tensors_in_tensorrt_llms_shapes():
    """context_logits [1, prompt, vocab] and generation_logits [1, outputs, tokens, vocab] (a shorter
    output padded with zeros, one with no new token all zeros): their bytes as binary, nested JSON
    otherwise, read back whole."""
    context = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    gen = [np.full((2, 4), 0.5, np.float32), np.full((1, 4), -1e-7, np.float32), []]
    generated = {"text_output": HI, "context_logits": context, "generation_logits": gen}
    _, binary = decode_request(b'{"inputs": [], "parameters": {"binary_data_output": true}}', None)
    content, json_length = encode_response(infer_response("ensemble", None, generated, None), binary)
    assert len(content) - json_length == 4 * (12 + 3 * 2 * 4) + 4 + len(HI.encode())  # raw float32
    result = httpclient.InferResult.from_response_body(content, header_length=json_length)
    assert result.as_numpy("context_logits").dtype == np.float32
    np.testing.assert_array_equal(result.as_numpy("context_logits"), context[None])
    expected = np.zeros((1, 3, 2, 4), np.float32)
    expected[0, 0], expected[0, 1, :1] = gen[0], gen[1]
    np.testing.assert_array_equal(result.as_numpy("generation_logits"), expected)
    as_json = infer_response("ensemble", None, generated, ["context_logits"])  # JSON: printed by to_json
    assert encode_response(as_json, decode_request(b'{"inputs": []}', None)[1]) is None
    (output,) = json.loads(to_json(as_json))["outputs"]
    assert output["shape"] == [1, 3, 4] and output["datatype"] == "FP32"
    assert np.array(output["data"], np.float32).tolist() == context[None].tolist()  # exact round trip
    mixed = BinaryOutputs(False, {"generation_logits": True})  # the context as JSON in the header
    content, json_length = encode_response(infer_response("ensemble", None, generated, None), mixed)
    result = httpclient.InferResult.from_response_body(content, header_length=json_length)
    np.testing.assert_array_equal(result.as_numpy("context_logits"), context[None])
    np.testing.assert_array_equal(result.as_numpy("generation_logits"), expected)


def test_bf16_and_fp16_inputs():
    header = json.dumps({"inputs": [
        {"name": "temperature", "shape": [1], "datatype": "BF16", "parameters": {"binary_data_size": 2}},
        {"name": "top_p", "shape": [1], "datatype": "FP16", "parameters": {"binary_data_size": 2}}]}).encode()
    body, _ = decode_request(header + struct.pack("<H", 0x3FC0) + np.float16(0.5).tobytes(), str(len(header)))
    assert [t["data"] for t in body["inputs"]] == [[1.5], [0.5]]


def _raw(tensors, tail: bytes, header_length=None, **envelope) -> tuple[bytes, str | None]:
    header = json.dumps({"inputs": tensors, **envelope}).encode()
    return header + tail, str(len(header)) if header_length is None else header_length


def _bytes_input(size, **extra):
    return {"name": "text_input", "shape": [1], "datatype": "BYTES", "parameters": {"binary_data_size": size},
            **extra}


def _int_input(size, shape=(1,), datatype="INT32"):
    return {"name": "max_tokens", "shape": list(shape), "datatype": datatype, "parameters": {"binary_data_size": size}}


HI_BYTES = struct.pack("<I", 2) + b"Hi"


@pytest.mark.parametrize("body, header_length, field, says", [
    (b'{"inputs": []}', "abc", HEADER, "number of bytes"),
    (b'{"inputs": []}', "-1", HEADER, "number of bytes"),
    (b'{"inputs": []}', "\u00b2", HEADER, "number of bytes"),  # str.isdigit() says yes; int() does not
    (b'{"inputs": []}', "9" * 40, HEADER, "18 digits"),
    (b'{"inputs": []}', "15", HEADER, "more than the whole body (14 bytes)"),
    (*_raw([_bytes_input(6)], HI_BYTES + b"xx"), HEADER,
     "8 bytes follow the JSON but the inputs' binary_data_size add up to 6"),
    (*_raw([], b"xx"), HEADER, "add up to 0"),
    (*_raw([_bytes_input(7)], HI_BYTES), "inputs.0.parameters.binary_data_size", "run past the end"),
    (*_raw([_bytes_input(6, data=["Hi"])], HI_BYTES), "inputs.0.data", "must be absent"),
    (_raw([_bytes_input(6)], b"")[0], None, "inputs.0.parameters.binary_data_size", HEADER),
    (*_raw([_bytes_input(-1)], b""), "inputs.0.parameters.binary_data_size", ">= 0"),
    (*_raw([_bytes_input("6")], HI_BYTES), "inputs.0.parameters.binary_data_size", ">= 0"),
    (*_raw([_bytes_input(True)], b"x"), "inputs.0.parameters.binary_data_size", ">= 0"),
    (*_raw([_bytes_input(6)], struct.pack("<I", 9) + b"Hi"), "inputs.0.data", "9 bytes long but 2"),
    (*_raw([_bytes_input(8)], HI_BYTES + b"\0\0"), "inputs.0.data", "inside the 4-byte length"),
    (*_raw([_bytes_input(12)], HI_BYTES * 2), "inputs.0.shape", "holds 1 elements but the binary data has 2"),
    (*_raw([_bytes_input(6)], struct.pack("<I", 2) + b"\xff\xfe"), "inputs.0.data", "not UTF-8"),
    (*_raw([_bytes_input(7)], struct.pack("<I", 3) + "\ud800".encode("utf-8", "surrogatepass")),
     "inputs.0.data", "not UTF-8"),
    (*_raw([{**_bytes_input(6), "shape": None}], HI_BYTES), "inputs.0.shape", "dimensions"),
    (*_raw([{**_bytes_input(6), "shape": [-1]}], HI_BYTES), "inputs.0.shape", "dimensions"),
    # A huge shape costs nothing: too many dimensions, or a product past what the bytes can hold.
    (*_raw([{**_bytes_input(6), "shape": [10 ** 18] * 9}], HI_BYTES), "inputs.0.shape", "at most 8"),
    (*_raw([{**_bytes_input(6), "shape": [10 ** 18] * 8}], HI_BYTES), "inputs.0.shape", "more elements than"),
    (*_raw([_int_input(4, shape=(1, 2))], b"\0" * 4), "inputs.0.parameters.binary_data_size",
     "is 4 bytes but [1, 2] of INT32 is 8"),
    (*_raw([_int_input(2, datatype="BOGUS")], b"\0\0"), "inputs.0.datatype", "not a KServe v2 datatype"),
    (*_raw([_int_input(1, datatype=None)], b"\0"), "inputs.0.datatype", "not a KServe v2 datatype"),
    (*_raw([_int_input(1, datatype="BOOL")], b"\x02"), "inputs.0.data", "0 or 1"),
    (*_raw([_int_input(4, datatype="FP32")], struct.pack("<f", float("nan"))), "inputs.0.data.0", "finite"),
    (*_raw([], b"", outputs=[{"name": "text_output", "parameters": {"binary_data": "yes"}}]),
     "outputs.0.parameters.binary_data", "true or false"),
    (*_raw([], b"", parameters={"binary_data_output": 1}), "parameters.binary_data_output", "true or false"),
    (b'{"inputs": [] } trailing', "10", "body", "not valid JSON"),
])
def test_malformed_bodies_name_the_field(body, header_length, field, says):
    with pytest.raises(InvalidRequestError) as err:
        decode_request(body, header_length)
    assert err.value.field == field and says in err.value.message, err.value
