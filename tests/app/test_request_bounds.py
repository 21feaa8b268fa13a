"""What the edge refuses before any stage runs: bodies (depth, Unicode, numbers), KServe tensors,
word caps and adapter names; and adapter names that stay bound to their first path."""
import pytest

from app.adapters import AdapterPolicy
from app.backends.base import AdapterTable
from app.engine import InvalidRequestError, SamplingParams
from app.protocol.body import parse_body
from app.protocol.messages import AdapterRef, GenerationJob, check_job
from app.protocol.triton import infer_to_generate_body


@pytest.mark.parametrize("raw, field, words", [
    (b"[" * 100_000, "body", "nested deeper"),
    (b'{"a": ' * 40 + b"1" + b"}" * 40, ".".join(["a"] * 32), "nested deeper"),
    (b'{"text_input": "hi \\ud800"}', "text_input", "surrogate"),
    (b'{"messages": [{"content": "\\udfff"}]}', "messages.0.content", "surrogate"),
    (b'{"\\ud800": 1}', "body", "surrogate"),
    (b'{"temperature": NaN}', "temperature", "finite"),
    (b'{"top_p": 1e999}', "top_p", "finite"),
    (b'{"x": -Infinity}', "x", "finite"),
    (b"\xff\xfe", "body", "not valid JSON"),
])
def test_bodies_refused_with_the_field(raw, field, words):
    with pytest.raises(InvalidRequestError) as err:
        parse_body(raw)
    assert err.value.field == field and words in err.value.message


def test_valid_bodies_pass_whole():
    assert parse_body('{"text_input": "caf\\u00e9 \\ud83d\\ude00", "n": [1.5, [2]]}'.encode()) == {
        "text_input": "café 😀", "n": [1.5, [2]]}


@pytest.mark.parametrize("body, field", [
    ({"inputs": [{"name": ["text_input"], "data": ["hi"]}]}, "inputs.0.name"),
    ({"inputs": [{"name": "text_input", "data": ["hi"]}], "outputs": 5}, "outputs"),
    ({"inputs": [{"name": "text_input", "data": ["hi"]}], "parameters": [1]}, "parameters"),
    ({"inputs": [{"name": "text_input", "data": ["hi"]}], "parameters": "x"}, "parameters"),
    ({"inputs": [{"name": "text_input", "data": ["hi"], "shape": [2, 2]}]}, "inputs.0.shape"),
    ({"inputs": [{"name": "text_input", "data": ["hi"], "shape": [10 ** 18] * 50_000}]}, "inputs.0.shape"),
    ({"inputs": [{"name": "text_input", "data": ["hi"], "shape": [10 ** 18] * 8}]}, "inputs.0.shape"),
    ({"inputs": [{"name": "max_tokens", "data": [4.5], "datatype": "INT32"}]}, "inputs.0.data"),
    ({"inputs": [{"name": "max_tokens", "data": [True], "datatype": "INT64"}]}, "inputs.0.data"),
    ({"inputs": [{"name": "max_tokens", "data": [4], "datatype": "INT4"}]}, "inputs.0.datatype"),
    ({"inputs": [{"name": "x", "data": [1]}, {"name": "x", "data": [2]}]}, "inputs.1.name"),
    ({"inputs": []}, "inputs"),
    ({"id": 5, "inputs": [{"name": "text_input", "data": ["hi"]}]}, "id"),
])
def test_kserve_tensors_are_checked_by_shape_and_type(body, field):
    with pytest.raises(InvalidRequestError) as err:
        infer_to_generate_body(body)
    assert err.value.field == field


def test_kserve_tensors_in_batches_of_one():
    fields, request_id, wanted = infer_to_generate_body({
        "id": "r1", "inputs": [{"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [["hi"]]},
                               {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "data": [4]}],
        "outputs": [{"name": "text_output"}]})
    assert fields == {"text_input": "hi", "max_tokens": 4} and request_id == "r1" and wanted == ["text_output"]


def _job(api="triton", stop=(), bad=(), adapter=None, stop_ids=()):
    params = SamplingParams(stop_token_ids=[list(s) for s in stop_ids])
    return GenerationJob("r", params, prompt="hi", stop=list(stop), bad_words=list(bad), adapter=adapter, api=api)


@pytest.mark.parametrize("job, field, words", [
    (_job(stop=["a"] * 5), "stop_words", "max_stop_words of 4"),
    (_job(stop=["a"] * 3, stop_ids=[[1], [2]]), "stop_words", "max_stop_words of 4"),
    (_job(api="openai", stop=["x" * 11]), "stop", "max_stop_word_len of 10"),
    (_job(bad=["b"] * 5), "bad_words", "max_stop_words"),
    (_job(stop_ids=[[1]] * 5), "stop_token_ids", "max_stop_words of 4"),
    (_job(adapter=AdapterRef("caf\u00e9")), "lora_task_id", "adapter name"),
    (_job(adapter=AdapterRef("-5", field="lora_name")), "lora_name", "adapter name"),
    (_job(adapter=AdapterRef("a" * 129)), "lora_task_id", "adapter name"),
])
def test_word_caps_and_adapter_names(job, field, words):
    with pytest.raises(InvalidRequestError) as err:
        check_job(job, max_stop_words=4, max_stop_word_len=10)
    assert err.value.field == field and words in err.value.message


def test_jobs_within_the_caps_pass():
    check_job(_job(stop=["a"] * 2, stop_ids=[[1], [2]], bad=["x" * 10], adapter=AdapterRef("org/my-adapter:v1.2")),
              max_stop_words=4, max_stop_word_len=10)


def test_a_configured_adapter_name_keeps_its_path(tmp_path):
    for name in ("sql", "other"):
        (tmp_path / name).mkdir()
    policy = AdapterPolicy([str(tmp_path)], {"sql": "sql"})
    assert policy.resolve(AdapterRef("sql")).path == str(tmp_path / "sql")
    assert policy.resolve(AdapterRef("sql", str(tmp_path / "sql"))).path == str(tmp_path / "sql")
    with pytest.raises(InvalidRequestError) as err:
        policy.resolve(AdapterRef("sql", "other"))
    assert err.value.status == 409 and str(tmp_path) not in err.value.message


def test_a_replica_binds_a_name_once():
    table = AdapterTable()
    first = table.register("x", "/a")
    assert table.resolve(AdapterRef("x")) == (first, "/a") and table.register("x", "/a") == first
    with pytest.raises(InvalidRequestError) as err:
        table.resolve(AdapterRef("x", "/b", "lora_path"))
    assert err.value.status == 409 and err.value.field == "lora_path" and "/a" not in err.value.message
    table.unregister("x")
    assert table.resolve(AdapterRef("x", "/b"))[1] == "/b"


def test_an_adapter_whose_files_link_out_of_the_roots_is_refused(tmp_path):
    """The directory lay inside the root, its files linked to an adapter elsewhere: the loader
    opened them. Each file must resolve inside the roots as well."""
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    for folder in (root / "linked", root / "plain", elsewhere):
        folder.mkdir(parents=True)
    (elsewhere / "adapter_config.json").write_text("{}")
    (root / "linked" / "adapter_config.json").symlink_to(elsewhere / "adapter_config.json")
    (root / "plain" / "adapter_config.json").write_text("{}")
    (root / "plain" / "inner.json").symlink_to(root / "plain" / "adapter_config.json")  # links within: fine
    policy = AdapterPolicy([str(root)], {})
    with pytest.raises(InvalidRequestError) as err:
        policy.resolve(AdapterRef("x", "linked", "lora_path"))
    assert err.value.status == 403 and "adapter_config.json" in err.value.message
    assert str(elsewhere) not in str(err.value)
    assert policy.resolve(AdapterRef("y", "plain", "lora_path")).path == str(root / "plain")
