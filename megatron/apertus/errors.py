"""Errors shared by every layer of the package: the bottom of the layering, importing nothing.

:class:`ConfigError` is what an entry point turns into one line and exit code 2; every layer
raises it, so it lives below all of them and importing it pulls in no model, data or torch.
"""


class ConfigError(ValueError):
    """A configuration or input that cannot work; the message names the flag, file or line."""


class ReplicasDiverged(ConfigError):
    """Ranks that must hold identical weights (data-parallel replicas) hold different ones: silent
    data corruption on some device or link. Not the user's input, but a run that must stop the
    same way (one line, exit 2) rather than train on; the message names the iterations and
    ranks."""
