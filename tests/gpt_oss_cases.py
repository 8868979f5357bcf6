"""The tiny gpt-oss checkpoint (tests/test_family_gpt_oss.py's ``save_gpt_oss``) saved once per test session under
pytest's base temp folder, shared by the gpt-oss live and expert-TP tests."""

from __future__ import annotations

import os

from test_family_gpt_oss import save_gpt_oss


def tiny_gpt_oss(tmp_path_factory) -> str:
    """The folder of the session's tiny gpt-oss (saved on first use)."""
    folder = tmp_path_factory.getbasetemp() / "gpt_oss_tiny"
    if not os.path.exists(folder / "config.json"):
        save_gpt_oss(folder)
    return str(folder)
