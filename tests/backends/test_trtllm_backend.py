"""The trtllm backend against the fake tensorrt_llm (tests/fakes): argument and field mapping,
guides, streaming, abort, stop sequences, LoRA, errors."""
import json
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

from app.engine import InvalidRequestError, SamplingParams
from app.engine.errors import BackendError
from app.engine.guided import Guide
from app.protocol.messages import AdapterRef
from tests.backends.conftest import (check_logit_bias, check_logits_stream, check_refused_as_the_engine_refuses,
                                     check_sampled_n_logits, collect, engine_reference, greedy_stream,
                                     service_config)

PROMPT = [1, 9690, 198, 2683, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 4093, 198]
SCHEMA = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
TAG = json.dumps({"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}],
                  "triggers": ["<f="]})


@pytest.fixture(scope="module")
def backend(smollm2_dir, lora_root):
    from app.backends.trtllm import TrtllmBackend

    config = service_config(smollm2_dir, backend="trtllm", cuda_graph_config={"max_batch_size": 16},
                            speculative_config={"decoding_type": "Lookahead", "max_window_size": 4},
                            disable_overlap_scheduler=True, lora_roots=[str(lora_root)],
                            max_return_sequences=32)  # n = 17 reaches TensorRT-LLM's own check
    backend = TrtllmBackend(config, {"sql": str(lora_root / "sql")})
    yield backend
    backend.shutdown()


def test_config_keys_reach_llm_as_model_yaml_does(backend, smollm2_dir):
    from app.backends.trtllm import llm_kwargs

    args = backend.llm.args
    # The tokenizer is loaded (the default): the xgrammar backend builds its vocabulary from it.
    assert args["model"] == str(smollm2_dir) and args["skip_tokenizer_init"] is False
    assert args["guided_decoding_backend"] == "xgrammar"
    assert (args["tensor_parallel_size"], args["pipeline_parallel_size"]) == (1, 1)
    assert (args["max_batch_size"], args["max_num_tokens"], args["max_seq_len"]) == (16, 2048, 1024)
    assert args["kv_cache_config"] == {"enable_block_reuse": True, "tokens_per_block": 32,
                                       "free_gpu_memory_fraction": 0.9, "max_tokens": 8192, "dtype": "auto"}
    assert args["scheduler_config"] == {"capacity_scheduler_policy": "GUARANTEED_NO_EVICT"}
    assert args["cuda_graph_config"] == {"max_batch_size": 16}
    assert args["speculative_config"]["decoding_type"] == "Lookahead"
    assert args["lora_config"] == {"max_lora_rank": 64, "max_loras": 8, "max_cpu_loras": 64}
    assert args["enable_chunked_prefill"] is True and args["trust_remote_code"] is False
    assert args["disable_overlap_scheduler"] is True
    assert args["gather_generation_logits"] is True  # max_logits_floats > 0: generation logits can be asked
    no_logits = llm_kwargs(service_config(smollm2_dir, backend="trtllm", max_logits_floats=0), str(smollm2_dir))
    assert "gather_generation_logits" not in no_logits


def test_every_sampling_field_maps(backend):
    ours = SamplingParams(max_tokens=7, end_id=5, pad_id=6, temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=11,
                          repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, min_tokens=2,
                          stop_token_ids=[[13], [30, 31]], bad_token_ids=[[17]], logprobs=True, n=2)
    sp = backend.sampling_params(ours)
    assert (sp.max_tokens, sp.end_id, sp.pad_id, sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.seed) == \
        (7, 5, 6, 0.7, 40, 0.9, 0.05, 11)
    assert (sp.repetition_penalty, sp.presence_penalty, sp.frequency_penalty, sp.min_tokens) == (1.1, 0.2, 0.3, 2)
    assert sp.stop_token_ids == [13]  # the multi-token sequence is watched by the adapter
    assert sp.bad_token_ids == [17] and sp.logprobs == 1 and sp.n == 2 and not sp.use_beam_search
    assert sp.detokenize is False and sp.return_perf_metrics is True and sp.ignore_eos is False
    beams = backend.sampling_params(SamplingParams(beam_width=3, n=2, length_penalty=0.5))
    assert beams.use_beam_search and (beams.best_of, beams.n, beams.length_penalty) == (3, 2, 0.5)
    greedy = backend.sampling_params(SamplingParams(temperature=0.0))
    assert (greedy.top_k, greedy.temperature) == (1, None)
    # The model's other end-of-turn ids stop it too, unless the request names its own end_id.
    assert backend.sampling_params(SamplingParams()).stop_token_ids == (backend.eos_ids[1:] or None)
    with pytest.raises(InvalidRequestError, match="bad_words"):
        backend.sampling_params(SamplingParams(bad_token_ids=[[1, 2]]))
    assert (sp.return_context_logits, sp.return_generation_logits) == (False, False)
    logits = backend.sampling_params(SamplingParams(return_context_logits=True, return_generation_logits=True))
    assert (logits.return_context_logits, logits.return_generation_logits) == (True, True)
    assert sp.embedding_bias is None
    bias = backend.sampling_params(SamplingParams(logit_bias={5: 2.5, 17: -100.0})).embedding_bias
    assert bias.dtype == torch.float32 and bias.shape == (backend.served.limits.vocab_size,)
    assert bias.nonzero().flatten().tolist() == [5, 17] and (bias[5].item(), bias[17].item()) == (2.5, -100.0)
    for name, value in (("top_logprobs", 2), ("prompt_logprobs", 0)):
        with pytest.raises(InvalidRequestError, match="not supported by the trtllm backend") as err:
            backend.sampling_params(SamplingParams(**{name: value}))  # refused by name, not ignored
        assert err.value.field == name


@pytest.mark.parametrize("guide, field, value", [
    (Guide("json"), "json", '{"type": "object"}'),  # an object, as on the torch engine (json_object allows arrays)
    (Guide("json_schema", SCHEMA, "guided_json"), "json", SCHEMA),
    (Guide("regex", "[0-9]{3}"), "regex", "[0-9]{3}"),
    (Guide("ebnf", 'root ::= "yes" | "no"'), "grammar", 'root ::= "yes" | "no"'),
], ids=["json", "json_schema", "regex", "ebnf"])
def test_a_guide_reaches_guided_decoding_params(backend, guide, field, value):
    _, merged = collect(backend, PROMPT, SamplingParams(max_tokens=4, temperature=0.0, guide=guide))
    assert merged.finished
    gd = backend.llm.requests[-1]["sampling_params"].guided_decoding
    assert type(gd).__module__ == "tensorrt_llm.sampling_params" and getattr(gd, field) == value
    assert [k for k in ("json", "regex", "grammar", "json_object", "structural_tag") if getattr(gd, k)] == [field]


def test_a_structural_tag_is_sent_in_xgrammars_current_form(backend):
    import xgrammar

    sp = backend.sampling_params(SamplingParams(guide=Guide("structural_tag", TAG, "response_format")))
    sent = json.loads(sp.guided_decoding.structural_tag)
    assert sent == {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f="], "tags": [
        {"begin": "<f=a>", "content": {"type": "json_schema", "json_schema": {"type": "object"}}, "end": "</f>"}]}}
    xgrammar.Grammar.from_structural_tag(sp.guided_decoding.structural_tag)  # what TensorRT-LLM compiles


def test_guides_that_cannot_run_are_refused(backend, smollm2_dir):
    from app.backends.trtllm import TrtllmBackend

    for guide, message in ((Guide("regex", "([0-9]", "guided_regex"), "guided_regex: does not compile"),
                           (Guide("structural_tag", SCHEMA), "guided_decoding: structural tag:")):
        with pytest.raises(InvalidRequestError, match=message):
            collect(backend, PROMPT, SamplingParams(max_tokens=4, guide=guide))
    with pytest.raises(InvalidRequestError, match="guided decoding does not combine with beam search"):
        collect(backend, PROMPT, SamplingParams(max_tokens=4, beam_width=2, guide=Guide("json")))
    # llm_args may build the LLM without xgrammar (and skip the tokenizer): guides are then refused.
    plain = TrtllmBackend(service_config(smollm2_dir, backend="trtllm", llm_args={
        "guided_decoding_backend": None, "skip_tokenizer_init": True}), {})
    try:
        with pytest.raises(InvalidRequestError, match="needs the LLM built with guided_decoding_backend: xgrammar"):
            plain.sampling_params(SamplingParams(guide=Guide("json")))
    finally:
        plain.shutdown()


def test_greedy_stream_matches_transformers(backend, smollm2_hf):
    merged = greedy_stream(backend, smollm2_hf, PROMPT)
    out = merged.outputs[0]
    assert out.finish_reason in ("stop", "length")
    m = merged.metrics
    assert m.arrival_time_ns <= m.first_scheduled_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
    assert m.num_prompt_tokens == len(PROMPT) and m.num_output_tokens == len(out.token_ids)


def test_sampling_n_and_beams_equal_the_portable_engine(backend, smollm2_dir):
    for params in (SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2),
                   SamplingParams(max_tokens=10, beam_width=3, n=2)):
        _, merged = collect(backend, PROMPT, params)
        ref = engine_reference(smollm2_dir, PROMPT, params)
        assert [o.token_ids for o in merged.outputs] == [o.token_ids for o in ref.outputs], (merged, ref)


def test_multi_token_stop_sequence_is_cut_and_aborts(backend, smollm2_dir):
    greedy = engine_reference(smollm2_dir, PROMPT, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].token_ids
    stop = greedy[5:7]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop])
    aborted_before = len(backend.llm.aborted)
    _, merged = collect(backend, PROMPT, params)
    ref = engine_reference(smollm2_dir, PROMPT, params).outputs[0]
    out = merged.outputs[0]
    assert out.token_ids == ref.token_ids == greedy[:5]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert len(backend.llm.aborted) == aborted_before + 1  # the executor was told to stop


def test_leaving_the_stream_aborts(backend):
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    deltas, _ = collect(backend, PROMPT, params, stop_after=1)
    assert len(deltas) == 1 and not deltas[0].finished
    request = backend.llm.requests[-1]
    assert request["streaming"] is True
    assert backend.llm.aborted[-1] == len(backend.llm.requests)  # request ids count from 1
    assert backend.stats()["num_running"] == 0


def test_lora_first_use_then_cached_id(backend, smollm2_dir, lora_root):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    path = str(lora_root / "poet")
    _, first = collect(backend, PROMPT, params, AdapterRef("poet", path, "lora_path"))
    _, again = collect(backend, PROMPT, params, AdapterRef("poet", None, "lora_task_id"))
    first_req, again_req = backend.llm.requests[-2]["lora_request"], backend.llm.requests[-1]["lora_request"]
    assert (first_req.lora_name, first_req.lora_path) == ("poet", path)
    assert again_req.lora_int_id == first_req.lora_int_id
    ref = engine_reference(smollm2_dir, PROMPT, params, lora_root / "poet").outputs[0].token_ids
    base = engine_reference(smollm2_dir, PROMPT, params).outputs[0].token_ids
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == ref != base
    _, configured = collect(backend, PROMPT, params, AdapterRef("sql", None, "model"))
    assert backend.llm.requests[-1]["lora_request"].lora_path == str(lora_root / "sql")
    with pytest.raises(InvalidRequestError, match="lora_task_id: LoRA adapter 'nobody' is not loaded"):
        collect(backend, PROMPT, params, AdapterRef("nobody", None, "lora_task_id"))
    with pytest.raises(InvalidRequestError, match="lora_path"):
        collect(backend, PROMPT, params, AdapterRef("ghost", str(lora_root / "missing"), "lora_path"))


def test_backend_errors_become_ours(backend, monkeypatch):
    with pytest.raises(InvalidRequestError, match="request: TensorRT-LLM refused it: SamplingParams.n"):
        collect(backend, PROMPT, SamplingParams(max_tokens=4, n=17))
    with pytest.raises(InvalidRequestError, match="max_tokens"):  # our own limits first
        collect(backend, PROMPT, SamplingParams(max_tokens=5000))

    async def broken(self, result, lora_request):
        from tensorrt_llm.executor import RequestError
        result._queue.put_nowait(RequestError("Encountered an error in forwardAsync function"))

    monkeypatch.setattr(type(backend.llm), "_run", broken)
    with pytest.raises(BackendError, match="trtllm: Encountered an error in forwardAsync"):
        collect(backend, PROMPT, SamplingParams(max_tokens=4))


def test_missing_package_is_one_sentence(smollm2_dir, monkeypatch):
    from app.backends.trtllm import TrtllmBackend

    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)
    with pytest.raises(RuntimeError, match=r"needs the 'tensorrt_llm' package .* container, or use backend: torch"):
        TrtllmBackend(service_config(smollm2_dir, backend="trtllm"), {})


def test_parallel_configs_use_the_ray_orchestrator(smollm2_dir):
    from app.backends.trtllm import llm_kwargs

    config = service_config(smollm2_dir, backend="trtllm", device="cuda", tensor_parallel_size=2,
                            pipeline_parallel_size=2, llm_args={"enable_attention_dp": False})
    kwargs = llm_kwargs(config, str(smollm2_dir))
    assert (kwargs["tensor_parallel_size"], kwargs["pipeline_parallel_size"]) == (2, 2)
    assert kwargs["orchestrator_type"] == "ray" and kwargs["enable_attention_dp"] is False
    assert "orchestrator_type" not in llm_kwargs(service_config(smollm2_dir, backend="trtllm"), str(smollm2_dir))


LOGITS = dict(return_context_logits=True, return_generation_logits=True)


def test_logits_stream_as_the_torch_engine_sends_them(backend, smollm2_dir):
    """Context logits [prompt, vocab] with the first delta; each delta's generation logits one row per
    new token; the whole equal (shapes and values) to what the fake's engine computed."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **LOGITS)
    deltas, merged = collect(backend, PROMPT, params)
    ref = engine_reference(smollm2_dir, PROMPT, params)
    vocab = backend.served.limits.vocab_size
    check_logits_stream(deltas, merged, ref, len(PROMPT), vocab, 8)
    assert backend.llm.requests[-1]["sampling_params"].return_generation_logits is True


def test_logits_follow_n_and_stop_sequences(backend, smollm2_dir):
    check_sampled_n_logits(backend, smollm2_dir, PROMPT)
    greedy = engine_reference(smollm2_dir, PROMPT, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0]
    stopped = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[greedy.token_ids[5:7]], **LOGITS)
    _, merged = collect(backend, PROMPT, stopped)
    out = merged.outputs[0]  # the stop sequence's rows are cut with its tokens, as the torch engine cuts them
    assert out.token_ids == greedy.token_ids[:5] and out.generation_logits.shape[0] == 5
    np.testing.assert_array_equal(out.generation_logits, engine_reference(smollm2_dir, PROMPT, stopped)
                                  .outputs[0].generation_logits)
    # a head held back until the end (by length): its rows go out with it
    held = SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=[[greedy.token_ids[5], 7]], **LOGITS)
    _, merged = collect(backend, PROMPT, held)
    out = merged.outputs[0]
    assert out.token_ids == greedy.token_ids[:6] and out.generation_logits.shape[0] == 6
    np.testing.assert_array_equal(out.generation_logits,
                                  engine_reference(smollm2_dir, PROMPT, held).outputs[0].generation_logits)


def test_logits_over_the_limit_are_refused_before_the_llm(backend, monkeypatch):
    vocab = backend.served.limits.vocab_size
    limits = replace(backend.served.limits, max_logits_floats=vocab * 20)  # 20 rows
    monkeypatch.setattr(backend.served, "limits", limits)
    sent = len(backend.llm.requests)
    for prompt, params, field in ((PROMPT, SamplingParams(max_tokens=8, **LOGITS), "return_generation_logits"),
                                  (PROMPT, SamplingParams(max_tokens=30, return_generation_logits=True),
                                   "return_generation_logits"),
                                  (PROMPT * 2, SamplingParams(max_tokens=2, return_context_logits=True),
                                   "return_context_logits")):
        check_refused_as_the_engine_refuses(backend, prompt, params, limits, field)
    assert len(backend.llm.requests) == sent  # none reached TensorRT-LLM
    _, merged = collect(backend, PROMPT, SamplingParams(max_tokens=2, return_context_logits=True))  # 15 rows fit
    assert merged.context_logits.shape == (len(PROMPT), vocab)


def test_short_or_missing_logits_are_the_backends_failure(backend, monkeypatch):
    from tensorrt_llm.executor import GenerationResult

    short = lambda self: torch.zeros(3, backend.served.limits.vocab_size)  # noqa: E731 - a cached prefix's rows
    monkeypatch.setattr(GenerationResult, "context_logits", property(short))
    with pytest.raises(BackendError, match="context_logits of shape \\[3, .*enable_block_reuse false"):
        collect(backend, PROMPT, SamplingParams(max_tokens=2, return_context_logits=True))
    monkeypatch.undo()
    original = GenerationResult._handle

    def no_rows(self, item):
        original(self, item)
        for out in self._outputs:
            out.generation_logits = None

    monkeypatch.setattr(GenerationResult, "_handle", no_rows)
    with pytest.raises(BackendError, match="no generation_logits .*gather_generation_logits"):
        collect(backend, PROMPT, SamplingParams(max_tokens=2, return_generation_logits=True))


def test_logit_bias_is_the_embedding_bias(backend, smollm2_dir):
    """+100 on one token forces it, -100 on the greedy choice bans it: the same tokens as logit_bias
    on the torch engine."""
    check_logit_bias(backend, smollm2_dir, PROMPT)
