"""The DAG, in one place: Ingress -> Tokenizer, then Detokenizer <= stream <= Engine.

`serve run serve_config.yaml` calls build_app with the `args` of serve_config.yaml.
"""
from __future__ import annotations

from ray.serve import Application

from app.config import load_config
from app.engine.model_loader import resolve_model_dir
from deployments.detokenizer import DetokenizerDeployment
from deployments.engine import EngineDeployment
from deployments.ingress import Ingress
from deployments.tokenizer import TokenizerDeployment

DEFAULT_CONFIG = "configs/smollm2-135m.yaml"


def build_app(args: dict) -> Application:
    config = load_config(args.get("config", DEFAULT_CONFIG))
    resolve_model_dir(config.model)  # convert an embedded/GGUF model once, before any replica starts
    stages = config.serve
    engine = EngineDeployment.options(**config.engine_deployment_options()).bind(config)
    tokenizer = TokenizerDeployment.options(**stages.tokenizer.deployment_options()).bind(config.model)
    detokenizer = DetokenizerDeployment.options(**stages.detokenizer.deployment_options()).bind(config, engine)
    return Ingress.options(**stages.ingress.deployment_options()).bind(config, tokenizer, detokenizer, engine)
