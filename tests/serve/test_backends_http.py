"""The serving acceptance checks, run on each backend: the portable engine and the fakes of
TensorRT-LLM's LLM API and Triton's in-process server (tests/fakes) behind the same DAG."""
import httpx
import openai
import pytest

from tests.conftest import hf_greedy

BACKENDS = ["torch", "trtllm", "triton"]


@pytest.fixture(params=BACKENDS)
def app(request):
    name = request.param
    url = request.getfixturevalue("server" if name == "torch" else f"{name}_server")
    with httpx.Client(base_url=url, timeout=120) as client:
        yield name, client


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{str(url).rstrip('/')}/v1", api_key="unused", max_retries=0)


def test_greedy_text_matches_transformers(app, smollm2_hf, smollm2_tokenizer):
    _, http = app
    text = "What is machine learning?"
    r = http.post("/v2/models/ensemble/generate", json={"text_input": text, "max_tokens": 20, "return_log_probs": True})
    assert r.status_code == 200, r.text
    expected = hf_greedy(smollm2_hf, smollm2_tokenizer.encode(text), 20)
    assert r.json()["text_output"] == smollm2_tokenizer.decode(expected, skip_special_tokens=True)
    assert len(r.json()["output_log_probs"]) == len(expected)


def test_stream_equals_whole_with_stop_words(app):
    _, http = app
    req = {"text_input": "Describe 🚀 and 🌍 with emoji:", "max_tokens": 30}
    whole = http.post("/v2/models/ensemble/generate", json=req).json()["text_output"]
    events = http.post("/v2/models/ensemble/generate_stream", json=req).text.splitlines()
    streamed = "".join(__import__("json").loads(e[6:])["text_output"] for e in events if e.startswith("data: "))
    assert streamed == whole
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    cut = http.post("/v2/models/ensemble/generate", json={**req, "stop_words": [stop]}).json()
    assert cut["text_output"] == whole[:whole.index(stop)] and cut["finish_reason"] == "stop"


def test_openai_chat_and_lora_adapter(app, server):
    name, http = app
    client = _openai(http.base_url)
    model = "smollm2-135m" if name == "torch" else f"smollm2-{name}"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, temperature=0, max_tokens=20, messages=messages)
    assert r.choices[0].message.content == "The capital of France is Paris."
    sql = client.chat.completions.create(model="sql", temperature=0, max_tokens=12, messages=messages)
    assert sql.choices[0].message.content == _openai(server).chat.completions.create(
        model="sql", temperature=0, max_tokens=12, messages=messages).choices[0].message.content


def test_bad_requests_are_400_naming_the_field(app):
    _, http = app
    r = http.post("/v2/models/ensemble/generate", json={"text_input": "hi", "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"].startswith("max_tokens: ")
    assert "ray::" not in r.json()["error"] and "Traceback" not in r.json()["error"]  # fields, not the remote trace
    r = http.post("/v2/models/ensemble/generate", json={"text_input": "hi", "lora_task_id": "nobody"})
    assert r.status_code == 400 and "'nobody' is not loaded" in r.json()["error"]
    assert http.post("/v2/models/ensemble/generate", json={"text_input": "Hi", "max_tokens": 3}).status_code == 200


def test_disconnect_mid_stream_leaves_nothing_running(app):
    _, http = app
    with http.stream("POST", "/v2/models/ensemble/generate_stream",
                     json={"text_input": "Tell me a very long story.", "max_tokens": 1000, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break
    import time
    for _ in range(100):
        if http.get("/stats").json()["num_running"] == 0:
            break
        time.sleep(0.1)
    assert http.get("/stats").json()["num_running"] == 0


@pytest.mark.parametrize("backend, body, field", [
    ("triton", {"text_input": "hi", "max_tokens": 4, "min_p": 0.1}, "min_p"),
    ("trtllm", {"text_input": "hi", "max_tokens": 4, "bad_words": ["machine learning"]}, "bad_words"),
])
def test_what_a_backend_cannot_do_is_a_400_naming_the_field(request, backend, body, field):
    url = request.getfixturevalue(f"{backend}_server")
    r = httpx.post(f"{url}/v2/models/ensemble/generate", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"].startswith(f"{field}:"), r.text
