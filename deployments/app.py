"""The DAG, in one place: Ingress -> Tokenizer, then Detokenizer <= stream <= Engine; beside it the
registry of client-chosen request ids that stop requests go through.

`serve run serve_config.yaml` calls build_app with the `args` of serve_config.yaml.
"""
from __future__ import annotations

import ray
from ray.serve import Application

from app.config import ConfigError, load_config
from app.placement import placement_problem
from app.engine.model_dir import resolve_model_dir
from deployments.detokenizer import DetokenizerDeployment
from deployments.engine import EngineDeployment
from deployments.ingress import Ingress
from deployments.request_ids import RequestIdsDeployment
from deployments.tokenizer import TokenizerDeployment

DEFAULT_CONFIG = "configs/smollm2-135m.yaml"


def build_app(args: dict) -> Application:
    config = load_config(args.get("config", DEFAULT_CONFIG))
    resolve_model_dir(config.model)  # convert an embedded/GGUF model once, before any replica starts
    stages = config.serve
    engine_options = config.engine_deployment_options()
    # A config file is built inside the cluster (Serve's build task), where Ray is always up.
    if config.check_placement and "placement_group_bundles" in engine_options and ray.is_initialized():
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        problem = placement_problem(engine_options["placement_group_bundles"],
                                    engine_options["placement_group_strategy"], nodes)
        if problem:
            raise ConfigError(f"{args.get('config', DEFAULT_CONFIG)}: {problem}")
    engine = EngineDeployment.options(**engine_options).bind(config)
    tokenizer = TokenizerDeployment.options(**stages.tokenizer.deployment_options()).bind(
        config.model, config.tool_call_parser)
    detokenizer = DetokenizerDeployment.options(**stages.detokenizer.deployment_options()).bind(config, engine)
    return Ingress.options(**stages.ingress.deployment_options()).bind(config, tokenizer, detokenizer, engine,
                                                                        RequestIdsDeployment.bind())
