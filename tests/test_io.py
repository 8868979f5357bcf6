"""Readers and streaming writers against the reference libraries (torch.load, safetensors, zipfile)."""

from __future__ import annotations

import argparse
import collections
import zipfile

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reshard.io import tensorfile
from reshard.io.safetensors_format import SafetensorsFile, SafetensorsWriter
from reshard.io.torch_format import TensorSlot, TorchFile, TorchZipWriter


def coded(shape, dtype=torch.float32):
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape).to(dtype)


def test_torch_zip_writer_matches_torch_load(tmp_path):
    tensors = {"a": coded((7, 5)), "b": coded((3,), torch.bfloat16), "c": coded((2, 3, 4), torch.float16),
               "empty": coded((0, 4))}
    payload = {"args": argparse.Namespace(x=1, params_dtype=torch.bfloat16), "checkpoint_version": 3.0,
               "model": collections.OrderedDict((k, TensorSlot(k, "", ())) for k in tensors)}
    payload["model"]["a._extra_state"] = None
    order = ["c", "a", "empty", "b"]
    for name in order:
        from reshard.io.dtypes import from_torch

        slot = payload["model"][name]
        slot.dtype, slot.shape = from_torch(tensors[name].dtype), tuple(tensors[name].shape)
    path = str(tmp_path / "f.pt")
    writer = TorchZipWriter(path, payload, order)
    assert not (tmp_path / "f.pt").exists()  # only the .partial exists until finish
    for name in order:
        writer.write(name, tensors[name])
    writer.finish()
    assert zipfile.ZipFile(path).testzip() is None  # CRCs are right
    for mmap in (False, True):
        with torch.serialization.safe_globals([argparse.Namespace]):
            loaded = torch.load(path, weights_only=True, mmap=mmap)
        assert loaded["args"].x == 1 and loaded["model"]["a._extra_state"] is None
        assert all(torch.equal(loaded["model"][k], v) and loaded["model"][k].dtype == v.dtype
                   for k, v in tensors.items())
    import struct

    raw = open(path, "rb").read()
    with zipfile.ZipFile(path) as z:  # storage records are 64-byte aligned like torch's own writer
        for info in z.infolist():
            if "/data/" in info.filename:
                name_len, extra_len = struct.unpack("<HH", raw[info.header_offset + 26:info.header_offset + 30])
                assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0


def test_safetensors_writer_matches_library(tmp_path):
    tensors = {"x": coded((4, 6)), "y": coded((5,), torch.bfloat16)}
    path = str(tmp_path / "m.safetensors")
    w = SafetensorsWriter(path, [(k, "F32" if v.dtype == torch.float32 else "BF16", tuple(v.shape))
                                 for k, v in tensors.items()])
    for k, v in tensors.items():
        w.write(k, v)
    w.finish()
    with safe_open(path, "pt") as f:
        assert all(torch.equal(f.get_tensor(k), v) for k, v in tensors.items())


@pytest.mark.parametrize("wide", [False, True])
def test_column_and_row_reads(tmp_path, monkeypatch, wide):
    t = coded((37, 1024 if wide else 24))
    save_file({"t": t, "v": coded((9,))}, str(tmp_path / "s.safetensors"))
    if wide:  # force the one-read-per-row path for narrow slices of wide rows
        monkeypatch.setattr(tensorfile, "_BLOCK_BYTES", 64)
    f = SafetensorsFile(str(tmp_path / "s.safetensors"))
    assert torch.equal(f.read("t", 1, 5, 7), t[:, 5:12])
    assert torch.equal(f.read("t", 0, 3, 10), t[3:13])
    assert torch.equal(f.read("v", 0, 2, 3), coded((9,))[2:5])


def test_non_contiguous_torch_tensors(tmp_path):
    base = coded((6, 8))
    torch.save({"view": base[:, 2:5], "t": base.t()}, tmp_path / "v.pt")
    f = TorchFile(str(tmp_path / "v.pt"))
    assert torch.equal(f.read("view"), base[:, 2:5])
    assert torch.equal(f.read("t", 1, 1, 3), base.t()[:, 1:4])
