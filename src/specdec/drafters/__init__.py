"""Drafters: every method that proposes tokens, behind one protocol (see base.py)."""

from .base import DecodeContext, Drafter, DraftSession, Proposal
from .draft_model import DraftModel
from .none import NoDraft
from .prompt_lookup import PromptLookup

__all__ = ["DecodeContext", "DraftModel", "DraftSession", "Drafter", "NoDraft", "PromptLookup", "Proposal"]
