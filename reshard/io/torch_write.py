"""Writing torch zip checkpoints (layout in :mod:`reshard.io.torch_format`): a whole object without tensors, or a
payload whose tensors stream in one storage record at a time (``data/0``, ``data/1``, ... in write order).
"""

from __future__ import annotations

import collections
import io
from typing import Any

from reshard.io import dtypes
from reshard.io.partial import PartialFile
from reshard.io.torch_pickle import _numel, _StorageRef, _TensorRef, pickled
from reshard.io.torch_zip import ZipRecords, crc32


class TensorSlot:
    """Placeholder for a tensor in a payload to be written by :class:`TorchZipWriter`."""

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], view: tuple[int, ...] | None = None):
        self.name, self.dtype, self.shape = name, dtype, tuple(shape)
        self.view = view  # the shape the pickle records, when it differs (same bytes: CLIP's [1, 1, H] class token)


def object_archive(obj: Any) -> bytes:
    """The bytes ``torch.save(obj)`` writes, for an object without tensors (e.g. ``[None]``)."""
    buf = io.BytesIO()
    records = ZipRecords(buf)
    records.add("data.pkl", pickled(obj))
    records.add("byteorder", b"little")
    records.close()
    return buf.getvalue()


class TorchZipWriter(PartialFile):
    """Writes a torch checkpoint one storage record at a time.

    ``payload`` is the object to save with :class:`TensorSlot` placeholders; ``order`` names the slots in the
    order their data will be passed to :meth:`write`. Nothing but one tensor is ever held. Output goes to
    ``PATH.partial`` and is renamed by :meth:`finish`.
    """

    def __init__(self, path: str, payload: Any, order: list[str]):
        self._order = list(order)
        self._slots: dict[str, TensorSlot] = {}
        refs = {}

        def swap(obj):
            if isinstance(obj, TensorSlot):
                self._slots[obj.name] = obj
                return refs[obj.name]
            if isinstance(obj, collections.OrderedDict):
                return collections.OrderedDict((k, swap(v)) for k, v in obj.items())
            if isinstance(obj, dict):
                return {k: swap(v) for k, v in obj.items()}
            return obj

        def collect(obj):
            if isinstance(obj, TensorSlot):
                self._slots[obj.name] = obj
            elif isinstance(obj, dict):
                for v in obj.values():
                    collect(v)

        collect(payload)
        if sorted(self._slots) != sorted(self._order):
            raise AssertionError("payload slots and write order differ")
        for i, name in enumerate(self._order):
            slot = self._slots[name]
            refs[name] = _TensorRef(_StorageRef(str(i), slot.dtype, _numel(slot.shape)), slot.view or slot.shape)
        data = pickled(swap(payload))
        super().__init__(path)
        self._records = ZipRecords(self._file)
        self._records.add("data.pkl", data)
        self._records.add("byteorder", b"little")
        self._next = 0

    def write(self, name: str, tensor) -> None:
        """Write the next tensor (a torch tensor) as its storage record."""
        self.check_next(name, dtypes.from_torch(tensor.dtype), tuple(tensor.shape))
        self.write_bytes(name, memoryview(tensor.contiguous().reshape(-1).view(dtypes.to_torch("U8")).numpy()))

    def check_next(self, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        expected = self._order[self._next]
        slot = self._slots[expected]
        if name != expected or tuple(shape) != slot.shape or dtype != slot.dtype:
            raise AssertionError(f"writer expected {expected} {slot.dtype}{list(slot.shape)}, got {name} "
                                 f"{dtype}{list(shape)}")

    def _start_tensor(self, name: str, total: int, whole) -> None:
        """The next storage record's header: with its CRC when the data comes whole, else patched at the end."""
        expected = self._order[self._next]
        slot = self._slots[expected]
        nbytes = dtypes.itemsize(slot.dtype) * _numel(slot.shape)
        if name != expected or total != nbytes:
            raise AssertionError(f"writer expected {expected} ({nbytes} bytes), got {name} ({total} bytes)")
        self._crc = None if whole is None else crc32(whole)
        self._crc_at = self._records.record(f"data/{self._next}", nbytes, self._crc, page_phase=0)
        self._crc_blocks = 0

    def _write_part(self, data: memoryview) -> None:
        if self._crc is None:
            self._crc_blocks = crc32(data, self._crc_blocks)
        self._file.write(data)

    def _end_tensor(self) -> None:
        if self._crc is None:
            self._records.patch_crc(self._crc_at, self._crc_blocks)
        self._next += 1

    def write_ranges(self, name: str, ranges) -> None:
        """Write the next storage record by copying source byte ranges file to file; ``ranges.crc`` is its CRC-32
        (the caller read the bytes once to compute it)."""
        from reshard.io.copy_ranges import copy_into

        expected = self._order[self._next]
        slot = self._slots[expected]
        nbytes = dtypes.itemsize(slot.dtype) * _numel(slot.shape)
        if name != expected or ranges.nbytes != nbytes or ranges.crc is None:
            raise AssertionError(f"writer expected {expected} ({nbytes} bytes, with a CRC), got {name}")
        self._records.record(f"data/{self._next}", nbytes, ranges.crc, page_phase=ranges.page_phase or 0)
        copy_into(self._file, ranges, self.partial)
        self._next += 1
        self.tensor_written()

    def finish(self) -> None:
        if self._next != len(self._order):
            raise AssertionError(f"{self.path}: {len(self._order) - self._next} tensors were not written")
        self._records.close()
        self.publish()
