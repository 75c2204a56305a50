"""Whole routed-expert stacks from an Orbax checkpoint's chunk file, at the speed of the GGUF loader.

Loading places every expert of a layer at once (the HBM and host tiers), so it reads the layer's chunk region in
large O_DIRECT spans rather than expert by expert through the SSD tier's reader: the chunks are contiguous
(`base + e * stride`), only their gate/up/down pieces must be scattered into three `[E, piece]` stacks. The
region is read in batches of experts (`batch_bytes`, one bounce buffer each, two in flight so the next batch
reads while this one is checked and scattered); each expert's checksum is taken on a thread pool (hashlib and
numpy copies release the GIL), so verification costs about what it costs the GGUF loader to have none.

A bad chunk raises ModelFileError naming the expert and its tensors; a failed read names the file and tensor.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

import numpy as np

from jds41.checkpoints import orbax_layout as F
from jds41.errors import ModelFileError
from jds41.tiers.ssd import CHUNK_BYTES, DirectFiles, ReadFault, Span, aligned_empty, read_spans, round_up

BATCH_BYTES = 256 << 20

Check = Callable[[tuple[int, int], list[np.ndarray]], "str | None"]


def read_layer_stacks(path: str, el: F.ExpertLayer, check: Check, *, threads: int = 8,
                      batch_bytes: int = BATCH_BYTES, direct: bool = True) -> dict[str, np.ndarray]:
    """{kind: uint8 [n_experts, piece_bytes]} for layer `el` of the chunk file `path`; `check(key, pieces)`
    returns None or why expert `key`'s bytes are bad (the checkpoint's checksum policy)."""
    stacks = {k: np.empty((el.n_experts, n), np.uint8) for k, n in zip(F.EXPERT_KINDS, el.piece_bytes)}
    cuts = np.cumsum((0, *el.piece_bytes))
    per_batch = max(1, batch_bytes // el.stride)
    batches = [range(e0, min(e0 + per_batch, el.n_experts)) for e0 in range(0, el.n_experts, per_batch)]
    files = DirectFiles(direct=direct, align=F.ALIGN)
    pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="jds41-orbax-read")
    workers = cf.ThreadPoolExecutor(threads, thread_name_prefix="jds41-orbax-check")

    # Two bounce buffers, reused: first-touching fresh pages costs as much as the read itself (measured on the CI
    # box: 3.9 s to fault 3.8 GB in, 1.4 s to read it).
    span_bytes = round_up(el.stride * (len(batches[0]) - 1) + el.expert_bytes, F.ALIGN) if batches else 0
    bounce = [aligned_empty(span_bytes, F.ALIGN) for _ in range(min(2, len(batches)))]

    def start(i: int) -> tuple[Span, cf.Future]:
        experts = batches[i]
        lo = el.chunk_offset(experts.start)
        need = el.chunk_offset(experts[-1]) + el.expert_bytes - lo
        span = Span(path, lo, need, bounce[i % 2][:round_up(need, F.ALIGN)], [(el.layer, e) for e in experts])
        return span, read_spans(pool, files, [span], CHUNK_BYTES)

    def place(span: Span, expert: int) -> str | None:
        at = el.chunk_offset(expert) - span.start
        pieces = [span.buf[at + cuts[i]:at + cuts[i + 1]] for i in range(len(F.EXPERT_KINDS))]
        why = check((el.layer, expert), pieces)
        if why is None:
            for kind, piece in zip(F.EXPERT_KINDS, pieces):
                stacks[kind][expert] = piece
        return why

    try:
        in_flight = start(0) if batches else None
        for i, experts in enumerate(batches):
            span, fut = in_flight
            try:
                fut.result()
            except ReadFault as fault:
                raise ModelFileError(path, fault.reason, tensor=f"blk.{el.layer}.ffn_gate_exps.weight") from None
            in_flight = start(i + 1) if i + 1 < len(batches) else None
            for why in workers.map(lambda e, span=span: place(span, e), experts):
                if why:
                    raise ModelFileError(path, why, tensor=f"blk.{el.layer}.ffn_gate_exps.weight")
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        workers.shutdown(wait=True)
        files.close()
    return stacks
