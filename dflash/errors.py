"""The one exception type the CLI turns into a one-line error and a non-zero exit."""


class DflashError(Exception):
    """A user-facing error: bad input, a mismatched cache, a missing file. Its message is one line
    that names the file, row or option at fault."""
