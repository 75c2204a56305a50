"""Compiled parts of the engine, built on first use from their C++ source (engram_ffi: the Engram host call)."""
