"""Property tests: corrupted safetensors headers and bodies fed to reshard's reader.

Every case must end in reshard's own error (ReshardError) or, when the reader accepts the file, the reference
``safetensors`` library must accept it too and return the same bytes for every tensor. Never another exception
type, never a hang (an alarm turns one into a failure), never a silent success the reference would refuse.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import struct
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save

from reshard.errors import ReshardError
from reshard.io.safetensors_format import SafetensorsFile

SETTINGS = settings(max_examples=200, deadline=2000, suppress_health_check=[HealthCheck.too_slow])


def _base() -> bytes:
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.arange(5, dtype=torch.float64).to(torch.bfloat16),
        "c": torch.arange(8, dtype=torch.float64).reshape(2, 2, 2).to(torch.float16),
        "d": torch.tensor([True, False, True]),
        "e": torch.empty(0, 3, dtype=torch.int32),
        "s": torch.tensor(7, dtype=torch.int64),
    }
    return save(tensors, metadata={"format": "pt"})


BASE = _base()
BASE_LEN = struct.unpack("<Q", BASE[:8])[0]
BASE_HEADER = json.loads(BASE[8:8 + BASE_LEN])
BODY = BASE[8 + BASE_LEN:]
NAMES = [n for n in BASE_HEADER if n != "__metadata__"]
WORK = tempfile.mkdtemp(prefix="reshard-fuzz-")
atexit.register(shutil.rmtree, WORK, ignore_errors=True)  # made at import: removed whichever tests ran


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang("the reader did not return within 10 s")


def check_reader(data: bytes) -> str:
    """Feed ``data`` to the reader; 'refused' (ReshardError) or 'accepted' (then equal to the reference)."""
    path = os.path.join(WORK, "x.safetensors")
    with open(path, "wb") as f:
        f.write(data)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, 10)
    try:
        reader = SafetensorsFile(path)
        with reader:
            got = {name: reader.read(name) for name in reader.tensors}
            for name, loc in reader.tensors.items():
                if len(loc.shape) >= 2 and loc.shape[1] > 1:  # a column slice, the other read path
                    assert torch.equal(reader.read(name, 1, 1, loc.shape[1] - 1).view(torch.uint8),
                                       got[name][:, 1:].contiguous().view(torch.uint8))
    except ReshardError as exc:
        assert str(exc) and "\n" not in str(exc)
        return "refused"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    try:
        with safe_open(path, "pt") as ref:
            assert sorted(ref.keys()) == sorted(got)
            for name, tensor in got.items():
                expected = ref.get_tensor(name)
                assert expected.dtype == tensor.dtype and expected.shape == tensor.shape
                assert torch.equal(expected.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"reshard accepted a file the reference library refuses or reads differently: {exc!r}")
    return "accepted"


def encode(header, body: bytes = BODY, length: int | None = None, pad: bool = True) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw) if length is None else length) + raw + body


def test_unmodified_file_is_read_exactly():
    assert check_reader(BASE) == "accepted"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
sizes = st.integers(-3, 10) | st.integers(2**31, 2**66) | st.just(0)
dtype_names = st.sampled_from(["F32", "F16", "BF16", "F64", "I8", "U8", "BOOL", "I64", "I32", "U16", "F8_E8M0",
                               "f32", "", "FLOAT"]) | st.text(max_size=5)
field_values = {
    "dtype": dtype_names | json_values,
    "shape": st.lists(sizes, max_size=4) | json_values,
    "data_offsets": st.lists(st.integers(-8, len(BODY) + 8) | sizes, min_size=0, max_size=3) | json_values,
}


@st.composite
def mutated_header(draw):
    header = json.loads(json.dumps(BASE_HEADER))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["field", "drop_field", "entry", "drop_entry", "add_entry", "metadata"]))
        name = draw(st.sampled_from(NAMES))
        if action == "field":
            key = draw(st.sampled_from(sorted(field_values)))
            if isinstance(header.get(name), dict):
                header[name][key] = draw(field_values[key])
        elif action == "drop_field" and isinstance(header.get(name), dict):
            header[name].pop(draw(st.sampled_from(sorted(field_values))), None)
        elif action == "entry":
            header[name] = draw(json_values)
        elif action == "drop_entry":
            header.pop(name, None)
        elif action == "add_entry":
            header[draw(st.text(max_size=6))] = {k: draw(v) for k, v in field_values.items()}
        else:
            header["__metadata__"] = draw(json_values)
    return header


@SETTINGS
@given(header=mutated_header(), length_delta=st.sampled_from([0, 0, 0, -1, 1, 8, -8, 2**40]))
def test_mutated_header_fields(header, length_delta):
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    check_reader(encode(raw, length=max(0, len(raw) + length_delta), pad=False))


@SETTINGS
@given(header=json_values | st.binary(max_size=40).map(lambda b: b"{" + b))
def test_arbitrary_header_json(header):
    check_reader(encode(header if isinstance(header, bytes) else json.dumps(header).encode()))


@SETTINGS
@given(flips=st.lists(st.tuples(st.integers(0, len(BASE) - 1), st.integers(0, 255)), max_size=6),
       cut=st.none() | st.integers(0, len(BASE)), tail=st.binary(max_size=16),
       length=st.none() | st.integers(0, 2**64 - 1))
def test_corrupted_bytes(flips, cut, tail, length):
    data = bytearray(BASE)
    for pos, value in flips:
        data[pos] = value
    if length is not None:
        data[:8] = struct.pack("<Q", length)
    if cut is not None:
        del data[cut:]
    data += tail
    check_reader(bytes(data))


CORRUPTIONS = [
    (encode(BASE_HEADER)[:5], "truncated"),
    (encode(BASE_HEADER, length=10**7), "runs past the end"),
    (encode(b"{not json}"), "invalid safetensors header JSON"),
    (encode({**BASE_HEADER, "a": {**BASE_HEADER["a"], "dtype": "F7"}}), "unknown dtype 'F7'"),
    (encode({**BASE_HEADER, "a": {**BASE_HEADER["a"], "data_offsets": [0, 10**6]}}), "outside the data"),
    (encode({**BASE_HEADER, "b": {**BASE_HEADER["b"], "data_offsets": [0, 10]}}), "overlap"),
    (encode({**BASE_HEADER, "a": {**BASE_HEADER["a"], "shape": [4, 4]}}), "needs 64 bytes"),
    (encode(BASE_HEADER, body=BODY[:-1]), "outside the data"),
    (encode(BASE_HEADER, body=BODY + b"\0" * 8), "belong to no tensor"),
    (encode(json.dumps(BASE_HEADER)[:-1].encode() + b', "a": {}}'), "names 'a' twice"),
]


@pytest.mark.parametrize("case, message", CORRUPTIONS, ids=[m for _, m in CORRUPTIONS])
def test_each_corruption_has_its_own_message(case, message):
    path = os.path.join(WORK, "y.safetensors")
    with open(path, "wb") as f:
        f.write(case)
    with pytest.raises(ReshardError, match=message) as info:
        SafetensorsFile(path)
    assert path in str(info.value)
