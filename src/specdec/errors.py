"""Exceptions for input the user can fix, and warnings; the CLI prints them as one line."""


class SpecdecError(Exception):
    """Base class of every error caused by bad input or an unusable model."""


class ModelLoadError(SpecdecError):
    """A model directory is missing, incomplete or not a causal LM."""


class VocabularyMismatchError(SpecdecError):
    """A drafter and its target do not share a vocabulary."""


class InvalidArgumentError(SpecdecError, ValueError):
    """A generation argument is out of its valid range."""


class ContextLengthError(SpecdecError):
    """Prompt plus requested tokens exceed the model's context window."""


class CacheRollbackError(SpecdecError):
    """The model's KV cache cannot be rolled back, so speculation would be unsafe."""


class PromptFileError(SpecdecError):
    """A prompts file is missing or has a malformed line."""


class UnsupportedModelError(CacheRollbackError):
    """The model keeps state or masks attention in a way speculative rollback cannot reproduce."""


class DrafterMismatchError(SpecdecError):
    """A trained drafter does not fit the target, or a folder holds another method's drafter."""


class SpecdecWarning(UserWarning):
    """Base of specdec's warnings; the CLI prints them as one line."""


class TargetMismatchWarning(SpecdecWarning):
    """A drafter trained for another target of the same shapes: it runs, but acceptance may be low."""


class NumericsWarning(SpecdecWarning):
    """The target's numerics depend on the block shape, so speculative output may differ from plain decoding."""
