"""Reading torch zip checkpoints (``torch.save`` since 1.6: ``<prefix>/data.pkl`` plus one ``data/<key>`` record
per storage) safely, tensors on the meta device.

``torch.load(weights_only=True, map_location="meta")`` with reshard's explicit allow-list gives the structure and,
per storage, its byte offset in the file; data is then read with positioned reads (see
:mod:`reshard.io.tensorfile`). Nothing outside the allow-list is unpickled; a refused or unreadable file is a
one-line :class:`~reshard.errors.CheckpointError`.
"""

from __future__ import annotations

import argparse
import errno
import gc
import io
import pickle
import re
import zipfile
from typing import Any

from reshard.errors import CheckpointError
from reshard.io import dtypes
from reshard.io.regular import check_regular
from reshard.io.tensorfile import TensorFile, TensorLocation


class MegatronEnum:
    """Stand-in for a Megatron enum member found in a checkpoint (``args``, rerun state): keeps its value."""

    def __init__(self, value=None):
        self.value = value

    def __repr__(self):
        return f"MegatronEnum({self.value!r})"


_MEGATRON_ENUMS = (
    "megatron.core.enums.ModelType",
    "megatron.core.transformer.enums.AttnBackend",
    "megatron.core.transformer.enums.AttnMaskType",
    "megatron.core.transformer.enums.AttnType",
    "megatron.core.transformer.enums.LayerType",
    "megatron.core.transformer.enums.ModelType",
    "megatron.core.rerun_state_machine.RerunMode",
    "megatron.core.rerun_state_machine.RerunState",
    "megatron.core.rerun_state_machine.RerunDiagnostic",
)


def _numpy_globals() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    items: list = [
        (core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct"),
        (core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct"),
        np.ndarray,
        np.dtype,
    ]
    if hasattr(core.multiarray, "scalar"):
        items += [(core.multiarray.scalar, "numpy.core.multiarray.scalar"),
                  (core.multiarray.scalar, "numpy._core.multiarray.scalar")]
    dtype_classes = getattr(np, "dtypes", None)
    if dtype_classes is not None:
        for name in dir(dtype_classes):
            obj = getattr(dtype_classes, name)
            if isinstance(obj, type) and issubclass(obj, np.dtype):
                items.append((obj, f"numpy.dtypes.{name}"))
    return items


def allowed_globals() -> list:
    """Everything a Megatron-Core / Megatron-LM or HF ``.bin`` checkpoint may name besides tensors.

    ``argparse.Namespace`` (the run's args), numpy's array/dtype reconstruction (numpy RNG state),
    ``io.BytesIO`` (Transformer Engine ``_extra_state``), ``bytes`` (protocol-2 pickles of byte strings), and
    stand-ins for Megatron enums. Nothing else.
    """
    return ([argparse.Namespace, (io.BytesIO, "_io.BytesIO"), (io.BytesIO, "io.BytesIO"), bytes]
            + _numpy_globals() + [(MegatronEnum, name) for name in _MEGATRON_ENUMS])


_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+)")


def load_structure(path: str, extra_globals: tuple = ()) -> Any:
    """Unpickle a torch zip checkpoint with ``torch.load(weights_only=True)`` and reshard's allow-list, every
    tensor on the meta device (no tensor bytes are read; each storage keeps its ``_checkpoint_offset``).
    ``extra_globals``: more ``(stand-in, "module.Name")`` pairs a layout allows for its own files (DeepSpeed's).

    This is the only unpickling reshard does: a hand-written restricted unpickler would skip torch's import
    (seconds) but is exactly the kind of code that must not be trusted with a stranger's pickle."""
    check_regular(path)
    try:
        return _torch_load_meta(path, extra_globals)
    except (zipfile.BadZipFile, EOFError, ValueError) as exc:
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({exc})") from None


def _refuse(path: str, exc: Exception):
    found = _UNSUPPORTED.search(str(exc))
    what = f"global '{found.group(1)}'" if found else str(exc).splitlines()[0]
    raise CheckpointError(f"{path}: refusing to unpickle {what}: not on reshard's allow-list "
                          "(reshard never runs code from a checkpoint)") from None


def _import_torch():
    """``import torch`` with the cyclic garbage collector paused: the import allocates about a million objects
    and would otherwise trigger hundreds of collections (a fifth of its time)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        import torch
    finally:
        if enabled:
            gc.enable()
    return torch


def _torch_load_meta(path: str, extra_globals: tuple = ()) -> Any:
    torch = _import_torch()

    try:
        with torch.serialization.safe_globals(allowed_globals() + list(extra_globals)):
            return torch.load(path, map_location="meta", weights_only=True)
    except pickle.UnpicklingError as exc:
        _refuse(path, exc)
    except OSError as exc:
        if exc.errno != errno.EINVAL or exc.filename:  # a real OS error (ELOOP, EACCES, EIO): exit 3 as for any
            raise
        _unreadable(path, "torch's zip reader cannot parse it")  # its bare EINVAL for a truncated archive
    except EOFError:
        _unreadable(path, "it ends early")
    except Exception as exc:  # noqa: BLE001  a truncated zip, a corrupt pickle stream, a bad storage record...
        line = (str(exc).splitlines() or [""])[0]
        _unreadable(path, re.split(r"(?<=[.!?])\s", line, maxsplit=1)[0].rstrip(".") or type(exc).__name__)


def _unreadable(path: str, reason: str):
    """Refuse ``path`` as an unreadable archive in one whole sentence: the reason (whole words) and the fix."""
    if len(reason) > 160:
        reason = reason[:160].rsplit(" ", 1)[0] + " ..."
    raise CheckpointError(f"{path}: not a readable torch checkpoint ({reason}): the file is truncated or corrupt; "
                          "copy it again from where it was saved, or save it again") from None


def _location(t, path: str, name: str) -> TensorLocation:
    storage = t.untyped_storage()
    base = getattr(storage, "_checkpoint_offset", None)
    if base is None:
        raise CheckpointError(f"{path}: cannot locate the bytes of '{name}' (needs torch >= 2.5 and a zip-format file)")
    size = t.element_size()
    dtype = dtypes.from_torch(t.dtype)
    offset = base + t.storage_offset() * size
    contiguous = t.is_contiguous()
    return TensorLocation(dtype=dtype, shape=tuple(t.shape), offset=offset,
                          strides=None if contiguous else tuple(t.stride()))


def flatten_tensors(obj: Any, path: str, prefix: str = "") -> dict[str, TensorLocation]:
    """Locations of every tensor inside nested dicts, named ``key/subkey/...``."""
    out: dict[str, TensorLocation] = {}
    if type(obj).__module__.startswith("torch") and hasattr(obj, "untyped_storage"):
        out[prefix] = _location(obj, path, prefix)
    elif isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten_tensors(value, path, f"{prefix}/{key}" if prefix else str(key)))
    return out


class TorchFile(TensorFile):
    """A torch zip checkpoint indexed lazily; ``structure`` is the unpickled object (meta tensors)."""

    format = "torch"

    def __init__(self, path: str):
        self.structure = load_structure(path)
        super().__init__(path, flatten_tensors(self.structure, path))
