"""Hostile input per route (issue 19 item 8), against a live app: values outside the declared types
and ranges (huge and negative integers, NaN / Infinity, 1e-300, wrong types, JSON nested 100,000
deep, lone surrogates, 60,000 stop words, 10,000 return sequences, malformed KServe tensors,
adapters that do not exist or lie outside the roots, unknown fields).

Every case: no 5xx and no hang; a 4xx is JSON whose error names a field (`{"error": "..."}` on
Triton routes, `{"error": {"message", "param", ...}}` on /v1); a 200 stream ends with a final or
an error event; readiness is still 200 after the case, and a normal 4-token generate works after
each batch. Known findings are fixed cases first; then Hypothesis draws cases per route.

A Hypothesis case records its failure instead of raising it, so one run lists every failing case
(shrinking against a live server would cost minutes); each test fails at its end with the list.
A case that leaves the app unready is charged with it, and the app is redeployed, so that later
cases are judged on a healthy server.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import httpx
import hypothesis
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from tests.serve import hostile_corpus as corpus
from tests.serve.conftest import _write_config

NAME, PREFIX = "hostile", "/hostile"
CASE_TIMEOUT_S = 30.0  # no case may take longer (a 200 is at most 8 tokens)
QUICK_S = 10.0  # a capped request (10,000 sequences, 60,000 stop words) is refused within this
PROBE_EVERY = 25  # cases per batch: readiness after every case, a 4-token generate after each batch
MIN_TOTAL = 500
NOTHING = object()
PROBE_BODY = {"text_input": "The capital of France is", "max_tokens": 4}


@dataclass
class Case:
    route: str  # what the counts are kept by: "POST /v2/models/ensemble/generate"
    path: str
    body: Any = NOTHING
    raw: bytes | None = None
    names: tuple[str, ...] = ()  # a 4xx error must name one of these (when given)
    method: str = "POST"
    refused: bool = False  # must be a 4xx
    quick: bool = False  # must be a 4xx within QUICK_S: a cap, not a run
    ok: bool = False  # must be a 200
    greedy_like: bool = False  # must be a 200 with the text that temperature 0 gives

    @property
    def openai(self) -> bool:
        return self.path.startswith("/v1/")

    def content(self) -> bytes | None:
        if self.raw is not None:
            return self.raw
        return None if self.body is NOTHING else json.dumps(self.body).encode()  # NaN, "\ud800" escapes

    def describe(self) -> str:
        sent = f"raw {len(self.raw)} bytes {self.raw[:24]!r}..." if self.raw is not None else \
            "" if self.body is NOTHING else _short(self.body)
        return f"{self.method} {self.path[:120]} {sent}"


def _short(value) -> str:
    """A body as a report line: long lists as their first item and length, long strings cut."""
    if isinstance(value, list) and len(value) > 6:
        return f"[{_short(value[0])}, ... x{len(value)}]"
    if isinstance(value, list):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_short(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    return text if len(text) < 80 else text[:60] + f"...({len(text)} chars)"


@dataclass
class Reply:
    status: int | None  # None: no complete answer (timeout or broken connection)
    data: bytes
    seconds: float
    streamed: bool
    failure: str = ""

    def summary(self) -> str:
        what = self.status if self.status is not None else self.failure
        return f"{what} in {self.seconds:.1f}s {self.data[:300].decode('utf-8', 'replace')!r}"


# -- judging one reply -----------------------------------------------------------------------------
def judge(case: Case, reply: Reply) -> list[str]:
    if reply.status is None:
        return [f"no complete answer ({reply.failure})"]
    if reply.status >= 500:
        return [f"server error {reply.status}"]
    problems = []
    if (case.refused or case.quick) and reply.status < 400:
        problems.append(f"not refused ({reply.status})")
    if case.quick and reply.seconds > QUICK_S:
        problems.append(f"took {reply.seconds:.1f}s: not refused quickly by a cap")
    if (case.ok or case.greedy_like) and reply.status != 200:
        problems.append(f"expected 200, got {reply.status}")
    if reply.status >= 400:
        return problems + _error_problems(case, _json(reply.data), f"{reply.status} body")
    if reply.streamed:
        return problems + _stream_problems(case, reply.data)
    if reply.data and _json(reply.data) is NOTHING:
        problems.append("200 body is not JSON")
    return problems


def _json(data: bytes | str):
    try:
        return json.loads(data)
    except ValueError:
        return NOTHING


def _error_problems(case: Case, body, where: str) -> list[str]:
    error = body.get("error") if isinstance(body, dict) else None
    if case.openai:
        if not (isinstance(error, dict) and isinstance(error.get("message"), str) and "param" in error):
            return [f"{where} is not an OpenAI error object"]
        if isinstance(error.get("code"), int) and error["code"] >= 500:
            return [f"{where} is a server error ({error['code']})"]
        text = f"{error['param']} {error['message']}"
    elif not isinstance(error, str) or len(error) < 5:
        return [f"{where} carries no error message"]
    else:
        text = error
    if case.names and not any(name in text for name in case.names):
        return [f"{where}: the error names none of {list(case.names)[:8]}"]
    return []


def _stream_problems(case: Case, data: bytes) -> list[str]:
    events = [line[6:] for line in data.decode("utf-8", "replace").split("\n") if line.startswith("data: ")]
    if not events:
        return ["200 stream carried no event"]
    parsed = [_json(e) for e in events if e != "[DONE]"]
    if any(p is NOTHING for p in parsed):
        return ["a streamed event is not JSON"]
    errors = [p for p in parsed if isinstance(p, dict) and "error" in p]
    if errors:
        late = "" if parsed[-1] is errors[0] else " (not the last event)"
        return [f"stream error event{late}: {p}" for p in _error_problems(case, errors[0], "error event")]
    if case.openai:
        return [] if events[-1] == "[DONE]" else ["stream ended without [DONE]"]
    last = parsed[-1] if parsed else None
    return [] if isinstance(last, dict) and last.get("sequence_end") is True else ["stream ended without a final event"]


def answer_text(case: Case, reply: Reply) -> str:
    """The generated text of a 200, whole or streamed."""
    if reply.streamed:
        events = [_json(line[6:]) for line in reply.data.decode().split("\n")
                  if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        events = [_json(reply.data)]
    parts = []
    for event in events:
        if case.openai:
            choice = (event.get("choices") or [{}])[0]
            message = choice.get("message") or choice.get("delta") or {}
            parts.append(choice.get("text") or message.get("content") or "")
        elif case.path.endswith("/infer"):
            parts += [t["data"][0] for t in event.get("outputs", []) if t["name"] == "text_output"]
        else:
            parts.append(event.get("text_output") or "")
    return "".join(parts)


# -- the live app ----------------------------------------------------------------------------------
class Hostile:
    """The dedicated app: sends cases, judges them, probes readiness, redeploys it when a case broke it."""

    def __init__(self, base: str, config_path):
        self.url, self.config_path = base + PREFIX, config_path
        self.client = httpx.Client(base_url=self.url, timeout=CASE_TIMEOUT_S)
        self.counts: Counter = Counter()
        self.answers: Counter = Counter()  # (route, "200" / "4xx" / "5xx" / "none")
        self.redeploys = 0
        self.deploy()

    def deploy(self) -> None:
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app({"config": str(self.config_path)}), name=NAME, route_prefix=PREFIX)
        self._wait_ready(120)

    def redeploy(self) -> None:
        from ray import serve

        self.redeploys += 1
        serve.delete(NAME)
        self.deploy()

    def send(self, case: Case, timeout: float = CASE_TIMEOUT_S) -> Reply:
        self.counts[case.route] += 1
        reply = self._exchange(case, timeout)
        self.answers[case.route, "none" if reply.status is None else f"{reply.status // 100}xx"] += 1
        return reply

    def _exchange(self, case: Case, timeout: float) -> Reply:
        """The whole answer, read with a deadline (a stream that never ends is a hang, not a pass)."""
        started, data = time.monotonic(), bytearray()
        try:
            with self.client.stream(case.method, case.path, content=case.content(), timeout=timeout) as r:
                streamed = r.headers.get("content-type", "").startswith("text/event-stream")
                for part in r.iter_bytes():
                    data += part
                    if time.monotonic() - started > timeout:
                        return Reply(None, bytes(data), time.monotonic() - started, streamed, f"hang > {timeout:.0f}s")
                return Reply(r.status_code, bytes(data), time.monotonic() - started, streamed)
        except httpx.HTTPError as exc:
            return Reply(None, bytes(data), time.monotonic() - started, False, f"{type(exc).__name__}: {exc}")

    def check(self, case: Case) -> list[str]:
        """Send one case; its problems, each a line naming the case, the reply and what is wrong."""
        reply = self.send(case, QUICK_S + 5 if case.quick else CASE_TIMEOUT_S)
        problems = judge(case, reply)
        if case.greedy_like and not problems:
            problems += self._greedy_problems(case, reply)
        if not self.ready():
            problems.append("/v2/health/ready is no longer 200 after this case")
            self.recover()
        elif reply.status is None:  # a hang: the engine may be stuck though it still answers stats
            problems += self.probe()
        return [f"{case.route}: {case.describe()} -> {reply.summary()}: {p}" for p in problems]

    def _greedy_problems(self, case: Case, reply: Reply) -> list[str]:
        text = answer_text(case, reply)
        greedy_body = {k: 0.0 if "temperature" in k else v for k, v in case.body.items()}
        reference = answer_text(case, self.send(replace(case, body=greedy_body)))
        if not text:
            return ["empty text: a temperature this small must decode greedily"]
        return [] if text == reference else [f"text {text!r} differs from temperature 0's {reference!r}"]

    def ready(self) -> bool:
        try:
            return self.client.get("/v2/health/ready", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def probe(self) -> list[str]:
        """The end of a batch: ready, and a normal 4-token generate answers."""
        problems = [] if self.ready() else ["after the batch: /v2/health/ready is not 200"]
        try:
            r = self.client.post("/v2/models/ensemble/generate", json=PROBE_BODY, timeout=60)
            if r.status_code != 200 or not r.json().get("text_output"):
                problems.append(f"after the batch: a 4-token generate answers {r.status_code} {r.text[:200]!r}")
        except httpx.HTTPError as exc:
            problems.append(f"after the batch: a 4-token generate failed: {exc!r}")
        if problems:
            self.recover()
        return problems

    def recover(self) -> None:
        if not self._wait_ready(10):
            self.redeploy()

    def _wait_ready(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.ready():
                return True
            time.sleep(0.5)
        return False

    def run_batch(self, cases, max_examples: int) -> None:
        """Draw `max_examples` cases from the strategy; fail with every failing case listed."""
        failures: list[str] = []
        drawn = Counter()

        @hypothesis.settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
                             phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
                             suppress_health_check=list(hypothesis.HealthCheck))
        @given(case=cases)
        def one(case):
            failures.extend(self.check(case))
            drawn["cases"] += 1
            if drawn["cases"] % PROBE_EVERY == 0:
                failures.extend(self.probe())

        one()
        failures.extend(self.probe())
        assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures)


@pytest.fixture(scope="module")
def hostile(server, tmp_path_factory, lora_root):
    from ray import serve

    stages = yaml.safe_load(open("configs/smollm2-135m.yaml"))["serve"]
    for stage in stages.values():
        stage["graceful_shutdown_timeout_s"] = 1  # a redeploy after a broken case does not wait
    path = _write_config(tmp_path_factory, lora_root, served_model_name=corpus.SERVED, max_output_len=8,
                         max_tokens_default=8, max_input_len=128, max_beam_width=2, serve=stages)
    app = Hostile(server, path)
    yield app
    app.client.close()
    serve.delete(NAME)


# -- cases -----------------------------------------------------------------------------------------
def gen(model: str = "ensemble", action: str = "generate", names=None, **fields) -> Case:
    body = {"text_input": "Hi", "max_tokens": 2, **fields}
    path = f"/v2/models/{model}/{action}"
    return Case(f"POST {path}", path, body, names=corpus.names_for(fields) if names is None else names)


def infer(model: str = "ensemble", tensors=(), names=None, **envelope) -> Case:
    inputs = [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": ["Hi"]},
              {"name": "max_tokens", "shape": [1], "datatype": "INT32", "data": [2]}, *tensors]
    path = f"/v2/models/{model}/infer"
    tensor_names = [t["name"] for t in tensors if isinstance(t, dict) and isinstance(t.get("name"), str)]
    names = corpus.names_for([*tensor_names, *envelope, "inputs"]) if names is None else names
    return Case(f"POST {path}", path, {"id": "hostile-1", "inputs": inputs, **envelope}, names=names)


def tensor(name, data, datatype: str = "INT64", shape=None) -> dict:
    data = data if isinstance(data, list) else [data]
    return {"name": name, "shape": [len(data)] if shape is None else shape, "datatype": datatype, "data": data}


def v1(chat: bool = False, names=None, **fields) -> Case:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": "Hi"}
    body = {"model": corpus.SERVED, **prompt, "max_tokens": 2, **fields}
    return Case(f"POST {path}", path, body, names=corpus.names_for(fields) if names is None else names)


def raw(path: str, data: bytes, names=("body",)) -> Case:
    return Case(f"POST {path}", path, raw=data, names=names, refused=True)


BIG, NAN, INF = 2**63, float("nan"), float("inf")
DEEP_LIST = b"[" * 100_000 + b"]" * 100_000
DEEP_OBJECT = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
WORDS = ["a"] * 60_000


def _q(case: Case, **flags) -> Case:
    return replace(case, **flags)


def known_cases() -> dict[str, Case]:
    cases = {f"top_k=2^63 generate {m}": gen(m, top_k=BIG) for m in corpus.MODELS}
    cases |= {f"top_k=2^63 generate_stream {m}": gen(m, "generate_stream", top_k=BIG) for m in corpus.MODELS}
    cases |= {f"top_k=2^63 infer {m}": infer(m, [tensor("top_k", BIG)]) for m in corpus.MODELS}
    cases |= {
        "sampling_param_top_k=2^63": gen("tensorrt_llm", sampling_param_top_k=BIG),
        "runtime_top_k=2^64": gen("tensorrt_llm", runtime_top_k=2**64),
        "parameters.top_k=1e30": gen(parameters={"top_k": 10**30}, names=("top_k",)),
        "top_k=2^63 infer parameters": infer(parameters={"top_k": BIG}, names=("top_k", "parameters")),
        "top_k=2^63 completions": v1(top_k=BIG),
        "top_k=2^63 completions stream": v1(top_k=BIG, stream=True),
        "top_k=2^63 chat": v1(True, top_k=BIG),
        "top_k=2^63 chat stream": v1(True, top_k=BIG, stream=True),
        "top_k=-2^63 generate": gen(top_k=-BIG),
    }
    cases |= {
        "lora_task_id surrogate": gen(lora_task_id="\ud800"),
        "lora_task_id surrogate + lora_path": gen(lora_task_id="\ud800", lora_path="sql"),
        "lora_task_id surrogate stream": gen("ensemble", "generate_stream", lora_task_id="\udfff"),
        "lora_task_id surrogate infer": infer(tensors=[tensor("lora_task_id", "\ud800", "BYTES")]),
        "lora_id/lora_name surrogate": gen(lora_id="\ud800", lora_name="\ud800", lora_path="sql"),
        "lora_path surrogate": gen(lora_task_id=7001, lora_path="\ud800"),
        "lora_task_id surrogate tensorrt_llm": gen("tensorrt_llm", lora_task_id="a\udc00b"),
    }
    cases |= {
        "seed=2^63 sampling": gen(seed=BIG, temperature=0.8, top_k=50),
        "seed=2^64 sampling": gen(seed=2**64, temperature=0.8),
        "seed=1e30 sampling": gen(seed=10**30, top_p=0.9),
        "seed=-1 sampling": gen(seed=-1, temperature=0.8),
        "sampling_param_seed=2^63": gen("tensorrt_llm", sampling_param_seed=BIG, sampling_param_temperature=0.7),
        "seed=2^63 sampling stream": gen("ensemble", "generate_stream", seed=BIG, temperature=0.9),
        "seed=2^63 infer": infer(tensors=[tensor("seed", BIG), tensor("temperature", 0.8, "FP32")]),
        "seed=2^63 completions": v1(seed=BIG, temperature=1.0),
        "seed=2^64 chat": v1(True, seed=2**64, temperature=1.0),
    }
    cases |= {
        "temperature=1e-300 generate": _q(gen(temperature=1e-300, max_tokens=4), greedy_like=True),
        "temperature=5e-324 generate": _q(gen(temperature=5e-324, max_tokens=4), greedy_like=True),
        "temperature=1e-300 stream": _q(gen("ensemble", "generate_stream", temperature=1e-300, max_tokens=4),
                                        greedy_like=True),
        "sampling_param_temperature=1e-300": _q(gen("tensorrt_llm", sampling_param_temperature=1e-300,
                                                    max_tokens=4), greedy_like=True),
        "temperature=1e-300 completions": _q(v1(temperature=1e-300, max_tokens=4), greedy_like=True),
        "temperature=1e-300 chat": _q(v1(True, temperature=1e-300, max_tokens=4), greedy_like=True),
        "temperature=1e-300 top_k=50 generate": _q(gen(temperature=1e-300, top_k=50, max_tokens=4), greedy_like=True),
    }
    cases |= {  # each once failed a step, a stream or the request's answer; each is a 400 naming it now
        "length_penalty 2000 beam": _q(gen(length_penalty=2000, beam_width=2), refused=True),
        "length_penalty -2000 beam stream": _q(gen("ensemble", "generate_stream", length_penalty=-2000,
                                                   beam_width=2), refused=True),
        "repetition_penalty 1e-300": _q(gen(repetition_penalty=1e-300), refused=True),
        "repetition_penalty 1e-300 chat": _q(v1(True, repetition_penalty=1e-300), refused=True),
        "prompt [-1] echo": _q(v1(prompt=[-1], echo=True), refused=True),
        "prompt [2^40] echo": _q(v1(prompt=[2**40], echo=True), refused=True),
        "input_ids a batch of 2": _q(gen("tensorrt_llm", input_ids=[[1, 2], [3, 4]]), refused=True),
        "stop_words a batch of 2": _q(gen(stop_words=[["a"], ["b"]]), refused=True),
        "max_tokens and request_output_len disagree": _q(gen(request_output_len=100), refused=True),
        "infer output misspelled": _q(infer(outputs=[{"name": "txt_output"}], names=("outputs",)), refused=True),
    }
    good = tensor("top_k", 1)
    cases |= {
        "infer tensor name a list": infer(tensors=[{**good, "name": ["text_input"]}], names=("inputs", "name")),
        "infer tensor name a dict": infer(tensors=[{**good, "name": {"a": 1}}], names=("inputs", "name")),
        "infer tensor name surrogate": infer(tensors=[{**good, "name": "\ud800"}], names=("inputs", "name")),
        "infer tensor name 5": infer(tensors=[{**good, "name": 5}], names=("inputs", "name", "5")),
        "infer outputs 5": infer(outputs=5),
        "infer outputs a string": infer(outputs="text_output"),
        "infer outputs name a list": infer(outputs=[{"name": ["text_output"]}]),
        "infer parameters a list": infer(parameters=[["top_k", 1]]),
        "infer parameters a string": infer(parameters="top_k=1"),
        "infer parameters 5": infer(parameters=5),
        "infer inputs a dict": _q(infer(names=("inputs",)), body={"inputs": {"text_input": "Hi"}}),
        "infer input 5": infer(tensors=[5], names=("inputs",)),
        "infer shape disagrees (3 for 1)": infer(tensors=[tensor("top_k", 1, shape=[3])], names=("top_k", "shape")),
        "infer shape disagrees (1 for 3)": infer(tensors=[tensor("stop_words", ["a", "b", "c"], "BYTES", [1])],
                                                 names=("stop_words", "shape")),
        "infer shape a string": infer(tensors=[tensor("top_k", 1, shape="1")], names=("top_k", "shape")),
        "infer datatype FP32 for text": infer(tensors=[tensor("stop_words", ["a"], "FP32")],
                                                names=("stop_words", "inputs")),
        "infer datatype BOGUS": infer(tensors=[tensor("top_k", 1, "BOGUS")], names=("top_k", "datatype")),
        "infer data missing": infer(tensors=[{"name": "top_k", "shape": [1], "datatype": "INT32"}],
                                    names=("inputs", "data")),
        "infer id surrogate": infer(id="\ud800"),
        "infer id a list": infer(id=[1, 2]),
        "infer id 2^64": infer(id=2**64),
    }
    cases |= {
        "stop_words 60000": _q(gen(stop_words=WORDS), quick=True),
        "bad_words 60000": _q(gen(bad_words=WORDS), quick=True),
        "stop_token_ids 60000": _q(gen(stop_token_ids=[[1]] * 60_000), quick=True),
        "stop 60000 completions": _q(v1(stop=WORDS), quick=True),
        "stop 60000 chat": _q(v1(True, stop=WORDS), quick=True),
        "stop_words 60000 infer": _q(infer(tensors=[tensor("stop_words", WORDS, "BYTES")]), quick=True),
        "num_return_sequences 10000": _q(gen(num_return_sequences=10_000), quick=True),
        "best_of 10000": _q(gen(best_of=10_000), quick=True),
        "sampling_param_n 10000": _q(gen("tensorrt_llm", sampling_param_n=10_000), quick=True),
        "sampling_param_best_of 10000": _q(gen("tensorrt_llm", sampling_param_best_of=10_000), quick=True),
        "beam_width 10000": _q(gen(beam_width=10_000), quick=True),
        "num_return_sequences 10000 stream": _q(gen("ensemble", "generate_stream", num_return_sequences=10_000),
                                                quick=True),
        "num_return_sequences 10000 infer": _q(infer(tensors=[tensor("num_return_sequences", 10_000)]), quick=True),
        "n 10000 completions": _q(v1(n=10_000), quick=True),
        "n 10000 chat": _q(v1(True, n=10_000), quick=True),
        "num_return_sequences 2^63": _q(gen(num_return_sequences=BIG), quick=True),
    }
    for label, path in (("generate", "/v2/models/ensemble/generate"), ("stream", "/v2/models/ensemble/generate_stream"),
                        ("infer", "/v2/models/ensemble/infer"), ("completions", "/v1/completions"),
                        ("chat", "/v1/chat/completions")):
        cases[f"deep list {label}"] = raw(path, DEEP_LIST)
        cases[f"deep object {label}"] = raw(path, DEEP_OBJECT)
    cases |= {
        "deep list in text_input": raw("/v2/models/ensemble/generate", b'{"text_input": ' + DEEP_LIST + b"}",
                                       ("body", "text_input")),
        "invalid UTF-8 body": raw("/v2/models/ensemble/generate", b'{"text_input": "\xff\xfe"}',
                                  ("body", "text_input")),
        "body null": raw("/v2/models/ensemble/generate", b"null"),
        "body a number infer": raw("/v2/models/ensemble/infer", b"5", ("body", "inputs")),
        "body a list completions": raw("/v1/completions", b"[1]"),
        "body NaN chat": raw("/v1/chat/completions", b"NaN"),
    }
    cases |= {
        "temperature NaN": gen(temperature=NAN), "temperature Infinity": gen(temperature=INF),
        "top_p NaN": gen(top_p=NAN), "length_penalty NaN": gen(length_penalty=NAN),
        "length_penalty Infinity beam": gen(length_penalty=INF, beam_width=2),
        "repetition_penalty Infinity": gen(repetition_penalty=INF),
        "presence_penalty -Infinity": gen(presence_penalty=-INF),
        "min_p NaN": gen(min_p=NAN), "temperature Infinity stream": gen("ensemble", "generate_stream", temperature=INF),
        "temperature NaN infer": infer(tensors=[tensor("temperature", NAN, "FP32")]),
        "temperature NaN completions": v1(temperature=NAN), "top_p Infinity completions": v1(top_p=INF),
        "frequency_penalty NaN chat": v1(True, frequency_penalty=NAN),
        "repetition_penalty Infinity chat": v1(True, repetition_penalty=INF),
    }
    cases |= {
        "text_input surrogate": gen(text_input="\ud800"),
        "text_input surrogate stream": gen("ensemble", "generate_stream", text_input="a\udc00b"),
        "text_input surrogate infer": infer(tensors=[tensor("text_input", "\ud800", "BYTES")]),
        "stop_words surrogate": gen(stop_words=["\ud800"]), "bad_words surrogate": gen(bad_words=["\udfff"]),
        "request_id surrogate": gen(request_id="\ud800"),
        "unknown field surrogate": _q(gen(**{"\ud800": 1}), refused=True),
        "prompt surrogate completions": v1(prompt="\ud800"),
        "chat content surrogate": v1(True, messages=[{"role": "user", "content": "\ud800"}]),
        "model surrogate completions": _q(v1(model="\ud800"), refused=True),
        "model surrogate chat": _q(v1(True, model="x\udfff"), refused=True),
        "stop surrogate completions": v1(stop=["\ud800"]),
    }
    cases |= {
        "adapter unknown": _q(gen(lora_task_id="no-such-adapter"), refused=True),
        "adapter unknown int": _q(gen(lora_task_id=987654), refused=True),
        "lora_path /etc": _q(gen(lora_task_id=7002, lora_path="/etc"), refused=True),
        "lora_path ../../etc": _q(gen(lora_task_id=7003, lora_path="../../etc"), refused=True),
        "lora_path missing under root": _q(gen(lora_task_id=7004, lora_path="does-not-exist"), refused=True),
        "lora_path a file": _q(gen(lora_task_id=7005, lora_path="sql/adapter_config.json"), refused=True),
        "lora_path alone": _q(gen(lora_path="sql"), refused=True),
        "lora_id alone": _q(gen(lora_id=1), refused=True),
        "lora_task_id a list": gen(lora_task_id=[1, 2]),
        "lora_task_id 2^64": _q(gen(lora_task_id=2**64), refused=True),
        "adapter unknown model completions": _q(v1(model="no-such-adapter"), refused=True),
        "adapter unknown stream": _q(gen("ensemble", "generate_stream", lora_task_id="nope"), refused=True),
        "adapter unknown infer": _q(infer(tensors=[tensor("lora_task_id", "nope", "BYTES")]), refused=True),
    }
    cases |= {
        "unknown field": _q(gen(no_such_field=1), refused=True),
        "unknown field under parameters": _q(gen(parameters={"no_such_field": 1}, names=("no_such_field",)),
                                             refused=True),
        "max_tokens a string": gen(max_tokens="8"), "max_tokens [1, 2]": gen(max_tokens=[1, 2]),
        "max_tokens 2^64": gen(max_tokens=2**64), "min_tokens 2^63": gen(min_tokens=BIG),
        "end_id 2^63": gen(end_id=BIG), "pad_id -2^63": gen(pad_id=-BIG), "beam_width 2^63": gen(beam_width=BIG),
        "input_lengths 1e30": gen(input_lengths=10**30), "input_ids [2^63]": gen("tensorrt_llm", input_ids=[BIG]),
        "stop_token_ids [[2^64]]": gen(stop_token_ids=[[2**64]]), "top_k a dict": gen(top_k={"a": 1}),
        "temperature a string": gen(temperature="hot"), "stream 'yes'": gen(stream="yes"),
        "text_input 5": gen(text_input=5), "text_input a batch of 2": gen(text_input=["a", "b"]),
        "ignore_eos 2^64": gen(ignore_eos=2**64), "parameters a list": gen(parameters=[1]),
        "max_tokens true completions": v1(max_tokens=True), "messages a string": v1(True, messages="hi"),
        "content a list": v1(True, messages=[{"role": "user", "content": ["x"]}]),
        "prompt a dict": v1(prompt={"a": 1}), "prompt [2^63]": v1(prompt=[BIG]), "prompt []": v1(prompt=[]),
        "max_tokens 1e30 completions": v1(max_tokens=10**30), "logprobs 2^63": v1(logprobs=BIG),
        "n true chat": v1(True, n=True), "unknown model path": gen("no-such-model", names=("model",)),
        "surrogate model path": gen("%ED%A0%80", names=("model",)),
    }
    return cases


KNOWN = known_cases()


@pytest.mark.parametrize("label", list(KNOWN))
def test_known_hostile_case(hostile, label):
    failures = hostile.check(KNOWN[label]) + hostile.probe()
    assert not failures, "\n".join(failures)


# -- drawn cases, per route ------------------------------------------------------------------------
def _body_with(base: dict, pairs, nested: bool) -> dict:
    body = {**base}
    target = body.setdefault("parameters", {}) if nested else body
    for key, value in pairs:
        target[key] = value
    return body


def triton_cases(model: str, action: str):
    def build(args):
        pairs, nested = args
        return gen(model, action, names=corpus.names_for([k for k, _ in pairs] + ["parameters"] * nested),
                   **_body_with({}, pairs, nested))

    return st.tuples(corpus.mutations(corpus.TRITON_FIELDS), st.booleans()).map(build)


def infer_cases(model: str):
    def from_data(pairs):
        return infer(model, [tensor(k, v, "BYTES" if isinstance(v, str) else "INT64") for k, v in pairs])

    def from_meta(t):
        names = ("inputs", "name", "shape", "datatype", "data", "top_k", str(t.get("name")))
        return infer(model, [t], names=names)

    def from_envelope(kv):
        key, value = kv
        inner = list(value) if isinstance(value, dict) else []
        return infer(model, names=corpus.names_for([key, "inputs", *inner]), **{key: value})

    return st.one_of(corpus.mutations(corpus.TRITON_FIELDS).map(from_data), corpus.tensor_meta().map(from_meta),
                     corpus.envelope().map(from_envelope))


def openai_cases(chat: bool):
    fields = corpus.CHAT_FIELDS if chat else corpus.COMPLETION_FIELDS
    whole = corpus.mutations(fields).map(lambda pairs: v1(chat, **dict(pairs)))
    if not chat:
        return whole
    message = st.tuples(st.sampled_from(("role", "content", "name")), corpus.hostile_values()).map(
        lambda kv: v1(True, names=("messages", kv[0]), messages=[{"role": "user", "content": "Hi", kv[0]: kv[1]}]))
    return st.one_of(whole, whole, message)


GET_ROUTES = ("/v1/models", "/v2/health/ready", "/stats", "/v2/models/{m}", "/v2/models/{m}/ready")


def get_cases(route: str):
    junk = st.sampled_from((None, b"NaN", b'{"model": "\\ud800"}', DEEP_LIST[:20_000] + DEEP_LIST[-20_000:]))

    def build(args):
        model, query, body = args
        path = route.replace("{m}", model) + query
        known = model in corpus.MODELS or "{m}" not in route
        return Case(f"GET {route}", path, raw=body, method="GET", names=("model",), ok=known)

    models = corpus.model_paths() if "{m}" in route else st.just("")
    return st.tuples(models, corpus.query_strings(), junk).map(build)


EXAMPLES = {"generate": 35, "generate_stream": 25, "infer": 30, "openai": 60, "get": 20}


@pytest.mark.parametrize("model", corpus.MODELS)
@pytest.mark.parametrize("action", ["generate", "generate_stream"])
def test_triton_generate_routes(hostile, action, model):
    hostile.run_batch(triton_cases(model, action), EXAMPLES[action])


@pytest.mark.parametrize("model", corpus.MODELS)
def test_kserve_infer(hostile, model):
    hostile.run_batch(infer_cases(model), EXAMPLES["infer"])


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_openai_routes(hostile, chat):
    hostile.run_batch(openai_cases(chat), EXAMPLES["openai"])


@pytest.mark.parametrize("route", GET_ROUTES)
def test_get_routes(hostile, route):
    hostile.run_batch(get_cases(route), EXAMPLES["get"])


def test_case_counts(hostile, capsys, request):
    """Last in the file: how many hostile requests each route got in this run."""
    total = sum(hostile.counts.values())
    with capsys.disabled():
        print(f"\nhostile requests per route ({total} in all, {hostile.redeploys} redeploys after a broken case):")
        for route, n in sorted(hostile.counts.items()):
            answers = ", ".join(f"{k} {hostile.answers[route, k]}" for k in ("2xx", "4xx", "5xx", "none")
                                if hostile.answers[route, k])
            print(f"  {n:5d}  {route}  ({answers})")
    selected = sum(item.module is request.module for item in request.session.items)
    if selected < len(KNOWN) + 2 * len(corpus.MODELS) + len(corpus.MODELS) + 2 + len(GET_ROUTES) + 1:
        pytest.skip("only part of this file ran")
    assert total >= MIN_TOTAL, hostile.counts
