"""The other ranks of a tensor/pipeline-parallel torch engine, as Ray actors in the engine
replica's placement group: rank r in bundle r (the replica itself is rank 0, in bundle 0)."""
from __future__ import annotations

import ray
from ray.exceptions import RayTaskError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from app.engine.executor import free_port
from app.engine.worker import worker_main
from deployments.nodes import model_dir_on_this_node, placement_of_this_process


@ray.remote(max_concurrency=2)  # `run` holds one thread for the rank's life; `placement` answers beside it
class EngineRank:
    def run(self, kwargs: dict) -> None:
        worker_main(**kwargs)

    def model_dir(self, model: str) -> str:
        return str(model_dir_on_this_node(model, "an engine rank"))

    def placement(self) -> dict:
        return placement_of_this_process()


class PlacementGroupLauncher:
    def __init__(self, device: str):
        self.placement_group = get_current_placement_group()
        if self.placement_group is None:
            raise RuntimeError("a parallel engine replica must run in its placement group "
                               "(engine_deployment_options sets placement_group_bundles)")
        self.on_gpu = device != "cpu"
        self.actors, self.runs = [], []

    def rendezvous(self) -> str:
        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def device(self, rank: int, device: str) -> str:
        return "cuda:0" if self.on_gpu else device  # Ray shows each rank only its own GPU

    def start(self, rank: int, kwargs: dict) -> None:
        strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
        resources = {"num_gpus": 1, "num_cpus": 0} if self.on_gpu else {"num_cpus": 1}
        actor = EngineRank.options(scheduling_strategy=strategy, name=None, **resources).remote()
        self.actors.append(actor)
        # Each rank finds the model on its own node (rank 0's directory is a path on rank 0's node; an
        # embedded model is converted there). One that cannot fails here, in one sentence, instead of
        # leaving rank 0 to wait out the rendezvous timeout.
        try:
            model_dir = ray.get(actor.model_dir.remote(kwargs["config"].model))
        except RayTaskError as exc:
            raise exc.cause from None
        self.runs.append(actor.run.remote({**kwargs, "model_dir": model_dir}))

    def lost_rank(self) -> bool:
        """Whether a rank has ended while rank 0 runs (its node lost, its actor killed): Ray fails
        the rank's `run` call, which otherwise returns only when rank 0 stops it."""
        return bool(self.runs) and bool(ray.wait(self.runs, timeout=0)[0])

    def placements(self) -> list[dict]:
        """Where ranks 1..N-1 run (placement group and node id of each), for operators and tests."""
        return ray.get([actor.placement.remote() for actor in self.actors])

    def stop(self) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for actor in self.actors:
            ray.kill(actor)
        self.actors, self.runs = [], []
