"""VERIFY: acceptance rules as pure functions of tensors (no models, no state)."""

from .chain import verify_greedy, verify_sampling

__all__ = ["verify_greedy", "verify_sampling"]
