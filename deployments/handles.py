"""Handles as a stage's replica calls with them."""
from __future__ import annotations

import os

from ray.serve.handle import DeploymentHandle


def for_this_replica(handle: DeploymentHandle) -> DeploymentHandle:
    """A handle passed to a deployment was made where the app was built, and carries that process's
    call options. Serve's switch for calls over gRPC (RAY_SERVE_USE_GRPC_BY_DEFAULT, which
    app/config.py's REPLICA_ENV sets for every stage) applies only to handles made in the replica
    itself, so it is applied here. (Not to the request-id registry's handle: the Ingress releases
    an id without awaiting the call, and only the actor-call path is known to send it regardless.)"""
    if os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") == "1":
        return handle.options(_by_reference=False)
    return handle
