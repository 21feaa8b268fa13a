"""A serving config with random LoRA adapters, for measuring adapter routing through the Serve app
(tools/gpu/serve_bench.sh's `adapters` step): writes N adapters of one rank for the config's model
(tools/bench/adapters.py, from config.json alone), a copy of the config that registers them under
a root, and a Serve config that serves it.

    python tools/gpu/lora_config.py tools/gpu/llama-3.1-8b-dummy.yaml /tmp/lora-bench --count 8 --rank 16

prints the Serve config's path. Slots as wide as the rank and as many as the adapters, as a
deployment sized for them would have.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from app.engine.model_dir import resolve_model_dir
from tools.bench.adapters import make_adapters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--count", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    config = yaml.safe_load(args.config.read_text())
    root = (args.out / "adapters").resolve()
    paths = make_adapters(resolve_model_dir(config["model"]), root, args.count, args.rank)
    config.update(lora_roots=[str(root)], lora_adapters={name: str(path) for name, path in paths.items()},
                  max_loras=args.count, max_lora_rank=args.rank)
    config_path = args.out / "config.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    serve = {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": 8000},
             "applications": [{"name": "llm", "route_prefix": "/", "import_path": "deployments.app:build_app",
                               "args": {"config": str(config_path.resolve())}}]}
    serve_path = args.out / "serve_config.yaml"
    serve_path.write_text(yaml.safe_dump(serve, sort_keys=False))
    print(serve_path)


if __name__ == "__main__":
    main()
