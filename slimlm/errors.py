"""The one exception type every layer raises for a problem the user can fix."""


class SlimlmError(Exception):
    """A problem the user can fix. The CLI prints its message as one line and exits non-zero."""
