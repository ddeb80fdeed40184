"""The one exception root of specrun. Messages carry the numbers and the fix."""


class SpecrunError(Exception):
    """Any error a user can act on; the CLI prints it as one line and exits 1."""


class GGUFError(SpecrunError):
    """A file that is missing, unreadable, not GGUF, truncated or nonsensical."""


class ModelNotAvailable(SpecrunError):
    """A registry name whose package is not installed."""


class IncompatibleDraft(SpecrunError):
    """A draft model that cannot draft for the target (vocabulary mismatch)."""
