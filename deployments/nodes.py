"""What a replica or rank learns about the node it runs on: where its model is, which placement
group holds it. Apart from workers.py, so that the Tokenizer and Detokenizer need not import the
engine's rank launcher."""
from __future__ import annotations

from pathlib import Path

import ray

from app.engine.model_dir import resolve_model_dir


def placement_of_this_process() -> dict:
    context = ray.get_runtime_context()
    group = context.get_placement_group_id()
    return {"placement_group": group, "node": context.get_node_id()}


def model_dir_on_this_node(model: str, who: str) -> Path:
    """`model` resolved where this process runs. A config's path is read on every node that a stage
    or rank lands on, not only where the app was built: missing here, it fails in one sentence."""
    try:
        return resolve_model_dir(model)
    except FileNotFoundError as exc:
        raise FileNotFoundError(
            f"{who} on node {ray.util.get_node_ip_address()} (node id {ray.get_runtime_context().get_node_id()}) "
            f"cannot find model {model!r}: model paths must be on storage every node mounts, or present at the "
            f"same path on every node ({exc})") from None
