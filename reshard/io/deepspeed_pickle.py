"""Inert stand-ins for the DeepSpeed classes a ZeRO checkpoint pickles, for :func:`reshard.io.torch_format.load_structure`.

DeepSpeed 0.19's ``*_optim_states.pt`` name exactly these globals (besides torch's and ``collections``'):

- ``deepspeed.runtime.zero.config.ZeroStageEnum``: an ``int`` enum pickled as ``ZeroStageEnum(2)``; read as the int.
- ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` / ``DynamicLossScaler``: objects whose state is ignored.
- ``deepspeed.utils.tensor_fragment.fragment_address``: a dataclass ``(numel, start)``; both kept as ints.

Nothing here runs code from the file: a stand-in is built with ``object.__new__`` and its pickled state is
either dropped or checked to be two ints. Every other global stays refused by torch's ``weights_only``
unpickler (and reported by name).
"""

from __future__ import annotations

from reshard.errors import CheckpointError


def zero_stage(value) -> int:
    """``ZeroStageEnum(value)`` read as its int (0..3)."""
    if type(value) is not int or not 0 <= value <= 3:
        raise CheckpointError(f"ZeroStageEnum({value!r}) is not a ZeRO stage (0..3)")
    return value


class IgnoredLossScaler:
    """A pickled ``LossScaler`` / ``DynamicLossScaler``: its state (scale, window, ...) is not needed and dropped."""

    def __setstate__(self, state) -> None:
        pass

    def __repr__(self) -> str:
        return "IgnoredLossScaler()"


class FragmentAddress:
    """A pickled ``fragment_address``: where a parameter's piece lies inside one rank's flat fp32 partition."""

    numel: int
    start: int

    def __setstate__(self, state) -> None:
        if isinstance(state, tuple) and len(state) == 2 and state[1] is None:  # (dict, slots) form
            state = state[0]
        numel = state.get("numel") if isinstance(state, dict) else None
        start = state.get("start") if isinstance(state, dict) else None
        if type(numel) is not int or type(start) is not int:
            raise CheckpointError(f"a fragment_address holds {state!r}, not two ints (numel, start)")
        self.numel, self.start = numel, start

    def __repr__(self) -> str:
        return f"FragmentAddress(numel={self.numel}, start={self.start})"


#: The (stand-in, DeepSpeed's global name) pairs passed to ``load_structure(extra_globals=...)``.
DEEPSPEED_GLOBALS = (
    (zero_stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (IgnoredLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (IgnoredLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
)
