"""Where a Megatron checkpoint's parts are (both formats, torch and torch_dist): the iteration folder of a root or
of an iteration folder named directly, the tracker's label, and the folders whose side files (tokenizer,
config.json) belong to the checkpoint, which may also give its true vocab size."""

from __future__ import annotations

import json
import os
import re

from reshard.errors import CheckpointError
from reshard.io.regular import open_regular
from reshard.layouts.base import Options

TRACKER = "latest_checkpointed_iteration.txt"
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
_REMOTE_RANK_FILE = re.compile(r"^(iter_\d{7}|release)/mp_rank_\d{2}(_\d{3})?/model_optim_rng\.pt$")


def _label(folder_name: str) -> str:
    """'iter_0000100' -> '100'; 'release' (or anything else) -> 'release'."""
    digits = folder_name.removeprefix("iter_")
    return str(int(digits)) if folder_name.startswith("iter_") and digits.isdigit() else "release"


def iteration_folder_name(label: str) -> str | None:
    """The folder of an iteration label (a tracker's text): 'release' or 'iter_%07d'; None for anything else."""
    label = label.strip()
    return "release" if label == "release" else f"iter_{int(label):07d}" if label.isdigit() else None


def _iteration_dir(path: str) -> tuple[str, str]:
    """The folder holding rank folders, and the iteration label (a number or 'release')."""
    if any(_RANK_DIR.match(n) for n in os.listdir(path)):
        base = os.path.basename(os.path.normpath(path))
        return path, _label(base)
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open_regular(tracker) as f:
            label = f.read().strip()
        sub = iteration_folder_name(label)
        if sub is None:
            raise CheckpointError(f"{tracker} holds '{label}', not an iteration number or 'release'")
        folder = os.path.join(path, sub)
        if not os.path.isdir(folder):
            raise CheckpointError(f"{tracker} points at {sub}, which does not exist")
        return folder, label
    candidates = sorted(n for n in os.listdir(path) if n.startswith("iter_") or n == "release")
    if len(candidates) == 1:
        return os.path.join(path, candidates[0]), _label(candidates[0])
    raise CheckpointError(f"{path} has no {TRACKER} and {len(candidates)} iteration folders; "
                          "pass the iteration folder itself")


def iteration_folder(tracker_text: str | None, names) -> str | None:
    """The iteration folder of a repo listing to download: the tracker's, else the only one present."""
    if tracker_text is not None:
        return iteration_folder_name(tracker_text)
    folders = sorted({p.split("/")[0] for p in names if _REMOTE_RANK_FILE.match(p)})
    return folders[0] if len(folders) == 1 else None


def side_folders(path: str, iter_dir: str) -> list[str]:
    """Where the side files (tokenizer, config.json) of the checkpoint the user named as ``path`` are: ``path``
    itself; for an iteration folder named directly, also its parent, but only where that is the Megatron root
    whose tracker names this iteration (else the parent's files belong to something else)."""
    if os.path.normpath(path) != os.path.normpath(iter_dir):
        return [path]
    parent = os.path.dirname(os.path.abspath(iter_dir))
    try:
        with open_regular(os.path.join(parent, TRACKER)) as f:
            label = f.read(64).strip()
    except (OSError, UnicodeDecodeError, CheckpointError):
        return [path]
    return [path, parent] if iteration_folder_name(label) == os.path.basename(os.path.abspath(iter_dir)) else [path]


_checkpoint_root = side_folders  # the forward verifier's name for it


def true_vocab_size(args, opts: Options, folders: str | list[str]) -> int:
    """The unpadded vocab: the recorded HF config's or ``args.vocab_size`` (``--vocab-size`` must then agree),
    else ``--vocab-size``, config.json or tokenizer.json in ``folders`` (:func:`side_folders`)."""
    hf_config = getattr(args, "hf_config", None)
    recorded = None
    if isinstance(hf_config, dict) and hf_config.get("vocab_size"):
        recorded = int(hf_config["vocab_size"])
    elif isinstance(getattr(args, "vocab_size", None), int):
        recorded = args.vocab_size
    if recorded is not None:
        if opts.vocab_size and int(opts.vocab_size) != recorded:
            raise CheckpointError(f"--vocab-size {opts.vocab_size} disagrees with the vocab size {recorded} the "
                                  f"checkpoint records ({'dropping' if opts.vocab_size < recorded else 'adding'} "
                                  f"{abs(recorded - int(opts.vocab_size))} rows of the embedding); omit --vocab-size")
        return recorded
    if opts.vocab_size:
        return int(opts.vocab_size)
    for folder in [folders] if isinstance(folders, str) else folders:
        found = _side_vocab_size(folder)
        if found:
            return found
    raise CheckpointError("the Megatron checkpoint does not record its true (unpadded) vocab size; pass "
                          "--vocab-size N or put the tokenizer.json / config.json next to the checkpoint")


def _side_vocab_size(folder: str) -> int | None:
    """The vocab size config.json or tokenizer.json in ``folder`` gives, if any."""
    cfg = os.path.join(folder, "config.json")
    if os.path.isfile(cfg):
        try:
            with open_regular(cfg) as f:
                return int(json.load(f)["vocab_size"])
        except (KeyError, ValueError, TypeError, json.JSONDecodeError):
            pass
    tok = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(tok):
        with open_regular(tok) as f:
            data = json.load(f)
        vocab = data.get("model", {}).get("vocab", {})
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens", [])]
        if ids:
            return max(ids) + 1
    return None
