"""What reshard shows people (issue 31): byte progress bars in binary units, ``reshard --version``, ``inspect``'s
table (``--json`` for machines), and the retry command a failed ``push`` names."""

from __future__ import annotations

import io
import re

from reshard.progress import binary_size, byte_bar


def test_byte_bar_counts_in_binary_units():
    out = io.StringIO()
    with byte_bar(3 * 2**30, "converting", disable=False, file=out, mininterval=0) as bar:
        bar.update(5 * 2**20)
    text = out.getvalue()
    assert "5.00M/3.00G" in text and re.search(r"[\d.]+[KMGT]iB/s", text), text
    assert not re.search(r"\d[KMGT]B/s", text), text  # tqdm's "MB" for MiB: gone
    assert byte_bar(1, "x", disable=True).disable


def test_binary_size():
    assert [binary_size(n) for n in (12, 1536, 5 * 2**20, 3 * 2**30 // 2)] == ["12 B", "1.5 KiB", "5.0 MiB", "1.5 GiB"]


def test_every_byte_bar_is_made_by_byte_bar():
    import pathlib

    import reshard

    root = pathlib.Path(reshard.__file__).parent
    makers = [str(p.relative_to(root)) for p in root.rglob("*.py") if "tqdm(" in p.read_text()]
    assert makers == ["progress.py"]
