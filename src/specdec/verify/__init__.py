"""VERIFY: acceptance rules as pure functions of tensors (no models, no state)."""

from specdec.verify.chain import verify_greedy, verify_sampling
from specdec.verify.tree import accepted_path, ancestor_mask, check_tree, depths, verify_tree_greedy, verify_tree_sampling

__all__ = ["verify_greedy", "verify_sampling", "verify_tree_greedy", "verify_tree_sampling", "ancestor_mask",
           "depths", "accepted_path", "check_tree"]
