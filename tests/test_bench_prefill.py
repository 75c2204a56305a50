"""experiments/bench_prefill.py runs on CPU with the shipped tiny model and short prompts (the lead runs it on the
GPU box): one JSON line per run, written to --out as printed, with byte counts and rooflines that agree with their
definitions. Timings here are not speed figures.
"""

from __future__ import annotations

import json
import sys

import pytest
from serve_harness import REPO

sys.path.insert(0, str(REPO / "experiments"))
import bench_prefill as B  # noqa: E402

from jds41.prompt_pieces import prompt_pieces  # noqa: E402

MODEL = str(REPO / "checkpoints" / "tiny-deepseek41-q8.gguf")


def _check_roofline(run):
    per = run["bytes_per_token"]
    worst = max(per[k] / bw for k, bw in B.BANDWIDTH.items())
    assert run["roofline"]["tok_s_overlapped"] == pytest.approx(1 / worst, rel=1e-3)
    assert run["of_roofline"] == pytest.approx(run["tok_s"] / run["roofline"]["tok_s_overlapped"], rel=1e-2, abs=1e-4)


def test_bench_all_hbm_lines_and_agent_turn(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    runs = B.main([MODEL, "--lengths", "40", "--profiles", "all-hbm", "--chunk", "16", "--turn", "24,5",
                   "--out", str(out)])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == runs == [json.loads(line) for line in out.read_text().splitlines()]
    prefill, turn = runs
    assert prefill["kind"] == "prefill" and prefill["pieces"] == [16, 16]
    assert prefill["tokens_by_piece"] == {"layer-major": 32, "step": 8} and prefill["decode_width"] == 1
    assert prefill["bytes_per_token"]["host"] == prefill["bytes_per_token"]["ssd"] == 0  # all resident
    assert prefill["bytes_per_token"]["hbm"] > 0 and prefill["tok_s"] > 0
    _check_roofline(prefill)
    engram = prefill["engram_read"]  # one host read per piece, the first before any piece runs
    assert engram["calls"] == len(prompt_pieces(40, 1, 16, False, 0)) and engram["source"] == "MmapRowSource"
    assert 0 < engram["first_read_s"] <= engram["read_s"] < prefill["seconds"]
    assert 0 <= engram["wait_s"] < prefill["seconds"]  # the feed's waits for the read-ahead thread's rows
    assert turn["kind"] == "agent_turn" and turn["cached_tokens"] == 24 and turn["prefix_cache"]["hits"] == 1
    assert turn["ttft_cached_s"] > 0 and turn["ttft_full_s"] > 0
    # conversation_read_s is rounded to 0.1 ms
    assert turn["conversation_tok_s"] == pytest.approx(24 / turn["conversation_read_s"], rel=0.02)


@pytest.mark.slow
def test_bench_tiered_profile_moves_fewer_bytes_layer_major():
    run, wide = B.main([MODEL, "--lengths", "48", "--profiles", "lucebox", "--chunk", "16", "--turn", "",
                        "--decode-widths", "1,4"])
    per, token_major = run["bytes_per_token"], run["token_major_bytes_per_token"]
    assert 0 < per["host"] < token_major["host"]  # once per 16-token group instead of once per token
    assert 0 < per["ssd"] <= token_major["ssd"]
    assert run["tier_stats"]["tokens"] >= 48
    _check_roofline(run)
    # at width 4 the tiered prompt is read in layer-major groups of 4-row blocks: each expert once per group
    assert wide["decode_width"] == 4 and wide["tokens_by_piece"] == {"layer-major-rows": 48}
    assert 0 < wide["bytes_per_token"]["host"] < wide["token_major_bytes_per_token"]["host"]
    assert wide["bytes_per_token"]["hbm"] < run["bytes_per_token"]["hbm"]  # dense weights read once per block
    _check_roofline(wide)


@pytest.mark.slow
def test_bench_measures_the_ssd_read_ahead_on_and_off(tmp_path):
    # every expert on the SSD, one layer's worth of slots: each layer's reads evict the last, so the timed feed
    # reads again after its warm-up and the read-ahead has something to start
    profile = tmp_path / "all-ssd.json"
    profile.write_text(json.dumps({"name": "all-ssd", "tier0_bytes": 0.0, "tier1_bytes": 0.0, "slot_cache_slots": 8}))
    on, off = B.main([MODEL, "--lengths", "48", "--profiles", str(profile), "--chunk", "16", "--turn", "",
                      "--set-ahead", "on,off"])
    assert (on["ssd_set_ahead"], off["ssd_set_ahead"]) == (True, False)
    assert on["slot_cache_feed"]["set_ahead"] > 0 and off["slot_cache_feed"]["set_ahead"] == 0
    for run in (on, off):
        feed = run["slot_cache_feed"]
        assert feed["host_calls"] > 0 and feed["host_call_s"] >= feed["stall_s"] >= 0
        assert feed["host_calls"] <= run["tier_stats"]["ssd"]["slot_cache"]["host_calls"]  # the feed's share
        # the reader pool read every byte the slot cache filled over the feed, alignment padding on top
        reader = run["reader_feed"]
        assert reader["bytes"] >= feed["bytes"] > 0 and reader["chunks"] > 0 and reader["read_s"] > 0
        assert reader["gb_s_over_feed"] == pytest.approx(reader["bytes"] / run["seconds"] / 1e9, rel=0.02, abs=1e-3)
