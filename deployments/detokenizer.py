"""The detokenizer stage: turns the engine's token deltas into UTF-8-safe text deltas."""
from __future__ import annotations

from contextlib import aclosing

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from app.channel import Inbound, Outbound, ReplyTo
from app.config import ServiceConfig
from app.engine.llm_engine import merge_outputs
from app.engine.outputs import RequestOutput
from app.protocol.messages import PromptText, TextChunk, TextOutput, TokenizedJob, TokenText, merge_chunks
from app.text import IncrementalDetokenizer, Tokenizer
from deployments.handles import for_this_replica
from deployments.workers import model_dir_on_this_node


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
        await self.outbound.stream(reply_to, self._text(job))

    def ready(self) -> bool:
        return True

    def _engine_call(self, job: TokenizedJob):
        # Requests for an adapter go to the engine replicas that already hold it (Serve multiplexing).
        generate = self.engine.generate.options(multiplexed_model_id=job.adapter.name) if job.adapter \
            else self.engine.generate
        return lambda reply_to: generate.remote(job.request_id, job.prompt_token_ids, job.params, job.adapter, reply_to)

    def _token_texts(self, token_ids: list[int], top_logprobs: list | None, offset: int) -> tuple[list[TokenText], int]:
        """Each token decoded on its own (Tokenizer.token_piece), with its alternatives if asked
        (`top_logprobs`, aligned with the tokens; None where there are none); `offset` is where the
        first starts, and the offset after the last comes back."""
        tokens = []
        for i, token_id in enumerate(token_ids):
            text, raw = self.tokenizer.token_piece(token_id)
            ids, values = (top_logprobs and top_logprobs[i]) or ((), ())
            top = [(*self.tokenizer.token_piece(t), value) for t, value in zip(ids, values)]
            tokens.append(TokenText(text, raw, offset, top))
            offset += len(text)
        return tokens, offset

    def _prompt(self, job: TokenizedJob, out: RequestOutput) -> PromptText:
        """The prompt to echo, and its tokens and logprobs where the engine computed them (they
        come with its first output)."""
        if out.prompt_logprobs is None:
            return PromptText(job.echo)
        tokens, _ = self._token_texts(job.prompt_token_ids, out.prompt_top_logprobs, 0)
        return PromptText(job.echo, tokens, out.prompt_logprobs)

    async def _text(self, job: TokenizedJob):
        detoks: dict[int, IncrementalDetokenizer] = {}
        offsets: dict[int, int] = {}  # characters of each output's token texts so far
        echoed = False
        async with aclosing(self.inbound.receive(self._engine_call(job))) as outputs:
            async for out in outputs:
                chunk = TextChunk([], out.finished, len(job.prompt_token_ids), out.metrics,
                                  context_logits=out.context_logits)
                if job.echo is not None and not echoed:
                    chunk.prompt, echoed = self._prompt(job, out), True
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
                    tokens = None
                    if c.logprobs is not None:
                        tokens, offsets[c.index] = self._token_texts(c.token_ids, c.top_logprobs,
                                                                     offsets.get(c.index, 0))
                    chunk.outputs.append(TextOutput(c.index, text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                                    finish, reason, tokens, c.generation_logits))
                chunk.finished = chunk.finished or (bool(detoks) and all(d.stopped is not None for d in detoks.values()))
                yield chunk
                if chunk.finished:
                    return  # every output hit a stop string: leaving cancels the engine's request
