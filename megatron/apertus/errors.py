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


def out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` or one of its causes is an allocation that failed: Python's and numpy's
    ``MemoryError``, torch's CPU allocator refusing (a ``RuntimeError``) or its
    ``OutOfMemoryError``. Sizes the user asked for caused it, and the caller names their flags;
    megatron-core's builders wrap the allocation's error in their own."""
    while err is not None:
        if isinstance(err, MemoryError):
            return True
        if isinstance(err, RuntimeError) and (
            "can't allocate memory" in str(err) or type(err).__name__ == "OutOfMemoryError"
        ):
            return True
        err = err.__cause__ or err.__context__
    return False
