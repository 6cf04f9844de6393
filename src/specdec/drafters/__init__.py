"""Drafters: every method that proposes tokens, behind one protocol (base.py), listed in registry.py."""

from .base import DecodeContext, Drafter, DraftSession, FeatureSpec, Proposal, TargetFeatures
from .draft_model import DraftModel
from .eagle import Eagle
from .medusa import Medusa
from .none import NoDraft
from .prompt_lookup import PromptLookup

__all__ = ["DecodeContext", "DraftModel", "DraftSession", "Drafter", "Eagle", "FeatureSpec", "Medusa", "NoDraft",
           "PromptLookup", "Proposal", "TargetFeatures"]
