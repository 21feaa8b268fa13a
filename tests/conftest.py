"""Shared fixtures: a small random Llama and the embedded SmolLM2, with transformers references."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from app.engine import EngineConfig, LLMEngine, SamplingParams
from app.engine.model_dir import resolve_model_dir

torch.set_num_threads(2)
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session, exitstatus):
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave without the interpreter's teardown, once the report is out. The suite starts and stops
    Ray four times in this process; Ray keeps native and daemon threads past ray.shutdown() (Serve's
    router loop is still polling here at the end; ray-project/ray#31145: not safe to restart in one
    process), and tearing the interpreter down under them killed CI's process with a segmentation
    fault after every test had passed (twice, with no Python frame even under the fault handler)."""
    if _EXIT_STATUS not in config.stash:  # no session ran (--help, --markers): the usual exit
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A 2-layer Llama with GQA and untied embeddings, saved as an HF safetensors directory.
    The init is wide (std 0.2) so that logits are peaked and greedy choices are far from ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                         tie_word_embeddings=False, rope_theta=10000.0)
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_llama_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A 4-layer random Llama over SmolLM2's vocabulary and tokenizer: a model that serves text and
    splits two ways in both dimensions (SmolLM2's 9 heads and 3 KV heads do not halve)."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny-chat-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    for file in smollm2_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, path / file.name)
    return path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model_dir("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_hf(tiny_llama_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(smollm2_dir)


def make_engine(model_dir: Path, max_tokens: int = 4096, tokens_per_block: int = 8, reuse: bool = True,
                **overrides) -> LLMEngine:
    kv = {"max_tokens": max_tokens, "tokens_per_block": tokens_per_block, "enable_block_reuse": reuse}
    return LLMEngine(EngineConfig(model=str(model_dir), kv_cache_config=kv, **overrides))


def hf_greedy(model, prompt: list[int], max_new_tokens: int, **kwargs) -> list[int]:
    """transformers' greedy continuation, with the end-of-sequence token cut as our engine does."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=model.config.eos_token_id, **kwargs)[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return out[:-1] if out and out[-1] in eos else out


def hf_greedy_logprobs(model, prompt: list[int], max_new_tokens: int, pad_token_id: int) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and the logprob of each (log-softmax of its step's logits)."""
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=pad_token_id)
    tokens = ref.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(ref.logits, tokens)]


async def leave_a_stream_early(engine, prompt: list[int]) -> bool:
    """Open a long stream on an async engine and leave it after its first output: whether the
    engine then holds no request and no KV block within 4 s (leaving must abort at once)."""
    import asyncio

    stream = engine.generate("gone", prompt, SamplingParams(max_tokens=400, ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()
    for _ in range(200):
        stats = engine.stats()
        if stats.num_running == 0 and stats.used_blocks == 0:
            return True
        await asyncio.sleep(0.02)
    return False


async def stream_tokens(engine, request_id: str, prompt: list[int], params: SamplingParams,
                        adapter_id: str | None = None) -> list[int]:
    """One request's tokens from an async engine (AsyncLLMEngine or EngineProcess), to the end."""
    tokens = []
    async for output in engine.generate(request_id, prompt, params, adapter_id):
        tokens.extend(output.outputs[0].token_ids)
    return tokens


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high + 1, (n,), generator=g).tolist()
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for length in lengths]


def mixed_sampling_params(count: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, n=2, end-of-sequence and stop-sequence stops, logprobs, short and
    long max_tokens, and one request with a repetition penalty: while it runs, steps are not overlapped."""
    params = []
    for i in range(count):
        p = dict(max_tokens=4 + (i * 7) % 29, logprobs=True, ignore_eos=i % 3 == 0)
        if i % 2:
            p.update(temperature=0.9, top_p=0.9, seed=100 + i, n=2 if i % 4 == 1 else 1)
        else:
            p.update(temperature=0.0, stop_token_ids=[[7, 9], [200]])
        if i == 13:
            p.update(repetition_penalty=1.3)
        params.append(SamplingParams(**p))
    return params


def run_staggered(engine: LLMEngine, prompts: list[list[int]], params, arrivals: list[int],
                  adapters: list[str | None] | None = None) -> list:
    """Add prompt i at step arrivals[i] (under adapters[i], if given); run until all finish; return
    merged outputs in prompt order."""
    from app.engine.outputs import merge_outputs

    params = params if isinstance(params, list) else [params] * len(prompts)
    merged, pending, step = {}, set(range(len(prompts))), 0
    while pending or engine.has_unfinished_requests():
        for i in sorted(pending):
            if arrivals[i] <= step:
                engine.add_request(f"r{i}", prompts[i], params[i], adapter_id=adapters[i] if adapters else None)
                pending.discard(i)
        for out in engine.step():
            merged[out.request_id] = merge_outputs(merged.get(out.request_id), out)
        step += 1
    return [merged[f"r{i}"] for i in range(len(prompts))]


ADAPTER_SEEDS = {"sql": 1, "poet": 2, "pirate": 3, "chef": 4}


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory, smollm2_dir):
    """PEFT adapters on SmolLM2 (random, non-zero B) under one adapter root."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    for name, seed in ADAPTER_SEEDS.items():
        torch.manual_seed(seed)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(smollm2_dir),
                               LoraConfig(r=4 + seed, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          init_lora_weights=False))
        for module in model.modules():
            if hasattr(module, "lora_B"):
                for b in module.lora_B.values():
                    torch.nn.init.normal_(b.weight, std=0.06)
        model.save_pretrained(root / name)
    return root
