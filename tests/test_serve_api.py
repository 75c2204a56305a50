"""The HTTP API of `python -m jds41.serve` against a real server process (tiny one-layer model, CPU).

What the clients rely on: temperature-0 stream and non-stream give the same text, the SSE invariants (first chunk
carries the role, one id, exactly one finish chunk, a usage chunk with `choices: []` when asked, then [DONE]),
UTF-8 never split, stop strings never leaked, logprobs, context overflow as a 400 before any chunk, max_tokens
clamped to the context with finish_reason "length", prefill, tokenize/detokenize, /props and /v1/models.
TextAssembler (the text side of streaming) is also tested directly with the model's own tokenizer.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from serve_harness import CTX, REPO, assert_error_shape, sse_events, start_server, tiny_model

from jds41.serve.streaming import TextAssembler

pytestmark = pytest.mark.timeout(300)
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
PROMPT_IDS = [0, 3, 47, 76, 313, 86, 266, 282, 4, 6]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "api")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from jds41.checkpoints import open_model
    from jds41.tokenizer import Tokenizer

    with open_model(tiny_model(tmp_path_factory)) as m:
        return Tokenizer.from_metadata(m.metadata)


def stream_raw(server, path: str, body: dict) -> tuple[list[str], list]:
    """Raw SSE lines and parsed events of a streaming request."""
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = list(r.iter_lines())
    return lines, sse_events(lines)


# ---- text assembly ------------------------------------------------------------------------------------------
def test_utf8_never_split(tokenizer):
    text = "naïve café — 世界 🎉🙂 ok"
    ids = tokenizer.encode(text, add_bos=False)
    assert any(not _valid_utf8(tokenizer.token_bytes(i)) for i in ids), "no token splits a character: test is moot"
    asm = TextAssembler(tokenizer)
    pieces = [asm.feed(i) for i in ids] + [asm.finish()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def _valid_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@settings(max_examples=150, deadline=None, derandomize=True)
@given(text=st.text(alphabet="ab é世🎉\n", max_size=40), stops=st.lists(st.text(alphabet="ab é世🎉\n", min_size=1,
                                                                                  max_size=4), max_size=3))
def test_stop_strings_cut_text_exactly(tokenizer, text, stops):
    asm = TextAssembler(tokenizer, stops)
    out = "".join(asm.feed(i) for i in tokenizer.encode(text, add_bos=False)) + asm.finish()
    hits = [text.find(s) for s in stops if s in text]
    assert out == (text[:min(hits)] if hits else text)
    assert asm.stopped == bool(hits)


def test_stop_string_held_back_until_decided(tokenizer):
    asm = TextAssembler(tokenizer, ["<END>"])
    released = [asm.feed(i) for i in tokenizer.encode("abc<EN", add_bos=False)]
    assert "".join(released) == "abc"  # "<EN" may still become "<END>"
    assert asm.feed(tokenizer.encode("x", add_bos=False)[0]) == "<ENx"


# ---- metadata endpoints -------------------------------------------------------------------------------------
def test_health_models_props(server, client):
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["load"]["phase"] == "ready"
    assert health["load"]["bytes_done"] == health["load"]["bytes_total"] > 0
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny-l1"]
    raw = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert raw["status"] == "loaded" and raw["context_length"] == CTX
    props = httpx.get(server.url + "/props").json()
    assert props["n_ctx"] == CTX and props["total_slots"] == 2 and props["profile"] == "all-hbm"
    assert props["chat_template_source"] == "gguf" and "<｜User｜>" in props["chat_template"]
    assert props["tiers"]["hbm_bytes"] > 0 and props["tiers"]["ssd_bytes"] == 0
    assert "clamped" in props["max_tokens_clamping"] and props["build"]["version"]


def test_tokenize_detokenize(server):
    text = "The quick brown fox. " * 2000  # a 40 KB system prompt must survive the trip
    toks = httpx.post(server.url + "/tokenize", json={"content": text, "add_special": False}).json()
    assert toks["count"] == len(toks["tokens"]) > 1000
    back = httpx.post(server.url + "/detokenize", json={"tokens": toks["tokens"]}).json()
    assert back["content"] == text
    pieces = httpx.post(server.url + "/tokenize", json={"content": "hi there", "with_pieces": True}).json()
    assert "".join(p["piece"] for p in pieces["tokens"]).endswith("hi there")
    chat = httpx.post(server.url + "/tokenize", json={"messages": HELLO}).json()
    assert chat["tokens"][0] == 0 and chat["tokens"][-1] == 6  # BOS ... <｜Assistant｜></think>


# ---- generation ---------------------------------------------------------------------------------------------
def test_temperature0_stream_equals_nonstream(client):
    full = client.chat.completions.create(model="tiny-l1", messages=HELLO, temperature=0, max_tokens=24)
    chunks = list(client.chat.completions.create(model="tiny-l1", messages=HELLO, temperature=0, max_tokens=24,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed and streamed
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 24
    comp = client.completions.create(model="tiny-l1", prompt=PROMPT_IDS, temperature=0, max_tokens=16)
    comp_stream = client.completions.create(model="tiny-l1", prompt=PROMPT_IDS, temperature=0, max_tokens=16,
                                            stream=True)
    assert comp.choices[0].text == "".join(c.choices[0].text for c in comp_stream if c.choices)


def test_seeded_sampling_stream_equals_nonstream(server):
    """Sampled text exercises rare tokens (multi-byte characters split over byte tokens): same seed, same text."""
    body = {"prompt": PROMPT_IDS, "temperature": 1.5, "seed": 7, "max_tokens": 200}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    _, events = stream_raw(server, "/v1/completions", body)
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == full


def test_stream_invariants(server):
    body = {"messages": HELLO, "temperature": 0, "max_tokens": 12, "stream_options": {"include_usage": True}}
    _, events = stream_raw(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"] is not None]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and chunks.index(finals[0]) == len(chunks) - 2
    usage = usage_chunk["usage"]
    full = httpx.post(server.url + "/v1/chat/completions", json=body | {"stream_options": None}, timeout=60).json()
    assert usage == full["usage"] and usage["completion_tokens"] == 12
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage_chunk["timings"]["predicted_n"] == 12
    # Without include_usage there is no usage chunk.
    _, plain = stream_raw(server, "/v1/chat/completions", {"messages": HELLO, "temperature": 0, "max_tokens": 3})
    assert all(e == "[DONE]" or e["choices"] for e in plain)


def test_stop_strings_end_to_end(server):
    base = {"prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 40}
    text = httpx.post(server.url + "/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    stop = text[12:15]
    expected = text[:text.find(stop)]
    body = {**base, "stop": [stop, "never-happens"]}
    full = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    assert full["choices"][0]["text"] == expected and full["choices"][0]["finish_reason"] == "stop"
    _, events = stream_raw(server, "/v1/completions", body)
    pieces = [e["choices"][0]["text"] for e in events[:-1] if e["choices"]]
    assert "".join(pieces) == expected and all(stop not in p for p in pieces)
    assert [e["choices"][0]["finish_reason"] for e in events[:-1]].count("stop") == 1


def test_logprobs(server, client):
    res = client.chat.completions.create(model="tiny-l1", messages=HELLO, temperature=0, max_tokens=6,
                                         logprobs=True, top_logprobs=3)
    content = res.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == entry.logprob  # greedy picks the most likely token
    chunks = client.chat.completions.create(model="tiny-l1", messages=HELLO, temperature=0, max_tokens=6,
                                            logprobs=True, top_logprobs=3, stream=True)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]
    comp = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT_IDS, "temperature": 0, "max_tokens": 5,
                                                            "logprobs": 2}, timeout=60).json()["choices"][0]
    lp = comp["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 5
    assert all(1 <= len(t) <= 2 for t in lp["top_logprobs"])


def test_context_overflow_is_400_before_any_chunk(server, client):
    prompt = [5] * (CTX + 10)
    for stream in (False, True):
        with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": prompt, "stream": stream},
                          timeout=60) as r:
            r.read()
            err = assert_error_shape(r, 400, "exceed_context_size_error")
        assert err["n_prompt_tokens"] == CTX + 10 and err["n_ctx"] == CTX
        assert f"maximum context length is {CTX} tokens" in err["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.chat.completions.create(model="tiny-l1", messages=[{"role": "user", "content": "x " * 5000}],
                                       stream=True)


def test_max_tokens_clamped_to_context(server):
    prompt = [5, 9, 17] * ((CTX - 8) // 3)
    room = CTX - len(prompt)
    res = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "temperature": 0, "max_tokens": 500},
                     timeout=60).json()
    assert res["choices"][0]["finish_reason"] == "length"
    assert res["usage"]["completion_tokens"] == room
    assert res["usage"]["prompt_tokens"] + res["usage"]["completion_tokens"] == CTX


def test_prefill_trailing_assistant(server, client):
    convo = HELLO + [{"role": "assistant", "content": "I am"}]
    base = httpx.post(server.url + "/tokenize", json={"messages": HELLO}).json()["tokens"]
    res = client.chat.completions.create(model="tiny-l1", messages=convo, temperature=0, max_tokens=4)
    assert res.usage.prompt_tokens > len(base)  # the prefill is in the prompt, after the generation prompt
    assert res.choices[0].finish_reason == "length"
    tool_call = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": HELLO + [tool_call]})
    assert "prefill" in assert_error_shape(r, 400, "invalid_request_error")["message"]


def test_model_names(server, client):
    for name in ("tiny-l1", "tiny-l1.gguf"):
        assert client.completions.create(model=name, prompt="hi", max_tokens=1).choices[0].finish_reason
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=1)


def test_openapi_schema_and_light_imports(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize"} <= set(spec["paths"])
    # Clients and tools import the request models on machines without an accelerator stack.
    code = "import sys, jds41.serve.schemas, jds41.serve.errors; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
