"""`python -m jds41.serve MODEL.gguf [--profile NAME] [--draft DRAFT.gguf] [--host 127.0.0.1] [--port 8000]
[--api-key KEY] [--ctx N] [--slots N]`: serve one model over an OpenAI-compatible HTTP API.

The port is bound at once and the model loads in the background (/health reports progress). A model that cannot
be loaded (bad magic, truncated, a tensor out of bounds or misshapen, wrong architecture) ends the process with
exit status 1 and one line naming the file and the tensor. Arguments that cannot work (a missing file, an unknown
profile, a missing draft file) end it with status 2 before anything is bound.

`--load-delay SECONDS` (hidden) holds the load in its `reading` phase: a test hook that makes the loading state
observable on a model that loads in a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from jds41.numerics import NUMERICS
from jds41.serve import DEFAULT_PROFILE, ServeOptions
from jds41.tiers.profiles import ProfileError, load_profile, shipped_profiles


def parse(argv: list[str] | None = None) -> tuple[str, ServeOptions]:
    ap = argparse.ArgumentParser(prog="python -m jds41.serve", description="Serve a DeepSeek V4(.1)-Flash GGUF "
                                 "over an OpenAI-compatible HTTP API.")
    ap.add_argument("model", help="GGUF file (any shard of a split file) or Orbax directory")
    ap.add_argument("--profile", default=DEFAULT_PROFILE,
                    help=f"placement profile: a shipped name ({', '.join(shipped_profiles())}) or a JSON file; "
                    f"{DEFAULT_PROFILE} (the default) keeps every weight in device memory and batches the slots in "
                    "one step, a tiered profile decodes each request in its own single-sequence step")
    ap.add_argument("--draft", help="DSpark draft GGUF ('self': the model's own mtp.* stages): greedy requests "
                    "without logprobs decode with drafting, token for token as `python -m jds41.generate` does")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get("JDS41_API_KEY"),
                    help="require 'Authorization: Bearer KEY' on every route but /health (default $JDS41_API_KEY)")
    ap.add_argument("--ctx", type=int, help="context size per slot (default min(model context, 8192))")
    ap.add_argument("--slots", type=int, default=4, help="requests decoded together (default 4)")
    ap.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot before 503 (default 64)")
    ap.add_argument("--prefill-chunk", type=int, default=4096,
                    help="prompt tokens per layer-major prefill group (default 4096; 0 = token-major only)")
    ap.add_argument("--prefill-budget", type=int, default=None,
                    help="prompt tokens fed per scheduler iteration, across requests (default 256; with a tiered "
                    "profile one whole prefill chunk, so each chunk moves its experts once)")
    ap.add_argument("--prefix-cache-bytes", type=int, default=0,
                    help="host memory for prompt-prefix snapshots, in bytes (default 0 = no prefix cache)")
    ap.add_argument("--prefix-cache-dir", help="also keep prefix snapshots in this directory (survives restarts)")
    ap.add_argument("--decode-width", type=int, default=1,
                    help="decode through the W-row batched pass (default 1); with --draft, the draft's block size + 1 "
                    "verifies each block in one pass (drafted tokens then equal `generate --decode-width W`)")
    ap.add_argument("--prompt-width", type=int, default=0,
                    help="read prompts in R-row blocks with each group's experts computed expert by expert (R >= 2; "
                    "several times faster prefill, the same bits however a prompt is cut, not decode's bits; "
                    "default 0: prompts read with decode's arithmetic)")
    ap.add_argument("--compile-cache", default=None, metavar="DIR|off",
                    help="keep compiled programs here, so a restart is ready sooner (default "
                    "$JAX_COMPILATION_CACHE_DIR, else ~/.cache/jds41/xla; 'off': compile at every start)")
    ap.add_argument("--numerics", default="jds41", choices=sorted(NUMERICS),
                    help="activation numerics (default jds41: f32 activations; int8: the two-bit experts' products "
                    "read int8 activations, faster on the GPU and not the same bits; experiments/README.md has its "
                    "fidelity)")
    ap.add_argument("--load-delay", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    try:
        load_profile(args.profile)
    except ProfileError as e:
        ap.error(str(e))
    if args.draft is not None and args.draft != "self" and not os.path.exists(args.draft):
        ap.error(f"draft file not found: {args.draft}")
    if not os.path.exists(args.model):
        ap.error(f"model file not found: {args.model}")
    if not 0 <= args.port <= 65535:
        ap.error(f"--port {args.port}: expected 0..65535")
    if args.prefix_cache_dir is not None and args.prefix_cache_bytes <= 0:
        ap.error("--prefix-cache-dir needs --prefix-cache-bytes > 0 (the cache's byte budget)")
    if args.prompt_width < 0 or args.prompt_width == 1:
        ap.error(f"--prompt-width {args.prompt_width}: expected 0 (prompts at the decode width) or an integer >= 2")
    for name, low in (("ctx", 2), ("slots", 1), ("max_queue", 0), ("prefill_chunk", 0), ("prefix_cache_bytes", 0),
                      ("decode_width", 1), ("prefill_budget", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            ap.error(f"--{name.replace('_', '-')} {value}: expected an integer >= {low}")
    return args.model, ServeOptions(host=args.host, port=args.port, api_key=args.api_key or None, ctx=args.ctx,
                                    slots=args.slots, max_queue=args.max_queue, profile=args.profile,
                                    draft=args.draft, load_delay_s=args.load_delay, prefill_chunk=args.prefill_chunk,
                                    prefill_budget=args.prefill_budget,
                                    decode_width=args.decode_width, prompt_width=args.prompt_width,
                                    prefix_cache_bytes=args.prefix_cache_bytes, prefix_cache_dir=args.prefix_cache_dir,
                                    compile_cache=args.compile_cache, numerics=args.numerics)


def main(argv: list[str] | None = None) -> int:
    model, options = parse(argv)
    import uvicorn

    from jds41.compile_cache import enable_compile_cache
    from jds41.serve.app import create_app

    enable_compile_cache(options.compile_cache)  # before the loader thread compiles the warm-up programs
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    failure: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_failure(message: str) -> None:
        # Runs in the loader thread: ask uvicorn to shut down; main() turns it into the exit status.
        failure.append(message)
        if server is not None:
            server.should_exit = True

    app = create_app(model, options, on_load_failure)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="info",
                                           timeout_graceful_shutdown=5))
    server.run()
    if failure:
        print(f"jds41.serve: error: cannot load the model: {failure[0]}", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
