"""Adapters over HTTP: naming styles, exactness against peft, path safety, replica affinity."""
import concurrent.futures
import os

import httpx
import pytest

from tests.conftest import hf_greedy
from tests.conftest import ADAPTER_SEEDS
from tests.serve.test_isolation import _broken_adapter

PROMPT = "Write a short greeting:"


@pytest.fixture(scope="module")
def peft_text(smollm2_dir, lora_root, smollm2_tokenizer):
    """transformers + peft greedy text for each adapter (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = smollm2_tokenizer.encode(PROMPT)
    texts = {}
    for name in [None, *ADAPTER_SEEDS]:
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir)
        if name is not None:
            model = PeftModel.from_pretrained(model, lora_root / name)
        texts[name] = smollm2_tokenizer.decode(hf_greedy(model.eval(), ids, 12), skip_special_tokens=True)
    assert len(set(texts.values())) == len(texts), "adapters must change the output"
    return texts


def _generate(http, **fields):
    return http.post("/v2/models/ensemble/generate", json={"text_input": PROMPT, "max_tokens": 12, **fields})


def test_first_use_with_path_then_id_only(http, lora_root, peft_text):
    first = _generate(http, lora_task_id=101, lora_path=str(lora_root / "poet"))
    assert first.status_code == 200, first.text
    assert first.json()["text_output"] == peft_text["poet"]
    again = _generate(http, lora_task_id=101)
    assert again.json()["text_output"] == peft_text["poet"]


def test_llmapi_trio_and_relative_path(http, peft_text):
    r = http.post("/v2/models/tensorrt_llm/generate", json={
        "text_input": PROMPT, "sampling_param_max_tokens": 12, "lora_id": 7, "lora_name": "pirate",
        "lora_path": "pirate"})
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == peft_text["pirate"]


def test_openai_model_field_names_a_configured_adapter(http, server, peft_text):
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    assert {"smollm2-135m", "sql"} <= {m.id for m in client.models.list().data}
    r = client.completions.create(model="sql", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == peft_text["sql"]


def test_a_batch_mixing_adapters_and_base_is_exact(http, server, lora_root, peft_text):
    jobs = [None, "sql", "poet", "pirate", "chef", None, "chef", "sql"]

    def one(name):
        with httpx.Client(base_url=server, timeout=120) as client:
            fields = {} if name is None else {"lora_task_id": f"mix-{name}", "lora_path": str(lora_root / name)}
            return client.post("/v2/models/ensemble/generate",
                               json={"text_input": PROMPT, "max_tokens": 12, **fields}).json()["text_output"]

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(one, jobs))
    assert texts == [peft_text[name] for name in jobs]
    lora = http.get("/stats").json()["lora"]
    assert {"mix-sql", "mix-chef"} <= set(lora["host"]) and lora["loads"] >= 4


def test_unknown_adapter_says_how_to_send_it(http):
    r = _generate(http, lora_task_id=999)
    assert r.status_code == 400
    assert "not loaded" in r.json()["error"] and "lora_path" in r.json()["error"]


@pytest.mark.parametrize("make_path", [
    lambda root, tmp: "/etc",
    lambda root, tmp: str(root / ".." / "elsewhere"),
    lambda root, tmp: "../../etc",
    lambda root, tmp: str(_symlink_out(root, tmp)),
])
def test_paths_outside_the_roots_are_forbidden(http, lora_root, tmp_path, make_path):
    r = _generate(http, lora_task_id=555, lora_path=make_path(lora_root, tmp_path))
    assert r.status_code == 403, r.text
    assert "outside the configured adapter roots" in r.json()["error"]


def _symlink_out(root, tmp):
    target = tmp / "secret-adapter"
    target.mkdir()
    link = root / f"link-{os.getpid()}-{len(list(root.iterdir()))}"
    link.symlink_to(target)
    return link


def test_configured_adapters_load_at_start(two_engine_server):
    with httpx.Client(base_url=two_engine_server, timeout=60) as client:
        for _ in range(4):  # whichever replica answers has it, before any request named it
            assert "sql" in client.get("/stats").json()["lora"]["host"]


def test_replica_affinity_for_adapters(two_engine_server, lora_root, peft_text):
    """With two engine replicas, an adapter loaded on one (by path) keeps finding it there: later
    requests send only the id, which the other replica would refuse as not loaded."""
    with httpx.Client(base_url=two_engine_server, timeout=120) as client:
        def send(**fields):
            return client.post("/v2/models/ensemble/generate",
                               json={"text_input": PROMPT, "max_tokens": 12, **fields})

        first = send(lora_task_id="affine", lora_path=str(lora_root / "chef"))
        assert first.status_code == 200, first.text
        for _ in range(6):
            r = send(lora_task_id="affine")
            assert r.status_code == 200, r.text
            assert r.json()["text_output"] == peft_text["chef"]
        for _ in range(4):  # base-model requests still work on either replica
            assert send().json()["text_output"] == peft_text[None]


def test_two_first_uses_of_a_name_at_once_bind_it_to_one_path(two_engine_server, lora_root, peft_text):
    """Two first uses of one name with different paths at the same moment, on two engine replicas:
    one binds the name and the other gets 409, and the name then serves the winner's weights on
    every replica. The name used to be recorded for other replicas only after its first answer, so
    each replica could bind it to its own path, and both answered 200."""
    with httpx.Client(base_url=two_engine_server, timeout=120) as client:
        def send(**fields):
            return client.post("/v2/models/ensemble/generate",
                               json={"text_input": PROMPT, "max_tokens": 12, **fields})

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            for k in range(4):
                name = f"raced-{k}"
                answers = list(pool.map(lambda a: send(lora_task_id=name, lora_path=str(lora_root / a)),
                                        ("poet", "chef")))
                assert sorted(r.status_code for r in answers) == [200, 409], [r.text for r in answers]
                winner = "poet" if answers[0].status_code == 200 else "chef"
                assert answers[("poet", "chef").index(winner)].json()["text_output"] == peft_text[winner]
                for _ in range(4):
                    r = send(lora_task_id=name)
                    assert r.status_code == 200 and r.json()["text_output"] == peft_text[winner], r.text
        # A directory that is no adapter, or whose files contradict each other (tensors of another
        # rank than its config's), is refused before its name is bound: the name stays free.
        (lora_root / "not-an-adapter").mkdir(exist_ok=True)
        for bad in (str(lora_root / "not-an-adapter"), _broken_adapter(lora_root)):
            r = send(lora_task_id="mended", lora_path=bad)
            assert r.status_code == 400 and "'mended'" in r.json()["error"], r.text
        r = send(lora_task_id="mended", lora_path=str(lora_root / "poet"))
        assert r.status_code == 200 and r.json()["text_output"] == peft_text["poet"], r.text


def test_a_used_name_cannot_be_rebound(http, lora_root, peft_text):
    """Rebinding a name to another path changed the weights under requests already in flight (a
    victim's greedy stream turned to garbage mid-answer): a name keeps its first path."""
    first = _generate(http, lora_task_id="bound", lora_path=str(lora_root / "poet"))
    assert first.status_code == 200 and first.json()["text_output"] == peft_text["poet"]
    for name in ("bound", "sql"):  # bound by a first request, or by the config
        r = _generate(http, lora_task_id=name, lora_path=str(lora_root / "chef"))
        assert r.status_code == 409, r.text
        assert f"'{name}'" in r.json()["error"] and str(lora_root) not in r.json()["error"]
    assert _generate(http, lora_task_id="bound").json()["text_output"] == peft_text["poet"]
    assert _generate(http, lora_task_id="sql").json()["text_output"] == peft_text["sql"]
