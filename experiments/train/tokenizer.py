"""The code tokenizer: a byte-level BPE trained with the `tokenizers` library, stored the way llama.cpp reads it.

Pre-tokenizer: DeepSeek V3's split chain (llama.cpp pre type `deepseek-v3`, the one `jds41.tokenizer` and the
synthetic tokenizer use) followed by the GPT-2 byte-level mapping, so the GGUF fields are the synthetic
tokenizer's (`jds41.checkpoints.synth_tokenizer.gguf_fields`: tokenizer.ggml.model gpt2, tokens, token types,
merges, bos/eos/pad, chat template, plus the HF JSON). The first ids are its special tokens (bos 0, eos 1, pad 2 =
the Engram pad id, chat roles, think tags, the DSpark noise token 7).

Training text: training files only (never held-out ones), taken in content-hash order up to `sample_bytes`.
Encoding the whole corpus uses `encode_batch`, which the library runs on all cores.
"""

from __future__ import annotations

import hashlib

import numpy as np

from jds41.checkpoints import synth_tokenizer


def train_tokenizer(texts: list[str], vocab_size: int, sample_bytes: int = 40_000_000):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    order = sorted(range(len(texts)), key=lambda i: hashlib.sha1(texts[i].encode()).hexdigest())
    sample, total = [], 0
    for i in order:
        if total >= sample_bytes:
            break
        sample.append(texts[i])
        total += len(texts[i])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in synth_tokenizer._PRE_SPLITS]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(synth_tokenizer.SPECIAL_TOKENS),
                                  min_frequency=2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(sample, trainer=trainer)
    n = tok.get_vocab_size(with_added_tokens=True)
    if n != vocab_size:
        raise ValueError(f"BPE training gave {n} tokens, wanted {vocab_size} (sample too small?)")
    return tok


def encode_stream(tok, texts: list[str], bos_id: int = synth_tokenizer.BOS_ID, batch: int = 2048) -> np.ndarray:
    """[BOS] + ids of every text, concatenated: uint16 [N] (vocab < 65536)."""
    parts = []
    for i in range(0, len(texts), batch):
        for enc in tok.encode_batch(texts[i:i + batch], add_special_tokens=False):
            parts.append(np.asarray([bos_id] + enc.ids, np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


def encode_docs(tok, texts: list[str], bos_id: int = synth_tokenizer.BOS_ID) -> list[np.ndarray]:
    """[BOS] + ids of each text (one array per document), as evaluation consumes them."""
    return [np.asarray([bos_id] + enc.ids, np.int32) for enc in tok.encode_batch(texts, add_special_tokens=False)]


def cached_tokenizer(path: str, train):
    """The tokenizer saved at `path` if there is one (a resumed run must keep its first call's vocabulary), else
    `train()`'s, saved there."""
    import os

    from tokenizers import Tokenizer

    if os.path.exists(path):
        return Tokenizer.from_file(path)
    tok = train()
    tok.save(path)
    return tok
