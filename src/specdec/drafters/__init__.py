"""Drafters: every method that proposes tokens, behind one protocol (base.py), listed in registry.py."""

from specdec.drafters.base import DecodeContext, Drafter, DraftSession, FeatureSpec, Proposal, TargetFeatures
from specdec.drafters.dflash import DFlash
from specdec.drafters.draft_model import DraftModel
from specdec.drafters.dspark import DSpark
from specdec.drafters.eagle import Eagle
from specdec.drafters.early_exit import EarlyExit
from specdec.drafters.lookahead import Lookahead
from specdec.drafters.medusa import Medusa
from specdec.drafters.mtp import MTP
from specdec.drafters.none import NoDraft
from specdec.drafters.prompt_lookup import PromptLookup
from specdec.drafters.retrieval import Datastore, Retrieval

__all__ = ["DFlash", "DSpark", "DecodeContext", "DraftModel", "DraftSession", "Drafter", "Eagle", "EarlyExit", "FeatureSpec", "Lookahead", "MTP",
           "Datastore", "Medusa", "NoDraft", "PromptLookup", "Proposal", "Retrieval", "TargetFeatures"]
