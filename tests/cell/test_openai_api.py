"""The OpenAI-compatible routes (openai_api.py) with the official ``openai`` client against a worker on the real
engine: chat and completions, plain and streamed, usage with cached tokens on a re-sent conversation (session
affinity), the same answers as the session contract, and bad input refused in OpenAI's error shape."""

from __future__ import annotations

import openai
import pytest
import pytest_asyncio

from ._server import call, client_fixture, new_sid, open_client  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.cell, pytest.mark.asyncio(loop_scope="session")]

MODEL = "SmolLM2-135M-Instruct"
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}


@pytest_asyncio.fixture(loop_scope="session", name="oa")
async def openai_client(client):
    c = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0, timeout=120)
    yield c
    await c.close()


async def _contract_reply(client, sid: str, messages: list[dict], max_tokens: int) -> tuple[list[int], str]:
    """The same exchange over the session contract: prefix with the generation prompt, greedy decode."""
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/prefix",
                             {"messages": messages, "add_generation_prompt": True})
    assert status == 200, out
    status, out = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": max_tokens})
    assert status == 200, out
    await call(client, "DELETE", f"/v1/sessions/{sid}")
    return out["tokens"], out["text"]


async def test_models_lists_the_served_model_and_health_answers(oa, client):
    models = await oa.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert await call(client, "GET", "/health") == (200, {})


async def test_chat_completion_equals_the_contracts_greedy_reply(oa, client):
    messages = [SYSTEM, {"role": "user", "content": "Name the capital of France."}]
    got = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    tokens, text = await _contract_reply(client, new_sid(), messages, 12)
    choice = got.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason in ("stop", "length")
    assert got.usage.completion_tokens == len(tokens)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    ext = got.model_extra["modeld"]                       # the contract's traces ride along
    assert ext["prefix"]["prompt_tokens"] == got.usage.prompt_tokens
    assert ext["decode"]["completion_tokens"] == got.usage.completion_tokens
    # without an affinity header the request's own session is closed afterwards
    status, _ = await call(client, "GET", f"/v1/sessions/{ext['session_id']}")
    assert status == 404


async def test_a_streamed_chat_arrives_as_chunks_that_add_up_to_the_plain_reply(oa):
    messages = [SYSTEM, {"role": "user", "content": "Count from one to five."}]
    plain = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    stream = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert roles == ["assistant"] and "".join(pieces) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens
    assert usage.prompt_tokens == plain.usage.prompt_tokens


async def test_a_resent_conversation_on_its_session_reuses_the_kv_of_what_was_sent_before(oa, client):
    sid = new_sid("oa")
    # a cache scope of this session's own (vLLM's cache_salt): nothing an earlier test left in the prefix cache counts
    headers, scope = {"x-session-id": sid}, {"cache_salt": sid}
    conversation = [SYSTEM, {"role": "user", "content": "Give me a word that rhymes with cat."}]
    try:
        first = await oa.chat.completions.create(model=MODEL, messages=conversation, max_tokens=8, temperature=0,
                                                 extra_headers=headers, extra_body=scope)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        conversation += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And one that rhymes with dog?"}]
        second = await oa.chat.completions.create(model=MODEL, messages=conversation, max_tokens=8, temperature=0,
                                                  extra_headers=headers, extra_body=scope)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # every token of the first request's prompt is still in the session's KV; the new turn is computed
        assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
        ext = second.model_extra["modeld"]
        assert ext["session_id"] == sid
        assert ext["prefix"]["tokens_computed"] == second.usage.prompt_tokens - cached
        # the session holds the conversation and the reply (it is the client's, so it stays open)
        status, held = await call(client, "GET", f"/v1/sessions/{sid}")
        assert status == 200 and len(held["tokens"]) == second.usage.prompt_tokens + second.usage.completion_tokens
        # llm-d's header name reaches the same session
        third = await oa.chat.completions.create(model=MODEL, messages=conversation, max_tokens=1, temperature=0,
                                                 extra_headers={"x-session-token": sid}, extra_body=scope)
        assert third.usage.prompt_tokens_details.cached_tokens == third.usage.prompt_tokens
    finally:
        await call(client, "DELETE", f"/v1/sessions/{sid}")


async def test_ignore_eos_runs_to_max_tokens_and_usage_streams_with_every_chunk(oa):
    """vLLM's extensions that load tools send (guidellm does): ignore_eos fixes the output length,
    stream_options.continuous_usage_stats puts the usage so far on every chunk."""
    messages = [{"role": "user", "content": "Reply with the single word OK."}]
    plain = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    fixed = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 40 and fixed.choices[0].finish_reason == "length"
    if plain.choices[0].finish_reason == "stop":            # it ended at EOS: the same start, then past it
        assert plain.usage.completion_tokens < 40
    stream = await oa.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
                                              stream_options={"include_usage": True, "continuous_usage_stats": True},
                                              extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.prompt_tokens == fixed.usage.prompt_tokens


async def test_completions_take_text_or_token_ids_plain_and_streamed(oa, client):
    status, tok = await call(client, "POST", "/v1/tokenize", {"text": "The capital of France is"})
    assert status == 200
    by_text = await oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    by_ids = await oa.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text and by_text.object == "text_completion"
    assert by_text.usage.prompt_tokens == tok["count"]
    streamed = await oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                           temperature=0, stream=True)
    text = "".join([c.choices[0].text async for c in streamed if c.choices])
    assert text == by_text.choices[0].text


async def test_stop_strings_and_seeded_sampling(oa):
    prompt = "1, 2, 3, 4, 5, 6, 7, 8,"
    out = await oa.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[" 11"])
    assert out.choices[0].finish_reason == "stop" and "11" not in out.choices[0].text
    a = await oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)
    b = await oa.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=7)
    assert a.choices[0].text == b.choices[0].text          # the same seed draws the same tokens


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}, "tools"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"temperature": 3}, "temperature"),
    ({"extra_body": {"guided_json": {}}}, "guided_json"),
], ids=["n", "logprobs", "tools", "penalty", "temperature", "unknown"])
async def test_what_the_cell_does_not_serve_is_refused_naming_the_parameter(oa, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         **kwargs)
    err = info.value.body
    assert param in err["message"] and err["type"] == "invalid_request_error" and err["code"] == "bad_request"
    assert err["param"] == param, err


async def test_errors_have_openais_shape_and_status(oa, client):
    with pytest.raises(openai.NotFoundError) as info:
        await oa.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as info:             # over the context tier (the engine's)
        await oa.completions.create(model=MODEL, prompt=[1] * 70_000, max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as info:
        await oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         extra_headers={"x-session-id": "../etc"})
    assert info.value.body["param"] == "x-session-id"
    status, body = await call(client, "POST", "/v1/chat/completions", raw=b"{not json")
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}


async def test_the_contracts_decode_takes_ignore_eos_too(client):
    sid = new_sid()
    try:
        status, _ = await call(client, "POST", f"/v1/sessions/{sid}/prefix",
                               {"messages": [{"role": "user", "content": "Reply with the single word OK."}],
                                "add_generation_prompt": True})
        assert status == 200
        status, out = await call(client, "POST", f"/v1/sessions/{sid}/decode", {"max_tokens": 30, "ignore_eos": True})
        assert status == 200 and out["trace"]["completion_tokens"] == 30 and out["finish_reason"] == "length", out
    finally:
        await call(client, "DELETE", f"/v1/sessions/{sid}")
