"""The detokenizer stage: streams the engine's token deltas back as UTF-8-safe text deltas."""
from __future__ import annotations

from ray import serve
from ray.serve.handle import DeploymentHandle

from app.config import ServiceConfig
from app.engine.model_loader import resolve_model_dir
from app.protocol.messages import TextChunk, TextOutput, TokenizedJob, merge_chunks
from app.streaming import StreamPacer
from app.text import IncrementalDetokenizer, Tokenizer
from deployments.consumers import ConsumerWatch, own_name


@serve.deployment(name="Detokenizer")
class DetokenizerDeployment:
    def __init__(self, config: ServiceConfig, engine: DeploymentHandle):
        self.tokenizer = Tokenizer(resolve_model_dir(config.model))
        self.engine = engine
        self.pacer = StreamPacer(config.serve.detokenizer.stream_interval_ms)
        self.consumers = ConsumerWatch()
        self.name = own_name()

    async def generate(self, job: TokenizedJob, consumer: str | None = None):
        """Text chunks of the job; the death of the `consumer` replica cancels the stream (and so the
        engine's request)."""
        async for chunk in self.pacer.pace(self.consumers.guard(consumer, self._text(job)), merge_chunks):
            yield chunk

    def ready(self) -> bool:
        return True

    async def _text(self, job: TokenizedJob):
        # Requests for an adapter go to the engine replicas that already hold it (Serve multiplexing).
        options = {"stream": True, "multiplexed_model_id": job.adapter.name} if job.adapter else {"stream": True}
        stream = self.engine.generate.options(**options).remote(job.request_id, job.prompt_token_ids, job.params,
                                                                job.adapter, self.name)
        detoks: dict[int, IncrementalDetokenizer] = {}
        try:
            async for out in stream:
                outputs = []
                for c in out.outputs:
                    detok = detoks.setdefault(c.index, IncrementalDetokenizer(self.tokenizer, job.stop))
                    if detok.stopped is not None:
                        continue  # already ended by a stop string; the engine may still be producing
                    text = detok.push(c.token_ids)
                    finish, reason = c.finish_reason, c.stop_reason
                    if detok.stopped is not None:
                        finish, reason = "stop", detok.stopped
                    if finish is not None:
                        text += detok.finish(reason if isinstance(reason, list) else None)
                        if detok.stopped is not None:
                            finish, reason = "stop", detok.stopped
                    outputs.append(TextOutput(c.index, text, c.token_ids, c.logprobs, c.cumulative_logprob, finish,
                                              reason))
                done_by_text = bool(detoks) and all(d.stopped is not None for d in detoks.values())
                yield TextChunk(outputs, out.finished or done_by_text, len(job.prompt_token_ids), out.metrics)
                if done_by_text and not out.finished:
                    return  # every output hit a stop string: leaving cancels the engine's request
        finally:
            stream.cancel()
