"""Self-checks of the float64 numpy reference (tests/reference/) on tiny random models: checks that can fail without
any other implementation. Causality, an inline dense-attention formulation, Sinkhorn sums and the comb layout, HCA
with fewer tokens than its ratio, permutation invariances (experts, heads, groups, hc copies), indexer and candidate
selection properties, the Engram hash against a vectorised int64 formulation, row decoding and the hc lag entry.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from reference import forward
from reference.numpy_attention import apply_rope, pool_blocks, rms_norm, rope_freqs, top_k
from reference.numpy_deepseek import hc_post, route, sinkhorn
from reference.numpy_engram import decode_rows, encode_rows, engram_row_ids

from jds41.checkpoints.schema import Kind, model_tensors
from jds41.config import EngramConfig, ModelConfig


# ---- tiny configs and random weights ---------------------------------------------------------------------------
def _next_primes(start: int, count: int, used: set[int]) -> list[int]:
    out, c = [], start
    while len(out) < count:
        c += 1
        if c > 1 and all(c % d for d in range(2, int(c ** 0.5) + 1)) and c not in used:
            used.add(c)
            out.append(c)
    return out


def tiny_engram(layer_ids: tuple[int, ...], heads: int = 2, max_ngram: int = 3, bucket_start: int = 64,
                multipliers: tuple[tuple[int, ...], ...] | None = None) -> EngramConfig:
    used: set[int] = set()
    primes = []
    for _ in layer_ids:  # per order the search restarts at bucket_start - 1 (MODEL.md §3)
        primes.append(tuple(p for _ in range(max_ngram - 1) for p in _next_primes(bucket_start - 1, heads, used)))
    offsets = tuple(tuple(int(sum(ps[:j])) for j in range(len(ps))) for ps in primes)
    if multipliers is None:
        rng = np.random.default_rng(7)
        multipliers = tuple(tuple(int(2 * rng.integers(0, 1 << 40) + 1) for _ in range(max_ngram)) for _ in layer_ids)
    return EngramConfig(layer_ids=layer_ids, n_heads=heads, head_dim=32, max_ngram=max_ngram, pad_id=2,
                        encoding="e4m3_e8m0_32", multipliers=multipliers, primes=tuple(primes), offsets=offsets,
                        rows=tuple(sum(p) for p in primes))


def tiny_config(arch: str = "deepseek4", ratios: tuple[int, ...] = (0, 4, 128), **kw) -> ModelConfig:
    n = len(ratios)
    fields = {
        "arch": arch, "vocab_size": 64, "dim": 32, "n_layers": n, "n_nextn": 0, "context_length": 4096, "n_heads": 4,
        "head_dim": 16, "rope_dim": 8, "q_lora_rank": 16, "o_lora_rank": 8, "o_groups": 2, "window": 8,
        "compress_ratios": ratios, "rope_base": 10000.0, "compress_rope_base": 160000.0, "rope_scaling": "yarn",
        "rope_factor": 16.0, "rope_orig_ctx": 64, "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "index_n_heads": 4,
        "index_head_dim": 16, "index_topk": 3, "n_experts": 8, "n_experts_used": 2, "n_shared_experts": 1,
        "expert_ff": 16, "expert_weights_scale": 1.5, "expert_weights_norm": True, "gating_func": "sqrtsoftplus",
        "n_hash_layers": 1, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": (2.0,) * n,
        "swiglu_limit_shexp": (2.5,) * n, "rms_eps": 1e-6, "alignment": 32}
    fields.update(kw)
    cfg = ModelConfig(**fields)
    # Round trip through the metadata reader so the config is validated like one read from a file.
    return ModelConfig.from_metadata({k: v for k, v, _ in cfg.to_metadata()})


def shared_config(**kw) -> ModelConfig:
    """deepseek41 shared layout: ratio-2 and ratio-1 sources, reuse, index reuse, candidate blocks, Engram."""
    fields = {"n_hash_layers": 0, "kv_source_layer_ids": (1, 3), "index_source_layer_ids": (1, 3, 5),
              "candidate_source_layer_id": 3, "candidate_block_size": 2, "candidate_topk_blocks": 2,
              "engram": tiny_engram((1, 4))}
    fields.update(kw)
    return tiny_config("deepseek41", (0, 2, 2, 1, 1, 1), **fields)


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    w = {}
    for name, spec in model_tensors(cfg).items():
        shape = spec.shape
        if spec.kind == Kind.INDEX:  # tid2eid: K distinct experts per token
            w[name] = np.stack([rng.permutation(cfg.n_experts)[:shape[1]] for _ in range(shape[0])]).astype(np.int32)
        elif spec.kind == Kind.ROWS:
            e = cfg.engram
            w[name] = encode_rows(rng.normal(0.0, 0.5, (shape[0], e.head_dim)))
        elif spec.kind in (Kind.MATRIX, Kind.EXPERTS, Kind.HC):
            w[name] = rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape)
        elif name.endswith("_scale.weight") and "hc" in name:
            w[name] = rng.uniform(0.5, 1.5, shape)
        elif name.endswith(("norm.weight", "engram_q.weight", "engram_k.weight")):
            w[name] = 1.0 + 0.2 * rng.normal(size=shape)
        else:  # sinks, routing bias, ape, hc base
            w[name] = rng.normal(0.0, 0.5, shape)
    return w


def token_map(cfg: ModelConfig, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 40, cfg.vocab_size)


def run(cfg, w, tokens, trace=None, **kw):
    if cfg.engram is not None and "token_map" not in kw:
        kw["token_map"] = token_map(cfg)
    return forward(cfg, w, list(tokens), trace=trace, **kw)


CONFIGS = {
    "v4": lambda: tiny_config("deepseek4", (0, 4, 128, 4)),
    "v41_v4layout": lambda: tiny_config("deepseek41", (0, 4, 8, 0), engram=tiny_engram((1,))),
    "v41_shared": shared_config,
}


# ---- causality -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_causal_and_prefix_consistent(name):
    cfg = CONFIGS[name]()
    w = random_weights(cfg)
    rng = np.random.default_rng(3)
    T = 140 if name == "v4" else 40  # v4 needs > 128 tokens before its HCA layer has a row
    tokens = rng.integers(0, cfg.vocab_size, T)
    full = run(cfg, w, tokens)
    assert full.shape == (T, cfg.vocab_size) and np.all(np.isfinite(full))
    for p in (0, 5, T // 2, T - 2):
        changed = tokens.copy()
        changed[p + 1:] = rng.integers(0, cfg.vocab_size, T - p - 1)
        other = run(cfg, w, changed)
        np.testing.assert_allclose(other[:p + 1], full[:p + 1], rtol=0, atol=1e-10)
        assert np.max(np.abs(other[p + 1:] - full[p + 1:])) > 1e-3  # later positions do see the change
        np.testing.assert_allclose(run(cfg, w, tokens[:p + 1]), full[:p + 1], rtol=0, atol=1e-10)


# ---- dense attention written another way -----------------------------------------------------------------------
def _dense_attention(cfg, w, layer, x_n):
    """Causal banded attention with a mask matrix and complex-number RoPE: a second formulation of the branch."""
    p = f"blk.{layer}."
    T, H, HD, R = x_n.shape[0], cfg.n_heads, cfg.head_dim, cfg.rope_dim
    rot = np.exp(1j * np.arange(T)[:, None] * cfg.rope_base ** (-np.arange(0, R, 2) / R)[None, :])  # [T, R/2]

    def rope(v, sign):  # v [T, ..., HD]; pairs (2k, 2k+1) of the last R dims as complex numbers
        z = v[..., HD - R::2] + 1j * v[..., HD - R + 1::2]
        z = z * (rot if sign > 0 else rot.conj()).reshape((T,) + (1,) * (v.ndim - 2) + (R // 2,))
        out = v.copy()
        out[..., HD - R::2], out[..., HD - R + 1::2] = z.real, z.imag
        return out

    def norm(v, g):
        return v / np.sqrt((v ** 2).mean(-1, keepdims=True) + cfg.rms_eps) * g

    qr = norm(x_n @ w[p + "attn_q_a.weight"].T, w[p + "attn_q_a_norm.weight"])
    q = rope(norm((qr @ w[p + "attn_q_b.weight"].T).reshape(T, H, HD), 1.0), +1)
    k = rope(norm(x_n @ w[p + "attn_kv.weight"].T, w[p + "attn_kv_a_norm.weight"]), +1)
    s = np.einsum("thd,sd->hts", q, k) / np.sqrt(HD)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    s = np.where((j <= i) & (j > i - cfg.window), s, -np.inf)
    sink = w[p + "attn_sinks.weight"][:, None, None]
    m = np.maximum(s.max(-1, keepdims=True), sink)
    e = np.exp(s - m)
    o = rope(np.einsum("hts,sd->thd", e / (e.sum(-1, keepdims=True) + np.exp(sink - m)), k), -1)
    wo_a = w[p + "attn_output_a.weight"].reshape(cfg.o_groups, cfg.o_lora_rank, -1)  # [G, OL, heads of g * HD]
    z = np.einsum("tgi,goi->tgo", o.reshape(T, cfg.o_groups, -1), wo_a).reshape(T, -1)
    return z @ w[p + "attn_output_b.weight"].T


@pytest.mark.parametrize("window", [32, 5])
def test_window_only_layer_equals_dense_attention(window):
    cfg = tiny_config("deepseek4", (0, 0), window=window)
    w = random_weights(cfg, seed=4)
    trace: dict = {}
    run(cfg, w, np.random.default_rng(5).integers(0, 64, 20), trace=trace)
    for layer in range(2):
        want = _dense_attention(cfg, w, layer, trace[f"blk.{layer}.attn_in"])
        np.testing.assert_allclose(trace[f"blk.{layer}.attn_out"], want, rtol=1e-10, atol=1e-12)


# ---- hyper-connections -----------------------------------------------------------------------------------------
def test_sinkhorn_rows_and_columns_sum_to_one():
    logits = np.random.default_rng(6).normal(0, 1, (50, 4, 4))
    c = sinkhorn(logits, 20, 1e-6)
    assert np.all(c > 0)
    np.testing.assert_allclose(c.sum(axis=-2), 1.0, atol=1e-5)  # columns: the last normalisation
    np.testing.assert_allclose(c.sum(axis=-1), 1.0, atol=1e-4)  # rows: converged after 19 more rounds
    sharp = np.random.default_rng(6).normal(0, 3, (50, 4, 4))  # sharper logits converge slower, but they do
    err = [np.abs(sinkhorn(sharp, n, 1e-6).sum(-1) - 1).max() for n in (5, 20, 100)]
    assert err[0] > err[1] > err[2]
    one = sinkhorn(logits, 1, 0.0)  # one pass: softmax over dst, then columns (over src)
    np.testing.assert_allclose(one.sum(axis=-2), 1.0, atol=1e-12)
    sm = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(one, sm / sm.sum(-2, keepdims=True), atol=1e-12)


def test_hc_post_comb_is_src_dst():
    rng = np.random.default_rng(7)
    h, out = rng.normal(size=(1, 4, 5)), rng.normal(size=(1, 5))
    comb = np.zeros((1, 4, 4))
    comb[0, 0, 2] = 1.0  # src 0 -> dst 2
    comb[0, 3, 0] = 0.5  # half of src 3 -> dst 0
    post = np.array([[0.0, 1.0, 0.0, 2.0]])
    new = hc_post(h, out, post, comb)
    np.testing.assert_allclose(new[0, 2], h[0, 0])
    np.testing.assert_allclose(new[0, 0], 0.5 * h[0, 3])
    np.testing.assert_allclose(new[0, 1], out[0])
    np.testing.assert_allclose(new[0, 3], 2 * out[0])


def test_hc_lag_first_attention_reads_copy_zero():
    cfg = tiny_config("deepseek41", (0, 0), n_hash_layers=0)
    w = random_weights(cfg, seed=8)
    trace: dict = {}
    run(cfg, w, [3, 9, 27], trace=trace)
    np.testing.assert_allclose(trace["blk.0.attn_in"],
                               rms_norm(trace["embed"], w["blk.0.attn_norm.weight"], cfg.rms_eps), atol=1e-12)
    # layer 0's FFN collapses with layer 0's attention pre, the head with the last FFN's pre
    after_attn = hc_post(trace["blk.0.stream_in"], trace["blk.0.attn_out"], trace["blk.0.attn_post"],
                         trace["blk.0.attn_comb"])
    want = rms_norm(np.einsum("tc,tcd->td", trace["blk.0.attn_pre"], after_attn), w["blk.0.ffn_norm.weight"],
                    cfg.rms_eps)
    np.testing.assert_allclose(trace["blk.0.ffn_in"], want, atol=1e-12)
    np.testing.assert_allclose(trace["head_pre"], trace["blk.1.ffn_pre"])


# ---- compressed layers -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch,ratio", [("deepseek4", 128), ("deepseek41", 16)])
def test_hca_with_fewer_tokens_than_ratio_is_window_only(arch, ratio):
    kw = {"compress_rope_base": 10000.0, "rope_scaling": "none"}  # same RoPE as a ratio-0 layer
    cfg = tiny_config(arch, (0, ratio), **kw)
    win = tiny_config(arch, (0, 0), **kw)
    w = random_weights(cfg, seed=9)
    tokens = np.random.default_rng(10).integers(0, 64, ratio)
    a, b = run(cfg, w, tokens), run(win, w, tokens)
    np.testing.assert_allclose(a[:ratio - 1], b[:ratio - 1], rtol=0, atol=1e-12)
    assert np.max(np.abs(a[ratio - 1] - b[ratio - 1])) > 1e-6  # the last token completes block 0 and sees it


def test_overlapped_pooling_by_hand():
    r, W, T = 4, 3, 13  # 3 complete blocks; token 12 starts an incomplete one that must not appear
    t = np.arange(T, dtype=np.float64)[:, None]
    kv = np.concatenate([np.repeat(t, W, 1), np.repeat(100 + t, W, 1)], 1)  # [0:W] previous-half, [W:2W] own-half
    score = np.zeros((T, 2 * W))
    score[r - 1::r, :W] = 60.0  # the last token of each block dominates when it is the PREVIOUS block
    rows = pool_blocks(kv, score, r, overlap=True)
    assert rows.shape == (3, W)
    np.testing.assert_allclose(rows[0], 101.5)  # block 0: previous half is -inf, own tokens 0..3 uniform
    np.testing.assert_allclose(rows[1:, 0], [3.0, 7.0], atol=1e-20)  # the previous block's last token, via [0:W]
    plain = pool_blocks(kv[:, W:], np.zeros((T, W)), r, overlap=False)
    np.testing.assert_allclose(plain[:, 0], [101.5, 105.5, 109.5])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_selected_rows_are_visible_top_scores(name):
    cfg = CONFIGS[name]()
    w = random_weights(cfg, seed=11)
    trace: dict = {}
    run(cfg, w, np.random.default_rng(12).integers(0, 64, 40), trace=trace)
    n_indexed = 0
    for layer in range(cfg.n_layers):
        r, key = cfg.ratio(layer), f"blk.{layer}.selected"
        if r == 0:
            assert key not in trace
            continue
        scores = trace.get(f"blk.{cfg.index_source(layer)}.index_scores")
        for p, rows in enumerate(trace[key]):
            n_vis = (p + 1) // r
            assert np.all(rows < n_vis) and len(set(rows.tolist())) == len(rows)
            if cfg.index_source(layer) < 0:
                assert len(rows) == n_vis
            elif scores is not None and not (cfg.shared_kv and cfg.index_source(layer) > cfg.candidate_source_layer_id):
                assert len(rows) == min(cfg.index_topk, n_vis)
                rest = np.setdiff1d(np.arange(n_vis), rows)
                if rest.size:
                    assert scores[p, rows].min() >= scores[p, rest].max()
                    n_indexed += 1
    assert n_indexed > 0  # the sparse path was exercised


def test_indexer_is_irrelevant_when_topk_covers_everything():
    cfg = tiny_config("deepseek4", (0, 4, 4), index_topk=64)
    w = random_weights(cfg, seed=13)
    w2 = dict(w)
    for name in list(w2):
        if ".indexer" in name:
            w2[name] = w2[name] * -3.0 + 0.1
    tokens = np.random.default_rng(14).integers(0, 64, 30)
    np.testing.assert_allclose(run(cfg, w2, tokens), run(cfg, w, tokens), rtol=0, atol=1e-12)
    sparse = tiny_config("deepseek4", (0, 4, 4), index_topk=2)
    assert np.max(np.abs(run(sparse, w2, tokens) - run(sparse, w, tokens))) > 1e-6


def test_shared_layout_reuses_sources_and_candidates():
    cfg = shared_config()
    w = random_weights(cfg, seed=15)
    trace: dict = {}
    tokens = np.random.default_rng(16).integers(0, 64, 30)
    logits = run(cfg, w, tokens, trace=trace)
    assert trace["blk.2.compressed"] is trace["blk.1.compressed"]  # ratio 2, reuses source 1
    assert trace["blk.4.compressed"] is trace["blk.3.compressed"] is trace["blk.5.compressed"]
    assert trace["blk.4.selected"] is trace["blk.3.selected"]  # index reuse
    assert trace["blk.1.compressed"].shape[0] == 15 and trace["blk.3.compressed"].shape[0] == 30
    blocks, bs = trace["blk.3.candidate_blocks"], cfg.candidate_block_size
    for p, rows in enumerate(trace["blk.5.selected"]):
        assert np.all(np.isin(rows // bs, blocks[p])) and len(rows) == min(cfg.index_topk, bs * len(blocks[p]), p + 1)
        assert len(blocks[p]) == min(cfg.candidate_topk_blocks, -(-(p + 1) // bs))
    # With room for every block the filter is a no-op, and differs from the tight filter.
    roomy = run(shared_config(candidate_topk_blocks=64), w, tokens)
    nofilter = run(shared_config(candidate_source_layer_id=-1), w, tokens)
    np.testing.assert_allclose(roomy, nofilter, rtol=0, atol=1e-12)
    assert np.max(np.abs(roomy - logits)) > 1e-6


# ---- permutation invariances -----------------------------------------------------------------------------------
def test_expert_permutation_invariance():
    cfg = tiny_config("deepseek4", (0, 4))
    w = random_weights(cfg, seed=17)
    perm = np.random.default_rng(18).permutation(cfg.n_experts)  # new expert i = old expert perm[i]
    inv = np.argsort(perm)
    w2 = dict(w)
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        for n in ("ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight",
                  "exp_probs_b.bias"):
            if p + n in w:
                w2[p + n] = w[p + n][perm]
        if p + "ffn_gate_tid2eid.weight" in w:
            w2[p + "ffn_gate_tid2eid.weight"] = inv[w[p + "ffn_gate_tid2eid.weight"]]
    tokens = np.random.default_rng(19).integers(0, 64, 25)
    t1, t2 = {}, {}
    np.testing.assert_allclose(run(cfg, w2, tokens, t2), run(cfg, w, tokens, t1), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(perm[t2["blk.1.experts"]], t1["blk.1.experts"])
    np.testing.assert_allclose(t1["blk.1.expert_weights"].sum(1), cfg.expert_weights_scale, rtol=1e-12)


def test_head_and_group_permutation_invariance():
    cfg = tiny_config("deepseek4", (0, 4), n_heads=4, o_groups=2)
    w = random_weights(cfg, seed=20)
    H, HD, G, OL = cfg.n_heads, cfg.head_dim, cfg.o_groups, cfg.o_lora_rank
    heads = np.array([3, 2, 1, 0])  # swaps the two groups AND permutes the heads inside each group
    per_g = H // G
    w2 = dict(w)
    for layer in range(cfg.n_layers):
        p = f"blk.{layer}."
        w2[p + "attn_q_b.weight"] = w[p + "attn_q_b.weight"].reshape(H, HD, -1)[heads].reshape(H * HD, -1)
        w2[p + "attn_sinks.weight"] = w[p + "attn_sinks.weight"][heads]
        wo_a = w[p + "attn_output_a.weight"].reshape(G, OL, per_g, HD)  # [group, OL, head in group, HD]
        # new group g holds the heads of old group group_order[g]; its OL outputs feed attn_output_b's columns
        group_order = np.array([heads[g * per_g] // per_g for g in range(G)])
        w2[p + "attn_output_a.weight"] = _regroup(wo_a, heads, per_g).reshape(G * OL, -1)
        w2[p + "attn_output_b.weight"] = w[p + "attn_output_b.weight"].reshape(-1, G, OL)[:, group_order].reshape(
            cfg.dim, -1)
    tokens = np.random.default_rng(21).integers(0, 64, 20)
    np.testing.assert_allclose(run(cfg, w2, tokens), run(cfg, w, tokens), rtol=1e-10, atol=1e-10)


def _regroup(wo_a, heads, per_g):
    """wo_a [G, OL, per_g, HD] for a head permutation: new head i reads old head heads[i]; new group g's OL block
    is the old block of the group its heads came from (groups must map to whole groups)."""
    out = np.empty_like(wo_a)
    for i, old in enumerate(heads):
        out[i // per_g, :, i % per_g] = wo_a[old // per_g, :, old % per_g]
    return out


def test_hc_copy_permutation_invariance():
    cfg = tiny_config("deepseek4", (0, 4))
    w = random_weights(cfg, seed=22)
    hc, D = cfg.hc_mult, cfg.dim
    perm = np.array([2, 0, 3, 1])  # new copy i = old copy perm[i]
    w2 = dict(w)

    def permute_mix(fn, base, n_rows):
        fn = fn.reshape(n_rows, hc, D)[:, perm].reshape(n_rows, hc * D)  # input copies
        idx = np.concatenate([perm, hc + perm, (2 * hc + perm[:, None] * hc + perm[None, :]).reshape(-1)])
        idx = idx[:n_rows]
        return fn[idx], base[idx]

    for name in [n for n in w if n.endswith("_fn.weight")]:
        base = name.replace("_fn.weight", "_base.weight")
        w2[name], w2[base] = permute_mix(w[name], w[base], w[name].shape[0])
    tokens = np.random.default_rng(23).integers(0, 64, 20)
    np.testing.assert_allclose(run(cfg, w2, tokens), run(cfg, w, tokens), rtol=1e-10, atol=1e-10)


# ---- small pieces ----------------------------------------------------------------------------------------------
def test_top_k_ties_go_to_lower_index():
    np.testing.assert_array_equal(top_k(np.array([1.0, 3.0, 0.5, 3.0, 3.0]), 2), [1, 3])


def test_rope_inverse_and_relative():
    cfg = tiny_config("deepseek4", (0, 4))
    rng = np.random.default_rng(24)
    x, y = rng.normal(size=(6, 16)), rng.normal(size=(6, 16))
    for layer in (0, 1):  # plain and YaRN
        f = rope_freqs(cfg, layer)
        pos = np.arange(6) * 7
        np.testing.assert_allclose(apply_rope(apply_rope(x, pos, f), pos, f, inverse=True), x, atol=1e-12)
        np.testing.assert_array_equal(apply_rope(x, pos, f)[:, :8], x[:, :8])  # only the last rope_dim dims
        # a dot product of rotated vectors depends on the position difference only
        d1 = np.sum(apply_rope(x, pos, f) * apply_rope(y, pos + 3, f), -1)
        d2 = np.sum(apply_rope(x, pos + 11, f) * apply_rope(y, pos + 14, f), -1)
        np.testing.assert_allclose(d1, d2, atol=1e-10)
    f0, f1 = rope_freqs(cfg, 0), rope_freqs(cfg, 1)
    np.testing.assert_allclose(f0, 10000.0 ** (-np.arange(4) * 2 / 8))
    # YaRN: the fastest pair keeps its frequency, the slowest is divided by the factor
    base = 160000.0 ** (-np.arange(4) * 2 / 8)
    assert f1[0] == pytest.approx(base[0]) and f1[-1] == pytest.approx(base[-1] / 16)


def test_route_weights_and_bias_selection_only():
    cfg = tiny_config("deepseek4", (0, 4), n_hash_layers=0)
    w = random_weights(cfg, seed=25)
    x = np.random.default_rng(26).normal(size=(5, cfg.dim))
    w["blk.1.exp_probs_b.bias"] = np.zeros(cfg.n_experts)
    w["blk.1.exp_probs_b.bias"][6] = 100.0  # forces expert 6 in, but not its weight
    experts, weights, scores = route(cfg, 1, w, x, np.zeros(5, dtype=np.int64))
    assert np.all(experts[:, 0] == 6)
    raw = np.take_along_axis(scores, experts, 1)
    np.testing.assert_allclose(weights, 1.5 * raw / raw.sum(1, keepdims=True), rtol=1e-12)


def test_engram_hash_matches_vectorised_int64():
    big = ((1 << 62) + 12345, (1 << 63) - 25, (1 << 61) + 7)  # products wrap; signed h can be negative
    for mult in (None, (big, big)):
        e = tiny_engram((1, 4), heads=3, max_ngram=3, multipliers=mult)
        tmap = np.random.default_rng(27).integers(0, 40, 64)
        tokens = np.random.default_rng(28).integers(0, 64, 30)
        for li, layer in enumerate(e.layer_ids):
            got = engram_row_ids(e, layer, tokens, tmap)
            ctx = np.stack([np.where(np.arange(30) - k >= 0, tmap[tokens[np.arange(30) - k]], tmap[e.pad_id])
                            for k in range(3)], 1).astype(np.int64)
            with np.errstate(over="ignore"):
                prods = ctx * np.array(e.multipliers[li], dtype=np.uint64).astype(np.int64)  # wraps mod 2^64
            h2 = prods[:, 0] ^ prods[:, 1]
            h3 = h2 ^ prods[:, 2]
            P, off = np.array(e.primes[li]), np.array(e.offsets[li])
            want = np.concatenate([np.mod(h2[:, None], P[None, :3]), np.mod(h3[:, None], P[None, 3:])], 1) + off
            np.testing.assert_array_equal(got, want)
            assert np.all(got >= 0) and np.all(got < e.rows[li])
            if mult is not None:
                assert np.any(h3 < 0)  # the wraparound case was exercised


def test_engram_row_decoding():
    row = np.zeros((1, 33), dtype=np.uint8)
    row[0, :32] = 0x38  # E4M3 1.0
    row[0, 0] = 0xB8  # -1.0
    row[0, 32] = 128  # scale 2^1
    got = decode_rows(row, np.array([0]), 32)
    assert got[0, 0] == -2.0 and np.all(got[0, 1:] == 2.0)
    vals = np.random.default_rng(29).normal(0, 0.3, (10, 64))
    back = decode_rows(encode_rows(vals), np.arange(10), 64)
    np.testing.assert_allclose(back, vals, rtol=0.07, atol=1e-3)  # E4M3 keeps 3 mantissa bits


def test_engram_gate_and_row_override():
    cfg = tiny_config("deepseek41", (0, 0), n_hash_layers=0, engram=tiny_engram((1,)))
    w = random_weights(cfg, seed=30)
    tokens = np.random.default_rng(31).integers(0, 64, 12)
    trace: dict = {}
    base = run(cfg, w, tokens, trace=trace)
    g = trace["blk.1.engram_gate"]
    assert g.shape == (12, 4) and np.all((g > 0) & (g < 1))
    rows = trace["blk.1.engram_rows"]
    np.testing.assert_allclose(run(cfg, w, tokens, engram_rows={1: rows}), base, atol=0)
    assert np.max(np.abs(run(cfg, w, tokens, engram_rows={1: rows[::-1].copy()}) - base)) > 1e-6
    w0 = dict(w)
    w0["blk.1.engram_wkv.weight"] = w["blk.1.engram_wkv.weight"].copy()
    w0["blk.1.engram_wkv.weight"][4 * cfg.dim:] = 0.0  # zero value: Engram adds nothing
    no_engram = dataclasses.replace(cfg, engram=None)
    np.testing.assert_allclose(run(cfg, w0, tokens), forward(no_engram, w, list(tokens)), atol=1e-12)
