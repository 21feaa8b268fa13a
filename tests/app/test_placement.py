"""Placement on a simulated multi-node cluster (ray.cluster_utils, fake GPUs): tensor-parallel
ranks stay on one node, pipeline stages spread over nodes, and a replica the cluster cannot hold
is refused at start-up with the numbers."""
import pytest
import ray
import yaml
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group

from app.config import ConfigError, parse_config
from app.placement import placement_problem


@pytest.fixture(scope="module")
def cluster():
    """A head without GPUs and two worker nodes of 2 GPUs and 2 CPUs each."""
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=2, num_gpus=2)
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _bundles_to_nodes(options: dict) -> list[str]:
    group = placement_group(options["placement_group_bundles"], strategy=options["placement_group_strategy"])
    ray.get(group.ready(), timeout=60)
    table = ray.util.placement_group_table(group)
    nodes = [table["bundles_to_node_id"][i] for i in range(len(options["placement_group_bundles"]))]
    remove_placement_group(group)
    return nodes


def test_tensor_parallel_ranks_share_one_node(cluster):
    options = parse_config({"device": "cuda", "tensor_parallel_size": 2}).engine_deployment_options()
    nodes = _bundles_to_nodes(options)
    assert len(set(nodes)) == 1


def test_pipeline_stages_cross_nodes_while_each_stage_stays_on_one(cluster):
    options = parse_config({"device": "cuda", "tensor_parallel_size": 2,
                            "pipeline_parallel_size": 2}).engine_deployment_options()
    nodes = _bundles_to_nodes(options)  # ranks stage-major: [stage 0 tp 0, stage 0 tp 1, stage 1 tp 0, ...]
    assert len(set(nodes)) == 2
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3]


@pytest.mark.parametrize("config, says", [
    ({"tensor_parallel_size": 4}, "needs 4 GPU on one node .* but the largest node has 2"),
    ({"tensor_parallel_size": 2, "pipeline_parallel_size": 4}, "needs 8 GPU .* but the cluster has 4"),
])
def test_a_replica_the_cluster_cannot_hold_is_refused_at_start(cluster, tmp_path, config, says):
    from deployments.app import build_app

    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump({"device": "cuda", **config}))
    with pytest.raises(ConfigError, match=says):
        build_app({"config": str(path)})
    path.write_text(yaml.safe_dump({"device": "cuda", "check_placement": False, **config}))
    build_app({"config": str(path)})  # an autoscaling cluster may add the nodes later: no check


def test_placement_problem_counts_every_resource():
    nodes = [{"CPU": 8, "GPU": 8}]
    assert placement_problem([{"CPU": 1, "GPU": 1}] * 8, "STRICT_PACK", nodes) is None
    assert "needs 9 CPU" in placement_problem([{"CPU": 9}], "PACK", nodes)
