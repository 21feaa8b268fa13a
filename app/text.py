"""Text <-> token ids: the tokenizer, chat templates, and an incremental, UTF-8-safe detokenizer."""
from __future__ import annotations

import re
from pathlib import Path

BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one raw byte


class Tokenizer:
    """The model's own tokenizer (transformers), loaded from the model directory; no remote code."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer

        self.hf = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
        self.eos_token_id = self.hf.eos_token_id
        self.pad_token_id = self.hf.pad_token_id if self.hf.pad_token_id is not None else self.eos_token_id
        self._byte_decoder = _byte_decoder(self.hf)
        self._added = set(self.hf.added_tokens_decoder)  # stored as their text, in every kind of tokenizer
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token_piece's, at most one per vocabulary entry

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """encode() of each text; a fast tokenizer spreads the batch over its threads, off the GIL."""
        return [list(ids) for ids in self.hf(texts, add_special_tokens=True)["input_ids"]]

    def encode_words(self, words: list[str]) -> list[list[int]]:
        """Stop/bad words as token-id sequences (the seeds' preprocessing does the same)."""
        return [ids for ids in (self.encode(w, add_special_tokens=False) for w in words if w) if ids]

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not self.hf.chat_template:
            raise ValueError("this model has no chat template; use /v1/completions")
        out = self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                          return_dict=True)
        return list(out["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token on its own, as OpenAI's logprobs show it: its text and its own bytes.

        The bytes come from the token's vocabulary entry (convert_ids_to_tokens): byte-level BPE
        spells each byte as one printable character, SentencePiece writes a byte-fallback token as
        <0xHH> and a space as U+2581. So a token holding part of a multibyte character gives the raw
        byte(s), which decode() cannot (it gives U+FFFD). The text is those bytes as UTF-8, U+FFFD
        for such a part: decoding the id alone would also drop SentencePiece's leading space."""
        piece = self._pieces.get(token_id)
        if piece is None:
            name = self.hf.convert_ids_to_tokens(token_id) or ""  # None: an id past the tokenizer's (padded vocab)
            if self._byte_decoder is not None and token_id not in self._added:
                raw = bytes(self._byte_decoder[c] for c in name)
            elif byte := BYTE_PIECE.fullmatch(name):
                raw = bytes([int(byte[1], 16)])
            else:
                raw = name.replace("\u2581", " ").encode()
            piece = self._pieces[token_id] = (raw.decode(errors="replace"), raw)
        return piece


def _byte_decoder(hf) -> dict[str, int] | None:
    """Byte-level BPE's character -> byte table (GPT-2's), for tokenizers that decode with it."""
    from tokenizers import decoders
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    backend = getattr(hf, "backend_tokenizer", None)  # None: a slow (SentencePiece) tokenizer
    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    return {char: byte for byte, char in bytes_to_unicode().items()}


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas whose concatenation equals decode(all ids).

    Text is decoded over a sliding window of tokens (vLLM's prefix/read offsets) and released only
    once it does not end in a partial UTF-8 character. Stop strings are matched on the text; while
    the stream runs, the last len(longest stop) - 1 characters are held back because they may be
    the start of one. On a match the text is cut before the stop string and `stopped` is set.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (complete characters only)
        self.emitted = 0  # characters of `text` already returned
        self.stopped: str | None = None

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to send."""
        if self.stopped is not None:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if len(window) > len(prefix) and not window.endswith("\ufffd"):
            self.text += window[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self, cut_ids: list[int] | None = None) -> str:
        """The stream ended: release everything left, partial characters included. `cut_ids` is a
        stop sequence the engine matched on token ids and cut: when a stop string shows up earlier
        in the text those ids complete (a string can tokenize differently in context), the text is
        cut there, so the result is the same as matching on text alone."""
        if self.stopped is None:
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            tail = self._decode(self.ids[self.prefix_offset:] + list(cut_ids or []))[len(prefix):]
            rest = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
            whole, self.text = self.text + tail, self.text + rest
            self.prefix_offset = self.read_offset = len(self.ids)
            start = max(0, self.emitted - max(map(len, self.stop), default=0))
            hits = [(i, s) for i, s in ((whole.find(s, start), s) for s in self.stop) if 0 <= i < len(self.text)]
            if cut_ids and hits:
                cut, self.stopped = min(hits)
                self.text = self.text[:cut]
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and self.stopped is None:
            start = max(0, self.emitted - max(map(len, self.stop)))
            hits = [(self.text.find(s, start), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                cut, self.stopped = min(hits)
                self.text = self.text[:cut]
                final = True
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - max(map(len, self.stop)) + 1)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""
