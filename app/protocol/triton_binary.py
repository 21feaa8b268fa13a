"""Triton's binary tensor data extension of KServe v2 /infer, as tritonclient, perf_analyzer and
genai-perf send it by default (server docs/protocol/extension_binary_data.md).

A body is a JSON header of `Inference-Header-Content-Length` bytes, then the data of each input
that has `parameters.binary_data_size`, in input order: little-endian, row major, no padding;
BOOL one byte 0/1; BYTES elements a 4-byte little-endian length then the bytes. decode_request
turns it into the JSON body infer_to_generate_body takes; encode_response sends outputs the same
way where the request asks (`outputs[i].parameters.binary_data`, else request-level
`parameters.binary_data_output`).
"""
from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

import numpy as np

from app.engine.errors import InvalidRequestError
from app.protocol.body import check_value, parse_body
from app.protocol.triton import element_count, to_json

HEADER = "Inference-Header-Content-Length"
# Fixed-size datatypes as numpy reads them; BF16 is the upper half of an FP32, widened on decode.
DTYPES = {"BOOL": "u1", "INT8": "i1", "INT16": "<i2", "INT32": "<i4", "INT64": "<i8", "UINT8": "u1",
          "UINT16": "<u2", "UINT32": "<u4", "UINT64": "<u8", "FP16": "<f2", "BF16": "<u2", "FP32": "<f4",
          "FP64": "<f8"}
MAX_HEADER_DIGITS = 18  # int() of a longer run of digits is slow; no body is that big anyway


class BinaryOutputs(NamedTuple):
    """Which outputs go back as binary: an output's own binary_data, else binary_data_output."""
    default: bool
    named: dict[str, bool]

    def wants(self, name: str) -> bool:
        return self.named.get(name, self.default)


def decode_request(raw: bytes, header_length: str | None) -> tuple[Any, BinaryOutputs]:
    """The JSON body with each binary input's data filled in, and the binary outputs asked for."""
    if header_length is None:
        body, tail = parse_body(raw), b""
    else:
        if not (header_length.isascii() and header_length.isdigit() and len(header_length) <= MAX_HEADER_DIGITS):
            raise InvalidRequestError(HEADER, f"must be a number of bytes (at most {MAX_HEADER_DIGITS} digits)")
        size = int(header_length)
        if size > len(raw):
            raise InvalidRequestError(HEADER, f"{size} bytes is more than the whole body ({len(raw)} bytes)")
        body, tail = parse_body(raw[:size]), raw[size:]
    if not isinstance(body, dict):
        return body, BinaryOutputs(False, {})  # infer_to_generate_body names the fault
    used = 0
    inputs = body.get("inputs")
    for i, tensor in enumerate(inputs if isinstance(inputs, list) else []):
        params = tensor.get("parameters") if isinstance(tensor, dict) else None
        if not isinstance(params, dict) or "binary_data_size" not in params:
            continue
        where = f"inputs.{i}.parameters.binary_data_size"
        size = params.pop("binary_data_size")  # what is left is the JSON body a JSON client sends
        if header_length is None:
            raise InvalidRequestError(where, f"needs the {HEADER} header giving the length of the JSON")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidRequestError(where, "must be a number of bytes >= 0")
        if "data" in tensor:
            raise InvalidRequestError(f"inputs.{i}.data", "must be absent when binary_data_size is given "
                                                          "(the data follows the JSON)")
        if used + size > len(tail):
            raise InvalidRequestError(where, f"{size} bytes run past the end of the body: {len(tail) - used} "
                                             f"bytes are left after the JSON and the inputs before")
        tensor["data"] = _decode(tensor, tail[used:used + size], f"inputs.{i}")
        used += size
    if used != len(tail):
        raise InvalidRequestError(HEADER, f"{len(tail)} bytes follow the JSON but the inputs' "
                                          f"binary_data_size add up to {used}")
    outputs = body.get("outputs")
    named = {o["name"]: _flag(o.get("parameters"), "binary_data", f"outputs.{i}.parameters.binary_data")
             for i, o in enumerate(outputs if isinstance(outputs, list) else [])
             if isinstance(o, dict) and isinstance(o.get("name"), str)}
    default = _flag(body.get("parameters"), "binary_data_output", "parameters.binary_data_output")
    return body, BinaryOutputs(bool(default), {k: v for k, v in named.items() if v is not None})


def _flag(params: Any, key: str, where: str) -> bool | None:
    """Popped: request parameters become generate fields, where these are no field."""
    value = params.pop(key, None) if isinstance(params, dict) else None
    if value is not None and not isinstance(value, bool):
        raise InvalidRequestError(where, "must be true or false")
    return value


def _decode(tensor: dict, raw: bytes, where: str) -> list:
    """The flat data of one binary input; its shape and datatype must account for every byte."""
    shape, datatype = tensor.get("shape"), tensor.get("datatype")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidRequestError(f"{where}.shape", "must be a list of dimensions >= 0 for binary data")
    count = element_count(shape, where, len(raw))  # every element takes at least a byte
    if datatype == "BYTES":
        data = _bytes_elements(raw, where)
        if len(data) != count:
            raise InvalidRequestError(f"{where}.shape", f"{shape} holds {count} elements but the binary "
                                                        f"data has {len(data)}")
    elif datatype in DTYPES:
        dtype = np.dtype(DTYPES[datatype])
        if len(raw) != count * dtype.itemsize:
            raise InvalidRequestError(f"{where}.parameters.binary_data_size",
                                      f"is {len(raw)} bytes but {shape} of {datatype} is {count * dtype.itemsize}")
        values = np.frombuffer(raw, dtype)
        if datatype == "BOOL":
            if (values > 1).any():
                raise InvalidRequestError(f"{where}.data", "a BOOL element must be the byte 0 or 1")
            values = values.astype(bool)
        elif datatype == "BF16":
            values = (values.astype("<u4") << 16).view("<f4")
        data = values.tolist()
    else:
        raise InvalidRequestError(f"{where}.datatype", f"'{datatype}' is not a KServe v2 datatype; "
                                                       f"one of BYTES, {', '.join(DTYPES)}")
    check_value(data, f"{where}.data")  # NaN and Infinity, as in JSON bodies
    return data


def _bytes_elements(raw: bytes, where: str) -> list[str]:
    out, pos = [], 0
    while pos < len(raw):
        if pos + 4 > len(raw):
            raise InvalidRequestError(f"{where}.data", f"ends inside the 4-byte length of BYTES element {len(out)}")
        (length,) = struct.unpack_from("<I", raw, pos)
        pos += 4
        if pos + length > len(raw):
            raise InvalidRequestError(f"{where}.data", f"BYTES element {len(out)} is {length} bytes long but "
                                                       f"{len(raw) - pos} bytes of binary_data_size are left")
        try:
            out.append(raw[pos:pos + length].decode())  # strict UTF-8: no surrogates either
        except UnicodeDecodeError:
            raise InvalidRequestError(f"{where}.data", f"BYTES element {len(out)} is not UTF-8 text") from None
        pos += length
    return out


def encode_response(response: dict, binary: BinaryOutputs) -> tuple[bytes, int] | None:
    """The body (JSON, then the binary outputs' data) and the JSON's length; None if all are JSON."""
    parts = []
    for output in response["outputs"]:
        if binary.wants(output["name"]):
            raw = _encode(output.pop("data"), output["datatype"])
            output["parameters"] = {"binary_data_size": len(raw)}
            parts.append(raw)
    if not parts:
        return None
    if any(isinstance(o.get("data"), np.ndarray) for o in response["outputs"]):  # logits asked as JSON
        header = to_json(response)
    else:
        header = json.dumps(response, ensure_ascii=False, separators=(",", ":")).encode()
    return header + b"".join(parts), len(header)


def _encode(data: list | np.ndarray, datatype: str) -> bytes:
    """The datatypes infer_response writes: BYTES, BOOL, INT64, FP32 (logits: a float32 array, sent
    as its bytes)."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(b)) + b for b in (s.encode() for s in data))
    return np.asarray(data, dtype=DTYPES[datatype]).tobytes()
