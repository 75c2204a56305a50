"""The prefix cache through `python -m jds41.serve --prefix-cache-bytes N --prefix-cache-dir D` (real server
process, real openai client): a later agent turn reports the tokens it resumed in
`usage.prompt_tokens_details.cached_tokens`, gives the text a server without the cache gives, the
`jds41:prefix_cache_*` metrics count it, and a restarted server on the same directory resumes from the files.
"""

from __future__ import annotations

import openai
import pytest
from serve_harness import start_server

pytestmark = pytest.mark.timeout(600)
SYSTEM = "You are a careful agent. Keep answers short and cite the tool output you used. " * 2


@pytest.fixture(scope="module")
def snapshot_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("serve-prefix")


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _turns(client) -> tuple:
    """Two chat turns of one conversation and a raw-id completion that extends the first turn's prompt."""
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the files."}]
    r1 = client.chat.completions.create(model="tiny-l1", messages=first, max_tokens=6, temperature=0)
    second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
              {"role": "user", "content": "Now open the first one."}]
    r2 = client.chat.completions.create(model="tiny-l1", messages=second, max_tokens=6, temperature=0)
    return r1, r2


def test_later_turn_reports_cached_tokens_and_matches_uncached_server(tmp_path_factory, snapshot_dir):
    cached = start_server(tmp_path_factory, "prefix-cache", "--prefix-cache-bytes", str(64 << 20),
                          "--prefix-cache-dir", str(snapshot_dir))
    try:
        c = _client(cached)
        r1, r2 = _turns(c)
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        hit = r2.usage.prompt_tokens_details.cached_tokens
        assert 0 < hit < r2.usage.prompt_tokens  # resumed from the first turn's prompt, computed only the rest
        assert hit <= r1.usage.prompt_tokens
        # raw ids: a prompt that extends an earlier one by exactly 3 ids resumes from all of it
        ids = list(range(3, 40))
        c.completions.create(model="tiny-l1", prompt=ids, max_tokens=2, temperature=0)
        r3 = c.completions.create(model="tiny-l1", prompt=ids + [7, 8, 9], max_tokens=4, temperature=0)
        assert r3.usage.prompt_tokens_details.cached_tokens == len(ids)
        assert cached.metric("jds41:prefix_cache_hits_total") == 2
        assert cached.metric("jds41:prefix_cache_misses_total") == 2
        assert cached.metric("jds41:prefix_cache_hit_tokens_total") == hit + len(ids)
        assert cached.metric("jds41:prefix_cache_bytes") > 0
        assert cached.metric("jds41:prefix_cache_evictions_total") == 0
    finally:
        cached.stop()

    plain = start_server(tmp_path_factory, "prefix-plain")
    try:
        c = _client(plain)
        p1, p2 = _turns(c)
        p3 = c.completions.create(model="tiny-l1", prompt=ids + [7, 8, 9], max_tokens=4, temperature=0)
        assert p2.usage.prompt_tokens_details.cached_tokens == 0
        assert plain.metric("jds41:prefix_cache_hits_total") == 0
    finally:
        plain.stop()
    assert (p1.choices[0].message.content, p2.choices[0].message.content, p3.choices[0].text) == \
        (r1.choices[0].message.content, r2.choices[0].message.content, r3.choices[0].text)

    restarted = start_server(tmp_path_factory, "prefix-restart", "--prefix-cache-bytes", str(64 << 20),
                             "--prefix-cache-dir", str(snapshot_dir))
    try:
        r = _client(restarted).completions.create(model="tiny-l1", prompt=ids + [7, 8, 9], max_tokens=4, temperature=0)
        # the 40-id prompt's own snapshot is not usable (one id must be computed): the 37-id one is, from disk
        assert r.usage.prompt_tokens_details.cached_tokens == len(ids)
        assert r.choices[0].text == r3.choices[0].text
    finally:
        restarted.stop()


def test_prefix_cache_flags_are_checked(tmp_path, capsys):
    from jds41.serve.__main__ import parse

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # parse only checks that it exists
    _, options = parse([str(model), "--prefix-cache-bytes", "1000", "--prefix-cache-dir", str(tmp_path / "d"),
                        "--prefill-chunk", "512"])
    assert (options.prefix_cache_bytes, options.prefix_cache_dir, options.prefill_chunk) == \
        (1000, str(tmp_path / "d"), 512)
    for bad, message in ((["--prefix-cache-dir", "d"], "needs --prefix-cache-bytes"),
                         (["--prefill-chunk", "-1"], "--prefill-chunk -1"),
                         (["--prefix-cache-bytes", "-5"], "--prefix-cache-bytes -5")):
        with pytest.raises(SystemExit):
            parse([str(model), *bad])
        assert message in capsys.readouterr().err
