"""Engram row ids of the engine's host hasher (jds41.layers.engram_rows) against the independent reference
re-derivation of MODEL.md §3 (tests/reference/numpy_engram.py, Python-int arithmetic), at the FULL V4.1 config
(layers 1 and 14, 4-grams, 8 heads, the published row counts) over a few hundred token windows, including the
sequence start (pad context) and chunked histories."""

from __future__ import annotations

import numpy as np
import pytest
from reference.numpy_engram import engram_row_ids

from jds41.checkpoints.presets import preset
from jds41.layers.engram_rows import EngramHasher


@pytest.fixture(scope="module")
def full_engram():
    e = preset("deepseek41", "full").engram
    assert e.layer_ids == (1, 14) and e.rows == (384006168, 384016682)
    token_map = np.random.default_rng(5).integers(0, 99092, 129280)  # any map into the compressed vocab
    return e, token_map


def test_row_ids_equal_reference_over_windows(full_engram):
    e, token_map = full_engram
    tokens = np.random.default_rng(6).integers(0, 129280, 300)
    ours = EngramHasher(e, token_map).row_ids_seq(tokens)  # [T, layers, buckets]
    for slot, layer in enumerate(e.layer_ids):
        ref = engram_row_ids(e, layer, tokens, token_map)  # [T, buckets]
        np.testing.assert_array_equal(ours[:, slot], ref)
        assert (ours[:, slot] < e.rows[slot]).all() and (ours[:, slot] >= 0).all()


def test_chunked_history_equals_whole_sequence(full_engram):
    e, token_map = full_engram
    hasher = EngramHasher(e, token_map)
    tokens = np.random.default_rng(7).integers(0, 129280, 64)
    whole = hasher.row_ids_seq(tokens)
    pieces = [hasher.row_ids_seq(tokens[i:i + 5], tokens[:i]) for i in range(0, 64, 5)]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
