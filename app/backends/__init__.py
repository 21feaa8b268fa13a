"""Engine backends behind one protocol: torch (app.engine, the default), trtllm, triton."""
from __future__ import annotations

from app.backends.base import EngineBackend
from app.config import ServiceConfig


def create_backend(config: ServiceConfig, adapters: dict[str, str], launcher=None) -> EngineBackend:
    """The config's backend; production backends import their package only here, lazily.
    `launcher` starts the other ranks of a parallel torch engine (app.engine.executor)."""
    if config.backend == "trtllm":
        from app.backends.trtllm import TrtllmBackend
        return TrtllmBackend(config, adapters)
    if config.backend == "triton":
        from app.backends.triton import TritonBackend
        return TritonBackend(config, adapters)
    from app.backends.torch_backend import TorchBackend
    return TorchBackend(config, adapters, launcher)
