"""The exceptions shardcheck raises on purpose.

Everything that is the user's input being wrong derives from :class:`BadInput`; the CLI turns
it into one line on stderr and exit status 2.
"""


class ShardcheckError(Exception):
    """Base of every error shardcheck raises on purpose."""


class BadInput(ShardcheckError, ValueError):
    """The user's input (a scenario, a suite, a target, an option) cannot be used."""


class WorldError(ShardcheckError, RuntimeError):
    """The world of rank processes could not be started or was lost."""
