"""One exception type for every user-facing error, so the CLI can print one clear line and exit non-zero."""


class ATSError(ValueError):
    """Bad input or a mismatch the user can fix; the message names the file, line or field and the bad value."""


class OptionError(Exception):
    """A command-line value that fails its option's checks while argparse parses it (`ats.config.OptionType`); the
    CLI prints it as it prints an `ATSError`. Not a ValueError: argparse would replace the message by its own
    "invalid float value"."""
