"""Fake tritonserver: the in-process API surface our triton backend uses (see tests/fakes/README.md).
Follows python/tritonserver/__init__.py of triton-inference-server/core for the exported names."""
from tritonserver._api import (DataType, InferenceRequest, InferenceResponse, InternalError, InvalidArgumentError,
                               Model, ModelControlMode, NotFoundError, Options, Server, Tensor, TritonError,
                               UnavailableError, UnsupportedError)

__all__ = ["DataType", "InferenceRequest", "InferenceResponse", "InternalError", "InvalidArgumentError", "Model",
           "ModelControlMode", "NotFoundError", "Options", "Server", "Tensor", "TritonError", "UnavailableError",
           "UnsupportedError"]
