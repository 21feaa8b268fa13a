"""The Tokenizer stage takes the jobs that reached an Ingress together: one job's error is its own,
and the text prompts among them are encoded as one batch."""
from app.engine.errors import InvalidRequestError
from app.engine.sampling_params import SamplingParams
from app.protocol.messages import AdapterRef, GenerationJob, TokenizedJob, tokenized_as_sent
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


def test_a_job_with_nothing_to_tokenize_skips_the_stage_and_gets_what_the_stage_gives(smollm2_dir):
    """The Ingress sends token-id jobs with no words and no echo on without a Tokenizer call: what it
    sends must be what the stage would have answered. Every other job still needs the stage."""
    stage = TokenizerDeployment.func_or_class(str(smollm2_dir))
    params = SamplingParams(max_tokens=4, stop_token_ids=[[7]], bad_token_ids=[[9, 10]])
    ids = [1, 2, 3]
    as_sent = [GenerationJob("a", params, prompt_token_ids=ids),
               GenerationJob("b", params, prompt_token_ids=ids, adapter=AdapterRef("poet", "/adapters/poet")),
               GenerationJob("empty", params, prompt_token_ids=[])]  # the engine refuses it, as before
    for job in as_sent:
        assert tokenized_as_sent(job) == stage._tokenize(job)
    # Ids with words or echo: the stage adds to what was sent, so skipping it would lose that.
    with_words = [GenerationJob("c", params, prompt_token_ids=ids, stop=["Paris"]),
                  GenerationJob("d", params, prompt_token_ids=ids, bad_words=["war"]),
                  GenerationJob("e", params, prompt_token_ids=ids, echo=True)]
    for job in with_words:
        assert tokenized_as_sent(job) is None
        assert stage._tokenize(job) != TokenizedJob(job.request_id, ids, params, [], None)
    for job in (GenerationJob("f", params, prompt="The capital of France is"),
                GenerationJob("g", params, messages=[{"role": "user", "content": "hi"}]),
                GenerationJob("h", params, prompt_token_ids=ids, stop=[""])):
        assert tokenized_as_sent(job) is None
