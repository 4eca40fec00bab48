"""One exception type for every user-facing error, so the CLI can print one clear line and exit non-zero."""


class ATSError(ValueError):
    """Bad input or a mismatch the user can fix; the message names the file, line or field and the bad value."""
