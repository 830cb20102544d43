"""Errors every layer may raise for a user to read."""


class UsageError(Exception):
    """A command line or configuration that cannot run as given: the message says what to
    change. The entry point prints it without a traceback."""
