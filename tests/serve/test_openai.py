"""The /v1 routes through the official openai client."""
import openai
import pytest


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


def test_models_list(client):
    assert [m.id for m in client.models.list().data] == ["smollm2-135m", "sql"]  # base, then adapters


def test_chat_completion_answers(client):
    r = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=20,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert r.choices[0].message.content == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 7 and r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_stream_equals_whole(client):
    kwargs = dict(model="smollm2-135m", temperature=0, max_tokens=40,
                  messages=[{"role": "user", "content": "Write two sentences about rain."}])
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
             if c.choices]
    assert "".join(parts) == whole


def test_a_chat_stream_assembles_as_openai_s_and_usage_comes_when_asked(client):
    """Through the openai client's own accumulator: the role in a choice's first delta only (in
    every one, it came out 'assistantassistant...'), one `created`, and usage only with
    stream_options.include_usage, in a last chunk of its own; counted whole when a stop string
    ends the answer (the last chunk's tokens alone, before)."""
    from openai.lib.streaming.chat import ChatCompletionStreamState

    kwargs = dict(model="smollm2-135m", temperature=0, max_tokens=40,
                  messages=[{"role": "user", "content": "What is the capital of France?"}])
    whole = client.chat.completions.create(**kwargs)
    plain = list(client.chat.completions.create(stream=True, **kwargs))
    assert all(c.usage is None for c in plain) and len({c.created for c in plain}) == 1
    assert [bool(c.choices[0].delta.role) for c in plain if c.choices] == [True] + [False] * (len(plain) - 1)
    state = ChatCompletionStreamState()
    for chunk in plain:
        state.handle_chunk(chunk)
    message = state.get_final_completion().choices[0].message
    assert message.role == "assistant" and message.content == whole.choices[0].message.content
    asked = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == whole.usage.completion_tokens
    stop = whole.choices[0].message.content.split()[-1]  # "Paris.": a stop string on the last word
    cut = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, stop=[stop],
                                              **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in cut if c.choices) == \
        whole.choices[0].message.content[:-len(stop)]
    assert cut[-1].usage.completion_tokens >= whole.usage.completion_tokens - 2


def test_completion_stop_n_seed_logprobs(client):
    r = client.completions.create(model="smollm2-135m", prompt="The weather today is", max_tokens=12,
                                  temperature=1.0, seed=7, n=2, logprobs=1)
    assert len(r.choices) == 2 and all(len(c.logprobs.token_logprobs) > 0 for c in r.choices)
    again = client.completions.create(model="smollm2-135m", prompt="The weather today is", max_tokens=12,
                                      temperature=1.0, seed=7, n=2, logprobs=1)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    greedy = client.completions.create(model="smollm2-135m", prompt="One, two, three,", max_tokens=16,
                                       temperature=0).choices[0].text
    stop = greedy.split()[2]
    cut = client.completions.create(model="smollm2-135m", prompt="One, two, three,", max_tokens=16, temperature=0,
                                    stop=[stop]).choices[0]
    assert cut.text == greedy[:greedy.index(stop)] and cut.finish_reason == "stop"


def test_bad_request_raises_client_error(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="smollm2-135m", prompt="x", max_tokens=10**6)


def test_logprobs_top_logprobs_and_logit_bias(client, smollm2_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kwargs = dict(model="smollm2-135m", temperature=0, max_tokens=20, messages=messages, logprobs=True, top_logprobs=3)
    choice = client.chat.completions.create(**kwargs).choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content == "The capital of France is Paris."
    for t in content:  # greedy: the likeliest alternative is the token taken
        assert bytes(t.bytes).decode() == t.token and len(t.top_logprobs) == 3
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
    streamed = [t for c in client.chat.completions.create(stream=True, **kwargs) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    pairs = lambda tokens: [(t.token, t.top_logprobs[1].token) for t in tokens]  # noqa: E731
    assert pairs(streamed) == pairs(content)

    r = client.completions.create(model="smollm2-135m", prompt="The weather today is", max_tokens=8, temperature=0,
                                  logprobs=3)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert "".join(lp.tokens) == text and len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(8)]
    assert all(len(top) == 3 and top[token] == logprob
               for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))

    # logit_bias: +100 forces a token, -100 bans the greedy answer's first one.
    (banana,) = smollm2_tokenizer.encode(" banana")
    r = client.completions.create(model="smollm2-135m", prompt="The weather today is", max_tokens=3, temperature=0,
                                  logit_bias={str(banana): 100})
    assert r.choices[0].text == " banana" * 3
    first = smollm2_tokenizer.encode(content[0].token)[0]
    banned = client.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=20, messages=messages,
                                            logit_bias={str(first): -100}).choices[0].message.content
    assert not banned.startswith("The")
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="smollm2-135m", prompt="x", max_tokens=2, logit_bias={"49152": 1})


def test_completion_echo_puts_the_prompt_and_its_logprobs_first(client, smollm2_hf, smollm2_tokenizer):
    """echo with logprobs: the prompt's text, tokens and logprobs (transformers' log-softmax over the
    prompt; null for the first token) before the completion's, which are those of a request without
    echo; streamed, the first chunk starts with the prompt; max_tokens 0 gives the prompt alone."""
    import torch

    prompt, kwargs = "The capital of France is", dict(model="smollm2-135m", temperature=0, logprobs=2)
    ids = smollm2_tokenizer.encode(prompt)
    with torch.inference_mode():
        ref = torch.log_softmax(smollm2_hf(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    expected = ref.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).tolist()
    plain = client.completions.create(prompt=prompt, max_tokens=6, **kwargs).choices[0]
    echoed = client.completions.create(prompt=prompt, max_tokens=6, echo=True, **kwargs).choices[0]
    n, lp = len(ids), echoed.logprobs
    assert echoed.text == prompt + plain.text and "".join(lp.tokens[:n]) == prompt
    assert lp.tokens[n:] == plain.logprobs.tokens
    assert lp.token_logprobs[n:] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(expected, abs=1e-3)
    assert all(len(top) >= 2 and top[t] == value for t, value, top in zip(lp.tokens[1:n], lp.token_logprobs[1:n],
                                                                           lp.top_logprobs[1:n]))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]

    streamed = [c.choices[0].text for c in client.completions.create(prompt=prompt, max_tokens=6, echo=True,
                                                                      stream=True, **kwargs) if c.choices]
    assert streamed[0].startswith(prompt) and "".join(streamed) == echoed.text
    alone = client.completions.create(prompt=prompt, max_tokens=0, echo=True, **kwargs)
    assert alone.choices[0].text == prompt and alone.choices[0].finish_reason == "length"
    assert alone.choices[0].logprobs.tokens == lp.tokens[:n] and alone.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"echo": True})


def test_completion_best_of_returns_the_likeliest(client):
    """best_of 4, n 2 with a seed: the engine's outputs i are seeded seed + i, so they are those of n 4
    with the same seed, and the answer holds the 2 of them whose logprobs sum highest, best first."""
    kwargs = dict(model="smollm2-135m", prompt="The weather today is", max_tokens=8, temperature=1.0, seed=11,
                  logprobs=0)
    every = client.completions.create(n=4, **kwargs).choices
    best = client.completions.create(n=2, best_of=4, **kwargs).choices
    ranked = sorted(every, key=lambda c: sum(c.logprobs.token_logprobs), reverse=True)
    assert [c.index for c in best] == [0, 1]
    assert [c.text for c in best] == [c.text for c in ranked[:2]]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(n=1, best_of=2, stream=True, **kwargs)
