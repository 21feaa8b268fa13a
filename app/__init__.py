"""Ray Serve LLM service with TensorRT-LLM semantics. Everything here is importable without Ray."""
