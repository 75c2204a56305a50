"""The narrow API the CLIs and the server use: open a model, make sessions, generate.

`Engine.open(path)` validates the file, builds the config, tokenizer, parameter pytree and layer plan once;
`Engine.session()` gives a `Session` that owns its decode state and token history, so callers never see tensors.
Prompts are cut into pieces by jds41/prompt_pieces.py: at decode width 1, layer-major groups of `prefill_chunk`
tokens (jds41/prefill.py: an expert outside HBM moves once per group), token-major scans and single steps, all
bit-identical to decoding one token at a time; at decode width W, whole W-row blocks (one batched pass each) and
single width-W steps, bit-identical to decoding one token at a time at width W; with a prompt width R, R-row blocks
with grouped expert products (the same bits however the prompt is cut, not decode's).
With a prefix cache (jds41/prefix_cache.py) a fresh session resumes from the longest cached prefix of its prompt.

Engram rows are known from token ids before a step runs, so the session hashes them on the host and reads them
through the engine's row source (memory-mapped here; the tiers give SSD and host-memory sources later); a prompt of
several pieces reads each next piece's rows on a worker thread while the current piece runs (`Session._pieces`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import time
from collections.abc import Iterator, Sequence

import jax
import numpy as np

from jds41 import model as M
from jds41.checkpoints import open_model
from jds41.errors import Jds41Error
from jds41.layers.engram_rows import EngramHasher, MmapRowSource, read_step_rows
from jds41.numerics import NUMERICS
from jds41.prompt_pieces import SCAN_PIECE as PREFILL_CHUNK  # noqa: F401  (re-exported)
from jds41.prompt_pieces import UNION_PIECES, chunk_tokens, prompt_pieces, run_piece
from jds41.quant.planar import planar_params
from jds41.quant.triton_matvec import planar_weights
from jds41.tiers.experts import take_failure
from jds41.tiers.loader import load_tensors
from jds41.tokenizer import Tokenizer
from jds41.weights import load_params, matrix_names

READ_AHEAD_THREAD = "jds41-engram-ahead"  # the name of the thread reading a prompt's next Engram rows
DEFAULT_PREFILL_CHUNK = 4096  # tokens per layer-major prefill group (0 = token-major only, the reference path)


class RequestError(Jds41Error, ValueError):
    """A request the model cannot serve (bad token ids, prompt past the context): the caller's fault."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None


class Engine:
    def __init__(self, path: str, gguf, params: dict, plan: M.ModelPlan, tokenizer: Tokenizer | None,
                 engram: tuple[EngramHasher, MmapRowSource] | None, load_seconds: float, tiers=None):
        self.path, self.gguf, self.params, self.plan = path, gguf, params, plan
        self.cfg = plan.cfg
        self.tokenizer = tokenizer
        self.engram = engram
        self.load_seconds = load_seconds
        self.tiers = tiers  # jds41.tiers.runtime.TierRuntime when a profile placed the experts, else None
        self.load_stats: dict = {}  # bytes, seconds, GB/s and O_DIRECT use of the bulk read (set by open)
        self.applied_lean_margin: float | None = None  # the lean margin in `params` once the guard changed it
        self.prefill_chunk = DEFAULT_PREFILL_CHUNK
        self.prefix_cache = None  # jds41.prefix_cache.PrefixCache, set by open(prefix_cache_bytes=...)

    @classmethod
    def open(cls, path: str, max_ctx: int | None = None, numerics: str = "jds41", profile: str | None = None,
             usage: str | None = None, progress: bool = False, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
             prefix_cache_bytes: int = 0, prefix_cache_dir: str | None = None, decode_width: int = 1,
             prompt_width: int = 0) -> Engine:
        """Open a model; with `profile` (a shipped name or a JSON path) the routed experts are placed across HBM,
        pinned host memory and the SSD by it (`usage`: a usage.json overriding the profile's placement source).
        `prefill_chunk`: tokens per layer-major prefill group (0: token-major only); `prefix_cache_bytes` > 0
        keeps prompt snapshots in host memory (and in `prefix_cache_dir` when given, across restarts).
        `decode_width` W > 1 decodes every position through the W-row batched pass (jds41/block_step.py), the
        numerics that a DSpark verify of W rows (block size W - 1) shares bit for bit; 1 is the one-token step.
        `prompt_width` R >= 2 reads prompts in R-row blocks with grouped expert products (ModelPlan.prompt_width:
        many times faster prefill, the same bits for any cut of a prompt, not decode's bits); 0 reads them at the
        decode width with decode's arithmetic."""
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, got {prefill_chunk}")
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {sorted(NUMERICS)}, got {numerics!r}")
        t0 = time.perf_counter()
        gguf = open_model(path)
        cfg = gguf.config
        ctx = min(cfg.context_length, max_ctx or 8192)
        engram = None
        if cfg.engram is not None:
            token_map = np.asarray(gguf.metadata[f"{cfg.arch}.engram.token_map"], np.int64)
            engram = (EngramHasher(cfg.engram, token_map), MmapRowSource.from_model(gguf, cfg.engram))
        # Bulk tensors on 8 O_DIRECT threads into their final buffers (DESIGN.md §6); with a profile the routed
        # stacks are left to the tier stores, which read only what each tier holds.
        loaded = load_tensors(gguf, matrix_names(cfg, with_routed_experts=profile is None), progress=progress)
        params = load_params(cfg, gguf, act_round=NUMERICS[numerics], raw=loaded.arrays,
                             with_routed_experts=profile is None)
        planar = planar_weights(NUMERICS[numerics])  # PLANAR_TYPES rows regrouped for the GPU kernels, same values
        if planar:
            params = planar_params(params)
        tiers = None
        if profile is not None:
            from jds41.tiers.runtime import open_tiers  # the tier machinery loads only when a profile asks for it

            params, tiers = open_tiers(gguf, params, profile, usage, planar=planar)
            if engram is not None:  # the profile also says where the Engram tables are read from
                from jds41.tiers.engram_store import row_source_for

                engram = (engram[0], row_source_for(gguf, cfg.engram, tiers.profile.engram_tables))
        # Weights go to the device once, here: numpy leaves would be copied host -> device on every jitted call
        # (measured on the H200: a 25 GB six-layer V4.1 file spent ~4.5 s per 32-token prefill call doing so).
        # Tier stores already placed their stacks (device or pinned host): only numpy leaves move.
        params = jax.tree.map(lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, params)
        lean = tiers.profile.router_lean if tiers is not None else None
        plan = M.make_plan(cfg, ctx, lean_margin=lean.margin if lean is not None and lean.enabled else None,
                           lookahead=tiers is not None and tiers.profile.lookahead_depth > 0, decode_width=decode_width,
                           prompt_width=prompt_width)
        engine = cls(path, gguf, params, plan, Tokenizer.from_metadata(gguf.metadata, path), engram,
                     time.perf_counter() - t0, tiers)
        engine.load_stats = {"bytes": loaded.bytes, "seconds": round(loaded.seconds, 3),
                             "gb_per_s": round(loaded.bytes / max(loaded.seconds, 1e-9) / 1e9, 3),
                             "direct_io": loaded.direct_io}
        engine.prefill_chunk = prefill_chunk
        if prefix_cache_bytes > 0:
            from jds41.prefix_cache import PrefixCache, fingerprint

            engine.prefix_cache = PrefixCache(prefix_cache_bytes, prefix_cache_dir, fingerprint(engine))
        return engine

    @property
    def max_ctx(self) -> int:
        return self.plan.max_ctx

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def with_params(self, params: dict) -> Engine:
        """The same model with another parameter pytree (e.g. experts placed across tiers); shares everything else."""
        engine = Engine(self.path, self.gguf, params, self.plan, self.tokenizer, self.engram, self.load_seconds,
                        self.tiers)
        engine.prefill_chunk, engine.prefix_cache = self.prefill_chunk, self.prefix_cache
        return engine

    def apply_lean_guard(self) -> None:
        """Put the router lean guard's margin into the parameters when it backed off (jds41/tiers/lean_guard.py):
        an array swap, not a recompilation; sessions read `engine.params` at every call."""
        guard = self.tiers.guard if self.tiers is not None else None
        if guard is None:
            return
        applied = guard.initial_margin if self.applied_lean_margin is None else self.applied_lean_margin
        if guard.margin != applied:
            from jds41.tiers.experts import with_lean_margin

            self.params = with_lean_margin(self.params, guard.margin)
            self.applied_lean_margin = guard.margin

    def session(self) -> Session:
        return Session(self)

    def engram_rows(self, new_tokens: Sequence[int], history: Sequence[int]) -> np.ndarray | None:
        """Rows of every Engram layer for each new token after `history` (only its last n-1 ids are read),
        [T, n_layers, n_buckets, row_bytes] uint8 on the host; None for a model without Engram. Sessions and the
        scheduler's slots share this, so a token gets the same rows however it is batched."""
        if self.engram is None:
            return None
        hasher, source = self.engram
        return read_step_rows(source, hasher.row_ids_seq(new_tokens, history[max(0, len(history) - (hasher.n - 1)):]))


class Session:
    """One conversation's decode state and token history."""

    def __init__(self, engine: Engine):
        self.engine = engine
        # Committed to the device like every state a jitted call returns: a tiered model's outputs are committed,
        # and jit keys its cache on commitment, so an uncommitted first state compiled each program twice.
        self.state = jax.device_put(M.init_state(engine.plan), jax.devices()[0])
        self.tokens: list[int] = []
        self.expert_counts: np.ndarray | None = None  # per layer and expert, selections so far (tier profiles)
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache instead of computed
        self.trace_routing = engine.tiers is not None  # pieces return their routing (tier stats; benchmarks)
        self._looked_up = False
        self._next: list[int] | None = None  # tokens the caller will feed next (read_next), for their Engram rows
        self._more_follows = False  # read_next said another feed comes right after this one (any model)
        self.engram_wait_s = 0.0  # time feeds waited for a piece's Engram rows from the read-ahead thread
        self._kept_rows: tuple[list[int], tuple[int, ...], jax.Array | None] | None = None  # (after, tokens, rows)

    # ---- host-side inputs ----------------------------------------------------------------------------------
    def _engram_rows(self, new_tokens: Sequence[int], history: Sequence[int] | None = None) -> jax.Array | None:
        """Rows of every Engram layer for each new token after `history` (default: the session's tokens),
        [T, n_layers, n_buckets, row_bytes] (uint8)."""
        rows = self.engine.engram_rows(new_tokens, self.tokens if history is None else history)
        return None if rows is None else jax.device_put(rows)  # jnp.asarray compiles a copy per shape

    def read_next(self, tokens: Sequence[int]) -> None:
        """Say which tokens the next `feed` will take: the next feed reads their Engram rows on its worker thread
        while its own last piece runs, and the feed after uses them if it starts with exactly those tokens (else it
        reads its own, as without this call). For a caller that feeds a long prompt a chunk per call, as the
        server's scheduler does, which would otherwise read each chunk's rows only once the chunk before is done.
        Nothing is read for a model without Engram."""
        self._next = [int(t) for t in tokens] if self.engine.engram is not None and len(tokens) else None
        self._more_follows = len(tokens) > 0

    def _pieces(self, tokens: list[int]) -> Iterator[tuple[str, list[int], jax.Array | None]]:
        """(how, piece, Engram rows on the device) for each prompt piece of `tokens` (jds41/prompt_pieces.py).

        Engram rows depend on token ids alone, so piece k + 1's rows are read and put on the device on a worker
        thread, submitted before piece k is handed out: the read overlaps the caller's dispatch of piece k and
        the device computing it, however long the dispatching call blocks (jaxlib releases the GIL while it
        executes; the SSD reads release it in preadv). Reading them after `run_piece` returned did not overlap at
        all: on the H200 (V4.1 4-layer, profile h200, tables on the SSD) a 20,480-token prompt took 12.51 s, of
        which 5.84 s were Engram reads (about 1.17 s per 4K piece), against 6.05 s with the tables in memory: most
        likely `run_piece` returns only when the device is nearly done (XLA:GPU drives while loops from the host,
        so the dispatching thread waits). The first piece's rows are read before it, with nothing to overlap; a
        one-piece feed (every decode step) starts no thread. A read's error is raised here when its piece is taken,
        as before.

        Callers close the generator (contextlib.closing) so that a feed stopped early, by an error in its piece
        or otherwise, waits for the read in flight and discards it: no read outlives the feed unobserved.

        After `read_next(T)` the tokens T are read as one more piece would be, while the last piece runs, and kept
        for the next feed (`read_next`); a failed read of them is dropped (the next feed reads them again)."""
        eng = self.engine
        pieces, at = [], 0
        for how, n in prompt_pieces(len(tokens), eng.plan.decode_width, eng.prefill_chunk, eng.tiers is not None,
                                    eng.plan.prompt_width):
            pieces.append((how, at, n))
            at += n
        before = list(self.tokens)
        upcoming, self._next = self._next, None
        more, self._more_follows = self._more_follows, False
        if eng.tiers is not None:  # every pass but the last then reads the next one's first SSD layer ahead
            eng.tiers.expect_union_passes(sum(how in UNION_PIECES for how, _, _ in pieces) + more)
        kept, self._kept_rows = self._kept_rows, None
        reads = [(start, n) for _, start, n in pieces] + ([(len(tokens), len(upcoming))] if upcoming else [])

        def read(k: int) -> jax.Array | None:
            start, n = reads[k]
            new = tokens[start:start + n] if k < len(pieces) else upcoming
            return self._engram_rows(new, before + tokens[:start])

        rows = None
        if pieces:
            first = tuple(tokens[:pieces[0][2]])
            rows = kept[2] if kept is not None and kept[1] == first and kept[0] == before else read(0)
        # a thread per feed of several reads: starting one costs nothing next to a piece, and none outlives the feed
        # (the engine has no close to shut a shared one down)
        worker = None
        if len(reads) > 1:
            worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=READ_AHEAD_THREAD)
        try:
            ahead = None
            for k, (how, start, n) in enumerate(pieces):
                ahead = worker.submit(read, k + 1) if k + 1 < len(reads) else None
                yield how, tokens[start:start + n], rows
                if ahead is not None and k + 1 < len(pieces):
                    t0 = time.perf_counter()
                    rows = ahead.result()  # re-raises the read's error (e.g. ExpertReadError) for this piece
                    self.engram_wait_s += time.perf_counter() - t0
            if upcoming and ahead is not None:
                try:
                    self._kept_rows = (before + tokens, tuple(upcoming), ahead.result())
                except Exception:  # noqa: BLE001  (only a guess at the next feed: it reads them itself)
                    self._kept_rows = None
        finally:
            if worker is not None:
                worker.shutdown(wait=True, cancel_futures=True)

    def _check(self, tokens: Sequence[int]) -> None:
        V = self.engine.vocab_size
        bad = [t for t in tokens if not 0 <= int(t) < V]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {V})")
        if len(self.tokens) + len(tokens) > self.engine.max_ctx:
            raise RequestError(f"this model's maximum context length is {self.engine.max_ctx} tokens, the request "
                               f"needs {len(self.tokens) + len(tokens)}")

    def _record(self, routing: list) -> None:
        """Per-tier counts from the expert ids the step returned (only when experts are placed by a profile)."""
        if routing and self.engine.tiers is not None:
            self.engine.tiers.record(routing[0])
            self.engine.apply_lean_guard()
            if self.expert_counts is None:  # the working set a prefix snapshot carries
                self.expert_counts = np.zeros(self.engine.tiers.tier_LE.shape, np.int64)
            experts_TLK = np.asarray(routing[0]["experts"])
            np.add.at(self.expert_counts, (np.arange(experts_TLK.shape[1])[None, :, None], experts_TLK), 1)

    # ---- prefix cache (issue #10; jds41/prefix_cache.py) ----------------------------------------------------
    def restore_prefix(self, tokens: Sequence[int], max_len: int | None = None) -> int:
        """On a fresh session: resume from the longest cached prefix of `tokens` (at most `max_len` of them) and
        prefetch its expert working set; returns the tokens restored (0: none cached, or no cache)."""
        from jds41.prefix_cache import resume_session

        return resume_session(self, tokens, max_len)

    def feed_prompt(self, tokens: Sequence[int]) -> np.ndarray:
        """`feed` through the prefix cache: resume from the longest cached prefix, compute the rest; the logits
        after the last token [V] (an exact hit computes nothing)."""
        n = self.restore_prefix(tokens)
        return np.array(self._cached_logits) if n == len(tokens) else self.feed(list(tokens)[n:])

    def save_prefix(self, logits) -> None:
        """Snapshot the state after every token so far (`logits`: those after the last one) into the cache."""
        if self.engine.prefix_cache is not None and self.tokens:
            from jds41.prefix_cache import capture

            self.engine.prefix_cache.put(capture(self.engine.plan, self.state, self.tokens, logits,
                                                 self.expert_counts))

    def _at_boundary(self, logits) -> None:
        chunk = chunk_tokens(self.engine.prefill_chunk, self.engine.plan.decode_width)
        if chunk and len(self.tokens) % chunk == 0:
            self.save_prefix(logits)

    # ---- model calls ---------------------------------------------------------------------------------------
    def feed(self, tokens: Sequence[int], all_logits: bool = False) -> np.ndarray:
        """Append tokens; returns the logits after the last one [V] (or after each one, [T, V]).

        A failed SSD expert read inside the step raises that read's error (ExpertReadError, naming the file, layer
        and expert), never a wrong token; the session's state is then unusable and the caller drops it."""
        try:
            return self._feed(tokens, all_logits)
        except Exception as e:
            cause = take_failure()
            if cause is not None:
                raise cause from e
            raise

    def _feed(self, tokens: Sequence[int], all_logits: bool) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise RequestError("no tokens to feed")
        self._check(tokens)
        eng = self.engine
        out = []
        i = 0
        trace = self.trace_routing
        if eng.tiers is not None:
            eng.tiers.prefetch_tokens(tokens)  # token ids are known now: start the hash layers' SSD reads
        with contextlib.closing(self._pieces(tokens)) as pieces:  # the next piece's rows are read meanwhile
            for how, piece, rows in pieces:
                n = len(piece)
                logits, self.state, *routing = run_piece(eng.plan, eng.params, self.state, how, piece, rows, trace,
                                                         (), all_logits, eng.prefill_chunk)
                self._record(routing)
                if all_logits or i + n == len(tokens):
                    out.append(logits if all_logits else logits[-1:])
                self.tokens += piece
                i += n
                if how != "step":  # a snapshot only where a piece ends: single steps end nowhere in particular
                    self._at_boundary(logits[-1])
        # joined on the host: a jitted concatenate compiles once per count of pieces, i.e. per prompt length
        result = np.concatenate([np.asarray(o, np.float32) for o in out])
        return result if all_logits else result[-1]

    def generate(self, prompt: Sequence[int], max_new: int, sampling: SamplingParams = SamplingParams(),
                 stop_ids: Sequence[int] = (), logits_out: list | None = None) -> Iterator[int]:
        """Yield up to `max_new` tokens after `prompt`; stops after a token in `stop_ids` (which is yielded)."""
        logits = self.feed(prompt, all_logits=True) if logits_out is not None else self.feed_prompt(prompt)
        self.save_prefix(logits[-1] if logits_out is not None else logits)
        if logits_out is not None:
            logits_out.extend(logits)
            logits = logits[-1]
        rng = np.random.default_rng(sampling.seed)
        for n in range(max_new):
            tok = sample(logits, sampling, rng)
            yield tok
            if tok in stop_ids or n == max_new - 1 or len(self.tokens) >= self.engine.max_ctx:
                return
            logits = self.feed([tok])
            if logits_out is not None:
                logits_out.append(logits)


def sample(logits: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> int:
    """Greedy at temperature 0 (lowest id on ties, like argmax), else temperature / top-k / top-p sampling."""
    if p.temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / p.temperature
    order = np.argsort(-z, kind="stable")
    if p.top_k > 0:
        order = order[:p.top_k]
    probs = np.exp(z[order] - z[order[0]])
    probs /= probs.sum()
    if p.top_p < 1.0:
        keep = np.searchsorted(np.cumsum(probs), p.top_p) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    return int(order[rng.choice(len(order), p=probs)])
