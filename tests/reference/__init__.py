"""Float64 numpy reference of the deepseek4 / deepseek41 forward pass, used only by tests as an oracle.

Imported as `reference` (pytest puts tests/ on sys.path; tests/ has no __init__.py). See numpy_deepseek.py.
"""

from .numpy_deepseek import forward

__all__ = ["forward"]
