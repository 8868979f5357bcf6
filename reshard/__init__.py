"""reshard: reshard and convert LLM checkpoints, streaming and bit-exact.

Python API::

    import reshard
    reshard.convert("llama-hf", "llama-tp8", to="megatron", tp=8)
    report = reshard.verify("llama-hf", "llama-tp8")   # report.equal
    info = reshard.inspect("llama-tp8")
    weights = reshard.load_rank("llama-tp8", to="vllm", tp=4, rank=3)  # rank 3's tensors, nothing written
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


def load_rank(src, to="vllm", **kwargs):
    """See :func:`reshard.rank_view.load_rank`."""
    from reshard.rank_view import load_rank as _load_rank

    return _load_rank(src, to, **kwargs)


__all__ = ["convert", "verify", "inspect", "load_rank", "ReshardError", "PlanError", "CheckpointError", "MappingError",
           "__version__"]
