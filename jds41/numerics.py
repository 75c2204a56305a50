"""The engine's activation numerics by name (`Engine.open(numerics=...)`, the CLIs' --numerics) -> QTensor.act_round.

A module of its own, importing nothing, so the server's command line can name the choices before it loads anything.

- "jds41" (default): every product reads the f32 activation as is.
- "llamacpp": products round the activation as llama.cpp's CPU backend does (Q8_0 blocks for Q8_0/MXFP4 weights, F16
  for F16), to compare against it tightly (tests/test_model_vs_llamacpp.py).
- "int8": the two-bit formats' products (IQ2_XXS, Q2_K) read the activation rounded to int8 blocks of 32, as
  llama.cpp's CUDA backend does, so the GPU computes them as integer dot products (quant/int8_act.py): faster, not
  the same bits; its fidelity is measured in experiments/README.md.
"""

NUMERICS = {"jds41": None, "llamacpp": "ggml-cpu", "int8": "int8"}
