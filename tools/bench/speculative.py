"""Speculation at batch 1: the same engine settings with and without `speculative_config` (n-gram, or
a draft model with --draft-model), on requests whose answers copy spans of their prompt (code to
repeat or edit, text to correct) and on requests whose answers do not (questions), one request at a
time, greedy.

    python -m tools.bench.speculative --model smollm2-135m --device cuda --dtype bfloat16 --json out.json
    python -m tools.bench.speculative --model configs/shapes/llama-3.1-8b --load-format dummy \
        --draft-model configs/shapes/llama-3.2-1b --device cuda --dtype bfloat16

Reports output tok/s for each, the speedup, the acceptance rate, and whether the outputs equal
(batch-size-dependent rounding may flip a near-tie in 16-bit: the count of equal outputs is reported).
With a draft model, also what its proposals cost: the wall time of the draft's passes per proposal
(they end in a read back, so wall time is device time), beside the target's time per step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from app.engine import EngineConfig, LLMEngine, SamplingParams

CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config needs a name")
    return Config(name=data["name"], size=data.get("size", 1), tags=data.get("tags", []))


def save_config(config, path):
    with open(path, "w") as f:
        json.dump({"name": config.name, "size": config.size, "tags": config.tags}, f, indent=2)
'''
TEXT = ("The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
        "the members agreed to increase funding for the library by ten percent and to postpone the decision "
        "on the new sports hall until the spring meeting. The chair thanked everyone for their patience.")
COPYING = [
    "Repeat this code exactly, then stop:\n" + CODE,
    "Rename the function load_config to read_config everywhere in this code and show the whole result:\n" + CODE,
    "Add a docstring to each function of this code and show the whole code:\n" + CODE,
    "Correct any spelling mistakes in this text and repeat it in full:\n" + TEXT.replace("members", "membres"),
    "Copy this paragraph word for word:\n" + TEXT,
]
ASKING = ["What is machine learning?", "Write a short poem about the sea.", "Give three tips for learning to cook.",
          "Why is the sky blue?", "Describe a busy train station in the morning."]


def timed_proposals(engine: LLMEngine) -> dict:
    """Counts the proposer's calls, the guesses they made and the wall time they took, until
    `restore` is called."""
    record = {"proposals": 0, "guesses": 0, "seconds": 0.0, "restore": lambda: None}
    if engine.proposer is None:
        return record
    propose_all = engine.proposer.propose_all

    def timed(wanted):
        start = time.perf_counter()
        drafts = propose_all(wanted)
        record["seconds"] += time.perf_counter() - start
        record["proposals"] += len(wanted)
        record["guesses"] += sum(len(d) for d in drafts)
        return drafts
    engine.proposer.propose_all = timed
    record["restore"] = lambda: setattr(engine.proposer, "propose_all", propose_all)
    return record


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
    proposals, steps = timed_proposals(engine), engine.num_steps
    tokens, wall, outputs, drafted, accepted = 0, 0.0, [], 0, 0
    per_request = []
    for prompt in prompts:
        start = time.perf_counter()
        (out,) = engine.generate([prompt], params)
        elapsed = time.perf_counter() - start
        n = len(out.outputs[0].token_ids)
        tokens, wall = tokens + n, wall + elapsed
        per_request.append(n / elapsed)
        outputs.append(out.outputs[0].token_ids)
        drafted += out.metrics.total_draft_tokens
        accepted += out.metrics.total_accepted_draft_tokens
    proposals["restore"]()
    return {"output_tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "median_request_tok_s": statistics.median(per_request), "draft_tokens": drafted,
            "accepted_draft_tokens": accepted, "acceptance_rate": accepted / drafted if drafted else 0.0,
            "steps": engine.num_steps - steps, "proposals": proposals["proposals"],
            "proposal_ms": 1e3 * proposals["seconds"] / max(1, proposals["proposals"]),
            "guesses_per_proposal": proposals["guesses"] / max(1, proposals["proposals"]),
            "target_ms_per_step": 1e3 * (wall - proposals["seconds"]) / max(1, engine.num_steps - steps),
            "outputs": outputs}


def steady_proposal_ms(engine: LLMEngine, prompt: list[int], batch: int, repeats: int = 30) -> float:
    """Median wall time of one draft-model proposal (max_draft_len guesses each for `batch`
    sequences) as it follows a step that rejected a guess: the draft has seen all but the last
    token, so the proposal is a one-row catch-up and the passes after it (after a step that took
    every guess it is two rows, in the same graph replay). The workloads of `run`, with random
    weights, accept nothing: their proposals follow pauses, and catch up over many tokens."""
    ids = [f"steady-{i}" for i in range(batch)]
    # Steps read back before the next: no sequence holds a placeholder for a token still on the device.
    overlap, engine.overlap = engine.overlap, False
    for rid in ids:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=512, temperature=0.0, ignore_eos=True))
    while any(engine.requests[rid].seqs[0].num_output_tokens < 2 for rid in ids):
        engine.step()
    seqs, k = [engine.requests[rid].seqs[0] for rid in ids], engine.proposer.max_draft_len
    for seq in seqs:  # the slots the guesses write, as the scheduler holds them before it asks
        assert engine.block_manager.ensure_slots(seq, seq.num_tokens + k)
    engine.proposer.propose_all([(seq, k) for seq in seqs])  # the draft sees the prompts
    times = []
    for _ in range(repeats):
        for seq in seqs:
            seq.draft_kv_tokens = seq.num_tokens - 1
        start = time.perf_counter()
        engine.proposer.propose_all([(seq, k) for seq in seqs])
        times.append(time.perf_counter() - start)
    for rid in ids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    engine.overlap = overlap
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--load-format", default="auto", help="dummy: random weights (speed and overhead only)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-draft-len", type=int, default=4)
    parser.add_argument("--ngram", type=int, default=3)
    parser.add_argument("--draft-model", help="draft-target speculation with this draft model (same tokenizer) "
                                              "in place of n-gram; loaded as --load-format says")
    parser.add_argument("--json")
    args = parser.parse_args()
    results = {}
    speculative = {"max_draft_len": args.max_draft_len, "max_matching_ngram_size": args.ngram}
    if args.draft_model:
        speculative = {"decoding_type": "DraftTarget", "max_draft_len": args.max_draft_len,
                       "speculative_model": args.draft_model}
    for name, speculative in (("plain", None), ("speculative", speculative)):
        engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, max_batch_size=16,
                                        load_format=args.load_format,
                                        speculative_config=speculative,
                                        kv_cache_config={"max_tokens": 65536, "tokens_per_block": 32}))
        tokenizer = AutoTokenizer.from_pretrained(engine.model_dir)

        def chat(text: str) -> list[int]:
            if tokenizer.chat_template is None:  # a shape's synthetic tokenizer (tools/gpu/make_tokenizer.py)
                return tokenizer.encode(text)
            return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                  add_generation_prompt=True, tokenize=False))
        results[name] = {workload: run(engine, [chat(p) for p in prompts], args.max_tokens)
                         for workload, prompts in (("copying", COPYING), ("asking", ASKING))}
        if name == "speculative" and args.draft_model:
            steady = {batch: steady_proposal_ms(engine, chat(ASKING[0]), batch) for batch in (1, 4)}
            print("steady-state proposal (one-row catch-up, then the passes): "
                  + ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in steady.items()), flush=True)
        engine.shutdown()
        del engine
    report = {"args": vars(args), "workloads": {}, "steady_proposal_ms": steady if args.draft_model else None}
    for workload in ("copying", "asking"):
        plain, spec = results["plain"][workload], results["speculative"][workload]
        equal = sum(a == b for a, b in zip(plain["outputs"], spec["outputs"]))
        row = {"plain_tok_s": plain["tok_s"], "speculative_tok_s": spec["tok_s"],
               "speedup": spec["tok_s"] / plain["tok_s"], "acceptance_rate": spec["acceptance_rate"],
               "draft_tokens": spec["draft_tokens"], "output_tokens": plain["output_tokens"],
               "equal_outputs": f"{equal}/{len(plain['outputs'])}",
               "plain_ms_per_step": plain["target_ms_per_step"], "target_ms_per_step": spec["target_ms_per_step"],
               "proposals": spec["proposals"], "proposal_ms": spec["proposal_ms"],
               "guesses_per_proposal": spec["guesses_per_proposal"]}
        report["workloads"][workload] = row
        print(f"{workload:8s} plain {row['plain_tok_s']:7.1f} tok/s  speculative {row['speculative_tok_s']:7.1f} "
              f"tok/s  x{row['speedup']:.2f}  acceptance {row['acceptance_rate']:.2f}  equal outputs "
              f"{row['equal_outputs']}  step {row['plain_ms_per_step']:.2f} / {row['target_ms_per_step']:.2f} ms  "
              f"{row['proposals']} proposals of {row['guesses_per_proposal']:.1f} in {row['proposal_ms']:.2f} ms",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
