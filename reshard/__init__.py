"""reshard: reshard and convert LLM checkpoints, streaming and bit-exact.

Python API::

    import reshard
    print(reshard.plan("llama-hf", to="megatron", tp=8).describe())  # what convert would write; nothing read
    reshard.convert("llama-hf", "llama-tp8", to="megatron", tp=8)
    report = reshard.verify("llama-hf", "llama-tp8")   # report.equal, report.report (the --json dict)
    report = reshard.verify("llama-hf", "llama-tp8", forward=True)   # the same surface
    info = reshard.inspect("llama-tp8")
    weights = reshard.load_rank("llama-tp8", to="vllm", tp=4, rank=3)  # rank 3's tensors, nothing written
"""

from reshard.api import convert, inspect, plan, verify  # typed: the command line's options by name
from reshard.errors import CheckpointError, MappingError, PlanError, ReshardError
from reshard.rank_view import load_rank
from reshard.version import __version__

__all__ = ["convert", "plan", "verify", "inspect", "load_rank", "ReshardError", "PlanError", "CheckpointError",
           "MappingError", "__version__"]
