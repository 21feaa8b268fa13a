"""The cluster deployments of deploy/ (issue 20), checked against the schemas that read them: the
Serve config against Ray Serve's ServeDeploySchema and the model config it names against the app's
load_config; the launcher's cluster YAML through Ray's own prepare_config and validate_config
(ray-schema.json), as `ray up` does; the RayService by its keys. Both clusters must hold the app
at its minimum replica counts and give its engine the GPUs of its maximum."""
import copy
import re
from collections import Counter
from pathlib import Path

import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.serve.schema import HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

from app.config import ServiceConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DOCKERFILE = (DEPLOY / "Dockerfile").read_text()
IMAGE_ROOT = re.search(r"^WORKDIR (\S+)$", DOCKERFILE, re.M).group(1)  # the project inside images and nodes


def _app_configs(serve_config: dict) -> list[ServiceConfig]:
    """Validate a Serve config as Serve does, and each app's model config as build_app does. Serve
    accepts keys it does not know (for configs of later versions) and ignores them: not here."""
    ServeDeploySchema.model_validate(serve_config)
    assert set(serve_config) <= set(ServeDeploySchema.model_fields)
    assert set(serve_config.get("http_options", {})) <= set(HTTPOptionsSchema.model_fields)
    configs = []
    for app in serve_config["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields)
        module, _, function = app["import_path"].partition(":")
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file() and function == "build_app"
        path = Path(app["args"]["config"])
        assert path.is_relative_to(IMAGE_ROOT), f"{path} is not in the project at {IMAGE_ROOT}"
        configs.append(load_config(ROOT / path.relative_to(IMAGE_ROOT)))
    return configs


def _needs(config: ServiceConfig, bound: str) -> Counter:
    """CPUs and GPUs that the app's replicas hold at their `bound` ("min" or "max") counts."""
    total = Counter()
    for name in ("ingress", "tokenizer", "detokenizer", "engine"):
        stage = getattr(config.serve, name)
        replicas = getattr(stage.autoscaling, f"{bound}_replicas") if stage.autoscaling else stage.num_replicas
        if name == "engine":  # its placement group, or its actor alone
            options = config.engine_deployment_options()
            actor = options["ray_actor_options"]
            bundles = options.get("placement_group_bundles", [{"CPU": actor["num_cpus"],
                                                               "GPU": actor.get("num_gpus", 0)}])
            per_replica = sum((Counter(bundle) for bundle in bundles), Counter())
        else:
            per_replica = Counter({"CPU": stage.num_cpus})
        for resource, amount in per_replica.items():
            total[resource] += amount * replicas
    return total


def _assert_holds(config: ServiceConfig, per_worker: dict, min_workers: int, max_workers: int) -> None:
    """The head runs no replicas: the minimum app fits the minimum workers, the maximum engine GPUs the maximum."""
    need = _needs(config, "min")
    assert all(need[r] <= per_worker.get(r, 0) * min_workers for r in need), (need, per_worker, min_workers)
    assert _needs(config, "max")["GPU"] <= per_worker["GPU"] * max_workers
    assert config.tensor_parallel_size <= per_worker["GPU"]  # tensor-parallel ranks share a node


def test_images_run_the_ray_of_requirements():
    assert f"rayproject/ray:{ray.__version__}-" in DOCKERFILE
    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    assert cluster["docker"]["image"].startswith(f"rayproject/ray:{ray.__version__}-")
    assert f"ray[serve]=={ray.__version__}" in (ROOT / "requirements.txt").read_text()


def test_rayservice_embeds_the_serve_config_and_a_gpu_group_that_holds_the_app():
    service = yaml.safe_load((DEPLOY / "kuberay/rayservice.yaml").read_text())
    assert (service["apiVersion"], service["kind"]) == ("ray.io/v1", "RayService")
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    assert serve_config == yaml.safe_load((DEPLOY / "serve_config.yaml").read_text())
    (config,) = _app_configs(serve_config)

    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["rayVersion"] == ray.__version__ and cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (group,) = cluster["workerGroupSpecs"]
    assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    (container,) = group["template"]["spec"]["containers"]
    assert container["image"] == head["template"]["spec"]["containers"][0]["image"]
    limits = container["resources"]["limits"]
    per_worker = {"CPU": float(limits["cpu"]), "GPU": float(limits["nvidia.com/gpu"])}
    _assert_holds(config, per_worker, group["minReplicas"], group["maxReplicas"])
    mounts = {m["mountPath"] for pod in (head, group) for c in pod["template"]["spec"]["containers"]
              for m in c.get("volumeMounts", [])}
    assert str(Path(config.model).parent) in mounts  # the model path is on every pod


def test_cluster_yaml_passes_ray_up_validation_and_holds_the_app():
    cluster = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(cluster)))  # what `ray up` runs before it contacts the cloud
    (config,) = _app_configs(yaml.safe_load((DEPLOY / "serve_config.yaml").read_text()))
    types = cluster["available_node_types"]
    assert types[cluster["head_node_type"]]["resources"] == {"CPU": 0}
    (worker,) = [t for name, t in types.items() if name != cluster["head_node_type"]]
    assert 1 <= worker["min_workers"] <= worker["max_workers"] <= cluster["max_workers"]
    _assert_holds(config, worker["resources"], worker["min_workers"], worker["max_workers"])
    assert cluster["file_mounts"][IMAGE_ROOT] == "."
    assert any(config.model in command for command in cluster["setup_commands"])  # on every node
    assert all(f"PYTHONPATH={IMAGE_ROOT} ray start" in " ".join(cluster[key])
               for key in ("head_start_ray_commands", "worker_start_ray_commands"))
