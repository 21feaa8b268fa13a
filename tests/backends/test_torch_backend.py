"""The torch backend (the default) in-process, without Ray: what it adds to the engine."""
import asyncio

from app.backends.torch_backend import TorchBackend
from app.config import ServiceConfig
from app.engine import SamplingParams
from app.protocol.messages import AdapterRef


def test_concurrent_first_uses_of_an_adapter_share_one_load(smollm2_dir, lora_root):
    """Three requests name a new adapter at once: it is read and folded once, and all three get the
    adapter's answer (before, each prepared it, and each registration dropped the device copy)."""
    backend = TorchBackend(ServiceConfig(model=str(smollm2_dir), lora_roots=[str(lora_root)],
                                         kv_cache_config={"max_tokens": 4096}), {})
    prepared = []
    prepare = backend.engine.engine.prepare_lora
    backend.engine.engine.prepare_lora = lambda *args: prepared.append(args[0]) or prepare(*args)
    adapter = AdapterRef("chef", str(lora_root / "chef"), "lora_path")

    async def answer():
        tokens = []
        async for out in backend.generate(f"r{len(tokens)}-{id(tokens)}", [1, 2, 3, 4, 5],
                                          SamplingParams(max_tokens=8, temperature=0.0), adapter):
            tokens += out.outputs[0].token_ids
        return tokens

    async def main():
        return await asyncio.gather(answer(), answer(), answer())
    try:
        answers = asyncio.run(main())
    finally:
        backend.shutdown()
    assert prepared == ["chef"] and answers[0] == answers[1] == answers[2] and len(answers[0]) == 8


def test_more_new_adapters_at_once_than_the_host_cache_holds_all_answer(smollm2_dir, lora_root):
    """Four requests bring four new adapters at once to a host cache of two: each adapter's load
    evicted the one before it, whose request had not reached the engine yet ('not loaded'). Now an
    adapter loaded for a request on its way is kept until it arrives, and one evicted meanwhile is
    loaded again; every answer is the adapter's own, as one request at a time gives it."""
    names = ["sql", "poet", "pirate", "chef"]
    params = SamplingParams(max_tokens=6, temperature=0.0)

    def backend(max_cpu_loras):
        return TorchBackend(ServiceConfig(model=str(smollm2_dir), lora_roots=[str(lora_root)],
                                          max_cpu_loras=max_cpu_loras, kv_cache_config={"max_tokens": 4096}), {})

    async def answer(b, name):
        tokens = []
        async for out in b.generate(f"r-{name}", [1, 2, 3, 4, 5], params,
                                    AdapterRef(name, str(lora_root / name), "lora_path")):
            tokens += out.outputs[0].token_ids
        return tokens

    async def together(b):
        return await asyncio.gather(*(answer(b, name) for name in names))

    async def one_by_one(b):
        return [await answer(b, name) for name in names]

    small, roomy = backend(2), backend(8)
    try:
        got, want = asyncio.run(together(small)), asyncio.run(one_by_one(roomy))
    finally:
        small.shutdown()
        roomy.shutdown()
    assert got == want and len(set(map(tuple, want))) == len(names)
