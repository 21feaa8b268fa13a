"""The tokenizer stage: text, chat messages and stop/bad words to token ids."""
from __future__ import annotations

from dataclasses import replace

from ray import serve

from app.engine.errors import InvalidRequestError
from app.engine.model_loader import resolve_model_dir
from app.protocol.messages import GenerationJob, TokenizedJob
from app.text import Tokenizer


@serve.deployment(name="Tokenizer")
class TokenizerDeployment:
    def __init__(self, model: str):
        self.tokenizer = Tokenizer(resolve_model_dir(model))

    def ready(self) -> bool:
        return True

    def tokenize(self, job: GenerationJob) -> TokenizedJob:
        if job.messages is not None:
            try:
                ids = self.tokenizer.apply_chat_template(job.messages)
            except ValueError as exc:
                raise InvalidRequestError("messages", str(exc)) from None
        elif job.prompt_token_ids is not None:
            ids = job.prompt_token_ids
        else:
            ids = self.tokenizer.encode(job.prompt)
        params = replace(job.params,
                         stop_token_ids=job.params.stop_token_ids + self.tokenizer.encode_words(job.stop),
                         bad_token_ids=job.params.bad_token_ids + self.tokenizer.encode_words(job.bad_words))
        return TokenizedJob(job.request_id, ids, params, job.stop, job.adapter)
