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

