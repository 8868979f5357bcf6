"""The Python API: ``convert``, ``plan``, ``verify`` and ``inspect`` take the command line's options under the same
names (dashes as underscores) and parse their values the same way (``max_shard_size="5GB"``, ``dtype="bf16"``).
The CLI commands are thin printers over these functions, so the two cannot drift apart (``tests/test_api_parity.py``
calls each function with every option of its command). Called from Python, their errors name options as
keywords (``tp and pp must be 1 for to="hf"``); from the command line, as flags (:func:`python_terms`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import typing
from typing import Literal

from reshard.errors import ReshardError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}

#: Options that change what a forward check runs; given without ``forward``, they are refused. Left as None,
#: the forward check's own defaults apply.
FORWARD_ONLY = ("nproc", "backend", "seq_len", "batch", "seed", "prompt_ids", "compute_dtype", "timeout")


def parse_size(text: str | int) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"2GiB"`` (decimal and binary units) or of an int."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    m = _SIZE.match(str(text))
    unit = (m.group(2) or "").upper() if m else None
    if not m or unit not in _UNITS:
        raise ReshardError(f"cannot read size '{text}': use e.g. 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


_COMMAND_LINE = contextvars.ContextVar("reshard_command_line", default=False)


@contextlib.contextmanager
def command_line():
    """While open (``reshard``'s commands run in it), the API's errors keep the command line's flags."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)


_FLAG = re.compile(r"--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)(?: ([^\s-][^\s,;:)]*))?")
_DTYPES = ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32")


def python_terms(message: str, function) -> str:
    """``message`` with ``function``'s options named as its keywords instead of flags: ``--tp 2`` -> ``tp=2``,
    ``--to hf`` -> ``to="hf"``, ``--config FILE`` -> ``config=FILE``, ``--drop-mtp`` -> ``drop_mtp=True``,
    ``--config`` -> ``config``. Flags that are not its options (torchrun's ``--nproc-per-node``) are left as they
    are."""
    hints = typing.get_type_hints(function)

    def keyword(m: re.Match) -> str:
        name, token = m.group(1).replace("-", "_"), m.group(2)
        if name not in hints:
            return m.group(0)
        kind = hints[name]
        rest = "" if token is None else f" {token}"
        if kind is bool:
            return f"{name}=True{rest}"
        value = _value(name, kind, token) if token is not None else None
        return f"{name}" + rest if value is None else f"{name}={value}"

    return _FLAG.sub(keyword, message)


def _value(name: str, kind, token: str) -> str | None:
    """``token`` spelt as a Python value of option ``name`` (of type ``kind``), or None when it is not one."""
    if re.fullmatch(r"[A-Z][A-Z_]*", token):  # a placeholder: FILE, N
        return token
    if re.fullmatch(r"\d+(\.\d+)?", token) and any(t in (int, float) for t in (kind, *typing.get_args(kind))):
        return token
    choices: tuple = ()
    for t in (kind, *typing.get_args(kind)):
        if typing.get_origin(t) is Literal:
            choices += typing.get_args(t)
    if name == "to":
        from reshard.layouts.registry import layout_names

        choices = layout_names()
    elif name in ("dtype", "compute_dtype"):
        choices = _DTYPES
    elif name == "allow_missing":
        choices = ("vision",)
    elif name == "allow_lossy_config":
        from reshard.core.model_config import SEMANTIC_FIELDS, UNCARRIED_SETTINGS

        choices = tuple(SEMANTIC_FIELDS) + tuple(UNCARRIED_SETTINGS)
    if token not in choices:
        return None
    return f'["{token}"]' if name.startswith("allow_") else f'"{token}"'


def _in_python_terms(function):
    """``function``, its :class:`ReshardError` messages in :func:`python_terms` unless the command line called it."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except ReshardError as exc:
            if not _COMMAND_LINE.get():
                exc.args = (python_terms(str(exc), function),)
            raise

    return wrapper


@_in_python_terms
def convert(src: str, dst: str, *, to: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
            expert_parallel: bool = False, moe_grouped_gemm: bool = False, dtype: str | None = None,
            overwrite: bool = False, dry_run: bool = False, megatron_spec: Literal["te", "local"] | None = None,
            megatron_format: Literal["torch", "torch_dist"] = "torch", max_shard_size: str | int | None = None,
            vocab_size: int | None = None, make_vocab_size_divisible_by: int | None = None,
            architecture: str | None = None, mapping: str | None = None, config: str | None = None,
            tag: str | None = None, master_weights: bool = False, allow_replica_mismatch: bool = False,
            maxtext_model: str | None = None, scan_layers: bool = True, maxtext_match_converter: bool = False,
            maxtext_vocab_size: int | None = None,
            workers: int | None = None, push_to: str | None = None, revision: str | None = None,
            allow_lossy_config: tuple[str, ...] | list[str] = (), allow_cast_overflow: bool = False,
            follow_symlinks: bool = False, keep_fp8: bool = False, drop_mtp: bool = False,
            torchtitan_names: Literal["current", "v0.2"] = "current",
            hf_spelling: Literal["hub", "v5"] = "hub", megatron_vision: Literal["hf", "native"] | None = None,
            vllm_vision: Literal["weights", "data", "none"] = "weights",
            allow_missing: tuple[str, ...] | list[str] = (), max_seq: int | None = None, progress: bool = False):
    """Convert ``src`` (a folder or ``hf://ORG/NAME[@REV]``) to layout ``to`` at the given degrees in ``dst``,
    streaming; returns a :class:`reshard.conversion.ConvertResult` (its ``plan``; ``download`` for a remote
    dry run). Options as ``reshard convert``: ``max_shard_size`` ``"5GB"`` or bytes; ``megatron_format``
    ``"torch_dist"`` with ``to="megatron"`` writes torch_dist; ``push_to`` uploads the finished output
    (``revision``: the branch); ``workers`` (default None: chosen from the cores, the memory and the bytes, as the CLI
    does; the result's ``workers`` and ``workers_reason`` say what ran); ``keep_fp8`` (``to="hf"``): copy a
    block-FP8 source's fp8 weights and scales unchanged instead of dequantising them; ``drop_mtp``: leave a
    model's multi-token-prediction layers out; ``config`` (a config.json), ``tag`` and ``master_weights``
    (DeepSpeed: fp32 masters) say how to read a training checkpoint; ``torchtitan_names`` (``to="torchtitan"``):
    ``"current"`` or ``"v0.2"``. Vision-language models: ``hf_spelling`` (``to="hf"``: ``"hub"`` or ``"v5"``),
    ``megatron_vision`` (``"hf"`` or ``"native"``; default: the family's), ``vllm_vision`` (``"weights"``,
    ``"data"``: the tower whole on every rank, or ``"none"``: language model only) and
    ``allow_missing=("vision",)`` (write without the tower tensors the source lacks). ``max_seq``: a Megatron
    target of Llama 4 matches only on shorter sequences than its chunk / floor_scale: accept that up to this length."""
    from reshard.conversion import convert as run_convert

    if megatron_format not in ("torch", "torch_dist"):
        raise ReshardError(f"'{megatron_format}' is not a Megatron format: use torch or torch_dist")
    if megatron_format == "torch_dist":
        if to != "megatron":
            raise ReshardError("--megatron-format applies to --to megatron")
        to = "torch_dist"
    if megatron_spec is not None and megatron_spec not in ("te", "local"):
        raise ReshardError(f"'{megatron_spec}' is not a Megatron spec: use te or local")
    if push_to:
        from reshard.hub import parse_repo_id

        parse_repo_id(push_to, revision)  # a bad repo id fails before anything is written
    result = run_convert(src, dst, to=to, tp=tp, pp=pp, ep=ep, etp=etp, expert_parallel=expert_parallel,
                         moe_grouped_gemm=moe_grouped_gemm, dtype=dtype, overwrite=overwrite, dry_run=dry_run,
                         megatron_spec=megatron_spec,
                         max_shard_size=None if max_shard_size is None else parse_size(max_shard_size),
                         vocab_size=vocab_size, vocab_divisor=make_vocab_size_divisible_by,
                         architecture=architecture, mapping=mapping, config=config, tag=tag,
                         master_weights=master_weights, allow_replica_mismatch=allow_replica_mismatch, progress=progress, workers=workers, allow_lossy_config=tuple(allow_lossy_config),
                         maxtext_model=maxtext_model, scan_layers=scan_layers,
                         maxtext_match_converter=maxtext_match_converter, maxtext_vocab_size=maxtext_vocab_size,
                         allow_cast_overflow=allow_cast_overflow, follow_symlinks=follow_symlinks,
                         keep_fp8=keep_fp8, drop_mtp=drop_mtp, torchtitan_names=torchtitan_names,
                         hf_spelling=hf_spelling, megatron_vision=megatron_vision, vllm_vision=vllm_vision,
                         allow_missing=tuple(allow_missing), max_seq=max_seq)
    result.layout = to
    result.degrees = {"tp": tp, "pp": pp, **({"ep": ep} if ep != 1 else {}),
                      **({"etp": etp} if etp is not None else {}),
                      **({"expert_parallel": True} if expert_parallel else {})}
    if push_to and not dry_run:
        import os

        from reshard.distributed import world_size_from_env

        if world_size_from_env() <= 1 or os.environ.get("RANK") == "0":
            from reshard.hub.push import push as run_push

            result.pushed = run_push(dst, push_to, revision=revision, private=False, create_pr=False,
                                     commit_message=None, replace=False)
    return result


@_in_python_terms
def plan(src: str, *, to: str, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None,
         expert_parallel: bool = False, moe_grouped_gemm: bool = False, dtype: str | None = None,
         megatron_spec: Literal["te", "local"] | None = None, megatron_format: Literal["torch", "torch_dist"] = "torch",
         max_shard_size: str | int | None = None, vocab_size: int | None = None,
         make_vocab_size_divisible_by: int | None = None, architecture: str | None = None, mapping: str | None = None,
         config: str | None = None, tag: str | None = None, master_weights: bool = False,
         maxtext_model: str | None = None, scan_layers: bool = True, maxtext_match_converter: bool = False,
         maxtext_vocab_size: int | None = None, allow_replica_mismatch: bool = False, workers: int | None = None,
         allow_lossy_config: tuple[str, ...] | list[str] = (), allow_cast_overflow: bool = False,
         follow_symlinks: bool = False, keep_fp8: bool = False, drop_mtp: bool = False,
         torchtitan_names: Literal["current", "v0.2"] = "current", hf_spelling: Literal["hub", "v5"] = "hub",
         megatron_vision: Literal["hf", "native"] | None = None,
         vllm_vision: Literal["weights", "data", "none"] = "weights", allow_missing: tuple[str, ...] | list[str] = (),
         max_seq: int | None = None):
    """What ``convert(src, ..., to=..., ...)`` would write, read from headers alone (``reshard plan``): a
    :class:`reshard.results.ConversionPlan` (``describe()``: the command's text; ``to_dict()``: its ``--json``).
    Options as :func:`convert`'s, less those of writing."""
    options = dict(locals())
    del options["src"]
    from reshard.results import ConversionPlan

    result = convert.__wrapped__(src, "", dry_run=True, **options)
    return ConversionPlan(result.plan, result.download)


@_in_python_terms
def verify(a: str, b: str, *, atol: float | None = None, rtol: float | None = None, vocab_size: int | None = None,
           architecture: str | None = None, mapping: str | None = None, config: str | None = None,
           tag: str | None = None, master_weights: bool = False, forward: bool = False,
           maxtext_model: str | None = None,
           nproc: int | None = None, backend: Literal["gloo", "nccl"] | None = None, seq_len: int | None = None,
           batch: int | None = None, seed: int | None = None, prompt_ids: str | None = None,
           compute_dtype: str | None = None, timeout: float | None = None, workers: int | None = None,
           dry_run: bool = False, drop_mtp: bool = False, progress: bool = False):
    """Compare checkpoints ``a`` and ``b`` as ``reshard verify`` does. Both checks return a report with ``.equal``,
    ``.report`` (the dict ``--json`` prints) and ``.to_json()``: the digest check (default) a
    :class:`reshard.verification.digest.VerifyReport`, ``forward=True`` a :class:`reshard.results.ForwardReport`
    (also read as a dict: ``report["max_abs"]``). ``nproc``, ``backend``, ``seq_len`` (16), ``batch`` (2),
    ``seed`` (0), ``prompt_ids``, ``compute_dtype`` ("fp32"), ``timeout`` (300 s) apply to the forward check
    only and are refused without it; its workers start from reshard's own entry point, so a script calling it
    needs no ``if __name__ == "__main__":``. ``progress``: a byte bar (digest) or the layers run (forward) on
    stderr, when it is a terminal. ``dry_run=True`` returns what each process would read and its peak-memory estimate;
    ``drop_mtp`` (digest check): compare the main models, leaving multi-token-prediction layers out. ``workers``
    (digest check): processes that compare; None (the default) chooses from the cores, the memory and the bytes,
    and the report's ``workers`` and ``workers_reason`` say what ran."""
    values = dict(nproc=nproc, backend=backend, seq_len=seq_len, batch=batch, seed=seed, prompt_ids=prompt_ids,
                  compute_dtype=compute_dtype, timeout=timeout)
    given = {k: values[k] for k in FORWARD_ONLY if values[k] is not None}
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ReshardError(f"workers must be a whole number of at least 1, or None to choose (got {workers!r})")
    common = dict(vocab_size=vocab_size, architecture=architecture, mapping=mapping, config=config, tag=tag,
                  master_weights=master_weights, maxtext_model=maxtext_model)
    if not forward:
        if given:
            name = next(iter(given)).replace("_", "-")
            raise ReshardError(f"--{name} applies to the forward check: add --forward, or leave it out")
        if dry_run:
            from reshard.verification.digest import verify_dry_run

            return verify_dry_run(a, b, workers=workers, drop_mtp=drop_mtp, **common)
        from reshard.verification.digest import verify as run_digest

        return run_digest(a, b, atol=atol, rtol=rtol, workers=workers, progress=progress, drop_mtp=drop_mtp,
                          **common)
    if workers is not None:
        raise ReshardError("--workers applies to the digest check; a forward check runs --nproc processes")
    if drop_mtp:
        raise ReshardError("--drop-mtp applies to the digest check; the forward check runs the main model only")
    options = {**given, **common}
    if dry_run:
        from reshard.verification.forward import forward_estimate

        return forward_estimate(a, b, atol=atol, rtol=rtol, **options)
    from reshard.verification.forward import verify_forward

    return verify_forward(a, b, atol=atol, rtol=rtol, progress=progress, **options)


@_in_python_terms
def inspect(path: str, *, vocab_size: int | None = None, architecture: str | None = None,
            mapping: str | None = None, config: str | None = None, tag: str | None = None,
            master_weights: bool = False, maxtext_model: str | None = None) -> dict:
    """What ``reshard inspect PATH --json`` prints: layout, architecture, degrees, dtype, parameters, bytes, files
    per rank."""
    from reshard.inspection import inspect as run_inspect

    return run_inspect(path, vocab_size=vocab_size, architecture=architecture, mapping=mapping, config=config,
                       tag=tag, master_weights=master_weights, maxtext_model=maxtext_model)
