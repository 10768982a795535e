"""One exception type for every user-facing failure: the CLI prints its message as one line."""


class CausalDraftError(Exception):
    """A clear, user-facing error (bad input, missing file, unsupported model)."""


class ContextOverflow(CausalDraftError):
    """A prompt that, with the tokens asked for, does not fit in the model's context."""
