"""Server / Options (core: python/tritonserver/_api/_server.py), Model.async_infer (_model.py),
InferenceRequest (_request.py), InferenceResponse and AsyncResponseIterator with cancel()
(_response.py), Model.config (_model.py), Tensor with DLPack export and BYTES from numpy object,
bytes or str arrays (_tensor.py). Models come from a repository on disk:
only the TensorRT-LLM backend's `tensorrt_llm` model is served (tritonserver/_trtllm_model.py)."""
from __future__ import annotations

import asyncio
import enum
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np


class TritonError(Exception):
    pass


class NotFoundError(TritonError):
    pass


class InternalError(TritonError):
    pass


class InvalidArgumentError(TritonError):
    pass


class UnavailableError(TritonError):
    pass


class UnsupportedError(TritonError):
    pass


class ModelControlMode(enum.IntEnum):  # TRITONSERVER_ModelControlMode
    NONE = 0
    POLL = 1
    EXPLICIT = 2


class DataType(enum.IntEnum):  # TRITONSERVER_DataType
    BOOL = 1
    UINT64 = 5
    INT32 = 8
    INT64 = 9
    FP16 = 10
    FP32 = 11
    BYTES = 13


NUMPY_TYPES = {np.dtype(bool): DataType.BOOL, np.dtype(np.uint64): DataType.UINT64, np.dtype(np.int32): DataType.INT32,
               np.dtype(np.int64): DataType.INT64, np.dtype(np.float16): DataType.FP16,
               np.dtype(np.float32): DataType.FP32}


@dataclass
class Tensor:
    data_type: DataType
    shape: tuple
    array: np.ndarray = field(repr=False)  # the fake's memory buffer

    @staticmethod
    def _from_object(obj: Any) -> Tensor:
        array = np.ascontiguousarray(obj)
        if array.dtype.kind in "OSU":  # object_, bytes_, str_: a BYTES tensor, each item as UTF-8 bytes
            items = [x if isinstance(x, bytes) else str(x).encode("utf-8") for x in array.flat]
            return Tensor(DataType.BYTES, array.shape, np.array(items, dtype=object).reshape(array.shape))
        if array.dtype not in NUMPY_TYPES:
            raise InvalidArgumentError(f"unsupported input data type {array.dtype}")
        return Tensor(NUMPY_TYPES[array.dtype], array.shape, array)

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@dataclass
class Options:
    model_repository: str | list[str] = field(default_factory=list)
    server_id: str = "triton"
    model_control_mode: ModelControlMode = ModelControlMode.NONE
    startup_models: list[str] = field(default_factory=list)
    strict_model_config: bool = False
    exit_on_error: bool = True
    strict_readiness: bool = True
    exit_timeout: int = 30
    log_info: bool = False
    log_warn: bool = False
    log_error: bool = False
    log_verbose: int = 0
    metrics: bool = True
    backend_directory: str = "/opt/tritonserver/backends"


@dataclass
class InferenceRequest:
    model: Model
    request_id: Optional[str] = None
    flags: int = 0
    correlation_id: Optional[int | str] = None
    priority: int = 0
    timeout: int = 0
    inputs: dict = field(default_factory=dict)
    parameters: dict = field(default_factory=dict)
    output_memory_type: Any = None
    response_queue: Optional[asyncio.Queue] = None


@dataclass
class InferenceResponse:
    model: Model
    request_id: Optional[str] = None
    parameters: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    error: Optional[TritonError] = None
    classification_label: Optional[str] = None
    final: bool = False


class AsyncResponseIterator:
    def __init__(self, model, request, inference_request, raise_on_error=False, loop=None):
        self._model, self._request, self._inference_request = model, request, inference_request
        self._raise_on_error = raise_on_error
        self._complete = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self._complete:
            raise StopAsyncIteration
        response = await self._request.responses.get()
        self._complete = response.final
        if response.error is not None and self._raise_on_error:
            raise response.error
        return response

    def cancel(self):
        self._request.cancel()


class Model:
    def __init__(self, server: Server, name: str, version: int = -1, state: Optional[str] = None,
                 reason: Optional[str] = None):
        self._server, self.name, self.version, self.state, self.reason = server, name, version, state, reason

    def create_request(self, **kwargs) -> InferenceRequest:
        kwargs.pop("model", None)
        return InferenceRequest(model=self, **kwargs)

    def async_infer(self, inference_request: Optional[InferenceRequest] = None, raise_on_error: bool = True,
                    **kwargs) -> AsyncResponseIterator:
        if inference_request is None:
            inference_request = InferenceRequest(model=self, **kwargs)
        backend = self._server._loaded.get(self.name)
        if backend is None:
            raise UnavailableError(f"Request for unknown model: '{self.name}' is not found")
        tensors = {name: value if isinstance(value, Tensor) else Tensor._from_object(value)
                   for name, value in inference_request.inputs.items()}
        request = backend.infer(inference_request.request_id, tensors)  # input errors raise here, as infer_async does
        return AsyncResponseIterator(self, request, inference_request, raise_on_error)

    def ready(self) -> bool:
        return self.name in self._server._loaded

    def config(self, config_version: int = 1) -> dict:
        """The loaded model's configuration as Triton serializes it (parameters as string_value maps)."""
        backend = self._server._loaded.get(self.name)
        if backend is None:
            raise NotFoundError(f"Request for unknown model: '{self.name}' is not found")
        c = backend.config
        return {"name": self.name, "backend": c["backend"], "max_batch_size": c["max_batch_size"],
                "parameters": {k: {"string_value": v} for k, v in c["parameters"].items()}}

    def metadata(self) -> dict:
        return {"name": self.name, "versions": ["1"], "platform": "tensorrtllm"}


class Server:
    def __init__(self, options: Optional[Options] = None, **kwargs) -> None:
        self.options = options if options is not None else Options(**kwargs)
        self._started = False
        self._loaded: dict[str, Any] = {}

    def start(self, wait_until_ready: bool = False, polling_interval: float = 0.1,
              timeout: Optional[float] = None) -> Server:
        if self._started:
            raise InvalidArgumentError("Server already started")
        repos = self.options.model_repository
        for repo in [repos] if isinstance(repos, str) else repos:
            if not Path(repo).is_dir():
                raise InvalidArgumentError(f"failed to stat file {repo}")
        self._started = True
        return self

    def stop(self) -> None:
        for backend in self._loaded.values():
            backend.shutdown()
        self._loaded.clear()
        self._started = False

    def live(self) -> bool:
        return self._started

    def ready(self) -> bool:
        return self._started

    def model(self, model_name: str, model_version: int = -1) -> Model:
        return Model(self, model_name, model_version)

    def load(self, model_name: str, parameters: Optional[dict] = None) -> Model:
        from tritonserver._trtllm_model import TensorrtLlmModel

        if self.options.model_control_mode != ModelControlMode.EXPLICIT:
            raise UnavailableError("explicit model load / unload is not allowed if polling is enabled")
        repo = self.options.model_repository
        model_dir = Path(repo if isinstance(repo, str) else repo[0]) / model_name
        config_file = model_dir / "config.pbtxt"
        if not config_file.is_file():
            raise InvalidArgumentError(f"failed to load '{model_name}', failed to poll from model repository")
        if not any(p.is_dir() and p.name.isdigit() for p in model_dir.iterdir()):
            raise InvalidArgumentError(f"failed to load '{model_name}': no version is available")
        config = parse_model_config(config_file.read_text())
        if config["backend"] != "tensorrtllm":
            raise UnsupportedError(f"this fake serves only the tensorrtllm backend, not {config['backend']!r}")
        self._loaded[model_name] = TensorrtLlmModel(config)
        return Model(self, model_name, 1, "READY")


def parse_model_config(text: str) -> dict:
    """The parts of a config.pbtxt the backend reads: backend, decoupled, inputs, parameters."""
    def section(name: str) -> str:
        match = re.search(rf"^{name} \[(.*?)^\]", text, re.S | re.M)
        return match.group(1) if match else ""

    def tensors(body: str) -> dict:
        blocks = re.findall(r'name: "(\w+)"\s*data_type: (TYPE_\w+)\s*dims: \[([^\]]*)\]((?:(?!name:).)*)', body, re.S)
        return {n: {"type": t, "dims": [int(d) for d in dims.replace(" ", "").split(",") if d],
                    "optional": "optional: true" in rest} for n, t, dims, rest in blocks}

    return {"backend": re.search(r'^backend: "(\w+)"', text, re.M).group(1),
            "max_batch_size": int(re.search(r"^max_batch_size: (\d+)", text, re.M).group(1)),
            "decoupled": bool(re.search(r"decoupled: true", text)),
            "inputs": tensors(section("input")), "outputs": tensors(section("output")),
            "parameters": dict(re.findall(r'key: "(\w+)"\s*value: \{\s*string_value: "([^"]*)"\s*\}', text))}
