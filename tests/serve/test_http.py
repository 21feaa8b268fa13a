"""The service over real HTTP: the seeds' requests, streaming equality, OpenAI, KServe, errors."""
import json

import pytest
import torch

from tests.conftest import hf_greedy

SEED_ENSEMBLE = {"text_input": "What is machine learning?", "max_tokens": 20, "bad_words": "", "stop_words": "",
                 "pad_id": 2, "end_id": 2}


def _events(response) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def _hf_text(smollm2_hf, tokenizer, text, max_new_tokens):
    ids = tokenizer.encode(text)
    return tokenizer.decode(hf_greedy(smollm2_hf, ids, max_new_tokens), skip_special_tokens=True)


def test_seed_ensemble_request_matches_transformers(http, smollm2_hf, smollm2_tokenizer):
    r = http.post("/v2/models/ensemble/generate", content=json.dumps(SEED_ENSEMBLE))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model_name"] == "ensemble" and body["model_version"] == "1"
    assert body["text_output"] == _hf_text(smollm2_hf, smollm2_tokenizer, SEED_ENSEMBLE["text_input"], 20)
    assert len(body["output_log_probs"]) == 20 and isinstance(body["cum_log_probs"], float)


@pytest.mark.parametrize("model", ["smollm2-135m", "tensorrt_llm_bls", "tensorrt_llm"])
def test_every_model_name_answers(http, model):
    r = http.post(f"/v2/models/{model}/generate", json={"text_input": "Hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["model_name"] == model


def test_llmapi_sampling_and_perf_metrics(http):
    r = http.post("/v2/models/tensorrt_llm/generate", json={
        "text_input": "What is machine learning?", "sampling_param_max_tokens": 12,
        "sampling_param_temperature": 0.8, "sampling_param_top_p": 0.95, "sampling_param_seed": 3,
        "sampling_param_return_perf_metrics": True})
    body = r.json()
    assert r.status_code == 200 and body["text_output"]
    assert body["arrival_time_ns"] <= body["first_token_time_ns"] <= body["last_token_time_ns"]
    assert 0.0 <= body["kv_cache_hit_rate"] <= 1.0 and "kv_cache_reused_block" in body
    again = http.post("/v2/models/tensorrt_llm/generate", json={
        "text_input": "What is machine learning?", "sampling_param_max_tokens": 12,
        "sampling_param_temperature": 0.8, "sampling_param_top_p": 0.95, "sampling_param_seed": 3})
    assert again.json()["text_output"] == body["text_output"]


@pytest.mark.parametrize("text", ["Write a poem about the sea", "用中文介绍一下北京。", "Describe 🚀 and 🌍 with emoji:"])
def test_stream_concatenation_equals_whole_answer(http, text):
    req = {"text_input": text, "max_tokens": 40, "return_log_probs": True}
    whole = http.post("/v2/models/ensemble/generate", json=req).json()
    r = http.post("/v2/models/ensemble/generate_stream", json=req)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    assert "".join(e["text_output"] for e in events).encode() == whole["text_output"].encode()
    assert sum((e["output_log_probs"] for e in events), []) == pytest.approx(whole["output_log_probs"])
    assert events[-1]["sequence_end"] and events[-1]["finish_reason"] in ("stop", "length")


def test_generate_stream_with_stream_false_sends_the_whole_answer_once(http):
    """TensorRT-LLM's non-streaming mode on the streaming endpoint: one event, the whole answer (it
    used to stream deltas whatever `stream` said); /generate refuses stream: true by name."""
    req = {"text_input": "Write a poem about the sea", "max_tokens": 24}
    whole = http.post("/v2/models/ensemble/generate", json=req).json()
    (event,) = _events(http.post("/v2/models/ensemble/generate_stream", json={**req, "stream": False}))
    assert event["text_output"] == whole["text_output"] and event["sequence_end"]
    with_prompt = {**req, "exclude_input_in_output": False}
    (event,) = _events(http.post("/v2/models/ensemble/generate_stream", json={**with_prompt, "stream": False}))
    assert event["text_output"] == http.post("/v2/models/ensemble/generate", json=with_prompt).json()["text_output"]
    assert event["text_output"].startswith(req["text_input"])
    assert len(_events(http.post("/v2/models/ensemble/generate_stream", json={**req, "stream": True}))) > 1
    r = http.post("/v2/models/ensemble/generate", json={**req, "stream": True})
    assert r.status_code == 400 and "stream" in r.json()["error"]


def test_stop_words_cut_the_text(http):
    base = http.post("/v2/models/ensemble/generate", json={"text_input": "Count: one, two,", "max_tokens": 30}).json()
    text = base["text_output"]
    stop = text[len(text) // 2:len(text) // 2 + 4]
    cut = http.post("/v2/models/ensemble/generate",
                    json={"text_input": "Count: one, two,", "max_tokens": 30, "stop_words": [stop]}).json()
    assert cut["text_output"] == text[:text.index(stop)] and cut["finish_reason"] == "stop"


def test_token_ids_model(http, smollm2_hf):
    ids = [1, 9690, 198, 2683, 359, 253]
    r = http.post("/v2/models/tensorrt_llm/generate", json={"input_ids": [ids], "input_lengths": [len(ids)],
                                                            "request_output_len": [8], "end_id": [2], "pad_id": [2]})
    body = r.json()
    assert r.status_code == 200, r.text
    assert body["output_ids"] == ids + hf_greedy(smollm2_hf, ids, 8)
    excluded = http.post("/v2/models/tensorrt_llm/generate", json={
        "input_ids": ids, "request_output_len": 8, "exclude_input_in_output": True}).json()
    assert excluded["output_ids"] == body["output_ids"][len(ids):]


def test_kserve_health_and_metadata(http):
    assert http.get("/v2/health/live").status_code == 200
    assert http.get("/v2/health/ready").status_code == 200
    assert http.get("/v2/models/ensemble/ready").status_code == 200
    assert http.get("/v2/models/nothing/ready").status_code == 404
    assert "generate" in http.get("/v2").json()["extensions"]
    meta = http.get("/v2/models/tensorrt_llm").json()
    assert meta["name"] == "tensorrt_llm" and {"input_ids", "text_input"} <= {i["name"] for i in meta["inputs"]}


@pytest.mark.parametrize("path, body, field", [
    ("/v2/models/ensemble/generate", "{not json", "body"),
    ("/v2/models/unknown/generate", '{"text_input": "hi"}', "model"),
    ("/v2/models/ensemble/generate", '{"max_tokens": 5}', "text_input"),
    ("/v2/models/ensemble/generate", '{"text_input": "hi", "max_tokens": "many"}', "max_tokens"),
    ("/v2/models/ensemble/generate", '{"text_input": "hi", "top_p": 3}', "top_p"),
    ("/v2/models/ensemble/generate", '{"text_input": "hi", "max_tokens": 5000}', "max_tokens"),
    ("/v2/models/ensemble/generate", '{"text_input": "hi", "temperature": -1}', "temperature"),
    ("/v2/models/ensemble/generate", '{"text_input": "hi", "no_such_field": 1}', "no_such_field"),
    ("/v2/models/ensemble/generate_stream", '{"text_input": "hi", "max_tokens": 5000}', "max_tokens"),
])
def test_triton_errors_name_the_field(http, path, body, field):
    r = http.post(path, content=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]


def test_prompt_too_long_is_refused(http):
    r = http.post("/v2/models/ensemble/generate", json={"text_input": "word " * 3000, "max_tokens": 4})
    assert r.status_code == 400 and "prompt" in r.json()["error"]


def test_openai_errors_are_openai_objects(http):
    r = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "hi", "top_p": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = http.post("/v1/chat/completions", json={"model": "other", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = http.post("/v1/completions", json={"model": "smollm2-135m", "prompt": "hi", "max_tokens": 9999})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_disconnect_aborts_and_frees_blocks(http, server):
    import httpx

    with httpx.stream("POST", f"{server}/v2/models/ensemble/generate_stream",
                      json={"text_input": "Tell me a very long story.", "max_tokens": 1500}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event: the connection closes
    for _ in range(100):
        stats = http.get("/stats").json()
        if stats["num_running"] == 0 and stats["used_blocks"] == 0:
            break
        torch.tensor(0)  # keep the loop cheap; the server does the work
        import time
        time.sleep(0.1)
    assert stats["num_running"] == 0 and stats["used_blocks"] == 0
    assert http.post("/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 3}).status_code == 200


def test_kserve_infer_with_tensors(http):
    body = {"id": "42", "inputs": [
        {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["What is machine learning?"]},
        {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [20]},
        {"name": "temperature", "shape": [1, 1], "datatype": "FP32", "data": [0.0]}],
        "outputs": [{"name": "text_output"}, {"name": "cum_log_probs"}]}
    r = http.post("/v2/models/ensemble/infer", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"] == "42" and out["model_name"] == "ensemble"
    tensors = {t["name"]: t for t in out["outputs"]}
    assert set(tensors) == {"text_output", "cum_log_probs"}
    assert tensors["text_output"]["datatype"] == "BYTES" and tensors["cum_log_probs"]["datatype"] == "FP32"
    generated = http.post("/v2/models/ensemble/generate", content=json.dumps(SEED_ENSEMBLE)).json()
    assert tensors["text_output"]["data"] == [generated["text_output"]]
    bad = http.post("/v2/models/ensemble/infer", json={"inputs": [{"name": "max_tokens", "data": [3]}]})
    assert bad.status_code == 400 and "text_input" in bad.json()["error"]


def test_command_line_client(server, capsys):
    from tools import client

    assert client.main(["--url", server, "--text", "What is machine learning?", "--request-output-len", "12",
                        "--streaming"]) == 0
    out = capsys.readouterr().out
    assert "Output: " in out and "[INFO] Latency" in out and "first_token_time_ns" in out
    assert client.main(["--url", server, "--streaming", "--stop-after-ms", "1", "--request-output-len", "300"]) == 0
    assert "stopped by the client" in capsys.readouterr().out


def test_overload_gets_503_with_retry_after_and_nothing_breaks(small_queue_server):
    import concurrent.futures

    import httpx

    def one(_):
        with httpx.Client(base_url=small_queue_server, timeout=120) as client:
            return client.post("/v2/models/ensemble/generate", json={"text_input": "Tell me a story.", "max_tokens": 40,
                                                                      "ignore_eos": True})

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(one, range(6)))
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 503 in codes, codes
    busy = next(r for r in responses if r.status_code == 503)
    assert busy.headers.get("Retry-After") and "capacity" in busy.json()["error"]
    assert all(len(r.json()["output_log_probs"]) == 40 for r in responses if r.status_code == 200)
    assert one(0).status_code == 200
