"""Engram hashing (MODEL.md §3): the token map, per-layer multipliers, bucket primes/offsets and the row hash.

Pure functions, no model state. The presets and the synthetic writer use them to produce the hash parameters a
file stores (`{arch}.engram.multipliers/primes/offsets/rows/token_map`); the engine reads those back from the
file. Everything here reproduces the DeepSeek
reference construction (Engram demo / V4.1 `inference/engram.py`) step for step, so a synthetic full-size file
gets the real model's row counts (384,006,168 and 384,016,682) and multipliers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jds41.config import EngramConfig

INT64_MAX = (1 << 63) - 1
LAYER_SEED_PRIME = 10007  # per-layer RNG seed = 10007 * layer id (seed offset 0)
ENCODING = "e4m3_e8m0_32"

# Deterministic Miller-Rabin witnesses: these 12 bases decide primality for every n < 3.3e24 (> 2^64).
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Exact for all n < 2^64 (deterministic Miller-Rabin); sympy is not a dependency."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(start: int, used: set[int] | frozenset[int] = frozenset()) -> int:
    """Smallest prime > start that is not in `used` (the reference's `find_next_prime`)."""
    n = start + 1
    while not is_prime(n) or n in used:
        n += 1
    return n


def engram_primes(engram_vocab: int, n_layers: int, max_ngram: int, n_heads: int) -> list[list[int]]:
    """Bucket sizes per Engram layer, order-major (n = 2..max_ngram, then head).

    For each order the search restarts at `engram_vocab - 1` and walks up, each head taking the next prime not
    used by any bucket of any earlier layer or head; so later layers get slightly larger tables.
    """
    used: set[int] = set()
    out = []
    for _ in range(n_layers):
        layer = []
        for _n in range(2, max_ngram + 1):
            start = engram_vocab - 1
            for _h in range(n_heads):
                p = next_prime(start, used)
                used.add(p)
                layer.append(p)
                start = p
        out.append(layer)
    return out


def engram_offsets(primes: Sequence[int]) -> list[int]:
    """Row offset of each bucket inside the layer's one table: the exclusive cumulative sum of the primes."""
    return [int(x) for x in np.concatenate([[0], np.cumsum(primes, dtype=np.int64)[:-1]])]


def engram_multipliers(layer_id: int, max_ngram: int, compressed_vocab: int) -> list[int]:
    """Odd int64 multipliers of one layer. The bound keeps t * m < 2^63 for every compressed id t, so the
    hash never overflows; it depends on the compressed vocab size, which therefore must match the token map."""
    half_bound = max(1, INT64_MAX // max(1, compressed_vocab) // 2)
    rng = np.random.default_rng(LAYER_SEED_PRIME * layer_id)
    r = rng.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
    return [int(x) for x in r * 2 + 1]


def make_engram_config(layer_ids: Sequence[int], n_heads: int, head_dim: int, max_ngram: int, engram_vocab: int,
                       compressed_vocab: int, pad_id: int = 2) -> EngramConfig:
    """The complete hash parameter set of a model, as `ModelConfig.engram` stores it."""
    primes = engram_primes(engram_vocab, len(layer_ids), max_ngram, n_heads)
    return EngramConfig(
        layer_ids=tuple(layer_ids), n_heads=n_heads, head_dim=head_dim, max_ngram=max_ngram, pad_id=pad_id,
        encoding=ENCODING,
        multipliers=tuple(tuple(engram_multipliers(L, max_ngram, compressed_vocab)) for L in layer_ids),
        primes=tuple(tuple(p) for p in primes), offsets=tuple(tuple(engram_offsets(p)) for p in primes),
        rows=tuple(sum(p) for p in primes))


def vocab_for_rows(rows: int, n_buckets: int) -> int:
    """Bucket start (`engram_vocab_size`) whose first layer gets about `rows` rows: each bucket is the next prime
    above the start, so n_buckets * start ~= rows (prime gaps add a few rows per bucket)."""
    return max(2, rows // n_buckets)


# ---- token map (MODEL.md §3 step 1) -------------------------------------------------------------------------


def _normalizer():
    from tokenizers import Regex, normalizers

    # A private-use sentinel protects a token that is exactly one space: Strip() would otherwise turn it into ""
    # and merge it with every other empty key.
    sentinel = "\ue000"
    return normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])


def token_keys(decoded: Sequence[str], raw: Sequence[str]) -> list[str]:
    """The equivalence key of every token: its normalized decoded text, or its raw token string when the decoded
    text holds U+FFFD (a partial UTF-8 byte has nothing to normalize); an empty normalization keeps the text."""
    norm = _normalizer()
    keys = []
    for text, piece in zip(decoded, raw, strict=True):
        if "\ufffd" in text:
            keys.append(piece)
        else:
            keys.append(norm.normalize_str(text) or text)
    return keys


def compressed_token_map(decoded: Sequence[str], raw: Sequence[str]) -> tuple[np.ndarray, int]:
    """Token id -> compressed id (u32), numbered by first appearance, and the number of compressed ids."""
    ids: dict[str, int] = {}
    out = np.empty(len(decoded), dtype=np.uint32)
    for i, key in enumerate(token_keys(decoded, raw)):
        out[i] = ids.setdefault(key, len(ids))
    return out, len(ids)


def tokenizer_token_map(tokenizer) -> tuple[np.ndarray, int]:
    """`compressed_token_map` of a `tokenizers.Tokenizer` (every id decoded alone, special tokens kept)."""
    n = tokenizer.get_vocab_size(with_added_tokens=True)
    decoded = [tokenizer.decode([i], skip_special_tokens=False) for i in range(n)]
    raw = [tokenizer.id_to_token(i) for i in range(n)]
    return compressed_token_map(decoded, raw)
