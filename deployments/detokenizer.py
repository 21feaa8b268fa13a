"""The detokenizer stage: turns the engine's token deltas into UTF-8-safe text deltas."""
from __future__ import annotations

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.channel import Inbound, Outbound, ReplyTo
from app.config import ServiceConfig
from app.detokenize import text_chunks
from app.engine.outputs import merge_outputs
from app.protocol.messages import TokenizedJob, merge_chunks
from app.text import Tokenizer
from deployments.handles import for_this_replica
from deployments.nodes import model_dir_on_this_node


@serve.deployment(name="Detokenizer")
class DetokenizerDeployment:
    def __init__(self, config: ServiceConfig, engine: DeploymentHandle):
        self.tokenizer = Tokenizer(model_dir_on_this_node(config.model, "the detokenizer"))
        self.engine = for_this_replica(engine)
        self.inbound = Inbound(ray.util.get_node_ip_address(), merge_outputs)  # from the engines
        self.outbound = Outbound(merge_chunks, config.serve.detokenizer.stream_interval_ms)  # to the Ingresses

    async def generate(self, job: TokenizedJob, reply_to: ReplyTo) -> None:
        """Send the job's text chunks to `reply_to` and return once the last is written. Cancelling
        this call, or the consumer's death, cancels the engine's request."""
        outputs = self.inbound.receive(self._engine_call(job))
        await self.outbound.stream(reply_to, text_chunks(self.tokenizer, job, outputs))

    def ready(self) -> bool:
        return True

    def _engine_call(self, job: TokenizedJob):
        # Requests for an adapter go to the engine replicas that already hold it (Serve multiplexing).
        generate = self.engine.generate.options(multiplexed_model_id=job.adapter.name) if job.adapter \
            else self.engine.generate
        return lambda reply_to: generate.remote(job.request_id, job.prompt_token_ids, job.params, job.adapter, reply_to)
