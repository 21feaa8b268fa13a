"""The tokenizer stage: text, chat messages and stop/bad words to token ids."""
from __future__ import annotations

import logging
from dataclasses import replace

from jinja2 import TemplateError
from ray import serve

from app.engine.errors import InvalidRequestError
from app.protocol import tools
from app.protocol.messages import GenerationJob, TokenizedJob
from app.text import Tokenizer
from deployments.nodes import model_dir_on_this_node

logger = logging.getLogger("ray.serve")


@serve.deployment(name="Tokenizer")
class TokenizerDeployment:
    def __init__(self, model: str, tool_call_parser: str = "auto"):
        self.tokenizer = Tokenizer(model_dir_on_this_node(model, "the tokenizer"))
        self.tool_parser = tools.pick_parser(tool_call_parser, self.tokenizer.hf.chat_template)

    def ready(self) -> bool:
        return True

    def tool_call_parser(self) -> str:
        """The format tool calls take in this model's output: the Ingress parses them."""
        return self.tool_parser

    def tokenize_many(self, jobs: list[GenerationJob]) -> list[TokenizedJob | Exception]:
        """Each job's tokens, or the error that refuses it: one job's error is its own (the Ingress
        sends the jobs that reached it together as one call, app/batching.py). Text prompts are
        encoded as one batch: a wave of them is not tokenized one after another."""
        texts = {i: job.prompt for i, job in enumerate(jobs)
                 if job.messages is None and job.prompt_token_ids is None and isinstance(job.prompt, str)}
        try:
            encoded = dict(zip(texts, self.tokenizer.encode_many(list(texts.values())))) if texts else {}
        except Exception:  # noqa: BLE001 - each job is encoded on its own below, and fails alone
            encoded = {}
        results: list[TokenizedJob | Exception] = []
        for i, job in enumerate(jobs):
            try:
                results.append(self._tokenize(job, encoded.get(i)))
            except InvalidRequestError as exc:
                results.append(exc)
            except Exception:  # noqa: BLE001 - a bug here must not fail the other jobs of the call
                logger.exception("tokenizing request %s failed", job.request_id)
                results.append(RuntimeError("the tokenizer failed on this request; its log says why"))
        return results

    def _tokenize(self, job: GenerationJob, encoded: list[int] | None = None) -> TokenizedJob:
        if job.messages is not None:
            messages, functions = tools.for_template(job.messages, job.tools, self.tokenizer.hf.chat_template,
                                                     self.tool_parser)
            try:
                ids = self.tokenizer.apply_chat_template(messages, functions)
            except (ValueError, TemplateError) as exc:  # a template's raise_exception() refuses the conversation
                raise InvalidRequestError("messages", str(exc)) from None
        elif job.prompt_token_ids is not None:
            ids = job.prompt_token_ids
        else:
            ids = encoded if encoded is not None else self.tokenizer.encode(job.prompt)
        params = replace(job.params,
                         stop_token_ids=job.params.stop_token_ids + self.tokenizer.encode_words(job.stop),
                         bad_token_ids=job.params.bad_token_ids + self.tokenizer.encode_words(job.bad_words))
        echo = None
        if job.echo:  # the text as sent; token ids as they decode
            echo = job.prompt if job.prompt is not None else self.tokenizer.decode(ids)
        return TokenizedJob(job.request_id, ids, params, job.stop, job.adapter, echo)
