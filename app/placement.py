"""Can the cluster hold one engine replica's placement group? Said at start-up, in one sentence,
instead of a replica that waits for resources forever."""
from __future__ import annotations


def placement_problem(bundles: list[dict[str, float]], strategy: str, nodes: list[dict[str, float]]) -> str | None:
    """`nodes`: each live node's total resources (ray.nodes()[i]["Resources"]). None when it fits."""
    need: dict[str, float] = {}
    for bundle in bundles:
        for resource, amount in bundle.items():
            need[resource] = need.get(resource, 0) + amount
    for resource, amount in need.items():
        have = sum(node.get(resource, 0) for node in nodes)
        if have < amount:
            return (f"an engine replica needs {amount:g} {resource} ({len(bundles)} ranks: tensor_parallel_size x "
                    f"pipeline_parallel_size) but the cluster has {have:g}")
    if strategy == "STRICT_PACK" and not any(all(node.get(r, 0) >= a for r, a in need.items()) for node in nodes):
        unit = "GPU" if "GPU" in need else "CPU"
        largest = max(node.get(unit, 0) for node in nodes)
        return (f"an engine replica needs {need.get(unit, 0):g} {unit} on one node (tensor parallelism does not "
                f"cross nodes; use pipeline_parallel_size to span nodes) but the largest node has {largest:g}")
    return None
