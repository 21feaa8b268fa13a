"""The Tokenizer stage takes the jobs that reached an Ingress together: one job's error is its own,
and the text prompts among them are encoded as one batch."""
from app.engine.errors import InvalidRequestError
from app.engine.sampling_params import SamplingParams
from app.protocol.messages import GenerationJob
from deployments.tokenizer import TokenizerDeployment


def test_one_jobs_refusal_or_failure_leaves_the_others_of_its_call_tokenized(smollm2_dir):
    stage = TokenizerDeployment.func_or_class(str(smollm2_dir))
    template = stage.tokenizer.hf.chat_template
    # A template that refuses a conversation (as Mistral's do for misordered roles), and a job that
    # breaks the stage in a way no check foresaw (a prompt that is not text).
    stage.tokenizer.hf.chat_template = ("{% if messages[0]['role'] == 'assistant' %}{{ raise_exception("
                                        "'conversations start with the user') }}{% endif %}" + template)
    params = SamplingParams(max_tokens=4)
    jobs = [GenerationJob("a", params, prompt="The capital of France is", stop=["Paris"]),
            GenerationJob("b", params, messages=[{"role": "assistant", "content": "hi"}]),
            GenerationJob("c", params, prompt=12345),
            GenerationJob("d", params, prompt_token_ids=[1, 2, 3], echo=True),
            GenerationJob("e", params, prompt="Élan vital, 東京 and emoji 🙂 spill over bytes")]
    first, refused, failed, ids, text = stage.tokenize_many(jobs)
    assert first.prompt_token_ids == stage.tokenizer.encode("The capital of France is")
    assert first.params.stop_token_ids == [stage.tokenizer.encode("Paris", add_special_tokens=False)]
    assert isinstance(refused, InvalidRequestError) and refused.field == "messages"
    assert "start with the user" in refused.message
    assert isinstance(failed, RuntimeError) and "tokenizer failed" in str(failed)
    assert (ids.request_id, ids.prompt_token_ids, ids.echo) == ("d", [1, 2, 3], stage.tokenizer.decode([1, 2, 3]))
    # The text prompts of a call are encoded as one batch, each as encoding it alone gives.
    assert (text.request_id, text.prompt_token_ids) == ("e", stage.tokenizer.encode(jobs[4].prompt))
