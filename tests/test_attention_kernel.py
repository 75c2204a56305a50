"""One token's attention as one Triton launch (jds41/layers/attention_kernel.py), opt-in with JDS41_ATTN_KERNEL=1.

On every machine: the kernel in Pallas' interpreter against `attention.attend_xla` (the reference) and a float64
numpy re-derivation (RoPE of q at the token's position, V4's per-head RMS norm, the softmax with the sink, the
output turned back), over key counts that are not whole chunks, masked keys, a query whose keys are all masked
(the sink alone), head counts that are not whole head blocks, RoPE over part of the latent or all of it; a row's
output does not depend on the rows around it (vmapped, permuted, each row at its own position); the window's keys
read where they lie in the ring equal `window_rows`' keys. Lowered for CUDA with the switch on, `attend` is the one
Triton call; for the CPU, or with the switch off, it is not; the products'
two forms (JDS41_ATTN_DOT) lower to different kernels. On a GPU (marker `gpu`), in both forms: the compiled kernel
against the XLA spelling and the float64 re-derivation, and one row against the same row in a vmapped block; the
ring form compiled likewise.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jds41.layers import attention, attention_kernel, sink_softmax_kernel
from jds41.layers.attention_kernel import attend_kernels, parse_dot, parse_tile

TRITON_CALL = "__gpu$xla.gpu.triton"


def _case(heads: int, kdim: int, n: int, seed: int = 0, masked: float = 0.2, rope: int = 16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((heads, kdim)).astype(np.float32)
    keys = rng.standard_normal((n, kdim)).astype(np.float32)
    valid = rng.random(n) >= masked
    sink = (rng.standard_normal(heads) * 2).astype(np.float32)
    freqs = (10000.0 ** -(np.arange(rope // 2) * 2 / rope)).astype(np.float32)
    return q, keys, valid, sink, np.int32(rng.integers(0, 5000)), freqs


def _cfg(kdim: int, head_norm: bool = False):
    return types.SimpleNamespace(head_dim=kdim, q_head_norm=head_norm, rms_eps=1e-6)


def _numpy_turn(x, pos, freqs, sign):
    """Adjacent pairs of x's last 2 len(freqs) columns turned by sign * pos * freqs, float64 but for the angle,
    which is one f32 product as rope.py (and ggml) take it (at pos ~5000 its rounding alone moves values ~1e-5)."""
    x = x.astype(np.float64).copy()
    angle = sign * (np.float32(pos) * freqs.astype(np.float32)).astype(np.float64)
    a, b = x[:, -2 * len(freqs)::2].copy(), x[:, -2 * len(freqs) + 1::2].copy()
    x[:, -2 * len(freqs)::2] = a * np.cos(angle) - b * np.sin(angle)
    x[:, -2 * len(freqs) + 1::2] = a * np.sin(angle) + b * np.cos(angle)
    return x


def _numpy_attend(q, keys, valid, sink, pos, freqs, head_norm=False):
    """attention.py's module docstring in float64: V4's head norm, RoPE of q, softmax over the valid keys with the
    sink in the denominator, the weighted latents turned back."""
    q = q.astype(np.float64)
    if head_norm:
        q = q / np.sqrt(np.mean(q * q, axis=1, keepdims=True) + 1e-6)
    s = _numpy_turn(q, pos, freqs, 1) @ keys.astype(np.float64).T / np.sqrt(q.shape[1])
    s = np.where(valid[None, :], s, -np.inf)
    top = np.maximum(s.max(axis=1), sink)
    e = np.exp(s - top[:, None])
    return _numpy_turn((e / (e.sum(axis=1) + np.exp(sink - top))[:, None]) @ keys.astype(np.float64), pos, freqs, -1)


def _kernels(q, keys, valid, sink, pos, freqs, head_norm=False, interpret=True, turn_inside=None, dot="ieee"):
    return attend_kernels(q, keys, valid, sink, pos, freqs, q.shape[1] ** -0.5, 1e-6 if head_norm else None,
                          interpret=interpret, turn_inside=turn_inside, dot=dot)


def _xla(q, keys, valid, sink, pos, freqs, head_norm=False):
    cfg = _cfg(q.shape[1], head_norm)
    return jax.jit(lambda *a: attention.attend_xla(cfg, sink, *a, freqs))(q, keys, valid, pos)


@pytest.mark.parametrize("turn_inside", [True, False])
@pytest.mark.parametrize("heads,kdim,n,rope,head_norm", [(2, 32, 45, 16, False), (20, 64, 96, 64, True),
                                                         (64, 512, 70, 64, False), (64, 512, 70, 64, True)])
def test_the_interpreted_kernels_equal_the_reference(heads, kdim, n, rope, head_norm, turn_inside):
    """Both places of the turns and the head norm: inside the kernels (as compiled) and around them (as
    interpreted in the engine)."""
    q, keys, valid, sink, pos, freqs = _case(heads, kdim, n, rope=rope)
    kernels = lambda *a: _kernels(*a, turn_inside=turn_inside)  # noqa: E731
    got = np.asarray(kernels(q, keys, valid, sink, pos, freqs, head_norm))
    want = np.asarray(_xla(q, keys, valid, sink, pos, freqs, head_norm))
    assert got.shape == (heads, kdim)
    tol = 3e-6 * np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    np.testing.assert_allclose(got, _numpy_attend(q, keys, valid, sink, pos, freqs, head_norm), rtol=0, atol=tol)
    # each input counts: the mask, the position (the RoPE columns of q and of the output)
    assert not np.array_equal(got, np.asarray(kernels(q, keys, ~valid, sink, pos, freqs, head_norm)))
    moved = np.asarray(kernels(q, keys, valid, sink, pos + 1, freqs, head_norm))
    np.testing.assert_allclose(moved, _numpy_attend(q, keys, valid, sink, pos + 1, freqs, head_norm), rtol=0,
                               atol=tol)
    assert np.abs(moved - got).max() > 100 * tol


@pytest.mark.parametrize("tile", [(16, 16, 32, 32, 2), (32, 64, 64, 16, 8), (16, 32, 16, 64, 4), (16, 16, 64, 64, 4)])
def test_other_tiles_give_the_same_attention(tile):
    """The benchmark's other tiles (experiments/bench_attention.py) compute the same attention, turns inside."""
    q, keys, valid, sink, pos, freqs = _case(20, 64, 96, seed=5, rope=32)
    got = np.asarray(attend_kernels(q, keys, valid, sink, pos, freqs, 64 ** -0.5, None, interpret=True,
                                    turn_inside=True, tile=tile))
    want = _numpy_attend(q, keys, valid, sink, pos, freqs)
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-6 * np.abs(want).max())


def _ring_case(window: int, slack: int, pos: int, n_extra: int, seed: int = 7, kdim: int = 64, heads: int = 20):
    """A window ring of `window + slack` rows written at positions up to pos + 2 (speculative rows past pos, which
    a query at pos must not read), one slot stale (it holds an older position), and n_extra keys after it."""
    rng = np.random.default_rng(seed)
    rows = window + slack
    ring = {"kv": np.zeros((rows, kdim), np.float32), "pos": np.full((rows,), -1, np.int32)}
    for p in range(max(0, pos + 3 - rows), pos + 3):
        ring["kv"][p % rows] = rng.standard_normal(kdim)
        ring["pos"][p % rows] = p
    if pos >= 3:
        ring["pos"][(pos - 3) % rows] -= rows  # a stale slot
    q, keys, valid, sink, _, freqs = _case(heads, kdim, max(n_extra, 1), seed=seed, rope=32)
    extra = (keys[:n_extra], valid[:n_extra]) if n_extra else (None, None)
    return q, {k: jnp.asarray(v) for k, v in ring.items()}, extra, sink, np.int32(pos), freqs


@pytest.mark.parametrize("window,slack,pos,n_extra", [(64, 0, 200, 0), (64, 5, 200, 24), (64, 3, 30, 0),
                                                      (48, 4, 131, 37), (64, 0, 0, 8)])
def test_the_ring_form_reads_the_windows_rows_as_window_rows_gives_them(window, slack, pos, n_extra):
    """The window's rows read where they lie in the ring (early positions, wrap-around, slack, a stale slot, rows
    past the query's position) and the keys after them: the XLA spelling's attention over `window_rows` joined
    with the keys, to f32 rounding; and where the window is whole chunks, bit for bit the kernel over the gathered
    keys (the same keys in the same chunks)."""
    q, ring, (extra, extra_valid), sink, pos, freqs = _ring_case(window, slack, pos, n_extra)
    cfg = types.SimpleNamespace(head_dim=64, q_head_norm=True, rms_eps=1e-6, window=window)
    w = {"attn_sinks": jnp.asarray(sink)}
    win_kv, win_valid = attention.window_rows(ring, window, pos)
    keys = win_kv if extra is None else jnp.concatenate([win_kv, extra])
    valid = win_valid if extra is None else jnp.concatenate([win_valid, extra_valid])
    for turn_inside in (True, False):
        got = np.asarray(attend_kernels(q, extra, extra_valid, sink, pos, freqs, 0.125, 1e-6, interpret=True,
                                        turn_inside=turn_inside, ring=ring, window=window))
        want = _numpy_attend(q, np.asarray(keys), np.asarray(valid), sink, pos, freqs, head_norm=True)
        np.testing.assert_allclose(got, want, rtol=0, atol=3e-6 * np.abs(want).max())
        gathered = np.asarray(attend_kernels(q, keys, valid, sink, pos, freqs, 0.125, 1e-6, interpret=True,
                                             turn_inside=turn_inside))
        if window % attention_kernel.BN == 0:
            np.testing.assert_array_equal(got, gathered)
    # attention.attend with the ring, switched off: XLA over window_rows and the keys joined after them, the bits
    # of the engine's composition before the ring form (the gather and the join in the same program)
    xla = np.asarray(jax.jit(lambda q: attention.attend(cfg, w, q, extra, extra_valid, pos, freqs, ring=ring))(q))
    np.testing.assert_allclose(xla, want, rtol=0, atol=3e-6 * np.abs(want).max())

    def before(q):
        win_kv, win_valid = attention.window_rows(ring, window, pos)
        keys, valid = [win_kv], [win_valid]
        if extra is not None:
            keys.append(extra)
            valid.append(extra_valid)
        return attention.attend_xla(cfg, w["attn_sinks"], q, jnp.concatenate(keys), jnp.concatenate(valid), pos,
                                    freqs)

    np.testing.assert_array_equal(xla, np.asarray(jax.jit(before)(q)))


def test_a_window_larger_than_its_ring_is_refused():
    q, ring, _, sink, pos, freqs = _ring_case(16, 0, 40, 0)
    with pytest.raises(ValueError, match="a window of 32 rows in a ring of 16"):
        attend_kernels(q, None, None, sink, pos, freqs, 0.125, interpret=True, ring=ring, window=32)


def test_a_tile_is_spelled_as_five_positive_integers():
    """JDS41_ATTN_TILE: BH:BN:BK:CH:warps; anything else is refused by name."""
    assert parse_tile("16:32:16:4:8") == (16, 32, 16, 4, 8)
    for bad in ("16:32:16:4", "16:32:-16:4:4", "16:32:0:4:4", "a:b:c:d:e", "16:32:16:4:4:1", ""):
        with pytest.raises(ValueError, match="attention tile"):
            parse_tile(bad)


def test_a_query_with_every_key_masked_reads_the_sink_alone():
    q, keys, _, sink, pos, freqs = _case(3, 32, 40, seed=1)
    none = np.zeros(40, bool)
    got = np.asarray(_kernels(q, keys, none, sink, pos, freqs))
    want = np.asarray(_xla(q, keys, none, sink, pos, freqs))
    np.testing.assert_array_equal(got, np.zeros_like(got))
    np.testing.assert_array_equal(want, np.zeros_like(want))
    # one live key in the last, partial chunk: its latent weighted by its share against the sink, turned back
    one = none.copy()
    one[-1] = True
    got = np.asarray(_kernels(q, keys, one, sink, pos, freqs))
    np.testing.assert_allclose(got, _numpy_attend(q, keys, one, sink, pos, freqs), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("head_norm", [False, True])
def test_a_rows_output_does_not_depend_on_the_rows_around_it(head_norm):
    """As the engine runs them interpreted (the turns around the kernels); compiled, the GPU test below."""
    rows = [_case(2, 32, 45, seed=s) for s in range(4)]
    q, keys, valid, _, pos, _ = (np.stack([r[i] for r in rows]) for i in range(6))
    sink, freqs = rows[0][3], rows[0][5]
    run = lambda q, k, v, p: _kernels(q, k, v, sink, p, freqs, head_norm)  # noqa: E731
    block = np.asarray(jax.vmap(run)(q, keys, valid, pos))
    for r in (0, 3):
        np.testing.assert_array_equal(np.asarray(run(q[r], keys[r], valid[r], pos[r])), block[r])
    perm = np.array([2, 0, 3, 1])
    np.testing.assert_array_equal(np.asarray(jax.vmap(run)(q[perm], keys[perm], valid[perm], pos[perm])), block[perm])


def test_attend_lowers_to_the_kernels_on_cuda_only_when_switched_on(monkeypatch):
    cfg = _cfg(32)
    w = {"attn_sinks": jnp.zeros(2, jnp.float32)}
    freqs = np.ones(8, np.float32)
    shapes = (jax.ShapeDtypeStruct((2, 32), jnp.float32), jax.ShapeDtypeStruct((45, 32), jnp.float32),
              jax.ShapeDtypeStruct((45,), jnp.bool_), jax.ShapeDtypeStruct((), jnp.int32))

    def calls(platform):  # a new function each time: jit's trace cache would keep the first switch's graph
        fn = lambda q, k, v, p: attention.attend(cfg, w, q, k, v, p, freqs)  # noqa: E731
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=(platform,)).as_text()
        return text.count(TRITON_CALL), "attend_one_pass" in text

    monkeypatch.setattr(attention_kernel.triton_matvec, "INTERPRET", False)
    monkeypatch.setattr(attention_kernel.triton_matvec, "ENABLED", True)
    monkeypatch.setattr(attention_kernel.triton_matvec, "has_triton_backend", lambda: True)
    monkeypatch.setattr(attention_kernel, "ENABLED", True)
    assert calls("cuda") == (1, True) and calls("cpu") == (0, False)
    monkeypatch.setattr(attention_kernel, "ENABLED", False)
    assert calls("cuda") == (1, False)  # XLA's products around the softmax's launch (layers/sink_softmax_kernel.py)
    monkeypatch.setattr(sink_softmax_kernel, "ENABLED", False)
    assert calls("cuda") == (0, False)


def test_the_products_form_is_a_known_name_and_reaches_the_compiled_kernels():
    """JDS41_ATTN_DOT's spellings: the two forms lower (for CUDA, on any machine) to different kernels."""
    assert parse_dot("ieee") == "ieee" and parse_dot("tf32x3") == "tf32x3"
    for bad in ("tf32", "IEEE", ""):
        with pytest.raises(ValueError, match="attention dot"):
            parse_dot(bad)
    shapes = (jax.ShapeDtypeStruct((64, 512), jnp.float32), jax.ShapeDtypeStruct((136, 512), jnp.float32),
              jax.ShapeDtypeStruct((136,), jnp.bool_), jax.ShapeDtypeStruct((64,), jnp.float32),
              jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((32,), jnp.float32))

    def lowered(dot):
        fn = lambda *a: attend_kernels(*a, 512 ** -0.5, None, dot=dot)  # noqa: E731
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        assert text.count(TRITON_CALL) == 1
        return text

    assert lowered("ieee") != lowered("tf32x3")


@pytest.mark.gpu
@pytest.mark.parametrize("dot", ["ieee", "tf32x3"])
@pytest.mark.parametrize("heads,kdim,n,head_norm", [(2, 32, 45, False), (64, 512, 640, False), (64, 512, 136, False),
                                                    (64, 512, 640, True)])
def test_the_compiled_kernels_agree_with_the_xla_spelling_on_the_gpu(heads, kdim, n, head_norm, dot):
    q, keys, valid, sink, pos, freqs = _case(heads, kdim, n, seed=3, rope=min(64, kdim // 2))
    got = np.asarray(_kernels(q, keys, valid, sink, pos, freqs, head_norm, interpret=False, dot=dot))
    want = np.asarray(_xla(q, keys, valid, sink, pos, freqs, head_norm))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    exact = _numpy_attend(q, keys, valid, sink, pos, freqs, head_norm)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    qs, ks, vs = (np.stack([a, a[::-1].copy()]) for a in (q, keys, valid))
    ps = np.array([pos, pos + 7], np.int32)
    block = np.asarray(jax.vmap(lambda a, b, c, p: _kernels(a, b, c, sink, p, freqs, head_norm, interpret=False,
                                                            dot=dot))(qs, ks, vs, ps))
    np.testing.assert_array_equal(block[0], got)


@pytest.mark.gpu
@pytest.mark.parametrize("window,slack,pos,n_extra", [(128, 0, 300, 96), (128, 5, 60, 0)])
def test_the_compiled_ring_form_reads_the_windows_rows_on_the_gpu(window, slack, pos, n_extra):
    """Compiled, tf32x3: the ring form against the float64 re-derivation over `window_rows`' keys, bit for bit
    the kernel over the gathered keys (the window whole chunks), and a row equal to itself among rows at other
    positions sharing the ring (block_step's vmap)."""
    q, ring, (extra, extra_valid), sink, pos, freqs = _ring_case(window, slack, pos, n_extra, kdim=512, heads=64)
    win_kv, win_valid = attention.window_rows(ring, window, pos)
    keys = win_kv if extra is None else jnp.concatenate([win_kv, extra])
    valid = win_valid if extra is None else jnp.concatenate([win_valid, extra_valid])

    def ring_form(q, p):
        return attend_kernels(q, extra, extra_valid, sink, p, freqs, 512 ** -0.5, 1e-6, dot="tf32x3", ring=ring,
                              window=window)

    got = np.asarray(ring_form(q, pos))
    exact = _numpy_attend(q, np.asarray(keys), np.asarray(valid), sink, pos, freqs, head_norm=True)
    np.testing.assert_allclose(got, exact, rtol=0, atol=1e-5 * np.abs(exact).max())
    np.testing.assert_array_equal(got, np.asarray(attend_kernels(q, keys, valid, sink, pos, freqs, 512 ** -0.5, 1e-6,
                                                                 dot="tf32x3")))
    block = np.asarray(jax.vmap(ring_form)(np.stack([q, q[::-1].copy()]), np.array([pos, pos - 1], np.int32)))
    np.testing.assert_array_equal(block[0], got)
