"""The "int8" activation numerics (jds41/quant/int8_act.py) and its dp4a kernel (jds41/quant/triton_int8.py).

On every machine: the rounding against a numpy re-derivation; the XLA integer product and the kernel (Pallas'
interpreter, with the dp4a spelled as shifts and multiplies) against a float64 product of gguf-py's dequantized
weights with the rounded activation; the dp4a spelling against numpy's int8 dot, and the prmt spelling against a
numpy re-derivation of PTX's byte permute; the IQ2_XXS octet arithmetic over every grid entry and sign index
against gguf-py's grid and ksigns; the wiring (which products round, which lower to which kernel on CUDA); and an
engine opened with numerics="int8": the device loop gives the step loop's tokens, a three-tier placement gives the
resident bits, and the logits differ from the f32 activation's (the numerics is really on) by little; the server's
and generate's --numerics. On a GPU (marker `gpu`): the compiled kernel against the XLA product at V4.1's expert
shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from kernel_reference import reference_rows_matvec
from kernel_reference import rel_error as _rel
from two_bit_model import two_bit_model

from jds41.quant import QTensor, int8_act, qmatvec_experts, qtensor, triton_int8
from jds41.quant import triton_matvec as tm
from jds41.quant.blocks import IQ2XXS_PACKED_GRID
from jds41.quant.int8_act import int8_values, round_int8, xla_int8_rows_matvec
from jds41.quant.planar import to_planar
from jds41.quant.random_blocks import random_quantized
from jds41.quant.triton_int8 import KINDS, _dp4a_plain, _octets, _prmt_plain, rows_matvec_int8
from jds41.quant.triton_matvec import IQ2XXS_SIGN_BYTES

TRITON_CALL = "__gpu$xla.gpu.triton"
KIND_LIST = sorted(KINDS, key=lambda k: (k[0].name, k[1]))


def _numpy_round(x):
    """The rounding re-derived in numpy: blocks of 32, d = amax / 127, q = nearest (ties to even) of x / d."""
    b = np.asarray(x, np.float32).reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(amax > 0, np.rint(b * (np.float32(127) / amax)), 0)
    return q.reshape(x.shape).astype(np.int8), (amax / np.float32(127))[..., 0]


def _reference(x, raw, idx, qtype):
    """float64: gguf-py's dequantized rows times the rounded activation (q * d), indices clamped."""
    q, d = _numpy_round(x)
    xr = (q.astype(np.float64).reshape(*q.shape[:-1], -1, 32) * d[..., None]).reshape(q.shape)
    return reference_rows_matvec(xr, raw, idx, qtype)


def test_the_rounding_matches_a_numpy_rederivation():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 256)).astype(np.float32) * rng.uniform(0.01, 100, (3, 1)).astype(np.float32)
    x[0, :32] = 0  # a zero block: q = d = 0
    x[1, 32:64] = np.arange(32) - 15.5  # halves: 127 / 16 * (k + 0.5) lands on ties only by luck; check anyway
    q, d = round_int8(jnp.asarray(x))
    want_q, want_d = _numpy_round(x)
    np.testing.assert_array_equal(np.asarray(q), want_q)
    np.testing.assert_array_equal(np.asarray(d), want_d)
    assert np.asarray(q).min() >= -127 and np.abs(np.asarray(int8_values(jnp.asarray(x))) - x).max() <= \
        np.asarray(d).max() / 2 * 1.0001


def test_dp4a_spelled_in_shifts_is_the_signed_byte_dot_product():
    rng = np.random.default_rng(1)
    a, b = (rng.integers(-128, 128, (64, 4)).astype(np.int8) for _ in range(2))
    c = rng.integers(-1 << 20, 1 << 20, 64).astype(np.int32)
    words = lambda v: jnp.asarray(v.view(np.int32)[:, 0])  # (bytes k = 0..3 of each word, little-endian)
    got = np.asarray(_dp4a_plain(words(a), words(b), jnp.asarray(c)))
    np.testing.assert_array_equal(got, (a.astype(np.int32) * b).sum(axis=1) + c)


def _numpy_prmt(a, b, c):
    """PTX's prmt.b32 default mode re-derived from the ISA's description over numpy bytes: result byte i is byte
    (c >> 4i) & 7 of a's four bytes followed by b's, or that byte's bit 7 replicated where (c >> 4i) & 8."""
    src = np.concatenate([a.astype("<i4").view(np.uint8).reshape(-1, 4), b.astype("<i4").view(np.uint8).reshape(-1, 4)],
                         axis=1)  # [n, 8]
    out = np.empty((len(c), 4), np.uint8)
    for i in range(4):
        nib = (c.astype(np.int64) >> (4 * i)) & 15
        picked = src[np.arange(len(c)), nib & 7]
        out[:, i] = np.where(nib & 8, np.where(picked & 0x80, 0xFF, 0), picked)
    return out.view("<i4")[:, 0]


def test_prmt_spelled_in_shifts_is_ptxs_byte_permute():
    rng = np.random.default_rng(9)
    a, b, c = (rng.integers(-1 << 31, 1 << 31, 512, dtype=np.int64).astype(np.int32) for _ in range(3))
    got = np.asarray(_prmt_plain(jnp.asarray(a), jnp.asarray(b), jnp.asarray(c)))
    np.testing.assert_array_equal(got, _numpy_prmt(a, b, c))


def _run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Execute the straight-line PTX of an inline-assembly block over numpy uint32 lanes: the opcodes the MXFP4
    and Q2_K pack steps use (mov, and, or, shr.u32, prmt.b32 in its default mode as `_numpy_prmt`,
    dp4a.s32.s32), registers by name ($0..$n and declared ones), immediates in hex or decimal. Anything else fails
    the test."""
    regs = {k: np.asarray(v).astype(np.int64).astype(np.uint32) for k, v in inputs.items()}

    def val(tok):
        return regs[tok] if tok in regs else np.uint32(int(tok, 0))

    def signed_bytes(w):
        return np.asarray(w, np.uint32).astype("<u4").view(np.int8).reshape(-1, 4).astype(np.int64)

    for ins in (i.strip() for i in asm.strip().strip("{}").split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        dst, *src = (a.strip() for a in args.split(","))
        n = len(next(iter(inputs.values())))
        a = [np.broadcast_to(val(t), (n,)).astype(np.uint32) for t in src]
        if op == "mov.b32":
            out = a[0]
        elif op == "and.b32":
            out = a[0] & a[1]
        elif op == "or.b32":
            out = a[0] | a[1]
        elif op == "shr.u32":
            out = a[0] >> a[1]
        elif op == "prmt.b32":
            out = _numpy_prmt(a[0].view(np.int32), a[1].view(np.int32), a[2].view(np.int32)).view(np.uint32)
        elif op == "dp4a.s32.s32":
            dot = (signed_bytes(a[0]) * signed_bytes(a[1])).sum(axis=1)
            out = (dot + a[2].view(np.int32).astype(np.int64)).astype(np.int32).view(np.uint32)
        else:
            raise AssertionError(f"opcode {op} is not one this test executes")
        regs[dst] = np.array(out, np.uint32)
    return regs


def test_the_mxfp4_pack_assembly_gives_gguf_pys_integers():
    """The MXFP4 step's inline assembly (`_MXFP4_PACK_ASM`), executed instruction by instruction in numpy, against
    gguf-py's dequantized values (a block with scale exponent 128 dequantizes to ggml's doubled integers): every
    byte value at every position of a pack, with random x; the other three outputs are 0."""
    rng = np.random.default_rng(12)
    block = np.zeros((256, 17), np.uint8)
    block[:, 0], block[:, 1] = 128, np.arange(256)
    integers = gguf.quants.dequantize(block, T.MXFP4)[:, [0, 16]].astype(np.int64)  # [byte, (low, high)]
    words = np.concatenate([np.repeat(np.arange(256, dtype=np.uint32), 4) * np.uint32(0x01010101),
                            rng.integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)])
    x_lo, x_hi = (rng.integers(-127, 128, (len(words), 4)).astype(np.int8) for _ in range(2))
    regs = _run_ptx(triton_int8._MXFP4_PACK_ASM, {"$4": words, "$5": x_lo.view("<u4")[:, 0],
                                                  "$6": x_hi.view("<u4")[:, 0]})
    q = words.astype("<u4").view(np.uint8).reshape(-1, 4)
    want = (integers[q, 0] * x_lo + integers[q, 1] * x_hi).sum(axis=1)
    np.testing.assert_array_equal(regs["$0"].view(np.int32), want)
    assert all((regs[f"${k}"] == 0).all() for k in (1, 2, 3))
    plain = np.asarray(triton_int8._mxfp4_packs_plain(jnp.asarray(q), jnp.asarray(x_lo), jnp.asarray(x_hi)))
    np.testing.assert_array_equal(plain.sum(axis=1), want)


def _crumb(q):
    """int8 x -> the Q2_K steps' crumb-major order (`triton_matvec._crumb_major`), int8."""
    return tm._crumb_major(q).astype(jnp.int8)


def _q2_k_code_blocks(rng, shape):
    """GGML Q2_K blocks [*shape, 84] with random codes, every scale 1 and min 0, d 1 and dmin 0, so gguf-py
    dequantizes them to their codes."""
    blocks = np.zeros((*shape, 84), np.uint8)
    blocks[..., :16] = 0x01  # scale 1, min 0 in every sub-block
    blocks[..., 16:80] = rng.integers(0, 256, (*shape, 64))
    blocks[..., 80:84] = np.frombuffer(np.array([1.0, 0.0], np.float16).tobytes(), np.uint8)  # d, dmin
    return blocks


def test_the_q2_k_pack_assembly_gives_gguf_pys_codes():
    """The Q2_K packs step's inline assembly (`_Q2_K_PACK_ASM`), executed instruction by instruction in numpy, on
    planar words (`to_planar`) of GGML blocks whose scales are 1, mins 0, d 1 and dmin 0, so gguf-py dequantizes
    them to their codes: each word's result is its sub-block's 16 codes dotted with their x; the interpreter's
    spelling sums to the same."""
    rng = np.random.default_rng(13)
    blocks = _q2_k_code_blocks(rng, (64,))
    codes = gguf.quants.dequantize(blocks, T.Q2_K).astype(np.int64).reshape(64, 16, 4, 4)  # [block, j, byte, u]
    words = to_planar(blocks, T.Q2_K)[:, :64].copy().view("<u4").reshape(-1)  # [block * 16 + j]
    x = rng.integers(-127, 128, (64, 16, 4, 4)).astype(np.int8)  # the x of each value, as codes
    # register $5 + u: the x of code u of each of word j's four bytes
    x_u = {f"${5 + u}": np.ascontiguousarray(x[..., u]).reshape(-1, 4).view("<u4")[:, 0] for u in range(4)}
    regs = _run_ptx(triton_int8._Q2_K_PACK_ASM, {"$4": words, **x_u})
    want = (codes * x).sum(axis=(2, 3)).reshape(-1)
    np.testing.assert_array_equal(regs["$0"].view(np.int32), want)
    assert all((regs[f"${k}"] == 0).all() for k in (1, 2, 3))
    q = words.astype("<u4").view(np.uint8).reshape(-1, 4)
    plain = triton_int8._q2_k_packs_plain(jnp.asarray(q), *(jnp.asarray(x[..., u].reshape(-1, 4)) for u in range(4)))
    np.testing.assert_array_equal(np.asarray(plain).sum(axis=1), want)


def test_every_grid_entry_and_sign_index_gives_gguf_pys_signed_octet():
    """The IQ2_XXS octet step (`_octets`: codes and sign bits to selector nibbles, signed bytes picked by byte
    permutes, two dp4a) over all 256 grid entries x 128 sign indices, with x = one-hot per value, against gguf-py's
    grid and ksigns: each value of every octet comes out as gguf-py's signed grid value, with the sign bytes looked
    up in the 128-byte table."""
    iq = gguf.quants.IQ2_XXS
    iq.init_grid()
    grid = np.asarray(iq.grid, np.int64).reshape(256, 8)
    ksigns = np.frombuffer(iq.ksigns, np.uint8)
    idx, s7 = (a.reshape(-1) for a in np.meshgrid(np.arange(256), np.arange(128), indexing="ij"))
    want = grid[idx] * np.where((ksigns[s7][:, None] >> np.arange(8)) & 1, -1, 1)  # [256 * 128, 8]
    got = np.empty_like(want)
    for k in range(8):  # x = 1 at value k alone: the octet's sum is its value k
        one_hot = np.zeros(8, np.int8)
        one_hot[k] = 1
        xl, xh = (jnp.asarray(np.full(idx.size, v, np.int32)) for v in one_hot.view(np.int32))
        got[:, k] = np.asarray(_octets(jnp.asarray(idx, jnp.int32), jnp.asarray(s7, jnp.int32), xl, xh,
                                       jnp.asarray(IQ2XXS_PACKED_GRID), jnp.asarray(IQ2XXS_SIGN_BYTES),
                                       dp4a=_dp4a_plain, prmt=_prmt_plain))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q2_K, T.Q8_0, T.MXFP4])
@pytest.mark.parametrize("layout", ["ggml", "planar"])
def test_the_xla_integer_product_equals_a_float64_reference(qtype, layout):
    rng = np.random.default_rng(2)
    raw = random_quantized(rng, qtype, (4, 16, 1024))
    x = rng.standard_normal((3, 1024)).astype(np.float32)
    idx = np.array([3, 0, 7], np.int32)
    q, d = round_int8(jnp.asarray(x))
    rows = jnp.asarray(to_planar(raw, qtype) if layout == "planar" else raw)
    got = xla_int8_rows_matvec(q, d, rows, jnp.asarray(idx), qtype, layout)
    assert _rel(got, _reference(x, raw, idx, qtype)) < 1e-6


@pytest.mark.parametrize("qtype,layout", KIND_LIST)
@pytest.mark.parametrize("x_rows", ["shared", "per-expert"])
def test_the_interpreted_int8_kernel_equals_the_reference(qtype, layout, x_rows):
    rng = np.random.default_rng(3)
    raw = random_quantized(rng, qtype, (5, 24, 1024))
    idx = np.array([4, 0, 2, 9, -3], np.int32)
    x = rng.standard_normal((1 if x_rows == "shared" else len(idx), 1024)).astype(np.float32)
    want = _reference(x, raw, idx, qtype)
    q, d = round_int8(jnp.asarray(x))
    rows = jnp.asarray(to_planar(raw, qtype) if layout == "planar" else raw)
    for tile in (None, (8, 2, 4), (8, 1, 4, 4)):  # the rule's, another grouping of blocks, a row split in four
        got = rows_matvec_int8(q, d, rows, jnp.asarray(idx), qtype, layout, interpret=True, tile=tile)
        assert got.shape == (5, 24) and _rel(got, want) < 1e-6, tile


@pytest.mark.parametrize("x_rows", [1, 3])
def test_both_q8_0_kernel_forms_equal_the_reference_and_each_other(monkeypatch, x_rows):
    """The Q8_0 step's two forms (JDS41_INT8_Q8_0_FORM, read at import: set here on the module and traced afresh,
    past the jit cache): the same integer sums, so the same bits, and the float64 reference's values."""
    rng = np.random.default_rng(8)
    raw = random_quantized(rng, T.Q8_0, (4, 16, 512))
    idx = np.array([2, 0, 3], np.int32)
    x = rng.standard_normal((x_rows, 512)).astype(np.float32)
    q, d = round_int8(jnp.asarray(x))
    got = {}
    for form in ("packs", "words"):
        monkeypatch.setattr(triton_int8, "_Q8_0_FORM", form)
        got[form] = np.asarray(triton_int8.rows_matvec_int8.__wrapped__(
            q, d, jnp.asarray(to_planar(raw, T.Q8_0)), jnp.asarray(idx), T.Q8_0, "planar", interpret=True))
    np.testing.assert_array_equal(got["packs"], got["words"])
    assert _rel(got["packs"], _reference(x, raw, idx, T.Q8_0)) < 1e-6


def test_both_q2_k_steps_sum_the_same_integers(monkeypatch):
    """The Q2_K step's two forms (JDS41_INT8_Q2_K_FORM): each sub-block's integer sums of code * q and of q, what
    each form's own load and dot hand the shared float steps (`_q2_k_sums`), are the same integers, and equal a
    numpy sum over gguf-py's codes (blocks with scales 1, mins 0, d 1, dmin 0 dequantize to their codes)."""
    rng = np.random.default_rng(14)
    blocks = _q2_k_code_blocks(rng, (6, 4))  # 6 rows of 4 blocks of 256
    codes = gguf.quants.dequantize(blocks.reshape(6, -1), T.Q2_K).astype(np.int64).reshape(6, 4, 16, 16)
    q, d = round_int8(jnp.asarray(rng.standard_normal((1, 1024)), jnp.float32))
    qv = np.asarray(q, np.int64).reshape(1, 4, 16, 16)
    monkeypatch.setattr(triton_int8, "_q2_k_sums", lambda qx, xs, *rest: (qx, xs))
    w, rows, b, xc = jnp.asarray(to_planar(blocks.reshape(6, -1), T.Q2_K)), jnp.arange(6), jnp.arange(4), _crumb(q)
    words = triton_int8._dot_q2_k_int8(triton_int8._load_q2_k_words(w, rows, b, n_in=1024), triton_int8._words(xc),
                                       0, b, d, dp4a=_dp4a_plain)
    packs = triton_int8._dot_q2_k_packs(tm._load_q2_k_planar(w, rows, b, n_in=1024), xc, 0, b, d,
                                        q2_k_packs=triton_int8._q2_k_packs_plain)
    for form in (words, packs):
        np.testing.assert_array_equal(np.asarray(form[0]), (codes * qv).sum(axis=3))
        np.testing.assert_array_equal(np.asarray(form[1]), qv.sum(axis=3))


def test_the_q2_k_packs_form_lowers_its_assembly_for_cuda(monkeypatch):
    """Lowered for CUDA (Triton's IR, built without a GPU), the packs form carries its pack assembly, which the words
    form does not."""
    rng = np.random.default_rng(16)
    rows = jnp.asarray(to_planar(random_quantized(rng, T.Q2_K, (8, 64, 1024)), T.Q2_K))
    q, d = round_int8(jnp.ones((6, 1024), jnp.float32))
    texts = {}
    for form in ("words", "packs"):
        monkeypatch.setattr(triton_int8, "_Q2_K_FORM", form)
        product = jax.jit(lambda q, d, r, i: triton_int8.rows_matvec_int8.__wrapped__(q, d, r, i, T.Q2_K))
        texts[form] = product.trace(q, d, rows, jnp.arange(6, dtype=jnp.int32)).lower(
            lowering_platforms=("cuda",)).as_text()
    pack_asm = "and.b32 c, $4, 0x03030303"
    assert TRITON_CALL in texts["packs"] and pack_asm in texts["packs"] and pack_asm not in texts["words"]


@pytest.mark.parametrize("x_rows", [1, 3])
def test_the_interpreted_q2_k_packs_kernel_equals_the_reference(monkeypatch, x_rows):
    """The whole packs-form kernel (JDS41_INT8_Q2_K_FORM=packs; the words form, the default, runs in the test
    above) in Pallas' interpreter, the form set on the module and traced afresh, against the float64 reference in
    three tiles. (On XLA:CPU its bits may differ from the words form's: XLA contracts the shared float steps into
    fused multiply-adds as each program's fusion happens to allow.)"""
    monkeypatch.setattr(triton_int8, "_Q2_K_FORM", "packs")
    rng = np.random.default_rng(14)
    raw = random_quantized(rng, T.Q2_K, (4, 24, 1024))
    idx = np.array([2, 0, 3], np.int32)
    x = rng.standard_normal((x_rows, 1024)).astype(np.float32)
    q, d = round_int8(jnp.asarray(x))
    rows = jnp.asarray(to_planar(raw, T.Q2_K))
    for tile in (None, (8, 2, 4), (8, 1, 4, 4)):
        got = triton_int8.rows_matvec_int8.__wrapped__(q, d, rows, jnp.asarray(idx), T.Q2_K, "planar",
                                                       interpret=True, tile=tile)
        assert _rel(got, _reference(x, raw, idx, T.Q2_K)) < 1e-6, tile


def test_only_the_expert_formats_round_and_take_the_int8_kernel_on_cuda(monkeypatch):
    rng = np.random.default_rng(4)
    x, idx = jnp.ones(512, jnp.float32), jnp.arange(3, dtype=jnp.int32)

    def lowered(w):
        traced = jax.jit(lambda x, i: qmatvec_experts(x, w, i)).trace(x, idx)
        return traced.lower(lowering_platforms=("cuda",)).as_text()

    iq2 = random_quantized(rng, T.IQ2_XXS, (8, 32, 512))
    assert "rows_matvec_int8_iq2_xxs" in lowered(QTensor.from_raw(iq2, T.IQ2_XXS, (8, 32, 512), act_round="int8"))
    assert "rows_matvec_int8" not in lowered(QTensor.from_raw(iq2, T.IQ2_XXS, (8, 32, 512)))
    mx = random_quantized(rng, T.MXFP4, (8, 32, 512))  # V4-Flash's experts: rounded too, the integer product
    assert "rows_matvec_int8_mxfp4" in lowered(QTensor.from_raw(mx, T.MXFP4, (8, 32, 512), act_round="int8"))
    assert "rows_matvec_int8" not in lowered(QTensor.from_raw(mx, T.MXFP4, (8, 32, 512)))
    xs = jnp.asarray(rng.standard_normal(512), jnp.float32)
    rounded = np.asarray(qmatvec_experts(xs, QTensor.from_raw(mx, T.MXFP4, (8, 32, 512), act_round="int8"), idx))
    plain = np.asarray(qmatvec_experts(xs, QTensor.from_raw(mx, T.MXFP4, (8, 32, 512)), idx))
    assert not np.array_equal(rounded, plain) and _rel(rounded, plain.astype(np.float64)) < 3e-2
    # Q8_0 rounds only where the numerics is told to (JDS41_INT8_Q8_0=1 sets INT8_TYPES at import)
    q8_rows = random_quantized(rng, T.Q8_0, (8, 32, 512))
    q8 = QTensor.from_raw(q8_rows, T.Q8_0, (8, 32, 512), act_round="int8").with_layout(to_planar(q8_rows, T.Q8_0),
                                                                                       "planar")
    text = lowered(q8)
    assert "rows_matvec_q8_0_planar" in text and "rows_matvec_int8" not in text
    monkeypatch.setattr(qtensor, "INT8_TYPES", int8_act.PRODUCT_TYPES)
    assert "rows_matvec_int8_q8_0_planar" in lowered(q8)


@pytest.mark.slow
def test_an_int8_engine_keeps_its_invariances_and_stays_near_the_f32_activation(tmp_path):
    from jds41.decode_loop import greedy_generate
    from jds41.engine import Engine, SamplingParams

    path = two_bit_model(tmp_path)
    toks = [int(t) for t in np.random.default_rng(5).integers(8, 400, 24)]
    eng = Engine.open(path, max_ctx=64, numerics="int8")
    want = eng.session().feed(toks, all_logits=True)
    gen = list(eng.session().generate(toks, 8, SamplingParams()))
    s = eng.session()
    assert greedy_generate(s, int(np.argmax(s.feed(toks))), 8) == gen
    split = {"name": "split3", "tier0_bytes": 0.3, "tier1_bytes": 0.3, "placement_source": "uniform",
             "slot_cache_slots": 2, "lookahead": 1, "router_lean": {"enabled": False}}
    prof = tmp_path / "split3.json"
    prof.write_text(json.dumps(split))
    tiered = Engine.open(path, max_ctx=64, numerics="int8", profile=str(prof))
    np.testing.assert_array_equal(tiered.session().feed(toks, all_logits=True), want)
    f32 = Engine.open(path, max_ctx=64).session().feed(toks, all_logits=True)
    assert not np.array_equal(f32, want)  # the two-bit products really read int8
    assert (f32.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.slow
def test_drafting_under_int8_gives_int8_plain_decode(tmp_path):
    """DSpark under the int8 numerics keeps its promise: the verified tokens are plain greedy decode's (the DSpark
    drafter, drafts always right and always wrong; host path and device loop), the two-bit products' int8
    rounding done per verified row as per decoded token."""
    from jds41.engine import Engine
    from jds41.speculative import DSparkDrafter, SpeculativeSession
    from jds41.speculative_loop import ForcedDrafter

    engine = Engine.open(two_bit_model(tmp_path, draft_stages=2), max_ctx=96, numerics="int8")
    k, layers = engine.cfg.dspark.block_size, engine.cfg.dspark.target_layer_ids
    prompt, n_new = [5, 17, 99, 3, 42, 7], 40
    want = list(engine.session().generate(prompt, n_new))
    drafters = {"dspark": lambda: DSparkDrafter.open(engine, "self"),
                "all-right": lambda: ForcedDrafter(engine, prompt + want, True, k, layers),
                "all-wrong": lambda: ForcedDrafter(engine, prompt + want, False, k, layers)}
    for name, make in drafters.items():
        for step_loop in (True, False):
            spec = SpeculativeSession(engine, make(), step_loop=step_loop)
            assert list(spec.generate(prompt, n_new)) == want, (name, step_loop)
            if name == "all-right":
                assert spec.stats.accepted == spec.stats.drafted > 0


@pytest.mark.gpu
@pytest.mark.parametrize("qtype,n_out,n_in,X", [(T.IQ2_XXS, 2304, 5120, 1), (T.Q2_K, 5120, 2304, 6),
                                                (T.Q8_0, 5120, 8192, 1), (T.Q8_0, 1024, 4096, 6),
                                                (T.MXFP4, 2048, 4096, 1), (T.MXFP4, 4096, 2048, 6)])
def test_the_compiled_int8_kernel_agrees_with_the_xla_product_on_the_gpu(qtype, n_out, n_in, X):
    rng = np.random.default_rng(6)
    one = random_quantized(rng, qtype, (1, n_out, n_in))
    raw = np.concatenate([one] * 8)
    idx = jnp.asarray(rng.integers(0, 8, 6), jnp.int32)
    q, d = round_int8(jnp.asarray(rng.standard_normal((X, n_in)), jnp.float32))
    rows = jax.device_put(to_planar(raw, qtype))
    got = np.asarray(jax.jit(lambda q, d, r, i: rows_matvec_int8(q, d, r, i, qtype, "planar"))(q, d, rows, idx))
    want = np.asarray(jax.jit(lambda q, d, r, i: xla_int8_rows_matvec(q, d, r, i, qtype, "planar"))(q, d, rows, idx))
    assert np.isfinite(got).all() and _rel(got, want.astype(np.float64)) < 1e-5


@pytest.mark.gpu
def test_the_compiled_q2_k_packs_form_agrees_with_the_words_form_on_the_gpu(monkeypatch):
    """At V4.1's routed W_down shape, six experts' rows: the packs form (Triton's packs of four must be the code
    words' four bytes, else whole sub-blocks take wrong scales) against the words form: equal integer sums and the
    same float steps after them, so equal up to how Triton contracts those steps (the bits, unless it differs)."""
    rng = np.random.default_rng(15)
    rows = jax.device_put(to_planar(random_quantized(rng, T.Q2_K, (8, 5120, 2304)), T.Q2_K))
    idx = jnp.asarray(rng.integers(0, 8, 6), jnp.int32)
    q, d = round_int8(jnp.asarray(rng.standard_normal((6, 2304)), jnp.float32))
    got = {}
    for form in ("words", "packs"):
        monkeypatch.setattr(triton_int8, "_Q2_K_FORM", form)
        product = jax.jit(lambda q, d, r, i: triton_int8.rows_matvec_int8.__wrapped__(q, d, r, i, T.Q2_K))
        got[form] = np.asarray(product(q, d, rows, idx))
    assert np.isfinite(got["words"]).all() and _rel(got["packs"], got["words"].astype(np.float64)) < 1e-6


def test_the_server_and_generate_command_lines_take_the_numerics(tmp_path, capsys):
    from jds41.generate import main as generate
    from jds41.serve.__main__ import parse

    model = tmp_path / "m.gguf"
    model.write_bytes(b"")  # parse only checks that the file exists
    assert parse([str(model)])[1].numerics == "jds41"
    assert parse([str(model), "--numerics", "int8"])[1].numerics == "int8"
    for cli in (parse, generate):
        with pytest.raises(SystemExit):
            cli([str(model), "--numerics", "fp4"])
        assert "invalid choice: 'fp4'" in capsys.readouterr().err


def test_generate_under_int8_numerics_rounds_q8_0_products_only_when_told(tmp_path):
    """The shipped tiny V4.1 file holds Q8_0 weights only: "int8" rounds the two-bit formats' activations, so its
    tokens and logits are the default numerics' (the flag reaches the engine without touching other products);
    with JDS41_INT8_Q8_0=1 the Q8_0 products read int8 too, and the logits move by little."""
    model = Path(__file__).resolve().parents[1] / "checkpoints" / "tiny-deepseek41-q8.gguf"
    runs, logits = [], []
    for i, (extra, env) in enumerate((((), {}), (("--numerics", "int8"), {}),
                                      (("--numerics", "int8"), {"JDS41_INT8_Q8_0": "1"}))):
        out = tmp_path / f"logits{i}.npy"
        runs.append(subprocess.run([sys.executable, "-m", "jds41.generate", str(model), "--tokens", "5,6,7,8", "-n",
                                    "4", "--json", "--logits", str(out), *extra], capture_output=True, text=True,
                                   timeout=300, env={**os.environ, "JDS41_INT8_Q8_0": "0", **env}))
        assert runs[-1].returncode == 0, runs[-1].stderr[-2000:]
        logits.append(np.load(out))
    outs = [json.loads(r.stdout.strip().splitlines()[-1]) for r in runs]
    assert outs[0]["tokens"] == outs[1]["tokens"] and len(outs[0]["tokens"]) == 4
    np.testing.assert_array_equal(logits[0], logits[1])
    assert logits[2].shape == logits[0].shape and not np.array_equal(logits[2], logits[0])
    assert _rel(logits[2], logits[0].astype(np.float64)) < 0.1
