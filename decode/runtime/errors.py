"""One exception type for every user-facing failure: the CLI prints its message as one line, no traceback."""


class DraftsmithError(ValueError):
    """A problem the user can fix (bad name, bad file, bad setting, no space...). The message is the whole story.

    A ValueError too: a bad value given to a function (`generate`, `KPolicy`) is both."""
