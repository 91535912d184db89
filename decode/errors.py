"""One exception type for every user-facing failure: the CLI prints its message as one line, no traceback."""


class DraftsmithError(Exception):
    """A problem the user can fix (bad name, bad file, no space...). The message is the whole story."""
