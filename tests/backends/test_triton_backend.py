"""The triton backend against the fake tritonserver (tests/fakes): the model repository helper,
input mapping, guides, decoupled streaming, cancellation, stop words, LoRA first use and eviction,
errors."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from app.engine import InvalidRequestError, SamplingParams
from app.engine.errors import BackendError
from app.engine.guided import Guide
from app.protocol.messages import AdapterRef
from tests.backends.conftest import (check_logit_bias, check_logits_stream, check_refused_as_the_engine_refuses,
                                     check_sampled_n_logits, collect, engine_reference, greedy_stream,
                                     service_config)
from tests.backends.test_trtllm_backend import PROMPT, SCHEMA, TAG

# config.pbtxt parameters of the seeds' inflight_batcher_llm tensorrt_llm model that we fill.
SEED_PARAMETERS = {"gpt_model_type", "gpt_model_path", "batch_scheduler_policy", "kv_cache_free_gpu_mem_fraction",
                   "max_tokens_in_paged_kv_cache", "enable_kv_cache_reuse", "enable_chunked_context",
                   "max_beam_width", "exclude_input_in_output", "lora_cache_optimal_adapter_size",
                   "lora_cache_max_adapter_size", "lora_cache_gpu_memory_fraction", "lora_cache_host_memory_bytes"}


def triton_config(model_dir, tmp_path, **overrides):
    from app.backends.triton_repository import write_model_repository

    config = service_config(model_dir, backend="triton", triton={"engine_dir": str(model_dir)}, **overrides)
    repository = write_model_repository(config, tmp_path / "repository")
    return service_config(model_dir, backend="triton", **overrides,
                          triton={"engine_dir": str(model_dir), "model_repository": str(repository)})


@pytest.fixture(scope="module")
def backend(smollm2_dir, lora_root, tmp_path_factory):
    from app.backends.triton import TritonBackend

    config = triton_config(smollm2_dir, tmp_path_factory.mktemp("triton"), lora_roots=[str(lora_root)])
    backend = TritonBackend(config, {"sql": str(lora_root / "sql")})
    yield backend
    backend.shutdown()


def last_request(backend) -> dict:
    return backend.server._loaded["tensorrt_llm"].requests[-1]


def test_repository_follows_the_seeds_config(smollm2_dir, tmp_path):
    from tritonserver._api import parse_model_config

    from app.backends.triton_repository import render_config

    config = service_config(smollm2_dir, backend="triton", scheduler_policy="MAX_UTILIZATION",
                            triton={"engine_dir": "/engines/llama"})
    parsed = parse_model_config(render_config(config))
    assert parsed["backend"] == "tensorrtllm" and parsed["decoupled"] and parsed["max_batch_size"] == 16
    p = parsed["parameters"]
    assert SEED_PARAMETERS <= set(p)
    assert (p["gpt_model_type"], p["gpt_model_path"], p["batch_scheduler_policy"]) == \
        ("inflight_fused_batching", "/engines/llama", "max_utilization")
    assert (p["kv_cache_free_gpu_mem_fraction"], p["max_tokens_in_paged_kv_cache"], p["enable_kv_cache_reuse"]) == \
        ("0.9", "8192", "true")
    inputs = parsed["inputs"]
    assert inputs["input_ids"] == {"type": "TYPE_INT32", "dims": [-1], "optional": False}
    assert inputs["stop_words_list"]["dims"] == [2, -1] and inputs["seed"]["type"] == "TYPE_UINT64"
    assert inputs["lora_weights"]["type"] == "TYPE_FP16" and inputs["lora_config"]["dims"] == [-1, 3]
    for name in ("guided_decoding_guide_type", "guided_decoding_guide"):
        assert inputs[name] == {"type": "TYPE_STRING", "dims": [1], "optional": True}
    assert 'name: "guided_decoding_guide"\n    data_type: TYPE_STRING\n    dims: [ 1 ]\n    allow_ragged_batch: true' \
        in render_config(config)  # as the seeds declare it: ragged, no reshape
    assert "guided_decoding_backend" not in p  # on only with the tokenizer info written beside it
    assert {"output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "sequence_index",
            "arrival_time_ns", "kv_cache_reused_blocks"} <= set(parsed["outputs"])
    for name in ("return_context_logits", "return_generation_logits"):  # as the seeds' model declares them
        assert inputs[name] == {"type": "TYPE_BOOL", "dims": [1], "optional": True}
    assert inputs["embedding_bias"] == {"type": "TYPE_FP32", "dims": [-1], "optional": True}
    assert parsed["outputs"]["context_logits"] == {"type": "TYPE_FP32", "dims": [-1, -1], "optional": False}
    assert parsed["outputs"]["generation_logits"]["dims"] == [-1, -1, -1]


def test_the_written_repository_turns_guided_decoding_on(smollm2_dir, tmp_path):
    from transformers import AutoTokenizer
    from tritonserver._api import parse_model_config

    from app.backends.triton_repository import write_model_repository

    config = service_config(smollm2_dir, backend="triton", triton={"engine_dir": "/engines/llama"})
    model_dir = write_model_repository(config, tmp_path) / "tensorrt_llm"
    p = parse_model_config((model_dir / "config.pbtxt").read_text())["parameters"]
    assert p["guided_decoding_backend"] == "xgrammar"
    assert p["xgrammar_tokenizer_info_path"] == str(model_dir.resolve() / "xgrammar_tokenizer_info.json")
    info = json.loads(Path(p["xgrammar_tokenizer_info_path"]).read_text())
    vocab = AutoTokenizer.from_pretrained(smollm2_dir).get_vocab()
    assert info["encoded_vocab"] == sorted(vocab, key=vocab.get) and json.loads(info["tokenizer_str"])["model"]
    assert info["stop_token_ids"] and all(isinstance(t, int) for t in info["stop_token_ids"])


@pytest.mark.parametrize("guide, guide_type, sent", [
    (Guide("json"), "json_schema", '{"type": "object"}'),  # an object, as on the torch engine ("json" allows arrays)
    (Guide("json_schema", SCHEMA, "guided_decoding_guide"), "json_schema", SCHEMA),
    (Guide("regex", "[0-9]{3}"), "regex", "[0-9]{3}"),
    (Guide("ebnf", 'root ::= "yes" | "no"'), "ebnf_grammar", 'root ::= "yes" | "no"'),
], ids=["json", "json_schema", "regex", "ebnf"])
def test_a_guide_becomes_the_guided_decoding_inputs(backend, guide, guide_type, sent):
    _, merged = collect(backend, PROMPT, SamplingParams(max_tokens=4, temperature=0.0, guide=guide))
    assert merged.finished
    values = last_request(backend)
    assert values["guided_decoding_guide_type"].tolist() == [guide_type.encode()]
    assert values["guided_decoding_guide"].tolist() == [sent.encode()]
    model = backend.server._loaded["tensorrt_llm"]
    assert model.guided_decoding is not None and model.guides[-1] == (guide_type, sent)
    assert "guided_decoding_guide" not in backend.inputs(PROMPT, SamplingParams())


def test_guides_the_model_cannot_follow_are_refused(backend, smollm2_dir, tmp_path):
    from app.backends.triton import TritonBackend
    from app.backends.triton_repository import render_config

    for guide, message in ((Guide("structural_tag", TAG, "guided_decoding_guide"), "not structural_tag"),
                           (Guide("json_schema", "{not json", "guided_decoding_guide"), "does not compile")):
        with pytest.raises(InvalidRequestError, match=f"guided_decoding_guide: .*{message}"):
            collect(backend, PROMPT, SamplingParams(max_tokens=4, guide=guide))
    # A repository of one's own without guided decoding: guides are refused, not sent unguided.
    config = service_config(smollm2_dir, backend="triton",
                            triton={"engine_dir": str(smollm2_dir), "model_repository": str(tmp_path)})
    (tmp_path / "tensorrt_llm" / "1").mkdir(parents=True)
    (tmp_path / "tensorrt_llm" / "config.pbtxt").write_text(render_config(config))
    plain = TritonBackend(config, {})
    try:
        with pytest.raises(InvalidRequestError, match="guided decoding is off in this Triton model repository"):
            plain.inputs(PROMPT, SamplingParams(guide=Guide("json")))
    finally:
        plain.shutdown()


def test_every_field_becomes_its_input_tensor(backend):
    params = SamplingParams(max_tokens=9, end_id=5, pad_id=6, temperature=0.7, top_k=40, top_p=0.9, seed=11,
                            repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=0.3, min_tokens=2,
                            stop_token_ids=[[13], [30, 31]], bad_token_ids=[[17, 18]], logprobs=True, n=2,
                            length_penalty=0.5)
    x = backend.inputs(PROMPT, params)
    assert x["input_ids"].dtype == np.int32 and x["input_ids"].tolist() == [PROMPT]
    assert x["input_lengths"].tolist() == [[len(PROMPT)]] and x["request_output_len"].tolist() == [[9]]
    assert (x["end_id"][0, 0], x["pad_id"][0, 0], x["runtime_top_k"][0, 0], x["min_tokens"][0, 0]) == (5, 6, 40, 2)
    for name, value in (("temperature", 0.7), ("runtime_top_p", 0.9), ("repetition_penalty", 1.1),
                        ("presence_penalty", 0.2), ("frequency_penalty", 0.3), ("len_penalty", 0.5)):
        assert x[name].dtype == np.float32 and x[name][0, 0] == pytest.approx(value)
    assert x["seed"].dtype == np.uint64 and x["seed"][0, 0] == 11
    assert x["stop_words_list"].tolist() == [[[13, 30, 31], [1, 3, -1]]]
    assert x["bad_words_list"].tolist() == [[[17, 18], [2, -1]]]
    assert x["num_return_sequences"][0, 0] == 2 and x["return_log_probs"][0, 0] and x["streaming"][0, 0]
    assert x["exclude_input_in_output"][0, 0] and x["return_perf_metrics"][0, 0]
    assert "end_id" not in backend.inputs(PROMPT, SamplingParams(ignore_eos=True))  # no end token at all
    assert not backend.inputs(PROMPT, SamplingParams(beam_width=2))["streaming"][0, 0]
    assert backend.inputs(PROMPT, SamplingParams(temperature=0.0))["runtime_top_k"][0, 0] == 1
    with pytest.raises(InvalidRequestError, match="min_p"):
        backend.inputs(PROMPT, SamplingParams(min_p=0.1))
    assert not x["return_context_logits"][0, 0] and not x["return_generation_logits"][0, 0]
    logits = backend.inputs(PROMPT, SamplingParams(return_context_logits=True, return_generation_logits=True))
    assert logits["return_context_logits"].dtype == bool and logits["return_context_logits"].tolist() == [[True]]
    assert logits["return_generation_logits"].tolist() == [[True]]
    assert "embedding_bias" not in x
    bias = backend.inputs(PROMPT, SamplingParams(logit_bias={5: 2.5, 17: -100.0}))["embedding_bias"]
    assert bias.dtype == np.float32 and bias.shape == (1, backend.served.limits.vocab_size)
    assert np.flatnonzero(bias).tolist() == [5, 17] and (bias[0, 5], bias[0, 17]) == (2.5, -100.0)
    for name, value in (("top_logprobs", 2), ("prompt_logprobs", 0)):
        with pytest.raises(InvalidRequestError, match="not supported by the triton backend") as err:
            backend.inputs(PROMPT, SamplingParams(**{name: value}))  # refused by name, not ignored
        assert err.value.field == name


def test_greedy_stream_matches_transformers(backend, smollm2_hf):
    merged = greedy_stream(backend, smollm2_hf, PROMPT)
    out = merged.outputs[0]
    assert (out.finish_reason, out.stop_reason) == (("stop", backend.eos_ids[0]) if len(out.token_ids) < 24
                                                    else ("length", None))
    m = merged.metrics
    assert m.arrival_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
    assert m.num_output_tokens == len(out.token_ids)


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=12, temperature=0.8, seed=5, n=2),
    SamplingParams(max_tokens=10, beam_width=3, n=2),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=16, temperature=0.0, bad_token_ids=[[1780]], min_tokens=3),
], ids=["n2", "beams", "ignore_eos", "bad_words"])
def test_outputs_equal_the_portable_engine(backend, smollm2_dir, params):
    _, merged = collect(backend, PROMPT, params)
    ref = engine_reference(smollm2_dir, PROMPT, params)
    assert [(o.token_ids, o.finish_reason) for o in merged.outputs] == \
        [(o.token_ids, o.finish_reason) for o in ref.outputs]


def test_stop_words_are_cut_like_the_portable_engine(backend, smollm2_dir):
    greedy = engine_reference(smollm2_dir, PROMPT, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0].token_ids
    for stop in ([greedy[4]], greedy[5:7]):
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[stop], logprobs=True)
        deltas, merged = collect(backend, PROMPT, params)
        ref = engine_reference(smollm2_dir, PROMPT, params).outputs[0]
        out = merged.outputs[0]
        assert out.token_ids == ref.token_ids and (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert len(out.logprobs) == len(out.token_ids)
        assert all(t not in stop or len(stop) > 1 for d in deltas for o in d.outputs for t in o.token_ids)


def test_leaving_the_stream_cancels_in_triton(backend):
    deltas, _ = collect(backend, PROMPT, SamplingParams(max_tokens=200, ignore_eos=True), stop_after=1)
    assert len(deltas) == 1 and not deltas[0].finished
    model = backend.server._loaded["tensorrt_llm"]
    assert model.engine.engine.has_unfinished_requests() is False  # cancel reached the model
    assert backend.stats()["num_running"] == 0


def test_lora_weights_on_first_use_then_the_id(backend, smollm2_dir, lora_root):
    params = SamplingParams(max_tokens=12, temperature=0.0)
    _, first = collect(backend, PROMPT, params, AdapterRef("poet", str(lora_root / "poet"), "lora_path"))
    sent = last_request(backend)
    assert {"lora_task_id", "lora_weights", "lora_config"} <= set(sent)
    assert sent["lora_weights"].dtype == np.float16 and sent["lora_config"].shape[1] == 3
    _, again = collect(backend, PROMPT, params, AdapterRef("poet", None, "lora_task_id"))
    assert "lora_weights" not in last_request(backend)
    assert last_request(backend)["lora_task_id"][0] == sent["lora_task_id"][0]
    ref = engine_reference(smollm2_dir, PROMPT, params, lora_root / "poet").outputs[0].token_ids
    base = engine_reference(smollm2_dir, PROMPT, params).outputs[0].token_ids
    assert first.outputs[0].token_ids == ref != base
    # fp16 weights on the wire: the same greedy tokens as the engine's own load of the adapter
    assert again.outputs[0].token_ids == ref


def test_evicted_adapter_is_sent_again(backend, lora_root):
    model = backend.server._loaded["tensorrt_llm"]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    collect(backend, PROMPT, params, AdapterRef("chef", str(lora_root / "chef"), "lora_path"))
    model.lora_cache.clear()  # Triton's LoRA cache evicted it
    _, merged = collect(backend, PROMPT, params, AdapterRef("chef", None, "lora_task_id"))
    assert merged.outputs[0].token_ids and "lora_weights" in last_request(backend)
    with pytest.raises(InvalidRequestError, match="'nobody' is not loaded"):
        collect(backend, PROMPT, params, AdapterRef("nobody", None, "lora_task_id"))


def test_backend_errors_become_ours(backend, monkeypatch):
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        collect(backend, PROMPT, SamplingParams(max_tokens=5000))
    model = backend.server._loaded["tensorrt_llm"]

    async def failing(self, values):
        raise RuntimeError("Executor failed to enqueue the request")

    monkeypatch.setattr(type(model), "_lora", failing)
    with pytest.raises(BackendError, match="triton: Executor failed to enqueue"):
        collect(backend, PROMPT, SamplingParams(max_tokens=4))
    original = backend.inputs
    monkeypatch.setattr(backend, "inputs", lambda *a: {**original(*a), "draft_tokens": np.zeros((1, 2), np.int32)})
    with pytest.raises(BackendError, match="unexpected inference input 'draft_tokens'"):
        collect(backend, PROMPT, SamplingParams(max_tokens=4))


def test_missing_package_is_one_sentence(smollm2_dir, tmp_path, monkeypatch):
    from app.backends.triton import TritonBackend

    monkeypatch.setitem(sys.modules, "tritonserver", None)
    with pytest.raises(RuntimeError, match=r"needs the 'tritonserver' package"):
        TritonBackend(triton_config(smollm2_dir, tmp_path), {})


LOGITS = dict(return_context_logits=True, return_generation_logits=True)


def test_logits_stream_as_the_torch_engine_sends_them(backend, smollm2_dir):
    """context_logits [1, prompt, vocab] and generation_logits [1, tokens, 1, vocab] per response
    become the torch engine's deltas: context rows once, one generation row per new token, equal
    (shapes and values) to what the model computed."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **LOGITS)
    deltas, merged = collect(backend, PROMPT, params)
    ref = engine_reference(smollm2_dir, PROMPT, params)
    vocab = backend.served.limits.vocab_size
    assert last_request(backend)["return_generation_logits"].tolist() == [True]
    check_logits_stream(deltas, merged, ref, len(PROMPT), vocab, 8)


def test_logits_follow_n_beams_and_stop_words(backend, smollm2_dir):
    check_sampled_n_logits(backend, smollm2_dir, PROMPT)
    beams = SamplingParams(max_tokens=6, beam_width=2, return_context_logits=True)  # one final response
    _, merged = collect(backend, PROMPT, beams)
    np.testing.assert_array_equal(merged.context_logits, engine_reference(smollm2_dir, PROMPT, beams).context_logits)
    greedy = engine_reference(smollm2_dir, PROMPT, SamplingParams(max_tokens=24, temperature=0.0)).outputs[0]
    for stop, most in (([greedy.token_ids[4]], 24), (greedy.token_ids[5:7], 24), ([greedy.token_ids[5], 7], 6)):
        # kept in output_ids: cut here, rows too; a head held back until the end goes out with its rows
        stopped = SamplingParams(max_tokens=most, temperature=0.0, stop_token_ids=[stop], **LOGITS)
        _, merged = collect(backend, PROMPT, stopped)
        out, theirs = merged.outputs[0], engine_reference(smollm2_dir, PROMPT, stopped).outputs[0]
        assert out.token_ids == theirs.token_ids and len(out.generation_logits) == len(out.token_ids)
        np.testing.assert_array_equal(out.generation_logits, theirs.generation_logits)


def test_logits_over_the_limit_are_refused_before_triton(backend, monkeypatch):
    from dataclasses import replace

    vocab = backend.served.limits.vocab_size
    limits = replace(backend.served.limits, max_logits_floats=vocab * 20)  # 20 rows
    monkeypatch.setattr(backend.served, "limits", limits)
    model = backend.server._loaded["tensorrt_llm"]
    sent = len(model.requests)
    for prompt, params, field in ((PROMPT, SamplingParams(max_tokens=8, **LOGITS), "return_generation_logits"),
                                  (PROMPT * 2, SamplingParams(max_tokens=2, return_context_logits=True),
                                   "return_context_logits")):
        check_refused_as_the_engine_refuses(backend, prompt, params, limits, field)
    assert len(model.requests) == sent  # none reached Triton


def test_short_or_missing_logits_are_the_backends_failure(backend, monkeypatch):
    model = backend.server._loaded["tensorrt_llm"]
    monkeypatch.setattr(model, "outputs", model.outputs - {"generation_logits"})  # a model that does not answer
    with pytest.raises(BackendError, match="no generation_logits .*--gather_generation_logits"):
        collect(backend, PROMPT, SamplingParams(max_tokens=2, return_generation_logits=True))


def test_logit_bias_is_the_embedding_bias(backend, smollm2_dir):
    vocab = backend.served.limits.vocab_size
    check_logit_bias(backend, smollm2_dir, PROMPT, lambda: last_request(backend)["embedding_bias"].shape == (vocab,))
