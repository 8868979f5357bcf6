"""reshard: reshard and convert LLM checkpoints, streaming and bit-exact.

Python API::

    import reshard
    reshard.convert("llama-hf", "llama-tp8", to="megatron", tp=8)
    report = reshard.verify("llama-hf", "llama-tp8")   # report.equal
    info = reshard.inspect("llama-tp8")
"""

from reshard.errors import CheckpointError, MappingError, PlanError, ReshardError
from reshard.version import __version__


def convert(src, dst, **kwargs):
    """See :func:`reshard.conversion.convert`."""
    from reshard.conversion import convert as _convert

    return _convert(src, dst, **kwargs)


def verify(a, b, **kwargs):
    """See :func:`reshard.verification.digest.verify`."""
    from reshard.verification.digest import verify as _verify

    return _verify(a, b, **kwargs)


def inspect(path, **kwargs):
    """See :func:`reshard.inspection.inspect`."""
    from reshard.inspection import inspect as _inspect

    return _inspect(path, **kwargs)


__all__ = ["convert", "verify", "inspect", "ReshardError", "PlanError", "CheckpointError", "MappingError",
           "__version__"]
