"""One exception type for every user-facing failure: the CLI prints its message as one line."""


class CausalDraftError(Exception):
    """A clear, user-facing error (bad input, missing file, unsupported model)."""
