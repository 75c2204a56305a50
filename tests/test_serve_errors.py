"""Bad input never becomes a 500: the malformed-request matrix (in the spirit of llama.cpp's
tools/server/tests/unit/test_chat_completion.py and vLLM's test_non_object_body_validation.py), a hypothesis
fuzzer over request bodies, wrong content types, unknown models and routes, the API key, a full queue, and a
fault in the middle of a stream. Every error must have the OpenAI shape {"error": {message, type, param, code}}.

The server runs with --api-key and --max-queue 0, so the same process also shows 401s and 503 queue_full.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_harness import assert_error_shape, sse_events, start_server

pytestmark = pytest.mark.timeout(300)
KEY = "test-key-123"
MSG = [{"role": "user", "content": "hi"}]
CHAT, COMP = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory, "errors", "--max-queue", "0", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with server.client() as c:
        yield c


# (path, body) -> 400 invalid_request_error. Bodies are JSON values, or bytes sent as they are.
BAD_REQUESTS = [
    (CHAT, b"{"), (CHAT, b'{"messages": [}'), (CHAT, b""), (CHAT, b"[]"), (CHAT, b'"hi"'), (CHAT, b"42"),
    (CHAT, b"null"), (CHAT, b"true"), (CHAT, b"\xff\xfe"), (COMP, b"[1, 2]"),
    (CHAT, {}), (CHAT, {"messages": None}), (CHAT, {"messages": "hi"}), (CHAT, {"messages": []}),
    (CHAT, {"messages": [None]}), (CHAT, {"messages": [{}]}), (CHAT, {"messages": [{"role": "user"}]}),
    (CHAT, {"messages": [{"role": "user", "content": None}]}), (CHAT, {"messages": [{"content": "hi"}]}),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}), (CHAT, {"messages": [{"role": 1, "content": "x"}]}),
    (CHAT, {"messages": [{"role": "user", "content": 1}]}), (CHAT, {"messages": [{"role": "user", "content": {}}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    (CHAT, {"messages": MSG, "temperature": "0.5"}), (CHAT, {"messages": MSG, "temperature": -1}),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'),
    (CHAT, {"messages": MSG, "top_p": 0}), (CHAT, {"messages": MSG, "top_p": 1.5}),
    (CHAT, {"messages": MSG, "top_k": "5"}), (CHAT, {"messages": MSG, "top_k": -7}),
    (CHAT, {"messages": MSG, "max_tokens": 0}), (CHAT, {"messages": MSG, "max_tokens": -5}),
    (CHAT, {"messages": MSG, "max_tokens": 1.5}), (CHAT, {"messages": MSG, "max_tokens": True}),
    (CHAT, {"messages": MSG, "max_tokens": "10"}), (CHAT, {"messages": MSG, "max_completion_tokens": []}),
    (CHAT, {"messages": MSG, "seed": "x"}), (CHAT, {"messages": MSG, "seed": 2**70}),
    (CHAT, {"messages": MSG, "stop": 5}), (CHAT, {"messages": MSG, "stop": [""]}),
    (CHAT, {"messages": MSG, "stop": [1]}), (CHAT, {"messages": MSG, "stop": ["x"] * 40}),
    (CHAT, {"messages": MSG, "stream": "yes"}), (CHAT, {"messages": MSG, "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": MSG, "n": 2}), (CHAT, {"messages": MSG, "logprobs": "yes"}),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 50}), (CHAT, {"messages": MSG, "top_logprobs": 2}),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}), (CHAT, {"messages": MSG, "model": 5}),
    (CHAT, {"messages": MSG, "tools": "all"}),
    (COMP, {}), (COMP, {"prompt": None}), (COMP, {"prompt": 5}), (COMP, {"prompt": []}), (COMP, {"prompt": [[]]}),
    (COMP, {"prompt": [-1]}), (COMP, {"prompt": [10**9]}), (COMP, {"prompt": [1.5]}), (COMP, {"prompt": [True]}),
    (COMP, {"prompt": [[1, 2], [3]]}), (COMP, {"prompt": ["a", "b"]}), (COMP, {"prompt": "hi", "echo": True}),
    (COMP, {"prompt": "hi", "logprobs": 50}), (COMP, {"prompt": "hi", "best_of": 3}),
    ("/tokenize", {}), ("/tokenize", {"content": 5}), ("/tokenize", {"content": "a", "prompt": "b"}),
    ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": ["a"]}), ("/detokenize", {"tokens": None}),
]


@pytest.mark.parametrize("path,body", BAD_REQUESTS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD_REQUESTS)])
def test_malformed_requests_are_400(http, path, body):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    for stream in (False, True):  # streaming requests are validated before the first chunk too
        if stream and not (isinstance(body, dict) and path in (CHAT, COMP) and "stream" not in body
                           and "stream_options" not in body):
            continue
        if stream:
            kw = {"json": {**body, "stream": True}}
        assert_error_shape(http.post(path, **kw), 400, "invalid_request_error")


def test_oov_token_ids_name_the_field(http):
    err = assert_error_shape(http.post(COMP, json={"prompt": [5, 512]}), 400, "invalid_request_error")
    assert err["param"] == "prompt" and "512" in err["message"]


def test_wrong_content_type_is_415(http):
    body = json.dumps({"messages": MSG})
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = http.post(CHAT, content=body, headers={"Content-Type": ctype})
        assert "application/json" in assert_error_shape(r, 415)["message"]
    ok = json.dumps({"messages": MSG, "max_tokens": 2})
    assert http.post(CHAT, content=ok, headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_unknown_model_route_and_method(server, http):
    err = assert_error_shape(http.post(CHAT, json={"messages": MSG, "model": "gpt-4o"}), 404, "not_found_error")
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert_error_shape(http.get("/v1/nope"), 404, "not_found_error")
    assert_error_shape(http.post("/v2/chat/completions", json={}), 404)
    assert_error_shape(http.get(CHAT), 405)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)


def test_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200  # public
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
        for method, path in (("POST", CHAT), ("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/props")):
            r = httpx.request(method, server.url + path, json={"messages": MSG}, headers=headers)
            assert_error_shape(r, 401, "authentication_error")
            assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.chat.completions.create(model="tiny-l1", messages=MSG, max_tokens=2).choices[0].finish_reason


def test_queue_full_is_503_with_retry_after(server):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60) as c:
            body = {"prompt": [5, 6, 7], "temperature": 0, "max_tokens": 3000, "stream": True}
            async with c.stream("POST", COMP, json=body) as a, c.stream("POST", COMP, json=body) as b:
                assert a.status_code == b.status_code == 200  # both slots busy for seconds; the queue holds 0
                r = await c.post(CHAT, json={"messages": MSG, "max_tokens": 1})
                assert_error_shape(r, 503, "unavailable_error")
                assert int(r.headers["retry-after"]) > 0

    asyncio.run(run())


# ---- fuzzing: any JSON body gives 200 or a 4xx in the OpenAI shape, never a 500 -------------------------
json_leaf = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
             | st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "assistant", "system", "tool", "x"])
                                              | json_value, "content": st.text(max_size=12) | json_value,
                                              "tool_calls": json_value})
FIELDS = {"model": st.just("tiny-l1") | json_value, "temperature": st.floats(0, 2) | json_value,
          "top_p": st.floats(0, 1) | json_value, "top_k": st.integers(-2, 50) | json_value,
          "seed": st.integers(-2, 2**64) | json_value, "stop": st.text(max_size=3) | json_value,
          "stream": st.booleans() | json_value, "stream_options": json_value,
          "logprobs": st.booleans() | st.integers(0, 30) | json_value, "top_logprobs": st.integers(-1, 30),
          "n": st.integers(0, 3), "response_format": json_value, "tools": json_value, "echo": st.booleans(),
          "messages": st.lists(message, max_size=3) | json_value,
          "prompt": st.text(max_size=12) | st.lists(st.integers(-5, 600), max_size=5) | json_value}
# max_tokens is always present and small when valid: a valid fuzzed body must not hold the slot for seconds.
body_strategy = st.fixed_dictionaries({"max_tokens": st.integers(1, 4) | json_value}, optional=FIELDS)


@settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from([CHAT, COMP, "/tokenize"]), body=body_strategy | json_value)
def test_fuzzed_bodies_never_500(http, path, body):
    r = http.post(path, json=body)
    if r.status_code == 200:
        if isinstance(body, dict) and body.get("stream") is True:
            events = sse_events(r.text.splitlines())
            assert events[-1] == "[DONE]" and not any(isinstance(e, dict) and "error" in e for e in events)
        return
    assert 400 <= r.status_code < 500 or r.status_code == 503, (r.status_code, r.text, body)
    assert_error_shape(r, r.status_code)


# ---- a fault mid-stream -------------------------------------------------------------------------------------
def test_fault_mid_stream_is_an_error_event_then_done():
    from jds41.serve.completions import Generation, _guarded

    class Trace:
        done = False

        def finish(self, *a):
            self.done = True
            return {}

    class Handle:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    async def chunks():
        yield b"data: {}\n\n"
        raise ValueError("device fell over")

    handle = Handle()
    gen = Generation(None, handle, None, Trace(), 3)

    async def collect():
        return [x async for x in _guarded(gen, chunks())]

    out = asyncio.run(collect())
    events = sse_events(b"".join(out).decode().splitlines())
    assert events[0] == {} and events[-1] == "[DONE]" and len(events) == 3
    assert events[1]["error"]["type"] == "server_error" and handle.cancelled
