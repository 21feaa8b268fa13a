"""The portable PyTorch engine: TensorRT-LLM executor semantics, no Ray.

The names below load on first use. The Ingress and RequestIds replicas import only the engine's
light modules (errors, outputs, sampling_params, guided, config), and an eager import here would
load torch into each of them: seconds of start-up and about 180 MB apiece.
"""
import importlib

_HOMES = {
    "AsyncLLMEngine": "async_engine", "BatchingType": "config", "CompletionOutput": "outputs",
    "EngineConfig": "config", "EngineDeadError": "errors", "EngineStats": "outputs",
    "InvalidRequestError": "errors", "KvCacheConfig": "config", "LLMEngine": "llm_engine",
    "RequestMetrics": "outputs", "RequestOutput": "outputs", "SamplingParams": "sampling_params",
    "SchedulerPolicy": "config",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
    globals()[name] = value
    return value
