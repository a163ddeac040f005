"""The engine's sampling features through the HTTP API, as the `openai` client sends them: logprobs (completions'
and chat's formats), echo with the prompt's logprobs, vLLM's prompt_logprobs, penalties, logit_bias, min_tokens,
min_p and include_stop_str_in_output. Each answer equals `LLM.generate` / `LLM.chat` with the same
SamplingParams (the engine's own tests compare those with transformers: test_19_sampling_features.py).
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from test_13_server import assert_engine_empty
from test_19_server import ENGINE, HAIL, LLAMA, assert_openai_error, serving

from roseinfer import LLM, LLMEngine, SamplingParams
from roseinfer.entrypoints.async_engine import AsyncLLMEngine

PROMPT = "ROMEO.\nWhat light"


@pytest.fixture(scope="module")
def llm():
    return LLM(LLAMA, **ENGINE)


@pytest.fixture(scope="module")
def server():
    engine = AsyncLLMEngine(LLMEngine(LLAMA, max_num_seqs=16, **ENGINE))
    with serving(engine) as (url, _):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def one(llm: LLM, prompt, **kwargs):
    return llm.generate([prompt], SamplingParams(**kwargs), use_tqdm=False)[0]


def test_completion_logprobs_equal_the_engines_and_stream_the_same(server, client, llm):
    want = one(llm, PROMPT, temperature=0, max_tokens=10, logprobs=3)
    r = client.completions.create(model="roseinfer", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    lp, c = r.choices[0].logprobs, want.outputs[0]
    assert r.choices[0].text == c.text
    assert lp.token_logprobs == pytest.approx([d[t].logprob for t, d in zip(c.token_ids, c.logprobs, strict=True)])
    assert lp.tokens == [d[t].decoded_token for t, d in zip(c.token_ids, c.logprobs, strict=True)]
    assert "".join(lp.tokens) == c.text  # greedy, no stop string: the tokens' texts make the text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    for top, d, t in zip(lp.top_logprobs, c.logprobs, c.token_ids, strict=True):
        best = sorted((x for x in d.values() if x.rank <= 3), key=lambda x: x.rank)
        assert list(top) == [x.decoded_token for x in best] or len(top) == 3  # greedy: the chosen one is rank 1
        assert top[d[t].decoded_token] == pytest.approx(d[t].logprob) and max(top.values()) <= 0
    parts = list(client.completions.create(model="roseinfer", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3,
                                           stream=True))  # fmt: skip
    streamed = [x for p in parts for ch in p.choices if ch.logprobs for x in ch.logprobs.token_logprobs]
    offsets = [x for p in parts for ch in p.choices if ch.logprobs for x in ch.logprobs.text_offset]
    assert streamed == pytest.approx(lp.token_logprobs) and offsets == lp.text_offset
    assert_engine_empty(server[1])


def test_echo_puts_the_prompt_and_its_logprobs_first(server, llm):
    want = one(llm, PROMPT, temperature=0, max_tokens=4, logprobs=1, prompt_logprobs=1)
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
    choice = httpx.post(server[0] + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["text"] == PROMPT + want.outputs[0].text
    lp, n = choice["logprobs"], len(want.prompt_token_ids)
    assert len(lp["tokens"]) == n + len(want.outputs[0].token_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # nothing comes before it
    prompt = [d[t].logprob for t, d in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:], strict=True)]
    assert lp["token_logprobs"][1:n] == pytest.approx(prompt)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    streamed = httpx.post(server[0] + "/v1/completions", json=body | {"stream": True}, timeout=60).text
    assert streamed.count('"text_offset"') >= 1 and PROMPT.split("\n")[0] in streamed
    plp = httpx.post(server[0] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                     "prompt_logprobs": 2}, timeout=60).json()["choices"][0]["prompt_logprobs"]  # fmt: skip
    assert plp[0] is None and len(plp) == n
    assert plp[1][str(want.prompt_token_ids[1])]["logprob"] == pytest.approx(prompt[0])


def test_chat_logprobs_and_top_logprobs(server, client, llm):
    want = llm.chat(HAIL, SamplingParams(temperature=0, max_tokens=8, logprobs=2), use_tqdm=False)[0].outputs[0]
    r = client.chat.completions.create(model="roseinfer", messages=HAIL, max_tokens=8, temperature=0, logprobs=True,
                                       top_logprobs=2)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert [e.logprob for e in content] == pytest.approx([d[t].logprob for t, d in zip(want.token_ids, want.logprobs,
                                                                                          strict=True)])  # fmt: skip
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in content)
    assert all(e.top_logprobs[0].token == e.token for e in content)  # greedy: the chosen token is the most likely
    assert all(bytes(e.bytes).decode("utf-8", errors="replace") == e.token for e in content)
    stream = client.chat.completions.create(model="roseinfer", messages=HAIL, max_tokens=8, temperature=0,
                                            logprobs=True, stream=True)  # fmt: skip
    streamed = [e for ch in stream for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content])
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs: the chosen token only
    plain = client.chat.completions.create(model="roseinfer", messages=HAIL, max_tokens=8, temperature=0)
    assert plain.choices[0].logprobs is None


FEATURES = [
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 1.8},
    {"logit_bias": {"11": 100.0}},
    {"min_tokens": 6, "stop_token_ids": [198]},
    {"min_p": 0.3, "temperature": 0.8, "seed": 3},
    {"stop": ["e"], "include_stop_str_in_output": True},
]


@pytest.mark.parametrize("fields", FEATURES, ids=lambda f: "+".join(f))
def test_sampling_fields_answer_as_the_engine_does(server, client, llm, fields):
    kwargs = {"temperature": 0, "max_tokens": 12} | fields
    params = kwargs | ({"logit_bias": {int(k): v for k, v in fields["logit_bias"].items()}} if "logit_bias" in fields
                       else {})  # fmt: skip
    want = one(llm, PROMPT, **params).outputs[0]
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": PROMPT} | kwargs, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == want.text and choice["finish_reason"] == want.finish_reason
    if "logit_bias" in fields:
        assert set(want.token_ids) == {11}
    if "include_stop_str_in_output" in fields:
        assert choice["text"].endswith("e")
    chat = client.chat.completions.create(model="roseinfer", messages=HAIL, extra_body=kwargs)  # vLLM's extras too
    want = llm.chat(HAIL, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == want.text


@pytest.mark.parametrize(
    ("path", "body", "status", "match"),
    [
        ("/v1/chat/completions", {"messages": HAIL, "top_logprobs": 2}, 400, "top_logprobs needs logprobs"),
        ("/v1/chat/completions", {"messages": HAIL, "logprobs": True, "top_logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "a", "logprobs": 21}, 400, "logprobs"),
        ("/v1/completions", {"prompt": "a", "presence_penalty": 3.0}, 400, "presence_penalty"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"999999": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1.0}}, 400, "logit_bias"),
        ("/v1/completions", {"prompt": "a", "min_tokens": 20, "max_tokens": 4}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "a", "min_p": 1.5}, 400, "min_p"),
        ("/v1/completions", {"prompt": "a", "repetition_penalty": 0.0}, 400, "repetition_penalty"),
    ],
)
def test_bad_sampling_fields_are_400s_naming_the_field(server, path, body, status, match):
    assert_openai_error(httpx.post(server[0] + path, json=body, timeout=60), status, match)


def test_no_logprob_is_sent_as_minus_infinity(server):
    """JSON has no -inf: a logprob that underflows is sent as -9999, as vLLM does."""
    r = httpx.post(server[0] + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "logprobs": 20,
                   "temperature": 0}, timeout=60)  # fmt: skip
    lp = r.json()["choices"][0]["logprobs"]
    values = [v for top in lp["top_logprobs"] for v in top.values()] + lp["token_logprobs"]
    assert all(math.isfinite(v) and v >= -9999 for v in values) and len(lp["top_logprobs"][0]) >= 20
