"""slimlm: post-training compression for LLMs, with its own serving runtime."""

__version__ = "0.1.0"


class SlimlmError(Exception):
    """A problem the user can fix. The CLI prints its message as one line and exits non-zero."""
