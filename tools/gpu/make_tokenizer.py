"""A synthetic tokenizer for a model shape (configs/shapes/<name>: config.json, no weights), so that
the Tokenizer and Detokenizer stages can serve a dummy-weight model: every id of the vocabulary
decodes, and any text encodes.

It is a byte-level BPE like Llama 3's: the 256 byte symbols, then merges that build ASCII words
("abc", "Ġabc" = " abc") up to the vocabulary size, so random ids decode to readable text of about
four characters a token. Ids from the lowest of bos/eos up are special tokens when they sit at the
top of the vocabulary (Llama 3: 128000-128255, with its names), else bos and eos alone are.
Deterministic: the same config.json gives the same files.

    python tools/gpu/make_tokenizer.py configs/shapes/llama-3.1-8b

writes tokenizer.json and tokenizer_config.json beside config.json (ignored by git; 8.5 MB for
Llama 3's 128,256 ids) and checks that transformers' AutoTokenizer loads them.
"""
from __future__ import annotations

import argparse
import itertools
import json
import string
from pathlib import Path

# Llama 3's named special tokens (tokenizer_config.json of meta-llama/Llama-3.1-8B-Instruct).
LLAMA3_NAMES = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
                128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>",
                128009: "<|eot_id|>", 128010: "<|python_tag|>"}
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
SPACE = "\u0120"  # the byte-level symbol of " "


def special_ids(config: dict) -> list[int]:
    vocab = config["vocab_size"]
    eos = config.get("eos_token_id")
    named = {config.get("bos_token_id"), *(eos if isinstance(eos, list) else [eos])} - {None}
    low = min(named)
    return list(range(low, vocab)) if vocab - low <= 1024 else sorted(named)


def special_name(token_id: int, config: dict, reserved: itertools.count) -> str:
    if config["vocab_size"] == 128256 and token_id in LLAMA3_NAMES:
        return LLAMA3_NAMES[token_id]
    return f"<|reserved_special_token_{next(reserved)}|>"


def words(count: int):
    """`count` tokens: words of letters after a space, then bare and after a space, shortest first."""
    made = 0
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            word = "".join(letters)
            for token in [SPACE + word] if length == 1 else [word, SPACE + word]:  # single letters are bytes
                if made == count:
                    return
                yield token
                made += 1


def build(config: dict):
    """The tokenizer and the names of its special ids. Every id is in the BPE vocabulary: specials at
    their ids, the byte symbols and the words in the ids left, each word merged from its prefix."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    reserved = itertools.count()
    names = {i: special_name(i, config, reserved) for i in special_ids(config)}
    free = [i for i in range(config["vocab_size"]) if i not in names]
    alphabet = sorted(ByteLevel.alphabet(), key=lambda ch: (ch not in string.printable, ch))
    if len(free) < len(alphabet):
        raise ValueError(f"vocab_size {config['vocab_size']} leaves no room for the 256 byte symbols")
    tokens = alphabet + list(words(len(free) - len(alphabet)))
    vocab = {**dict(zip(tokens, free)), **{name: i for i, name in names.items()}}
    merges = [(token[:-1], token[-1]) for token in tokens[len(alphabet):]]
    tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names.values()])
    bos = names.get(config.get("bos_token_id"))
    if bos is not None:  # Llama 3 prepends <|begin_of_text|>
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, config["bos_token_id"])])
    return tokenizer, names


def write(shape_dir: Path) -> Path:
    config = json.loads((shape_dir / "config.json").read_text())
    tokenizer, names = build(config)
    if tokenizer.get_vocab_size() != config["vocab_size"]:
        raise ValueError(f"built {tokenizer.get_vocab_size()} ids, config.json has {config['vocab_size']}")
    tokenizer.save(str(shape_dir / "tokenizer.json"))
    eos = config.get("eos_token_id")
    eos_id = 128009 if config["vocab_size"] == 128256 else (eos[0] if isinstance(eos, list) else eos)
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.get("max_position_embeddings"),
                "bos_token": names.get(config.get("bos_token_id")), "eos_token": names.get(eos_id),
                "clean_up_tokenization_spaces": False}
    if config["vocab_size"] == 128256:
        settings["chat_template"] = LLAMA3_CHAT_TEMPLATE
    (shape_dir / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return shape_dir


def check(shape_dir: Path) -> str:
    """Load it as the service does (app/text.py) and round-trip text and every id."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from app.text import Tokenizer

    config = json.loads((shape_dir / "config.json").read_text())
    tok = Tokenizer(shape_dir)
    text = "What is machine learning? Ünïcode, digits 123 and emoji \U0001f600."
    ids = tok.encode(text, add_special_tokens=False)
    if tok.decode(ids) != text:
        raise ValueError(f"round trip failed: {tok.decode(ids)!r}")
    if len(tok.hf) != config["vocab_size"]:
        raise ValueError(f"AutoTokenizer sees {len(tok.hf)} ids, config.json has {config['vocab_size']}")
    every = tok.hf.convert_ids_to_tokens(list(range(config["vocab_size"])))
    if any(t is None for t in every):
        raise ValueError("an id has no token")
    sample = tok.decode(list(range(config["vocab_size"] - 2000, config["vocab_size"] - 1990)))
    return (f"{shape_dir}: {len(tok.hf)} ids, bos {tok.hf.bos_token_id}, eos {tok.eos_token_id}; "
            f"{len(text)} chars -> {len(ids)} tokens; ids {config['vocab_size'] - 2000}.. decode to {sample!r}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape_dir", type=Path, nargs="+")
    for shape_dir in parser.parse_args(argv).shape_dir:
        print(check(write(shape_dir)), flush=True)


if __name__ == "__main__":
    main()
