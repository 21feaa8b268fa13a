"""The README's Python example and the shipped serve_config.yaml work as written."""
import re
from pathlib import Path

import yaml

from app.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def test_readme_python_example_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", readme, re.S):
        exec(compile(block, "README.md", "exec"), {})
    assert capsys.readouterr().out


def test_serve_config_points_at_a_valid_model_config():
    serve_config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    (app,) = serve_config["applications"]
    module, _, function = app["import_path"].partition(":")
    assert (ROOT / (module.replace(".", "/") + ".py")).is_file() and function == "build_app"
    assert load_config(ROOT / app["args"]["config"]).served_model_name == "smollm2-135m"



def test_the_lora_plot_pairs_each_adapter_run_with_its_own_base_run(tmp_path):
    """tools/bench/plot_lora.py reads the published JSONs: an adapter run's ratio is over the base run
    of its own level and kind, and levels the targets do not name are left out."""
    import json

    from tools.bench.plot_lora import ratios

    def run(name, tok_s):
        return {"name": name, "output_tok_s": tok_s}

    serve = {"args": {"concurrency": [1, 64, 256]}, "config": {"max_lora_rank": 16},
             "results": [run("dag openai c=1", 200), run("dag openai c=1 8 adapters", 190),
                         run("dag openai c=64", 9000), run("dag openai c=64 8 adapters", 1),
                         run("dag openai c=256", 15000), run("dag openai c=256 8 adapters", 12000)]}
    engine = {"args": {"concurrency": 256, "lora_rank": 64},
              "results": [run("ours", 16000), run("ours, 8 adapters (rank 64)", 12000)]}
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    (tmp_path / "engine.json").write_text(json.dumps(engine))
    assert ratios(str(tmp_path / "serve.json")) == [("batch 1", "Serve", 0.95), ("8 x rank 16", "Serve", 0.8)]
    assert ratios(str(tmp_path / "engine.json")) == [("8 x rank 64", "engine", 0.75)]
