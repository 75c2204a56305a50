#!/usr/bin/env bash
# The measurements queued for the next session that is lent the GPU box (the twenty-eighth session ran its tests,
# decode, profile and depth calls: experiments/README.md). One device call per argument, each under the 600 s
# limit; results land in $OUT as the rows' JSON files.
#
#   bash experiments/device_next.sh kernels   # Q8_0 under the int8 numerics: both kernel forms against f32, ~4 min
#   bash experiments/device_next.sh depth     # V4.1 plain at 2, 4 and 8 layers (int8) for the 40-layer fit, ~8 min
#   bash experiments/device_next.sh round     # the int8 rounding kernel (default since the thirty-first session)
#                                             # and, with ROUND_ATTN=1, the attention kernels: GPU tests, then three
#                                             # profiles (defaults with the attention kernels if their tests passed;
#                                             # XLA's rounding, JDS41_INT8_ROUND_KERNEL=0; Q8_0 rounded too), then
#                                             # decode ABAB pairs, one and more while SECONDS < ROUND_DECODE_UNTIL_S
#                                             # (330), ~7-9 min
#   bash experiments/device_next.sh determinism  # V4.1 int8 plain decode in separate processes: two with jds41's
#                                             # default (XLA's GEMM autotuning off, jds41/__init__.py), one with
#                                             # XLA's own level 4: do the predictions repeat across processes?
#                                             # (at 451c1c4, two with autotuning gave two hashes, two without one), ~4 min
#   bash experiments/device_next.sh attention # one token's attention alone: XLA against the kernels over a sweep of
#                                             # their tiles at V4.1's shape (experiments/bench_attention.py), ~3 min;
#                                             # ATTN_TILES picks the tiles (BH:BN:BK:CH:W,...). At 11f519e on an H100
#                                             # steps of 16 and 32 latent columns ran slower than 128 (thirty-eighth
#                                             # session): not register spills. ATTN_DOTS picks the products' forms:
#                                             # at 9eabd80 tf32x3 ran 8x faster than ieee, level with XLA
#   bash experiments/device_next.sh attention-ncu  # the attention kernels' counters (NCU_TILE: the tile, NCU_DOT:
#                                             # the products' form): ncu of one attend_partials and one
#                                             # attend_combine call at 136 keys, ~2 min. At 9676a52 on an H100 (the
#                                             # ieee form): 20 programs of 4 warps, 6% occupancy, 130 us
#   bash experiments/device_next.sh cmdbuf    # V4.1 int8 decode ABAB (decode-ab): XLA's default command buffer types
#                                             # against the same plus WHILE and CONDITIONAL (the device loop's
#                                             # predicate stays on the GPU), ~6 min; CMDBUF_NONE=1 adds an
#                                             # arm with none, ~9 min. Run at 287f3a2 on an H100: no change, and
#                                             # the loop stayed off the graph (its Engram host call)
#   bash experiments/device_next.sh decode-ab # V4.1 int8 decode ABAB: the defaults against the environment in
#                                             # AB_ON (e.g. AB_ON="JDS41_ATTN_KERNEL=1", or
#                                             # AB_ON="XLA_FLAGS=--xla_gpu_enable_pdl=false":
#                                             # recent XLA launches its own kernels with programmatic dependent
#                                             # launch on Hopper by default, llama.cpp overlaps its ~1,100 kernels a
#                                             # step that way); AB_ON2 adds a third arm; rounds while
#                                             # time allows, then one profile an arm, ~8 min
#   bash experiments/device_next.sh mhc       # V4.1's sublayer-input launches (layers/mhc_input_kernel.py): GPU
#                                             # tests, then their layouts alone (experiments/bench_mhc_input.py,
#                                             # every h consumed), ~2 min. Its first form (thirty-sixth session)
#                                             # A/B'd three launches against two in decode: two won, 753.7 vs 737.1
#   bash experiments/device_next.sh side-stream  # the shared expert, the K = V latent and the Engram rows on a
#                                             # second CUDA stream (JDS41_SIDE_STREAM, layers/side_stream.py; the
#                                             # same bits): probe_side_stream.py --engine tries each site alone in
#                                             # the engine (~3 min), then decode ABAB of the defaults against
#                                             # SIDE_ON (default 1: every site) and a profile an arm (decode-ab
#                                             # below), ~8 min more. At 20734c9 (H100) every site on failed to
#                                             # compile (the prefill's "No ExecutionStreamId found for
#                                             # %call-start"); at 9676a52 the small probe failed only with a cond
#                                             # inside the region. Regions now inline their nested calls (the
#                                             # suspect since: side_stream.inline_calls); run the small probe first
#                                             # (python3 experiments/probe_side_stream.py --out ..., ~2 min)
#   bash experiments/device_next.sh co-launch # the routed and shared experts' products in shared launches
#                                             # (quant/co_launch.py, the default since 47db046's run on an H100:
#                                             # 766.0, 750.3 against 746.0, 746.4 tok/s, the same bits): its GPU
#                                             # tests, then decode ABAB of the defaults against JDS41_CO_LAUNCH=0
#                                             # and against that with the shared gate/up at its sweep's 8 warps
#                                             # (the tile before 47db046), a profile an arm (decode-ab), ~9 min
#   bash experiments/device_next.sh q2k-packs # Q2_K's int8 step by packs (JDS41_INT8_Q2_K_FORM=packs; 0f9b21a on an
#                                             # H100: W_down's co-launch 28.41 against 29.76 us, the same
#                                             # predictions) against words, the default: GPU test, W_down alone in
#                                             # each form, decode ABAB and a profile an arm, ~5 min
#   bash experiments/device_next.sh mhc-v4    # V4's unlagged sublayer inputs in three launches
#                                             # (layers/mhc_input_kernel.py, JDS41_MHC_KERNEL_V4, the default since
#                                             # eb7f426's run on an H100: 549.1 against 520.9 tok/s) against XLA's
#                                             # ~9 kernels a sublayer, ~7 min
#   bash experiments/device_next.sh attn-together  # an attention sublayer's products of its input as one launch
#                                             # (model.attention_products; JDS41_CO_LAUNCH_ATTENTION=0 launches
#                                             # them one by one; 084a7bd on an H100: 560.3 against 553.0), ~7 min
#   bash experiments/device_next.sh compressor  # a compressor's ring writes, pooling, norm, RoPE and row write as
#                                             # one launch updating its state in place (layers/compressor_kernel.py,
#                                             # the default since ffbbc38's run; JDS41_COMPRESSOR_KERNEL=0 keeps
#                                             # XLA's ~7 kernels) against XLA's, ~7 min
#   bash experiments/device_next.sh softmax   # the attention's softmax with its sink as one launch a layer
#                                             # (layers/sink_softmax_kernel.py, the default; JDS41_SOFTMAX_KERNEL=0)
#                                             # against XLA's four kernels, ~7 min
#   bash experiments/device_next.sh v4-state  # those two and the router's selection in one program
#                                             # (layers/topk_kernel.py's `route`, the default; JDS41_ROUTE_KERNEL=0):
#                                             # their GPU tests, decode with none, adding one at a time; a profile
#                                             # of all three and of none, ~9 min. At ffbbc38 on an H100 (none, all
#                                             # three): 552.5 against 581.1 tok/s
#   bash experiments/device_next.sh ffn       # an FFN's hidden activations (SwiGLU, and the routed one's int8 rounding)
#                                             # in one launch (quant/swiglu_kernel.py, the default; JDS41_SWIGLU_KERNEL=0)
#                                             # and its input's int8 blocks written by the sublayer input's launch
#                                             # (JDS41_MHC_ROUND=0 turns it off): GPU tests, V4 8 layers and V4.1 4
#                                             # layers int8 with both off against the defaults, a V4 profile an arm.
#                                             # At 7953c48 on an H100: 338.5 launches a V4 token (361.5 off), decode
#                                             # 567.9 against 574.9 in one pair (8fbb14c: 567.8 against 562.6):
#                                             # repeat with FFN_UNTIL_S=300 (FFN_TESTS, FFN_PROFILE_ARMS trim it)
#   bash experiments/device_next.sh attn-one  # the attention kernel as one launch (JDS41_ATTN_KERNEL=1; the two-launch
#                                             # form it replaced gave no gain): alone over four tiles against XLA
#                                             # (the fastest is the decode arms' JDS41_ATTN_TILE), its GPU tests,
#                                             # V4 8 layers int8 with the defaults, the kernel, a profile of it,
#                                             # the Q8_0 products rounded too (JDS41_INT8_Q8_0=1, opt-in since the
#                                             # thirty-first session's H100 run), both, ~9-10 min. At 1dc57f3 on
#                                             # an H100 (ATTN_ONE_SHORT=1, cut at 311 s): the kernel 3-4x slower
#                                             # than XLA alone, decode 474.3 against 591.9 tok/s; the Q8_0 arms
#                                             # did not run
#     mhc-v4, attn-together, compressor and softmax run through `v4_ab`: the GPU tests, V4-Flash 8 layers int8 AB
#     pairs while SECONDS < V4_AB_UNTIL_S (0: one pair), a profile an arm if SECONDS < V4_AB_PROFILE_BEFORE_S (400);
#     the forty-third session ran the first two as separate cases with MHC_V4_* and TOGETHER_* in place of V4_AB_*
#     (experiments/README.md)
#   bash experiments/device_next.sh small-tiles  # V4-Flash's small Q8_0 products of the attention input ([1024, 4096],
#                                             # [512, 4096]: no measured tile, the rule's one row a program): a
#                                             # sweep of 4-warp unsplit tiles (a co-launch has one warp count), the
#                                             # fastest of each set by JDS41_TILES for V4 8 layers int8 against the
#                                             # defaults, one pair, a profile of the tiles arm, ~8 min
#   bash experiments/device_next.sh v4-int8   # V4-Flash's MXFP4 experts under the int8 numerics (dp4a, as llama.cpp's
#                                             # CUDA backend computes them): GPU tests, then 8 layers int8 and f32
#                                             # and an int8 profile, ~5 min (0f9b21a on an H100: 525.1 against
#                                             # 446.6 tok/s); V4_INT8_PART=tests: the tests and the products alone;
#                                             # V4_INT8_PART=decode: the decode pair(s) alone
#   bash experiments/device_next.sh v4        # V4-Flash 8 layers resident (MXFP4 experts), the peer table's shape
#                                             # (llama.cpp 337 tok/s), last measured at e8e7bb3: defaults, then the
#                                             # switches in V4_ON (e.g. V4_ON="JDS41_ATTN_KERNEL=1"), ~6 min;
#                                             # V4_ON="JDS41_CO_LAUNCH=0" A/Bs the co-launch, the default there
#                                             # too since 6469745 (MXFP4 beside Q8_0) but not yet timed on V4
#     V4_ON's assignments are split at spaces, so no value can hold one. Run at e8e7bb3 on an H100 with
#     V4_ON="XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,\
#     DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL": 456.0 against 450.8 tok/s, the same predictions
#
# The device machine lacks gguf: carry .whl (the gguf wheel, device README) and this script installs it first.
# The tree that travels to it is limited to 64 MiB in all, and the small model's shards (checkpoints/
# code-deepseek41-small*.gguf, ~67 MB, unused here) exceed it: move them out before a call and back after
# (mkdir -p /tmp/ckpt_hold && mv checkpoints/code-deepseek41-small*.gguf /tmp/ckpt_hold/), as sessions 28-31 did.
# While they are out, commit named paths only: `git commit -a` records them as deleted (it has, more than once).
# Its copy of the tree has no .git: pass the commit, e.g. `JDS41_COMMIT=$(git rev-parse HEAD)` expanded here, in
# the command (JDS41_COMMIT=<sha> bash experiments/device_next.sh round), so the rows name it.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:.
export JDS41_COMMIT=${JDS41_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
OUT=${OUT:?set OUT to the folder the rows go to}
Q8_SHAPES=v41-attn-q-a,v41-attn-kv,v41-attn-q-b,v41-attn-o-a,v41-attn-o-b,v41-shexp-gate-up,v41-shexp-down,v41-head
# V4.1 int8 decode at 4 layers, as every decode case runs it (the A/B pairs and the profiles); each adds its --out
V41_DECODE=(--arch deepseek41 --layers 4 --quant ds4-q2 --profiles plain --prompt 256 --decode 128 --usage-tokens 128
            --prefill-budget-s 5 --numerics int8)
V41_PROFILE=(--arch deepseek41 --layers 4 --quant ds4-q2 --prompt 64 --decode 64 --numerics int8)

v4_ab() {  # $1 a switch read as 0 / 1, $2 its GPU tests, $3 the files' name: the tests, then V4-Flash 8 layers int8
  # with $1=0 then $1=1, pairs while SECONDS < V4_AB_UNTIL_S (0: one pair), then a profile an arm if SECONDS <
  # V4_AB_PROFILE_BEFORE_S (400)
  python3 -m pytest -q -m gpu "$2" -p no:cacheprovider -rf --tb=short > "$OUT/$3_gpu_tests.txt" 2>&1 || true
  tail -3 "$OUT/$3_gpu_tests.txt"
  local v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
            --prefill-budget-s 30 --numerics int8 --out "$OUT/bench_decode_$3_8L.jsonl")
  while true; do
    env "$1=0" python3 experiments/bench_decode.py "${v4[@]}"  # the first run writes the 28 GB file
    env "$1=1" python3 experiments/bench_decode.py "${v4[@]}"
    (( SECONDS < ${V4_AB_UNTIL_S:-0} )) || break
  done
  if (( SECONDS < ${V4_AB_PROFILE_BEFORE_S:-400} )); then
    for on in 0 1; do
      env "$1=$on" python3 experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 --prompt 64 \
        --decode 64 --numerics int8 --out "$OUT/profile_decode_$3_8L.jsonl" || true
    done
  fi
}

case "${1:-}" in
  kernels)
    for form in packs words; do
      JDS41_INT8_Q8_0_FORM=$form python3 experiments/bench_kernels.py --shapes "$Q8_SHAPES" \
        --out "$OUT/bench_kernels_int8_q8_0_${form}_h200.jsonl"
    done ;;
  depth)  # DEPTH_ENV: environment assignments for every run (e.g. DEPTH_ENV="JDS41_ATTN_KERNEL=1"), recorded in the rows
    read -r -a depth_env <<<"${DEPTH_ENV:-}"
    for n in 2 4 8; do
      env "${depth_env[@]}" python3 experiments/bench_decode.py --arch deepseek41 --layers $n --quant ds4-q2 --profiles plain \
        --numerics int8 --prompt 256 --decode 128 --usage-tokens 256 --prefill-budget-s 5 \
        --out "$OUT/bench_decode_depth_v41_h200.jsonl"
      rm -rf /tmp/jds41-bench  # the disk holds one file at a time
    done
    python3 experiments/extrapolate_depth.py "$OUT/bench_decode_depth_v41_h200.jsonl" \
      --out "$OUT/extrapolate_depth_v41_h200.jsonl" ;;
  round)
    passes() {  # the GPU tests of these files pass (their summary and any failure's first lines go into the record)
      local log
      log=$(python3 -m pytest -q -m gpu -rf --tb=line "$@" 2>&1 | tail -25)
      printf '== %s (JDS41_ATTN_KERNEL=%s)\n%s\n' "$*" "${JDS41_ATTN_KERNEL:-0}" "$log" >>"$OUT/gpu_tests_round_h200.txt"
      grep -q "passed" <<<"$log" && ! grep -qE "[0-9]+ (failed|error)" <<<"$log"
    }
    on=(env)  # the defaults and each opt-in whose GPU tests pass; no timing of a broken kernel
    off=(env JDS41_INT8_ROUND_KERNEL=0)
    passes tests/test_int8_round_kernel.py || exit 1
    # the attention kernels passed their tests at 00bd37d but their partials took ~120 us a call (XLA's seven
    # kernels: 17.7): timed again only when asked
    if [ "${ROUND_ATTN:-0}" = 1 ]; then
      passes tests/test_attention_kernel.py && (export JDS41_ATTN_KERNEL=1; passes tests/test_gpu_paths.py) \
        && on+=(JDS41_ATTN_KERNEL=1)
    fi
    prof=("${V41_PROFILE[@]}" --out "$OUT/profile_decode_round_v41_4L_h200.jsonl")
    "${on[@]}" python3 experiments/profile_decode.py "${prof[@]}"  # the kernel-level A/B: on, off, Q8_0 rounded too
    "${off[@]}" python3 experiments/profile_decode.py "${prof[@]}"
    "${on[@]}" JDS41_INT8_Q8_0=1 python3 experiments/profile_decode.py "${prof[@]}"
    common=("${V41_DECODE[@]}" --out "$OUT/bench_decode_round_v41_4L_h200.jsonl")
    while true; do  # decode ABAB: one pair, then more while the call's time allows
      "${on[@]}" python3 experiments/bench_decode.py "${common[@]}"
      "${off[@]}" python3 experiments/bench_decode.py "${common[@]}"
      (( SECONDS < ${ROUND_DECODE_UNTIL_S:-330} )) || break
    done ;;
  attention)  # ATTN_TILES, ATTN_DOTS: the tiles and product forms to time (bench_attention's --tiles, --dots)
    python3 experiments/bench_attention.py ${ATTN_TILES:+--tiles "$ATTN_TILES"} ${ATTN_DOTS:+--dots "$ATTN_DOTS"} \
      --out "$OUT/bench_attention_h200.jsonl" ;;
  attention-ncu)  # NCU_DOT: the products' form (ieee, tf32x3)
    # On the H100s lent so far kernel replay failed (LaunchFailed) and application replay crashed at the fourth pass
    # with the warp-state, scheduler and memory sections: application replay of these three ran (~10 passes)
    sections=(--section SpeedOfLight --section LaunchStats --section Occupancy)
    ncu --replay-mode application --clock-control none -k regex:attend_ -c 2 "${sections[@]}" \
      python3 experiments/bench_attention.py --reps 1 --keys 136 --tiles "${NCU_TILE:-16:32:128:4:4}" \
      --dots "${NCU_DOT:-ieee}" --out "$OUT/bench_attention_ncu.jsonl" >"$OUT/ncu_attention.txt" 2>&1
    tail -60 "$OUT/ncu_attention.txt" ;;
  determinism)
    common=("${V41_DECODE[@]}" --out "$OUT/bench_decode_determinism_v41_4L_h200.jsonl")
    python3 experiments/bench_decode.py "${common[@]}"
    python3 experiments/bench_decode.py "${common[@]}"
    XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=4" python3 experiments/bench_decode.py "${common[@]}" ;;
  cmdbuf)  # decode ABAB: XLA's default command buffers against the same with WHILE and CONDITIONAL added (the
    # device loop as CUDA graph nodes rather than a host copy of its predicate a step) and, with CMDBUF_NONE=1,
    # against none; each arm only where this XLA accepts its flag (XLA stops a process at a value it does not know)
    cb="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION"
    accepts() { env "$1" python3 -c 'import jax.numpy as j; j.ones(2).sum()' >/dev/null 2>&1; }
    arms=()
    candidates=("XLA_FLAGS=$cb,WHILE,CONDITIONAL")
    [ "${CMDBUF_NONE:-0}" = 1 ] && candidates+=("XLA_FLAGS=--xla_gpu_enable_command_buffer=")
    for arm in "${candidates[@]}"; do
      accepts "$arm" && arms+=("$arm")
    done
    printf 'arms: %s\n' "${arms[@]}" | tee "$OUT/cmdbuf_arms.txt"
    (( ${#arms[@]} )) || exit 1
    AB_ON="${arms[0]}" AB_ON2="${arms[1]:-}" AB_DECODE_UNTIL_S=${AB_DECODE_UNTIL_S:-280} bash "$0" decode-ab ;;
  decode-ab)  # AB_ON: the arm's environment; AB_ON2 (optional): a third arm. Rounds of A B [C] while time allows.
    read -r -a on <<<"${AB_ON:?set AB_ON to the environment assignments to A/B, e.g. JDS41_ATTN_KERNEL=1}"
    arms=("" "${AB_ON}")
    [ -n "${AB_ON2:-}" ] && arms+=("${AB_ON2}")
    common=("${V41_DECODE[@]}" --out "$OUT/bench_decode_ab_v41_4L.jsonl")
    prof=("${V41_PROFILE[@]}" --out "$OUT/profile_decode_ab_v41_4L.jsonl")
    rounds=0
    while (( rounds < 2 || SECONDS < ${AB_DECODE_UNTIL_S:-300} )); do  # the rows carry the switches and XLA_FLAGS
      for arm in "${arms[@]}"; do
        read -r -a e <<<"$arm"; env "${e[@]}" python3 experiments/bench_decode.py "${common[@]}" || true  # a row lost
      done
      rounds=$((rounds + 1))
    done
    for arm in "${arms[@]}"; do  # one profile an arm, the switched ones first, while the call's time allows
      (( SECONDS < 480 )) || break
      [ -z "$arm" ] && continue
      read -r -a e <<<"$arm"; env "${e[@]}" python3 experiments/profile_decode.py "${prof[@]}" || true
    done
    if (( SECONDS < 500 )); then python3 experiments/profile_decode.py "${prof[@]}" || true; fi ;;
  mhc)  # pytest unbuffered, so a timeout still leaves its lines
    python3 -u -m pytest -q -m gpu -rf --tb=line tests/test_mhc_input_kernel.py 2>&1 | tail -4 \
      | tee "$OUT/mhc_gpu_tests.txt" || true
    python3 experiments/bench_mhc_input.py --out "$OUT/bench_mhc_input.jsonl" ;;
  side-stream)  # the engine's sites one at a time first (a row a site: compiles? same predictions?), then decode
    # ABAB of SIDE_ON (a JDS41_SIDE_STREAM value; default every site) against the defaults
    python3 experiments/probe_side_stream.py --engine off,latent,shared,engram,1 --layers 2 \
      --out "$OUT/probe_side_stream_engine.jsonl" >/dev/null 2>&1 || true
    rm -rf /tmp/jds41-bench
    AB_ON="JDS41_SIDE_STREAM=${SIDE_ON:-1}" bash "$0" decode-ab ;;
  co-launch)
    python3 -m pytest -q -m gpu tests/test_co_launch.py -p no:cacheprovider > "$OUT/co_launch_gpu_tests.txt" 2>&1 || true
    tail -3 "$OUT/co_launch_gpu_tests.txt"
    AB_ON="JDS41_CO_LAUNCH=0" AB_ON2="JDS41_CO_LAUNCH=0 JDS41_TILES=Q8_0:1:2304:5120=16,8,8,5" bash "$0" decode-ab ;;
  q2k-packs)  # Q2_K's int8 step by packs (JDS41_INT8_Q2_K_FORM=packs) against words: GPU test, the routed W_down
    # product alone in each form, then decode ABAB (decode-ab)
    python3 -m pytest -q -m gpu tests/test_int8_numerics.py -k q2_k -p no:cacheprovider -rf --tb=short \
      > "$OUT/q2k_packs_gpu_tests.txt" 2>&1 || true
    tail -3 "$OUT/q2k_packs_gpu_tests.txt"
    for form in words packs; do
      JDS41_INT8_Q2_K_FORM=$form python3 experiments/bench_kernels.py --shapes v41-experts-down \
        --out "$OUT/bench_kernels_q2k_packs.jsonl" || true
    done
    AB_ON="JDS41_INT8_Q2_K_FORM=packs" AB_DECODE_UNTIL_S=${AB_DECODE_UNTIL_S:-300} bash "$0" decode-ab ;;
  attn-one)  # the attention kernel in one launch (JDS41_ATTN_KERNEL=1) and the Q8_0 products rounding x too
    # (JDS41_INT8_Q8_0=1, quant/int8_act.py; its rounding launches cost what the products saved on an H100 in the
    # thirty-first session, before the FFN's input came rounded from its sublayer input's launch) against the
    # defaults on V4-Flash 8 layers int8. First the kernel alone against XLA (four tiles, 136 and 640 keys), then
    # one run an arm with its GPU tests and profile after the kernel's (the Q8_0 arms last: a cut call loses them)
    # ATTN_ONE_SHORT=1 (a short call): the sweep after the tests, the kernel's arms at the default tile
    sweep=(python3 experiments/bench_attention.py --keys 136,640 --out "$OUT/bench_attention_one.jsonl"
           --tiles 16:32:128:128:4,16:32:128:512:8,16:16:128:128:4,16:32:128:64:4)
    [ -n "${ATTN_ONE_SHORT:-}" ] || "${sweep[@]}" > /dev/null || true
    # the decode arms take the tile with the least summed time over both key counts (the default if none ran)
    tile=$(python3 - "$OUT/bench_attention_one.jsonl" <<'PICK'
import collections, json, sys
try:
    rows = [json.loads(line) for line in open(sys.argv[1])]
except OSError:
    rows = []
total, seen = collections.Counter(), collections.Counter()
for r in rows:
    if r.get("path") == "kernel" and "net_us" in r:
        key = ":".join(map(str, r["tile"]))
        total[key] += r["net_us"]
        seen[key] += 1
full = [k for k in total if seen[k] == max(seen.values())]
print(min(full, key=total.__getitem__) if full else "")
PICK
)
    echo "JDS41_ATTN_TILE=$tile"
    attn=(JDS41_ATTN_KERNEL=1 ${tile:+JDS41_ATTN_TILE=$tile})
    v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
        --prefill-budget-s 30 --numerics int8 --out "$OUT/bench_decode_s46_8L.jsonl")
    python3 experiments/bench_decode.py "${v4[@]}"  # the first run writes the 28 GB file
    env "${attn[@]}" python3 experiments/bench_decode.py "${v4[@]}" || true
    python3 -m pytest -q -m gpu tests/test_attention_kernel.py -p no:cacheprovider -rf --tb=short \
      > "$OUT/attn_one_gpu_tests.txt" 2>&1 || true
    tail -3 "$OUT/attn_one_gpu_tests.txt"
    [ -z "${ATTN_ONE_SHORT:-}" ] || "${sweep[@]}" > /dev/null || true
    if (( SECONDS < 400 )); then
      env "${attn[@]}" python3 experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 \
        --prompt 64 --decode 64 --numerics int8 --out "$OUT/profile_decode_s46_8L.jsonl" || true
    fi
    if (( SECONDS < 470 )); then JDS41_INT8_Q8_0=1 python3 experiments/bench_decode.py "${v4[@]}" || true; fi
    if (( SECONDS < 520 )); then
      env "${attn[@]}" JDS41_INT8_Q8_0=1 python3 experiments/bench_decode.py "${v4[@]}" || true
    fi ;;
  mhc-v4)  # V4's unlagged sublayer inputs: three launches (the default) against XLA's ~9 kernels a sublayer
    v4_ab JDS41_MHC_KERNEL_V4 tests/test_mhc_input_kernel.py mhc_v4 ;;
  attn-together)  # model.attention_products (one launch for W_qa, W_kv, the compressors', W_proj) against one each
    v4_ab JDS41_CO_LAUNCH_ATTENTION tests/test_co_launch.py attn_together ;;
  compressor)  # a compressor's sequential part as one launch (layers/compressor_kernel.py) against XLA's ~7 kernels
    v4_ab JDS41_COMPRESSOR_KERNEL tests/test_compressor_kernel.py compressor ;;
  softmax)  # the attention's softmax with its sink as one launch (layers/sink_softmax_kernel.py) against XLA's four
    v4_ab JDS41_SOFTMAX_KERNEL tests/test_sink_softmax_kernel.py softmax ;;
  v4-state)  # the three opt-ins: their GPU tests, then V4-Flash 8 layers int8 with none, the compressor's, it and
    # the softmax's, all three (V4_STATE_ARMS="0 0 0;1 1 1" for the first and last alone; rounds while SECONDS <
    # V4_STATE_UNTIL_S, 0: one), then a profile of all three and of none while SECONDS < 440
    python3 -m pytest -q -m gpu tests/test_compressor_kernel.py tests/test_sink_softmax_kernel.py \
      tests/test_topk_kernel.py -p no:cacheprovider -rf --tb=short > "$OUT/v4_state_gpu_tests.txt" 2>&1 || true
    tail -3 "$OUT/v4_state_gpu_tests.txt"
    v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
        --prefill-budget-s 30 --numerics int8 --out "$OUT/bench_decode_v4_state_8L.jsonl")
    while true; do
      IFS=';' read -ra arms <<< "${V4_STATE_ARMS:-0 0 0;1 0 0;1 1 0;1 1 1}"
      for arm in "${arms[@]}"; do
        set -- $arm
        JDS41_COMPRESSOR_KERNEL=$1 JDS41_SOFTMAX_KERNEL=$2 JDS41_ROUTE_KERNEL=$3 \
          python3 experiments/bench_decode.py "${v4[@]}"
      done
      (( SECONDS < ${V4_STATE_UNTIL_S:-0} )) || break
    done
    for on in 1 0; do
      if (( SECONDS < 440 )); then
        JDS41_COMPRESSOR_KERNEL=$on JDS41_SOFTMAX_KERNEL=$on JDS41_ROUTE_KERNEL=$on python3 \
          experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 --prompt 64 --decode 64 \
          --numerics int8 --out "$OUT/profile_decode_v4_state_8L.jsonl" || true
      fi
    done ;;
  ffn)  # an FFN's hidden activations in one launch (quant/swiglu_kernel.py, JDS41_SWIGLU_KERNEL) and its input's
    # int8 blocks from the sublayer input's launch (JDS41_MHC_ROUND): their GPU tests, then V4-Flash 8 layers int8
    # and V4.1 4 layers int8 with both off against the defaults (pairs while SECONDS < FFN_UNTIL_S, 0: one each),
    # then a profile of each arm on V4 while SECONDS < 470
    read -r -a tests <<<"${FFN_TESTS:-tests/test_swiglu_kernel.py tests/test_mhc_input_kernel.py tests/test_co_launch.py}"
    python3 -u -m pytest -q -m gpu "${tests[@]}" -p no:cacheprovider -rf --tb=short -s > "$OUT/ffn_gpu_tests.txt" 2>&1 \
      || true
    tail -3 "$OUT/ffn_gpu_tests.txt"
    off=(JDS41_SWIGLU_KERNEL=0 JDS41_MHC_ROUND=0)
    v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
        --prefill-budget-s 30 --numerics int8 --out "$OUT/bench_decode_ffn_v4_8L.jsonl")
    while true; do
      env "${off[@]}" python3 experiments/bench_decode.py "${v4[@]}"  # the first run writes the 28 GB file
      python3 experiments/bench_decode.py "${v4[@]}"
      (( SECONDS < ${FFN_UNTIL_S:-0} )) || break
    done
    for arm in ${FFN_PROFILE_ARMS:-on off}; do
      (( SECONDS < 400 )) || break
      e=(); [ "$arm" = off ] && e=("${off[@]}")
      env "${e[@]}" python3 experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 --prompt 64 \
        --decode 64 --numerics int8 --out "$OUT/profile_decode_ffn_v4_8L.jsonl" || true
    done
    rm -rf /tmp/jds41-bench  # the disk holds one file at a time
    if (( SECONDS < 470 )); then
      env "${off[@]}" python3 experiments/bench_decode.py "${V41_DECODE[@]}" --out "$OUT/bench_decode_ffn_v41_4L.jsonl"
      python3 experiments/bench_decode.py "${V41_DECODE[@]}" --out "$OUT/bench_decode_ffn_v41_4L.jsonl"
    fi ;;
  small-tiles)
    python3 experiments/bench_kernels.py --shapes attn-q-a,attn-kv --tiles --rows 1,2,4,8 --blocks 16,32,64,128 \
      --warps 4 --splits 1 --out "$OUT/bench_kernels_small_tiles.jsonl" > /dev/null
    tiles=$(python3 - "$OUT/bench_kernels_small_tiles.jsonl" <<'PICK'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
best = {}
for r in rows:  # the fastest f32 kernel tile of each shape (net of the loop), the rule's included
    if r.get("path") == "triton" and r.get("layout") == "planar" and "net_us" in r:
        key = (r["out"], r["in"])
        if key not in best or r["net_us"] < best[key]["net_us"]:
            best[key] = r
print(";".join(f"Q8_0:1:{o}:{i}=" + ",".join(map(str, r["tile"])) for (o, i), r in sorted(best.items())))
PICK
)
    echo "JDS41_TILES=$tiles"
    v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
        --prefill-budget-s 30 --numerics int8 --out "$OUT/bench_decode_small_tiles_8L.jsonl")
    python3 experiments/bench_decode.py "${v4[@]}"  # the first run writes the file
    JDS41_TILES="$tiles" python3 experiments/bench_decode.py "${v4[@]}"
    if (( SECONDS < ${SMALL_TILES_PROFILE_BEFORE_S:-380} )); then
      JDS41_TILES="$tiles" python3 experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 \
        --prompt 64 --decode 64 --numerics int8 --out "$OUT/profile_decode_small_tiles_8L.jsonl" || true
    fi ;;
  v4-int8)  # V4-Flash's MXFP4 experts under the int8 numerics (their products the dp4a kernel, quant/triton_int8.py)
    # V4_INT8_PART=tests: the int8 GPU tests and V4's co-launch bit test, then the expert products alone in both
    # numerics (bench_kernels' "triton" and "int8" paths); V4_INT8_PART=decode: 8 layers resident, int8 then f32
    # activations, pairs while SECONDS < V4_INT8_UNTIL_S (0: one pair), then an int8 profile if SECONDS <
    # V4_INT8_PROFILE_BEFORE_S (420); all (the default): the tests, then decode
    part=${V4_INT8_PART:-all}
    if [ "$part" != decode ]; then
      python3 -m pytest -q -m gpu tests/test_int8_numerics.py -p no:cacheprovider -rf --tb=short \
        > "$OUT/v4_int8_gpu_tests.txt" 2>&1 || true
      python3 -m pytest -q -m gpu tests/test_co_launch.py -k v4 -p no:cacheprovider -rf --tb=short \
        >> "$OUT/v4_int8_gpu_tests.txt" 2>&1 || true
      grep -E "passed|failed|error" "$OUT/v4_int8_gpu_tests.txt" || true
    fi
    if [ "$part" = tests ]; then
      python3 experiments/bench_kernels.py --shapes experts-gate-up,experts-down --out "$OUT/bench_kernels_v4_int8.jsonl"
    else
      v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
          --prefill-budget-s 30 --out "$OUT/bench_decode_v4_int8_8L.jsonl")
      while true; do
        python3 experiments/bench_decode.py "${v4[@]}" --numerics int8  # the first run writes the 28 GB file
        python3 experiments/bench_decode.py "${v4[@]}"
        (( SECONDS < ${V4_INT8_UNTIL_S:-0} )) || break
      done
      # where an int8 V4 token's time goes now (the last V4 profile on record is 0744cc7's, f32), if time is left
      if (( SECONDS < ${V4_INT8_PROFILE_BEFORE_S:-420} )); then
        python3 experiments/profile_decode.py --arch deepseek4 --layers 8 --quant mxfp4 --prompt 64 --decode 64 \
          --numerics int8 --out "$OUT/profile_decode_v4_int8_8L.jsonl" || true
      fi
    fi ;;
  v4)
    v4=(--arch deepseek4 --layers 8 --quant mxfp4 --profiles plain --prompt 256 --decode 128 --usage-tokens 64
        --prefill-budget-s 30 --out "$OUT/bench_decode_v4_8L_h200.jsonl")
    python3 experiments/bench_decode.py "${v4[@]}"  # writes the 28 GB file once; the row below reads it again
    if [ -n "${V4_ON:-}" ]; then
      env $V4_ON python3 experiments/bench_decode.py "${v4[@]}"
    fi ;;
  *)
    echo "usage: $0 kernels|depth|round|attention|attention-ncu|determinism|cmdbuf|decode-ab|mhc|side-stream|co-launch|q2k-packs|mhc-v4|attn-together|compressor|softmax|v4-state|small-tiles|v4-int8|v4" >&2
    exit 2 ;;
esac
