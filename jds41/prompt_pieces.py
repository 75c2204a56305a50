"""How a prompt is cut into pieces and each piece run through the model, the same way for every session.

At decode width 1 (the one-token step): layer-major groups of `chunk` tokens and power-of-two pieces
(jds41/prefill.py), then token-major scans of SCAN_PIECE tokens (model.prefill), then single steps; all three are
bit-identical to decode one token at a time. With tiered experts the rest after the full groups, from
LAYER_MAJOR_MIN tokens up, is one group instead ("layer-major-tail": the chunk's program reading only the first n
rows): every layer-major group moves the union of its experts, nearly every expert of a layer from 64 tokens up, so
a 200-token agent turn read as 128 + 64 + 8 steps moved them twice and stepped 8 tokens through the SSD (11.2 s
to first token under lucebox on the H200, experiments/README.md), and the tail's one program replaces the
power-of-two pieces' five compilations. At width W > 1: pieces of whole W-row blocks (block_step.prefill_rows,
each block one row-batched pass) and the last n % W tokens one position at a time through the width-W decode;
bit-identical to decoding the prompt one token at a time at width W (row uniformity: tests/test_block_step.py);
with tiered experts the blocks of a group run layer-major (jds41/layer_major_rows.py), the same bits.
`chunk` 0 is the reference path: every piece is token-major (width 1) or a single width-W step.

With a prompt width R (ModelPlan.prompt_width >= 2) none of that: pieces of whole R-row blocks, each read
layer-major with the group's routed experts grouped by expert: full groups of `chunk_tokens(chunk, R)` tokens
("wide"), then the remaining whole blocks, if any, as one group read by the full group's program with a traced
block count ("wide-tail": its loops run only the read blocks, blocks never read add no expert to the union), then
the last n % R tokens as one R-row block rolled back to them ("wide-rest"). So a prompt of any length runs at most
three wide programs: one such program of the full-size model took ~150 s to compile on the H200, and the
power-of-two groups the rest was cut into before compiled one each (a 55,296-token prompt two, a server's warm-up
seven). The full group keeps its own program (a scan of a static N blocks) rather than the tail's loop of a
traced count: XLA:GPU's while thunk reads a loop's condition back to the host every trip unless the trip count
is known (its cost on the full model is not measured). Every row of that pass is the same whatever block, group
or piece it is read in, so any cut of a prompt, a prefix-cache resume included, gives the same bits
(tests/test_prompt_width.py, tests/test_wide_tail.py); they are not decode's bits (layers/grouped_experts.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jds41 import model as M
from jds41 import prefill as PF
from jds41.block_step import decode_step_for, prefill_rows
from jds41.layer_major_rows import prefill_layer_major_rows, prefill_wide_rest

SCAN_PIECE = 32  # tokens per token-major scan call: one compiled program serves every prompt length
TAIL = "layer-major-tail"  # a layer-major group shorter than the chunk, read by the chunk-sized program
WIDE_REST = "wide-rest"  # the last n % R tokens of a wide-pass prompt: one R-row block, rolled back to them
WIDE_TAIL = "wide-tail"  # the whole R-row blocks after a wide prompt's full groups, read by the full group's program
# The pieces whose routed experts move as one union per layer (prefill.py's group call): each is one pass over
# the layers, which the SSD tier's read-ahead counts (SsdStore.expect_passes). WIDE_REST's one block may ask for
# too few of a layer's experts to count as a pass; then the pass before it reads one layer it did not need to.
UNION_PIECES = frozenset({"layer-major", TAIL, "layer-major-rows", "wide", WIDE_TAIL, WIDE_REST})
ROWS_MIN_BLOCKS = 8  # the smallest prefill_rows piece, in blocks; shorter remainders run one position at a time


def chunk_tokens(chunk: int, width: int) -> int:
    """Tokens in one full prefill group: `chunk` rounded down to whole W-row blocks (0: no groups)."""
    return max(chunk // width, 1) * width if chunk > 0 else 0


def prompt_pieces(n_tokens: int, width: int, chunk: int, tiered: bool = False,
                  prompt_width: int = 0) -> list[tuple[str, int]]:
    """[(how, tokens)] in order, how in "layer-major", TAIL, "scan", "rows", "layer-major-rows", "step" (one token),
    or with a `prompt_width` R: "wide", WIDE_TAIL and WIDE_REST. At width W > 1 the groups of blocks run
    layer-major ("layer-major-rows": each layer's experts moved once per group) when experts are `tiered`, else
    block after block ("rows"); both give the same bits."""
    if prompt_width:
        R = prompt_width
        group = chunk_tokens(chunk, R) or R  # chunk 0: one block per group, never a tail
        full, tail = divmod(n_tokens - n_tokens % R, group)
        pieces = [("wide", group)] * full + ([(WIDE_TAIL, tail)] if tail else [])
        return pieces + ([(WIDE_REST, n_tokens % R)] if n_tokens % R else [])
    if width == 1:
        if tiered and chunk > 0:  # full chunks, then (below) the rest as one TAIL group
            groups, rest = [chunk] * (n_tokens // chunk), n_tokens % chunk
        else:
            groups, rest = PF.plan_pieces(n_tokens, chunk)
        pieces = [("layer-major", n) for n in groups]
        if tiered and chunk > 0 and rest >= min(PF.LAYER_MAJOR_MIN, chunk):
            pieces, rest = pieces + [(TAIL, rest)], 0
        pieces += [("scan", SCAN_PIECE)] * (rest // SCAN_PIECE)
        rest %= SCAN_PIECE
    else:
        blocks = PF.plan_pieces(n_tokens // width, chunk_tokens(chunk, width) // width, ROWS_MIN_BLOCKS)[0]
        pieces = [("layer-major-rows" if tiered else "rows", b * width) for b in blocks]
        rest = n_tokens - sum(n for _, n in pieces)
    return pieces + [("step", 1)] * rest


def piece_lengths(longest: int, width: int, chunk: int, tiered: bool = False, prompt_width: int = 0) -> list[int]:
    """Prompt lengths that, fed one per fresh session, run every distinct piece a feed of 1..`longest` tokens can
    run (the shortest length that runs each): what a server compiles before it answers, so no request waits for
    XLA. At width 1 and a 256-token feed: 1, 32, 64, 128, 256."""
    first: dict[tuple[str, int], int] = {}
    for n in range(1, longest + 1):
        for how, m in prompt_pieces(n, width, chunk, tiered, prompt_width):
            first.setdefault((how, 0 if how in (TAIL, WIDE_TAIL, WIDE_REST) else m), n)  # every tail: one program
    return sorted(set(first.values()))


def _blocks(a, width: int):
    return None if a is None else a.reshape((-1, width, *a.shape[1:]))


def run_piece(plan: M.ModelPlan, params: dict, state: dict, how: str, tokens: list[int], engram_rows=None,
              trace_routing: bool = False, feature_layers: tuple[int, ...] = (), all_logits: bool = True,
              chunk: int = 0):
    """One piece: (logits [n, V], state[, routing][, features]), per-token outputs with a leading n axis. Without
    `all_logits` a layer-major piece gives the last token's logits only ([1, V]: its output head runs once, not
    n times); other pieces give all n. A TAIL or WIDE_TAIL piece runs in the program of a `chunk`-token group."""
    if how == TAIL:
        return _run_tail(plan, params, state, tokens, engram_rows, trace_routing, feature_layers, all_logits, chunk)
    if how == WIDE_TAIL:
        return _run_wide_tail(plan, params, state, tokens, engram_rows, trace_routing, feature_layers, all_logits,
                              chunk)
    if how == WIDE_REST:
        return _run_wide_rest(plan, params, state, tokens, engram_rows, trace_routing, feature_layers)
    toks = jnp.asarray(tokens, jnp.int32)
    if how == "step":
        logits, state, *extra = decode_step_for(plan)(plan, params, state, toks[0],
                                                      None if engram_rows is None else engram_rows[0],
                                                      trace_routing, feature_layers)
        return (logits[None], state, *(jax.tree.map(lambda a: a[None], e) for e in extra))
    if how == "wide":
        R = plan.prompt_width
        return prefill_layer_major_rows(plan, params, state, _blocks(toks, R), _blocks(engram_rows, R), trace_routing,
                                        feature_layers, R, not all_logits)
    if how in ("rows", "layer-major-rows"):
        W = plan.decode_width
        run = prefill_rows if how == "rows" else prefill_layer_major_rows
        return run(plan, params, state, _blocks(toks, W), _blocks(engram_rows, W), trace_routing, feature_layers)
    if how == "layer-major":
        return PF.prefill_layer_major(plan, params, state, toks, engram_rows, trace_routing, feature_layers,
                                      not all_logits)
    return M.prefill(plan, params, state, toks, engram_rows, trace_routing, feature_layers)


def _padded(tokens: list[int], engram_rows, rows: int):
    """Tokens and Engram rows padded with zeros to `rows`, built on the host and put on the device (jnp.asarray of a
    host array compiles a copy per shape)."""
    n = len(tokens)
    toks = jax.device_put(np.asarray(list(tokens) + [0] * (rows - n), np.int32))
    if engram_rows is not None:
        e = np.asarray(engram_rows)
        engram_rows = jax.device_put(np.concatenate([e, np.zeros((rows - n, *e.shape[1:]), e.dtype)]))
    return toks, engram_rows


def _run_wide_rest(plan: M.ModelPlan, params: dict, state: dict, tokens: list[int], engram_rows,
                   trace_routing: bool, feature_layers: tuple[int, ...]):
    """A WIDE_REST piece: n < R tokens as one R-row block rolled back to n positions; outputs cut to n on the host."""
    n, R = len(tokens), plan.prompt_width
    if not 0 < n < R:
        raise ValueError(f"a {n}-token rest does not fit under a {R}-row block")
    toks, engram_rows = _padded(tokens, engram_rows, R)
    out = prefill_wide_rest(plan, params, state, toks, engram_rows, jnp.int32(n), trace_routing, feature_layers)
    cut = functools.partial(jax.tree.map, lambda a: np.asarray(a)[:n])
    return (cut(out[0]), out[1], *(cut(e) for e in out[2:]))


def _run_wide_tail(plan: M.ModelPlan, params: dict, state: dict, tokens: list[int], engram_rows, trace_routing: bool,
                   feature_layers: tuple[int, ...], all_logits: bool, chunk: int):
    """A WIDE_TAIL piece: n whole R-row blocks padded to the full group's blocks (`chunk_tokens(chunk, R)` rows),
    read by prefill_layer_major_rows with n_valid = n / R blocks. Per-row outputs are cut to n rows on the host."""
    n, R = len(tokens), plan.prompt_width
    group = chunk_tokens(chunk, R)
    if not (0 < n <= group and n % R == 0):
        raise ValueError(f"a {n}-token wide tail is not whole {R}-row blocks within a {group}-token group")
    toks, engram_rows = _padded(tokens, engram_rows, group)
    logits, state, *extra = prefill_layer_major_rows(plan, params, state, _blocks(toks, R), _blocks(engram_rows, R),
                                                     trace_routing, feature_layers, R, not all_logits,
                                                     jnp.int32(n // R))
    cut = functools.partial(jax.tree.map, lambda a: np.asarray(a)[:n])
    return (cut(logits) if all_logits else logits, state, *(cut(e) for e in extra))


def _run_tail(plan: M.ModelPlan, params: dict, state: dict, tokens: list[int], engram_rows, trace_routing: bool,
              feature_layers: tuple[int, ...], all_logits: bool, chunk: int):
    """A TAIL piece: the n tokens padded to `chunk` rows, read by prefill_layer_major with n_valid = n. Per-token
    outputs come back cut to n rows on the host (a device slice would compile once per length)."""
    n = len(tokens)
    if not 0 < n <= chunk:
        raise ValueError(f"a {n}-token tail does not fit a {chunk}-token group")
    toks, engram_rows = _padded(tokens, engram_rows, chunk)
    logits, state, *extra = PF.prefill_layer_major(plan, params, state, toks, engram_rows, trace_routing,
                                                   feature_layers, not all_logits, jnp.int32(n))
    cut = functools.partial(jax.tree.map, lambda a: np.asarray(a)[:n])
    return (cut(logits) if all_logits else logits, state, *(cut(e) for e in extra))
