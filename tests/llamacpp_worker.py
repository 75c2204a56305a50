"""Subprocess side of the llama.cpp oracle: load one GGUF with llama-cpp-python's low-level API and evaluate tokens.

Run only by `tests/llamacpp_oracle.py` (`python tests/llamacpp_worker.py REQUEST.json`), never imported by tests:
llama.cpp aborts the whole process (SIGABRT) on many bad files, so it must not live in the pytest process.

The request (JSON) names the model, the token ids, how to feed them and where to write results:
- `chunk`: tokens per `llama_decode` call; 0 = the whole prompt in one batch, 1 = token by token (the decode path).
- `n_new`: after the prompt, greedy (argmax) continuation of that many tokens, one token per call.
Results go to `out_dir`: `logits.npy` (float32 [T + n_new, V]: one row per evaluated position, prompt rows first,
then one row per greedy step) and `result.json` (`n_vocab`, `greedy` token ids).

Settings follow LLAMACPP_DEEPSEEK4.md §7: F32 K and V caches (types must be equal; F16 flips indexer choices), no
flash attention, plain file reads (no mmap), 2 threads, n_ctx and n_batch large enough for the whole sequence.
Exit codes: 0 ok, 2 bad request, 3 model load failed, 4 context creation failed, 5 decode failed.
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np


def _log(level: int, text: bytes, user_data) -> None:
    sys.stderr.write(text.decode("utf-8", errors="replace"))
    sys.stderr.flush()


def _fail(code: int, message: str) -> None:
    print(f"llamacpp_worker: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        _fail(2, "usage: llamacpp_worker.py REQUEST.json")
    req = json.loads(Path(argv[1]).read_text())
    import llama_cpp.llama_cpp as ll  # imported late: a missing/broken build is reported on stderr with exit 1

    tokens = [int(t) for t in req["tokens"]]
    n_new, chunk, n_threads = int(req.get("n_new", 0)), int(req.get("chunk", 0)), int(req.get("n_threads", 2))
    if not tokens or n_new < 0 or chunk < 0:
        _fail(2, f"bad request: {len(tokens)} tokens, n_new={n_new}, chunk={chunk}")
    total = len(tokens) + n_new
    n_ctx = int(req.get("n_ctx") or 0) or -(-(total + 1) // 256) * 256  # DSV4 caches pad to 256 rows anyway
    if n_ctx < total:
        _fail(2, f"n_ctx {n_ctx} < {total} positions")
    step = chunk or len(tokens)

    # llama-cpp-python's own log callback decodes strictly and raises on metadata dumps cut inside a UTF-8
    # character (the tokenizer keys): replace it with one that never fails. `log_cb` lives as long as main().
    log_cb = ll.llama_log_callback(_log)
    ll.llama_log_set(log_cb, ctypes.c_void_p(0))
    ll.llama_backend_init()
    mparams = ll.llama_model_default_params()
    mparams.n_gpu_layers = 0
    mparams.load_mode = ll.LLAMA_LOAD_MODE_NONE  # read into memory: the test may rewrite or delete the file
    model = ll.llama_model_load_from_file(str(req["model"]).encode(), mparams)
    if not model:
        _fail(3, f"llama.cpp could not load {req['model']} (see its log above)")
    n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(model))
    if any(not 0 <= t < n_vocab for t in tokens):
        _fail(2, f"token id out of range [0, {n_vocab})")

    cparams = ll.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = cparams.n_ubatch = max(step, 1)  # one ubatch per decode call: no hidden re-chunking
    cparams.n_outputs_max = 0  # = n_batch: every position of the batch can return logits
    cparams.n_seq_max = 1
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.type_k = cparams.type_v = ll.GGML_TYPE_F32
    cparams.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cparams.embeddings = False
    cparams.no_perf = True
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        _fail(4, f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={cparams.n_batch})")

    rows: list[np.ndarray] = []
    batch = ll.llama_batch_init(max(step, 1), 0, 1)

    def decode(ids: list[int], pos0: int) -> None:
        batch.n_tokens = len(ids)
        for j, tok in enumerate(ids):
            batch.token[j] = tok
            batch.pos[j] = pos0 + j
            batch.n_seq_id[j] = 1
            batch.seq_id[j][0] = 0
            batch.logits[j] = 1
        rc = ll.llama_decode(ctx, batch)
        if rc != 0:
            _fail(5, f"llama_decode returned {rc} at positions {pos0}..{pos0 + len(ids) - 1}")
        for j in range(len(ids)):
            ptr = ll.llama_get_logits_ith(ctx, j)
            if not ptr:
                _fail(5, f"no logits for position {pos0 + j}")
            rows.append(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).copy())

    for start in range(0, len(tokens), step):
        decode(tokens[start:start + step], start)
    greedy: list[int] = []
    for k in range(n_new):
        nxt = int(np.argmax(rows[-1]))
        greedy.append(nxt)
        decode([nxt], len(tokens) + k)

    out = Path(req["out_dir"])
    np.save(out / "logits.npy", np.stack(rows).astype(np.float32))
    (out / "result.json").write_text(json.dumps({"n_vocab": n_vocab, "greedy": greedy}))
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


if __name__ == "__main__":
    main(sys.argv)
