"""Stream a chat answer from the portable engine, no server: a quick look at the engine working.

    python tools/demo.py "What is the capital of France?"
"""
from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from app.engine import AsyncLLMEngine, EngineConfig, SamplingParams  # noqa: E402


async def chat(engine: AsyncLLMEngine, tokenizer, question: str, max_tokens: int) -> None:
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"]
    tokens, shown = [], ""
    async for out in engine.generate("demo", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0)):
        tokens.extend(out.outputs[0].token_ids)
        text = tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):  # hold back a partial multi-byte character
            print(text[len(shown):], end="", flush=True)
            shown = text
    print(f"\n[{out.outputs[0].finish_reason}; {out.metrics.num_prompt_tokens} prompt tokens, "
          f"{out.metrics.num_output_tokens} generated, first token after "
          f"{(out.metrics.first_token_time_ns - out.metrics.arrival_time_ns) / 1e6:.0f} ms]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="What is the capital of France?")
    parser.add_argument("--model", default=EngineConfig.model)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    engine = AsyncLLMEngine(EngineConfig(model=args.model, kv_cache_config={"max_tokens": 8192}))
    tokenizer = AutoTokenizer.from_pretrained(engine.engine.model_dir)
    try:
        asyncio.run(chat(engine, tokenizer, args.question, args.max_tokens))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
