"""Tokenizer, StreamDecoder and chat templates against a byte-level BPE trained here with `tokenizers`.

The BPE's vocab and merges are written into a metadata dict in GGUF form (GPT-2 byte-to-unicode token strings,
llama.cpp token types), so these tests exercise exactly what `Tokenizer.from_metadata` reads from a file. The
byte map is computed here from GPT-2's definition, independently of jds41.tokenizer, so a wrong map in the module
fails the token_bytes test instead of agreeing with itself.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from jds41.chat import DEEPSEEK_V4_TEMPLATE, ChatTemplateError
from jds41.errors import ConfigError
from jds41.tokenizer import InvalidTokenError, StreamDecoder, Tokenizer

BOS, EOS, USER, ASSISTANT = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
THINK = "<think>"  # appended as a user-defined token (type 4): atomic, but not special
ROBOT = "🤖"  # F0 9F A4 96: its first byte alone is not valid UTF-8

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Robots 🤖 write code: def add(x, y): return x + y\n",
    "Un café à Paris, s'il vous plaît — naïve résumé, déjà vu, où est la gare? Élodie répond: très bien.\n",
    "中文分词测试：我们正在训练一个很小的分词器。今天天气很好，机器人🤖在写代码。\n",
    "Numbers 0 1 12 123 1234 12345 3.14159 and symbols !@#$%^&*()[]{}<>|\\/~`'\"\n",
    "Emoji mix: 😀 🎉 🚀 🤖🤖 ✨ — and tabs\tand\nnewlines\r\n  indented lines   with trailing spaces   \n",
]


def gpt2_bytes_to_unicode() -> dict[int, str]:
    """GPT-2 (openai/gpt-2 encoder.py, `bytes_to_unicode`): the 188 printable bytes in !..~, ¡..¬, ®..ÿ keep their
    code point; the remaining 68 bytes, in increasing order, take U+0100, U+0101, ..."""
    printable = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    others = [b for b in range(256) if b not in printable]
    table = {b: chr(b) for b in printable}
    table.update({b: chr(0x100 + i) for i, b in enumerate(others)})
    return table


B2U = gpt2_bytes_to_unicode()
U2B = {c: b for b, c in B2U.items()}


def train_bpe() -> HFTokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    # The full 256-byte alphabet guarantees every byte has a token, so any text round-trips.
    trainer = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[BOS, EOS, USER, ASSISTANT], show_progress=False)
    hf.train_from_iterator(CORPUS * 20, trainer)
    return hf


def gguf_metadata(hf: HFTokenizer, **extra) -> dict:
    """The tokenizer.ggml.* keys a GGUF converter writes for `hf`, plus a user-defined token at the end."""
    n = hf.get_vocab_size()
    tokens = [hf.id_to_token(i) for i in range(n)]
    specials = {BOS, EOS, USER, ASSISTANT}
    for t in tokens:
        assert t in specials or all(c in U2B for c in t), f"{t!r} is not in byte-to-unicode form"
    merges = json.loads(hf.to_str())["model"]["merges"]
    meta = {
        "general.architecture": "deepseek4",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": [*tokens, THINK],
        "tokenizer.ggml.token_type": [3 if t in specials else 1 for t in tokens] + [4],
        "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
        "tokenizer.ggml.bos_token_id": tokens.index(BOS),
        "tokenizer.ggml.eos_token_id": tokens.index(EOS),
        "tokenizer.ggml.padding_token_id": tokens.index(EOS),
        "tokenizer.ggml.add_bos_token": True,
    }
    meta.update(extra)
    return meta


@pytest.fixture(scope="module")
def hf():
    return train_bpe()


@pytest.fixture(scope="module")
def meta(hf):
    return gguf_metadata(hf)


@pytest.fixture(scope="module")
def tok(meta):
    return Tokenizer.from_metadata(meta)


def byte_token(tok: Tokenizer, b: int) -> int:
    return tok.backend.token_to_id(B2U[b])


SAMPLES = ["", "hello", " leading space", "café 中文 🤖", "🤖🤖🤖", "a\nb\r\n\tc  ", "x" * 300, "ÿ\x00\x7f\u2028",
           "日本語のテキスト", "mixed: naïve 12345 🎉!", "\ufffd already a replacement char"]


# ---- building ---------------------------------------------------------------------------------------------


def test_model_none_has_no_tokenizer():
    assert Tokenizer.from_metadata({"tokenizer.ggml.model": "none", "deepseek4.vocab_size": 512}) is None


@pytest.mark.parametrize("patch, key", [
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "no-such-pre"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "tokenizer.ggml.token_type"),
    ({"tokenizer.ggml.merges": ["nospace"]}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.merges": ["Ġ zzzz_not_a_token"]}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.bos_token_id": 10**6}, "tokenizer.ggml.bos_token_id"),
    ({"tokenizer.ggml.eos_token_id": "1"}, "tokenizer.ggml.eos_token_id"),
    ({"tokenizer.ggml.tokens": 7}, "tokenizer.ggml.tokens"),
    ({"tokenizer.chat_template": "{% for m in messages %}"}, "tokenizer.chat_template"),
])
def test_bad_metadata_names_the_key(meta, patch, key):
    bad = {k: v for k, v in {**meta, **patch}.items() if v is not None}
    with pytest.raises(ConfigError) as err:
        Tokenizer.from_metadata(bad, path="model.gguf")
    assert err.value.key == key and "model.gguf" in str(err.value)


def test_vocab_and_ids(tok, hf, meta):
    assert tok.vocab_size == hf.get_vocab_size() + 1
    assert (tok.bos_id, tok.eos_id) == (hf.token_to_id(BOS), hf.token_to_id(EOS))
    assert tok.is_special(tok.bos_id) and tok.is_special(hf.token_to_id(USER))
    assert not tok.is_special(byte_token(tok, ord("a"))) and not tok.is_special(tok.vocab_size - 1)
    with pytest.raises(InvalidTokenError):
        tok.token_bytes(tok.vocab_size)
    with pytest.raises(InvalidTokenError):
        tok.decode([0, -1])


def test_token_bytes_follow_gpt2_byte_map(tok, meta):
    for i, (text, kind) in enumerate(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"])):
        want = bytes(U2B[c] for c in text) if kind == 1 else text.encode()
        assert tok.token_bytes(i) == want, (i, text)
    assert tok.token_bytes(byte_token(tok, 0xF0)) == b"\xf0"


# ---- encode / decode --------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_and_same_ids_as_trained_tokenizer(tok, hf, text):
    ids = tok.encode(text, add_bos=False)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=120))
def test_round_trip_any_text(tok, text):
    assert tok.decode(tok.encode(text, add_bos=False)) == text


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 1 << 16), max_size=40))
def test_decode_agrees_with_tokenizers_byte_level_decoder(tok, hf, ids):
    # Arbitrary ids cut characters anywhere; both must replace the same invalid bytes with U+FFFD.
    ids = [i % hf.get_vocab_size() for i in ids]
    ids = [i for i in ids if not tok.is_special(i)]
    assert tok.decode(ids) == hf.decode(ids)


def test_bos_is_added_once(tok):
    ids = tok.encode("hi")
    assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
    assert tok.encode(BOS + "hi") == ids  # a template that writes BOS itself gets no second one
    assert tok.encode("hi", add_bos=False) == ids[1:]


def test_special_tokens_are_atomic(tok, hf):
    user, assistant, think = hf.token_to_id(USER), hf.token_to_id(ASSISTANT), tok.vocab_size - 1
    ids = tok.encode(f"x{USER}y{ASSISTANT}{ASSISTANT}z{THINK}", add_bos=False)
    assert ids.count(user) == 1 and ids.count(assistant) == 2 and ids.count(think) == 1
    assert tok.decode(ids) == f"x{USER}y{ASSISTANT}{ASSISTANT}z{THINK}"
    assert tok.decode(ids, skip_special=True) == f"xyz{THINK}"
    # Half a marker is plain text.
    assert user not in tok.encode("<｜User", add_bos=False)
    # parse_special=False: marker text stays text (no role injection), user-defined tokens still match whole.
    literal = tok.encode(f"a{USER}b{THINK}", add_bos=False, parse_special=False)
    assert not any(tok.is_special(i) for i in literal) and think in literal
    assert tok.decode(literal) == f"a{USER}b{THINK}"


def test_deepseek_v3_pre_tokenizer(meta):
    ds = Tokenizer.from_metadata({**meta, "tokenizer.ggml.pre": "deepseek-v3"})
    for text in ["1234567 x", "abc中文def", "Hello, world! 🤖 12"] + SAMPLES:
        assert ds.decode(ds.encode(text, add_bos=False)) == text
    # Digits come in groups of at most three and CJK runs never share a token with Latin letters.
    digits = [ds.token_bytes(i) for i in ds.encode("1234567", add_bos=False)]
    assert b"".join(digits) == b"1234567" and all(len(d) <= 3 for d in digits)
    for i in ds.encode("abc中文def", add_bos=False):
        piece = ds.token_bytes(i).decode("utf-8", errors="ignore")
        assert not (any(c.isascii() for c in piece) and any(not c.isascii() for c in piece))


# ---- StreamDecoder ----------------------------------------------------------------------------------------


def stream_pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    return [dec.feed(i) for i in ids] + [dec.flush()]


def test_stream_holds_an_emoji_until_complete(tok):
    ids = tok.encode("a", add_bos=False) + [byte_token(tok, b) for b in ROBOT.encode()] + tok.encode("b", add_bos=False)
    dec = StreamDecoder(tok)
    assert dec.feed(ids[0]) == "a"
    for i in ids[1:4]:  # F0, 9F, A4: never a piece, never a replacement char
        assert dec.feed(i) == "" and dec.pending
    assert dec.feed(ids[4]) == ROBOT and not dec.pending
    assert dec.feed(ids[5]) == "b" and dec.flush() == ""


def test_stream_flush_replaces_an_unfinished_character(tok):
    dec = StreamDecoder(tok)
    ids = [byte_token(tok, b) for b in ROBOT.encode()[:2]]
    assert dec.feed_many(ids) == "" and dec.flush() == "\ufffd" == tok.decode(ids)
    assert dec.feed(byte_token(tok, ord("z"))) == "z"  # reusable after flush


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=60), cut=st.randoms(use_true_random=False))
def test_stream_never_emits_part_of_a_character(tok, text, cut):
    # Mix BPE tokens with single-byte tokens so multi-byte characters are split across tokens at random places.
    ids = []
    for ch in text:
        if cut.random() < 0.5:
            ids += [byte_token(tok, b) for b in ch.encode()]
        else:
            ids += tok.encode(ch, add_bos=False)
    pieces = stream_pieces(tok, ids)
    for p in pieces:
        p.encode("utf-8")  # a well-formed str (no lone surrogates)
        assert "\ufffd" not in p or "\ufffd" in text
    assert "".join(pieces) == text == tok.decode(ids)


@settings(max_examples=200, deadline=None)
@given(ids=st.lists(st.integers(0, 1 << 16), max_size=50))
def test_stream_equals_decode_for_any_ids(tok, ids):
    ids = [i % tok.vocab_size for i in ids]
    assert "".join(stream_pieces(tok, ids)) == tok.decode(ids)


def test_stream_can_skip_special_tokens(tok, hf):
    ids = tok.encode(f"hi{EOS}", add_bos=True)
    assert StreamDecoder(tok, skip_special=True).feed_many(ids) == "hi"
    assert tok.stream().feed_many(ids) == f"{BOS}hi{EOS}"


# ---- chat templates ---------------------------------------------------------------------------------------

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🤖"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]


def test_default_deepseek_v4_template(tok):
    assert tok.chat_template_source == "default-deepseek-v4" and tok.chat.source == DEEPSEEK_V4_TEMPLATE
    text = tok.apply_chat_template(CHAT)
    assert text == f"{BOS}Be brief.{USER}Hi 🤖{ASSISTANT}Hello!{EOS}{USER}Bye{ASSISTANT}"
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == text.removesuffix(ASSISTANT)
    # Several system messages join into the prefix; no system message leaves BOS alone in front.
    two = [{"role": "system", "content": "A"}, {"role": "user", "content": "q"}, {"role": "system", "content": "B"}]
    assert tok.apply_chat_template(two) == f"{BOS}A\n\nB{USER}q{ASSISTANT}"
    assert tok.apply_chat_template([{"role": "user", "content": "q"}]) == f"{BOS}{USER}q{ASSISTANT}"
    assert tok.apply_chat_template([]) == f"{BOS}{ASSISTANT}"


def test_default_template_prefill_and_content_parts(tok):
    prefill = [*CHAT[:2], {"role": "assistant", "content": "Sure, "}]
    assert tok.apply_chat_template(prefill) == f"{BOS}Be brief.{USER}Hi 🤖{ASSISTANT}Sure, "
    assert tok.apply_chat_template(prefill, add_generation_prompt=False).endswith(f"Sure, {EOS}")
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts) == f"{BOS}{USER}a\nb{ASSISTANT}"


@pytest.mark.parametrize("messages", [
    "not a list", [1], [{"content": "no role"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "tool", "content": "unsupported role"}],
])
def test_bad_messages_raise_chat_template_error(tok, messages):
    with pytest.raises(ChatTemplateError):
        tok.apply_chat_template(messages)


def test_rendered_prompt_tokenizes_markers_whole(tok, hf):
    ids = tok.encode(tok.apply_chat_template(CHAT))
    assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
    assert ids.count(hf.token_to_id(USER)) == 2 and ids[-1] == hf.token_to_id(ASSISTANT)
    assert ids.count(tok.eos_id) == 1


GGUF_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools: ' ~ m.content) }}"
    "{% endif %}[{{ m.role }}]{{ m.content }}{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}{{ tools | tojson if tools else '' }}"
)


def test_gguf_template_is_used_sandboxed(meta):
    tok = Tokenizer.from_metadata({**meta, "tokenizer.chat_template": GGUF_TEMPLATE})
    assert tok.chat_template_source == "gguf"
    # trim_blocks (as in transformers) eats the newline after each `{% endif %}`.
    assert tok.apply_chat_template(CHAT[1:3]) == f"{BOS}[user]Hi 🤖[assistant]Hello!{EOS}[assistant]"
    assert tok.apply_chat_template(CHAT[1:2], tools=[{"name": "<a&b>"}]).endswith('[{"name": "<a&b>"}]')
    with pytest.raises(ChatTemplateError, match="no tools: x"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    sneaky = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    escape = Tokenizer.from_metadata({**meta, "tokenizer.chat_template": sneaky})
    with pytest.raises(ChatTemplateError):
        escape.apply_chat_template(CHAT)
    mutate = Tokenizer.from_metadata({**meta, "tokenizer.chat_template": "{{ messages.append(1) }}"})
    with pytest.raises(ChatTemplateError):
        mutate.apply_chat_template(CHAT)
    # An empty template counts as none.
    empty = Tokenizer.from_metadata({**meta, "tokenizer.chat_template": ""})
    assert empty.chat_template_source == "default-deepseek-v4"


# ---- through a GGUF file ----------------------------------------------------------------------------------


def read_gguf_metadata(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {name: field.contents() for name, field in reader.fields.items()}


def test_gguf_file_round_trip(tmp_path, meta):
    # Written and read with gguf-py, so arrays and ids arrive in the types a real file gives.
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "deepseek4")
    for add, key in [(w.add_tokenizer_model, "model"), (w.add_tokenizer_pre, "pre"), (w.add_token_list, "tokens"),
                     (w.add_token_types, "token_type"), (w.add_token_merges, "merges"),
                     (w.add_bos_token_id, "bos_token_id"), (w.add_eos_token_id, "eos_token_id")]:
        add(meta[f"tokenizer.ggml.{key}"])
    w.add_add_bos_token(True)
    w.add_chat_template(GGUF_TEMPLATE)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    tok = Tokenizer.from_metadata(read_gguf_metadata(path), path=str(path))
    assert tok.chat_template_source == "gguf" and tok.vocab_size == len(meta["tokenizer.ggml.tokens"])
    for text in SAMPLES:
        assert tok.decode(tok.encode(text)) == (BOS + text)
    assert tok.encode(f"{USER}🤖", add_bos=False)[0] == meta["tokenizer.ggml.tokens"].index(USER)


# ---- a synthetic model file (jds41.checkpoints.synth) -----------------------------------------------------


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory):
    from jds41.checkpoints import presets, synth

    path = tmp_path_factory.mktemp("synth") / "tiny-deepseek41.gguf"
    synth.write_synthetic(path, presets.preset("deepseek41", "tiny"), "f32", progress=False)
    meta = read_gguf_metadata(path)
    return Tokenizer.from_metadata(meta, path=str(path)), meta


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=80) | st.sampled_from(SAMPLES))
def test_synthetic_file_tokenizer_matches_its_hf_json(synth_file, text):
    # The file also stores the writer's own tokenizer as tokenizer.huggingface.json: the one rebuilt from the
    # llama.cpp keys (deepseek-v3 pre-tokenizer) must give the same ids.
    tok, meta = synth_file
    reference = HFTokenizer.from_str(meta["tokenizer.huggingface.json"])
    ids = tok.encode(text, add_bos=False)
    assert ids == reference.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids) == text == "".join(stream_pieces(tok, ids))


def test_synthetic_file_metadata(synth_file):
    from jds41.engram_hash import tokenizer_token_map

    tok, meta = synth_file
    assert tok.vocab_size == meta["deepseek41.vocab_size"] and tok.pre == "deepseek-v3"
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 1, True)
    assert tok.chat_template_source == "gguf"
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi 🤖"}]))
    assert ids[:2] == [0, tok.backend.token_to_id(USER)] and ids.count(0) == 1
    # The Engram token map written into the file is reproduced from the rebuilt tokenizer.
    tmap, _ = tokenizer_token_map(tok.backend)
    assert np.array_equal(tmap, np.asarray(meta["deepseek41.engram.token_map"]))
