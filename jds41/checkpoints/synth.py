"""Synthetic GGUF model files: real tensor names, shapes, keys, quant types and tokenizer, random weights.

`write_synthetic(path, cfg, quant=...)` writes metadata from `cfg.to_metadata()` (+ tokenizer, Engram token map),
then exactly `schema.model_tensors(cfg)` in that order. It streams: the tensor directory is declared up front
(gguf-py computes the aligned offsets), then each tensor is generated and written in row chunks of about
`CHUNK_BYTES`, so a file of hundreds of GB is written in constant memory.

Storage layouts (`quant`):
- `f32`: every float tensor F32.
- `q8`: matrices and experts Q8_0, vectors / hc F32.
- `mxfp4`: llama.cpp converter layout: experts MXFP4, other matrices Q8_0, vectors F32.
- `ds4-q2`: ds4's 2-bit layout: routed gate/up IQ2_XXS, down Q2_K; attention / shared expert / head /
  embedding / Engram wkv Q8_0; router, hc, compressor and indexer F16; norms F32. A tensor whose row length is
  not a multiple of 256 falls back to Q8_0; the names are listed in `jds41.synthetic.fallback_q8_0`.
Always: tid2eid I32 (distinct experts per row), Engram tables I8 rows of head_dim E4M3 bytes then head_dim/32
E8M0 scales (no NaN byte patterns).

Weights are scaled so activations stay O(1): N(0, 1/fan_in) matrices, embeddings N(0, 1), norms ~1, small hc
mixing matrices, moderate hc base/scale, sinks ~0, small router bias. Generation is seeded per tensor name and
draws rows in order, so a tensor's bytes depend only on (seed, name, shape, type), not on the chunking.

DSpark drafts (schema.draft_tensors): `--draft-stages S` writes S draft stages (`mtp.{s}.*`) into the model file;
`--draft-out FILE` also writes a separate draft file holding only those tensors and the keys of the config with
the stages (`{arch}.dspark.standalone` = true). Tensors are seeded by name, so a separate draft file's stages are
byte-identical to the in-file stages of the same seed.

CLI: python -m jds41.checkpoints.synth --arch deepseek41 --size tiny --quant q8 --out FILE.gguf
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import zlib
from collections.abc import Iterator

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

from jds41.checkpoints import presets, synth_tokenizer
from jds41.checkpoints.schema import STANDALONE_DRAFT_KEY, Kind, TensorSpec, draft_tensors, model_tensors
from jds41.config import ModelConfig

log = logging.getLogger(__name__)

QUANTS = ("f32", "q8", "mxfp4", "ds4-q2")
CHUNK_BYTES = 32 << 20  # generated per write: bounds memory whatever the tensor size
_VTYPES = {"str": V.STRING, "u32": V.UINT32, "i32": V.INT32, "u64": V.UINT64, "i64": V.INT64, "f32": V.FLOAT32,
           "bool": V.BOOL}
_GGUF_QUANTIZABLE = frozenset({T.F32, T.F16, T.BF16, T.Q8_0, T.MXFP4})
_NORM_SUFFIXES = ("norm.weight", "nextn.enorm.weight", "nextn.hnorm.weight")


# ---- tensor types ------------------------------------------------------------------------------------------


def tensor_type(spec: TensorSpec, quant: str) -> T:
    """Storage type of one tensor under a layout (before the row-length fallback, see `choose_types`)."""
    if spec.kind is Kind.INDEX:
        return T.I32
    if spec.kind is Kind.ROWS:
        return T.I8
    if quant == "f32":
        return T.F32
    name = spec.name
    if quant == "ds4-q2":
        if spec.kind is Kind.EXPERTS:
            return T.Q2_K if "down" in name else T.IQ2_XXS
        if name.endswith(_NORM_SUFFIXES) or (spec.kind is Kind.VECTOR and "hc_" in name):
            return T.F32  # llama.cpp's hc ops require F32 base/scale (ggml_dsv4_hc_comb asserts it)
        if spec.kind is Kind.HC or "compressor" in name or "indexer" in name:
            return T.F16
        if name.endswith("ffn_gate_inp.weight"):  # the router picks experts: keep it above 8-bit
            return T.F16
        return T.Q8_0 if spec.kind is Kind.MATRIX else T.F32
    if spec.kind is Kind.EXPERTS:
        return T.MXFP4 if quant == "mxfp4" else T.Q8_0
    return T.Q8_0 if spec.kind is Kind.MATRIX else T.F32


def choose_types(cfg: ModelConfig, quant: str) -> tuple[dict[str, T], list[str]]:
    """Type of every tensor, and the names that fell back to Q8_0 because their rows do not fit the type."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant layout {quant!r} (one of {', '.join(QUANTS)})")
    types, fallback = {}, []
    for name, spec in model_tensors(cfg).items():
        t = tensor_type(spec, quant)
        block = gguf.GGML_QUANT_SIZES[t][0]
        if spec.shape[-1] % block:
            if spec.shape[-1] % 32:
                raise ValueError(f"{name}: row length {spec.shape[-1]} fits neither {t.name} nor Q8_0")
            t = T.Q8_0
            fallback.append(name)
        types[name] = t
    return types, fallback


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


# ---- values -------------------------------------------------------------------------------------------------


def _random_quantized(rng: np.random.Generator, qtype: T, shape: tuple[int, int], scale: float) -> np.ndarray:
    """Valid raw blocks of ~N(0, scale) values, [rows, row_bytes] uint8 (adapter over gguf-py's quantizers)."""
    x = rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)
    return _encode(x, qtype)


def _encode(x: np.ndarray, qtype: T) -> np.ndarray:
    if qtype == T.F32:
        return x.astype(np.float32).view(np.uint8)
    if qtype in (T.F16, T.BF16, T.Q8_0, T.MXFP4):
        return gguf.quants.quantize(x, qtype).view(np.uint8).reshape(x.shape[0], -1)
    raise NotImplementedError(f"random {qtype.name} blocks need jds41.quant.random_blocks")


def _values(spec: TensorSpec, rng: np.random.Generator, n: int, cols: int) -> np.ndarray:
    """[n, cols] f32 values of a float-valued (non-Gaussian-matrix) tensor, by role."""
    name, shape = spec.name, (n, cols)
    normal = rng.standard_normal(shape, dtype=np.float32)
    if name.endswith(_NORM_SUFFIXES) or name.endswith(("engram_q.weight", "engram_k.weight")):
        return 1.0 + 0.05 * normal
    if spec.kind is Kind.HC:  # mix logits ~ N(0, 0.25) for an RMS-normalised input of width fan_in
        return normal * np.float32(0.5 / np.sqrt(cols))
    if name.endswith("_base.weight"):
        return 0.5 * normal
    if name.endswith("_scale.weight"):
        return 1.0 + 0.1 * normal
    if name.endswith(("attn_sinks.weight", "ape.weight")):
        return 0.1 * normal
    if name.endswith("exp_probs_b.bias"):
        return 0.01 * normal
    raise AssertionError(f"no value rule for vector tensor {name}")


def _chunks(spec: TensorSpec, qtype: T, cfg: ModelConfig, rng: np.random.Generator, quantized,
            fast: bool = False) -> Iterator[bytes]:
    """The tensor's bytes in row order, a bounded number of rows at a time."""
    if fast and spec.kind is Kind.EXPERTS:
        yield from _fast_expert_chunks(spec, qtype, rng, quantized)
        return
    cols = spec.shape[-1]
    rows = int(np.prod(spec.shape[:-1], dtype=np.int64))
    row_bytes = tensor_nbytes((1, cols), qtype)
    step = max(1, CHUNK_BYTES // max(row_bytes, cols * 4))
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        if spec.kind is Kind.INDEX:  # hash routing: K distinct experts per token
            yield np.argsort(rng.random((n, cfg.n_experts)), axis=1)[:, :cols].astype(np.int32).tobytes()
        elif spec.kind is Kind.ROWS:
            yield _engram_rows(rng, n, cfg.engram.head_dim).tobytes()
        elif spec.kind in (Kind.MATRIX, Kind.EXPERTS, Kind.SMALL_MATRIX):
            scale = 1.0 if spec.name == "token_embd.weight" else 1.0 / np.sqrt(cols)
            if fast and qtype in _FAST_BLOCKS:
                yield _FAST_BLOCKS[qtype](rng, (n, cols), scale).tobytes()
            else:
                yield quantized(rng, qtype, (n, cols), scale).tobytes()
        else:
            yield _encode(_values(spec, rng, n, cols), qtype).tobytes()


FAST_EXPERT_POOL = 8  # --fast: distinct random experts per stack, cycled over the stack


def _fast_q8_0(rng: np.random.Generator, shape: tuple[int, int], scale: float) -> np.ndarray:
    """Q8_0 blocks of uniform random bytes (int8) under one f16 scale, std ~scale: valid weights at write speed
    (gguf-py's quantizer runs at ~12 M values/s, so a full-size embedding alone would take a minute)."""
    rows, cols = shape
    blocks = np.empty((rows, cols // 32, 34), np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(scale / 73.9).tobytes(), np.uint8)  # std of U{-128..127} is 73.9
    n = rows * (cols // 32) * 32
    blocks[..., 2:] = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(rows, cols // 32, 32)
    return blocks.reshape(rows, -1)


MXFP4_CODE_STD = float(np.sqrt(np.mean(np.square(gguf.quants.MXFP4.kvalues, dtype=np.float64))))  # 5.85


def _fast_mxfp4(rng: np.random.Generator, shape: tuple[int, int], scale: float) -> np.ndarray:
    """MXFP4 blocks (an E8M0 scale byte, then 16 bytes of 4-bit codes) of uniform random codes under one scale,
    std within a factor of sqrt(2) of `scale` (the scale is a power of two): gguf-py's MXFP4 quantizer searches
    every code for every value and took most of a V4-Flash 8-layer benchmark file's 200 s write on the H200 box."""
    rows, cols = shape
    blocks = np.empty((rows, cols // 32, 17), np.uint8)
    # a block's values are code value * 2^(e - 128) (gguf-py's e8m0_to_fp32_half, for e >= 2)
    blocks[..., 0] = np.uint8(np.clip(np.round(np.log2(scale / MXFP4_CODE_STD)) + 128, 2, 254))
    n = rows * (cols // 32) * 16
    blocks[..., 1:] = rng.bit_generator.random_raw(-(-n // 8)).view(np.uint8)[:n].reshape(rows, cols // 32, 16)
    return blocks.reshape(rows, -1)


_FAST_BLOCKS = {T.Q8_0: _fast_q8_0, T.MXFP4: _fast_mxfp4}  # --fast generators of valid random blocks, by type


def _fast_expert_chunks(spec: TensorSpec, qtype: T, rng: np.random.Generator, quantized) -> Iterator[bytes]:
    """An expert stack [E, out, in] as FAST_EXPERT_POOL distinct random experts repeated: speed benchmarks need the
    bytes and the layout, not E distinct values."""
    n_exp, out, cols = spec.shape
    make = _FAST_BLOCKS.get(qtype) or (lambda r, shape, scale: quantized(r, qtype, shape, scale))
    pool = [make(rng, (out, cols), 1.0 / np.sqrt(cols)).tobytes() for _ in range(min(FAST_EXPERT_POOL, n_exp))]
    for e in range(n_exp):
        yield pool[e % len(pool)]


def _engram_rows(rng: np.random.Generator, n: int, head_dim: int) -> np.ndarray:
    """[n, head_dim + head_dim/32] bytes: E4M3 values with bit 6 cleared (exponent <= 7, so |v| < 1.875 and
    never the 0x7F / 0xFF NaN patterns), then E8M0 scales 125..128 (x0.25 .. x2). One draw of whole rows, so the
    bytes do not depend on how rows are chunked."""
    width = head_dim + head_dim // 32
    words = -(-width // 8)  # whole 64-bit draws per row: numpy's byte draws are not chunk-invariant
    raw = rng.bit_generator.random_raw(n * words).view(np.uint8).reshape(n, words * 8)[:, :width].copy()
    raw[:, :head_dim] &= np.uint8(0xBF)
    raw[:, head_dim:] = np.uint8(125) + (raw[:, head_dim:] & np.uint8(3))
    return raw


def _quantizer():
    """Raw-block generator: gguf-py's quantizers on whole-row chunks for the types it supports (F32 / F16 / BF16 /
    Q8_0 / MXFP4), the quant package's `random_quantized` for the rest (Q2_K, Q4_K, IQ2_XXS). gguf-py splits its
    input into groups of 16 rows, so rows must be real rows: random_quantized feeds it one block per row, which
    measured 1.4 M values/s for Q8_0 against 12 M/s here."""
    try:
        from jds41.quant.random_blocks import random_quantized
    except ImportError:  # the quant package is not in this checkout yet: only gguf-py's types
        return _random_quantized

    def quantized(rng, qtype, shape, scale):
        if qtype in _GGUF_QUANTIZABLE:
            return _random_quantized(rng, qtype, shape, scale)
        return np.asarray(random_quantized(rng, qtype, shape, scale), dtype=np.uint8).reshape(shape[0], -1)

    return quantized


# ---- metadata -----------------------------------------------------------------------------------------------


def _add(w: gguf.GGUFWriter, key: str, value, typ: str) -> None:
    if typ.endswith("[]"):
        if len(value) == 0:  # GGUF has no typed empty array in gguf-py; an absent key means empty
            return
        w.add_key_value(key, list(value), V.ARRAY, sub_type=_VTYPES[typ[:-2]])
    else:
        w.add_key_value(key, value, _VTYPES[typ])


def token_map_for(cfg: ModelConfig, tok) -> np.ndarray:
    """Engram token map of the file; without a tokenizer, id mod compressed vocab (no texts to normalise)."""
    from jds41.engram_hash import INT64_MAX, tokenizer_token_map

    if tok is None:
        tmap = (np.arange(cfg.vocab_size) % presets.compressed_vocab(cfg.vocab_size)).astype(np.uint32)
    else:
        tmap = tokenizer_token_map(tok)[0]
    top = int(tmap.max())
    for li, ms in enumerate(cfg.engram.multipliers):
        if max(ms) * top > INT64_MAX:  # the hash would overflow int64: multipliers built for a smaller vocab
            raise ValueError(f"Engram layer {cfg.engram.layer_ids[li]}: multipliers overflow with {top + 1} "
                             "compressed ids; build the config for this tokenizer's compressed vocab")
    return tmap


def _metadata(w: gguf.GGUFWriter, cfg: ModelConfig, quant: str, seed: int, tok, fallback: list[str],
              name: str) -> None:
    for key, value, typ in cfg.to_metadata():
        if key != "general.architecture":  # the writer adds it itself
            _add(w, key, value, typ)
    _add(w, "general.name", name, "str")
    _add(w, "general.quantization_version", 2, "u32")
    _add(w, "jds41.synthetic.quant", quant, "str")
    _add(w, "jds41.synthetic.seed", seed, "u32")
    _add(w, "jds41.synthetic.fallback_q8_0", fallback, "str[]")
    if tok is None:
        _add(w, "tokenizer.ggml.model", "none", "str")
    else:
        for key, value, typ in synth_tokenizer.gguf_fields(tok):
            _add(w, key, value, typ)
    if cfg.engram is not None:
        tmap = token_map_for(cfg, tok)
        w.add_key_value(f"{cfg.arch}.engram.token_map", tmap.tolist(), V.ARRAY, sub_type=V.UINT32)
        _add(w, f"{cfg.arch}.engram.compressed_vocab_size", int(tmap.max()) + 1, "u32")


def _tokenizer(cfg: ModelConfig, tokenizer):
    if tokenizer == "none" or tokenizer is None:
        return None
    if tokenizer == "synthetic":
        return synth_tokenizer.build_tokenizer(cfg.vocab_size, presets.compressed_vocab(cfg.vocab_size))
    if tokenizer.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids, config says {cfg.vocab_size}")
    return tokenizer


# ---- writer -------------------------------------------------------------------------------------------------


def write_synthetic(path: str | os.PathLike, cfg: ModelConfig, quant: str = "f32", seed: int = 0,
                    progress: bool = True, tokenizer="synthetic", name: str | None = None,
                    draft_only: bool = False, fast: bool = False) -> dict:
    """Write a complete synthetic model file; returns a summary (bytes, tensors, Q8_0 fallbacks, seconds).

    `tokenizer`: "synthetic" (built for the vocab size), "none" (llama.cpp's test-model convention: only
    vocab_size), or a `tokenizers.Tokenizer` with exactly `cfg.vocab_size` ids. `draft_only`: a separate DSpark
    draft file (only the config's `mtp.*` draft tensors; `cfg` must have draft stages). `fast`: for full-size speed
    benchmarks, experts cycle through FAST_EXPERT_POOL random experts per stack and Q8_0 and MXFP4 matrices are
    uniform random blocks (same names, shapes, types and layout; writes at disk speed).
    """
    from tqdm import tqdm

    t0 = time.time()
    specs = draft_tensors(cfg) if draft_only else model_tensors(cfg)
    if draft_only and not specs:
        raise ValueError("a draft file needs a config with DSpark draft stages (preset(..., draft_stages=S))")
    types, fallback = choose_types(cfg, quant)
    if fallback:
        log.info("%d tensors fall back to Q8_0 (rows not a multiple of 256): %s", len(fallback), fallback[:4])
    tok = _tokenizer(cfg, tokenizer)
    w = gguf.GGUFWriter(os.fspath(path), cfg.arch)
    w.data_alignment = cfg.alignment
    _metadata(w, cfg, quant, seed, tok, fallback, name or f"jds41-synthetic-{cfg.arch}-{quant}")
    if draft_only:
        _add(w, f"{cfg.arch}.{STANDALONE_DRAFT_KEY}", True, "bool")
    sizes = {}
    for tname, spec in specs.items():
        sizes[tname] = tensor_nbytes(spec.shape, types[tname])
        w.add_tensor_info(tname, spec.shape, np.dtype(np.float32), sizes[tname], raw_dtype=types[tname])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    fout = w.fout[0]
    w.write_padding(fout, fout.tell())
    quantized = _quantizer()
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, disable=not progress, desc="synthetic")
    for tname, spec in specs.items():
        rng = np.random.default_rng([seed, zlib.crc32(tname.encode())])
        written = 0
        for chunk in _chunks(spec, types[tname], cfg, rng, quantized, fast):
            fout.write(chunk)
            written += len(chunk)
            bar.update(len(chunk))
        if written != sizes[tname]:
            raise AssertionError(f"{tname}: wrote {written} bytes, declared {sizes[tname]}")
        w.write_padding(fout, written)  # next tensor starts on the alignment boundary gguf-py's offsets assume
    bar.close()
    total = fout.tell()
    w.close()
    return {"path": os.fspath(path), "bytes": total, "tensors": len(specs), "fallback_q8_0": fallback,
            "seconds": round(time.time() - t0, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jds41.checkpoints.synth", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", required=True, choices=("deepseek4", "deepseek41"))
    ap.add_argument("--size", required=True, choices=presets.SIZES)
    ap.add_argument("--layers", type=int, default=None, help="keep the first N main layers")
    ap.add_argument("--nextn", type=int, default=0, help="MTP blocks (deepseek4)")
    ap.add_argument("--draft-stages", type=int, default=0, help="DSpark draft stages written into the model file")
    ap.add_argument("--draft-out", default=None, help="also write a separate DSpark draft file (the size's stage "
                    "count unless --draft-stages says otherwise)")
    ap.add_argument("--quant", default="f32", choices=QUANTS)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engram-rows", type=int, default=None, help="shrink each Engram table to about R rows")
    ap.add_argument("--tokenizer", default="synthetic", choices=("synthetic", "none"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--fast", action="store_true",
                    help="speed-benchmark files: pooled experts, uniform Q8_0 and MXFP4 blocks (see write_synthetic)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.quiet else logging.INFO, format="%(message)s")
    cfg = presets.preset(a.arch, a.size, a.layers, nextn=a.nextn, draft_stages=a.draft_stages)
    if a.engram_rows is not None:
        cfg = presets.with_engram_rows(cfg, a.engram_rows)
    info = write_synthetic(a.out, cfg, a.quant, a.seed, progress=not a.quiet, tokenizer=a.tokenizer,
                           name=f"jds41-synthetic-{a.arch}-{a.size}-{a.quant}", fast=a.fast)
    print(f"wrote {info['path']}: {info['bytes'] / 2**30:.3f} GiB, {info['tensors']} tensors, "
          f"{len(info['fallback_q8_0'])} Q8_0 fallbacks, {info['seconds']} s")
    if a.draft_out:
        base = "tiny" if a.size == "tiny-shared" else a.size
        dcfg = presets.preset(a.arch, a.size, a.layers, draft_stages=a.draft_stages or presets.DRAFT_STAGES[base])
        if a.engram_rows is not None:
            dcfg = presets.with_engram_rows(dcfg, a.engram_rows)
        info = write_synthetic(a.draft_out, dcfg, a.quant, a.seed, progress=not a.quiet, tokenizer=a.tokenizer,
                               name=f"jds41-synthetic-{a.arch}-{a.size}-{a.quant}-dspark", draft_only=True)
        print(f"wrote draft {info['path']}: {info['bytes'] / 2**20:.2f} MiB, {info['tensors']} tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
