"""A tiny V4.1 GGUF file with ds4's two-bit experts (IQ2_XXS gate/up, Q2_K down), the shape the int8 numerics and
the two-bit kernels are tested on."""

from __future__ import annotations

import dataclasses


def two_bit_model(tmp_path, **preset_args) -> str:
    """Write it under `tmp_path` (rows of 256 values, so no Q8_0 fallback) and return its path; `preset_args` go to
    the tiny preset (e.g. draft_stages=2)."""
    from jds41.checkpoints import synth
    from jds41.checkpoints.presets import preset

    path = tmp_path / "two-bit.gguf"
    cfg = dataclasses.replace(preset("deepseek41", "tiny", **preset_args), dim=256, expert_ff=256)
    assert not synth.write_synthetic(path, cfg, "ds4-q2", progress=False)["fallback_q8_0"]
    return str(path)
