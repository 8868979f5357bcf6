"""The ``reshard`` command line: thin typer commands over the Python API, one error handler. The app and its
``convert``, ``plan``, ``verify``, ``inspect`` and ``demo`` commands live here, registered in help order with
``pull`` / ``push`` (:mod:`.cli_hub`) and the ``mappings`` sub-app (:mod:`.cli_mappings`); shared options:
:mod:`.cli_options`; printing: :mod:`.cli_output`; error lines and exit: :mod:`.cli_errors`."""

from __future__ import annotations

import inspect as inspect_module
import json
import os
import sys
from typing import Optional

import typer
import typer.core

from reshard.cli_errors import _error_line, _remove_multiprocessing_temp_folder, _terminated, _usage_error
from reshard.cli_hub import pull, push
from reshard.cli_mappings import (mappings_app, mappings_check, mappings_list, mappings_new,  # noqa: F401
                                  mappings_show)
from reshard.cli_options import (ArchOpt, ConfigOpt, JsonOpt, MappingOpt, MasterOpt, MaxtextModelOpt,  # noqa: F401
                                 Spec, TagOpt, TargetOpt, VocabOpt, _plain_usage_name, _refresh_layout_help,
                                 _target_layout)
from reshard.cli_output import (_describe_download, _describe_plan, _format_estimate, _plan_json,  # noqa: F401
                                _print_digest_report, _report_push)
from reshard.errors import ReshardError

EXIT_CODES = ("Exit codes: 0 ok; 1 verification found differences (or an internal error); 2 bad input or "
              "usage (malformed or hostile checkpoint, impossible request, existing output without --overwrite); "
              "3 I/O error (disk full, file size limit, permissions); 130 interrupted (Ctrl-C, SIGTERM). "
              "Errors are one line on stderr; RESHARD_DEBUG=1 shows the traceback.")
# Plain (click) help, not rich's tables: at 80 columns rich cut long option names and showed flags as "<bool>".
app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Reshard and convert LLM checkpoints (Hugging Face, Megatron-Core, vLLM) at any TP/PP degree.",
                  epilog=EXIT_CODES)
app.add_typer(mappings_app, name="mappings")


from reshard.api import parse_size  # noqa: E402,F401 - one definition, shared with the Python API


@app.command()
def convert(
    src: str = typer.Argument(..., metavar="SRC", help="Source checkpoint folder or hf://ORG/NAME[@REV] (layout "
                              "detected)."),
    dst: str = typer.Argument(..., metavar="DST", help="Output folder."),
    to: str = TargetOpt,
    tp: int = typer.Option(1, "--tp", help="Target tensor-parallel degree."),
    pp: int = typer.Option(1, "--pp", help="Target pipeline-parallel degree."),
    ep: int = typer.Option(1, "--ep", help="Megatron expert-parallel degree (Mixture of Experts)."),
    etp: Optional[int] = typer.Option(None, "--etp", help="Megatron expert-tensor-parallel degree (default: --tp, "
                                      "or 1 where the experts have biases, as gpt-oss's; 1 keeps each expert whole)."),
    expert_parallel: bool = typer.Option(False, "--expert-parallel", help="vLLM: whole experts split over the "
                                         "ranks, as enable_expert_parallel loads them."),
    moe_grouped_gemm: bool = typer.Option(False, "--moe-grouped-gemm", help="Megatron: name the experts as "
                                          "TEGroupedMLP's (linear_fc1.weight{j}) instead of SequentialMLP's."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast to bf16, fp16 or fp32 (default: keep)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output (only once complete)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan; write nothing."),
    megatron_spec: Optional[Spec] = typer.Option(None, "--megatron-spec", help="Megatron names: te (fused norms; "
                                                 "the default) or local."),
    megatron_format: str = typer.Option("torch", "--megatron-format", help="With --to megatron: torch (per-rank "
                                        "files) or torch_dist (Megatron-LM's default; same as --to torch_dist)."),
    max_shard_size: Optional[str] = typer.Option(None, "--max-shard-size", help="HF shard / vLLM part size "
                                                 "(default: 5GB)."),
    vocab_size: Optional[int] = VocabOpt,
    make_vocab_size_divisible_by: Optional[int] = typer.Option(None, "--make-vocab-size-divisible-by",
                                                help="Megatron vocab padding divisor (default: source's, else 128)."),
    architecture: Optional[str] = ArchOpt,
    mapping: Optional[str] = MappingOpt,
    config: Optional[str] = ConfigOpt,
    tag: Optional[str] = TagOpt,
    master_weights: bool = MasterOpt,
    maxtext_model: Optional[str] = typer.Option(None, "--maxtext-model", help="MaxText: the model name (e.g. "
                                                "llama3.1-8b), for its RoPE order and query scaling."),
    scan_layers: bool = typer.Option(True, "--scan-layers/--no-scan-layers", help="With --to maxtext: stack "
                                     "the layers (MaxText scan_layers, the default) or not."),
    maxtext_match_converter: bool = typer.Option(False, "--maxtext-match-converter", help="With --to maxtext: "
                                                 "every leaf in --dtype, rounded as MaxText's to_maxtext."),
    maxtext_vocab_size: Optional[int] = typer.Option(None, "--maxtext-vocab-size", metavar="N", help="With --to "
                                                     "maxtext: MaxText's vocab_size (zero rows added; fewer rows "
                                                     "need --allow-lossy-config vocab)."),
    allow_replica_mismatch: bool = typer.Option(False, "--allow-replica-mismatch",
                                                help="Take rank 0's copy when replicated tensors differ."),
    as_json: bool = JsonOpt,
    workers: Optional[int] = typer.Option(None, "--workers", help="Processes that write target files (same output "
                                          "bytes); default: chosen from the cores, the memory and the bytes, as "
                                          "the Python API's workers=None (the output line says what ran)."),
    push_to: Optional[str] = typer.Option(None, "--push-to", help="Upload the output to this Hub repo (ORG/NAME)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch for --push-to (created when missing)."),
    allow_lossy_config: Optional[list[str]] = typer.Option(None, "--allow-lossy-config", metavar="FIELD",
                                                           help="Let the output "
                                                           "drop this canonical config field, or a source setting "
                                                           "reshard does not carry such as logit_scale "
                                                           "(repeatable); default: refuse what it cannot express."),
    allow_cast_overflow: bool = typer.Option(False, "--allow-cast-overflow", help="Let a --dtype cast turn finite "
                                             "values into inf (default: refuse)."),
    follow_symlinks: bool = typer.Option(False, "--follow-symlinks", help="Copy side files (tokenizer, generation "
                                         "config) that are symlinks out of the source too (default: skip, warn)."),
    keep_fp8: bool = typer.Option(False, "--keep-fp8", help="With --to hf: copy a block-FP8 source's fp8 weights "
                                  "and _scale_inv scales unchanged (default: dequantise to bf16)."),
    drop_mtp: bool = typer.Option(False, "--drop-mtp", help="Leave multi-token-prediction (MTP) layers out "
                                  "(default: keep them where the target holds them)."),
    torchtitan_names: str = typer.Option("current", "--torchtitan-names", help="With --to torchtitan: current "
                                         "(torchtitan's present parameter names) or v0.2."),
    hf_spelling: str = typer.Option("hub", "--hf-spelling", help="With --to hf, a vision-language model: hub "
                                    "(the names Hub checkpoints and vLLM use) or v5 (transformers 5's own)."),
    megatron_vision: Optional[str] = typer.Option(None, "--megatron-vision", help="Megatron, a vision-language "
                                                  "model: hf (the tower's HF modules, whole on every TP rank) or "
                                                  "native (vision_model.decoder.layers.*, split at --tp); default: "
                                                  "the family's."),
    vllm_vision: str = typer.Option("weights", "--vllm-vision", help="With --to vllm, a vision-language model: "
                                    "weights (the tower split as vLLM splits it), data (whole on every rank, for "
                                    "mm_encoder_tp_mode=\"data\") or none (language model only, for "
                                    "limit_mm_per_prompt all 0)."),
    allow_missing: Optional[list[str]] = typer.Option(None, "--allow-missing", metavar="WHAT", help="vision: write "
                                                      "the output without the vision tensors the source lacks "
                                                      "(vLLM / megatron-core LLaVA build no unused CLIP layer)."),
    max_seq: Optional[int] = typer.Option(None, "--max-seq", help="Megatron, Llama 4: accept an output that "
                                          "matches only on sequences up to this many tokens (megatron-core has no "
                                          "chunked attention or temperature tuning)."),
):
    """Convert SRC (a folder or hf://ORG/NAME[@REV]) to another layout and/or TP/PP degree, streaming."""
    from reshard import api

    result = api.convert(src, dst, to=to, tp=tp, pp=pp, ep=ep, etp=etp, expert_parallel=expert_parallel,
                         moe_grouped_gemm=moe_grouped_gemm, dtype=dtype, overwrite=overwrite, dry_run=dry_run,
                         megatron_spec=megatron_spec.value if megatron_spec else None,
                         megatron_format=megatron_format, max_shard_size=max_shard_size, vocab_size=vocab_size,
                         make_vocab_size_divisible_by=make_vocab_size_divisible_by, architecture=architecture,
                         mapping=mapping, config=config, tag=tag, master_weights=master_weights,
                         maxtext_model=maxtext_model, scan_layers=scan_layers,
                         maxtext_match_converter=maxtext_match_converter, maxtext_vocab_size=maxtext_vocab_size,
                         allow_replica_mismatch=allow_replica_mismatch, workers=workers,
                         push_to=push_to, revision=revision, allow_lossy_config=tuple(allow_lossy_config or ()),
                         allow_cast_overflow=allow_cast_overflow, follow_symlinks=follow_symlinks,
                         keep_fp8=keep_fp8, drop_mtp=drop_mtp, torchtitan_names=torchtitan_names,
                         hf_spelling=hf_spelling, megatron_vision=megatron_vision, vllm_vision=vllm_vision,
                         allow_missing=tuple(allow_missing or ()), max_seq=max_seq,
                         progress=not as_json and sys.stderr.isatty())
    if dry_run:
        if as_json:
            print(json.dumps({**_plan_json(result.plan), "download": result.download}, indent=2))
        else:
            _describe_plan(result.plan)
            if result.download is not None:
                _describe_download(result.download)
        return
    from reshard.distributed import world_size_from_env

    if world_size_from_env() > 1 and os.environ.get("RANK") != "0":
        return  # under torchrun rank 0 reports the run and pushes
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    degrees = {"tp": tp, "pp": pp, **({"ep": ep} if ep != 1 else {}), **({"etp": etp} if etp is not None else {}),
               **({"expert_parallel": True} if expert_parallel else {})}
    if as_json:
        print(json.dumps({"output": dst, "layout": result.layout, **degrees, "files": len(result.plan.files),
                          "bytes": result.plan.nbytes, "workers": result.workers,
                          "workers_reason": result.workers_reason}))
    else:
        shown = " ".join(f"{k}={v}" if v is not True else k.replace("_", "-") for k, v in degrees.items())
        print(f"wrote {dst}: {result.layout} {shown}, {len(result.plan.files)} files, "
              f"{result.plan.nbytes / 2**20:.1f} MiB\n  written by {result.workers_reason}")
    if result.pushed is not None:
        _report_push(dst, result.pushed)


#: convert's options that only make sense when writing: ``plan`` has all the others (one definition serves both).
_WRITE_ONLY = ("dst", "overwrite", "dry_run", "push_to", "revision")


def plan(**options):
    """Print the conversion plan (what `convert --dry-run` prints); write nothing."""
    convert(dst="", overwrite=False, dry_run=True, push_to=None, revision=None, **options)


_convert_signature = inspect_module.signature(convert)
plan.__signature__ = _convert_signature.replace(
    parameters=[p for p in _convert_signature.parameters.values() if p.name not in _WRITE_ONLY])
plan.__annotations__ = {k: v for k, v in convert.__annotations__.items() if k not in _WRITE_ONLY}
app.command()(plan)


@app.command()
def verify(
    a: str = typer.Argument(..., metavar="A", help="Reference checkpoint."),
    b: str = typer.Argument(..., metavar="B", help="Checkpoint to check."),
    atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance when dtypes differ (--forward: on "
                                         "logits)."),
    rtol: Optional[float] = typer.Option(None, "--rtol", help="Relative tolerance when dtypes differ (--forward: on "
                                         "logits)."),
    vocab_size: Optional[int] = VocabOpt, architecture: Optional[str] = ArchOpt, mapping: Optional[str] = MappingOpt,
    config: Optional[str] = ConfigOpt, tag: Optional[str] = TagOpt, master_weights: bool = MasterOpt,
    as_json: bool = JsonOpt,
    maxtext_model: Optional[str] = MaxtextModelOpt,
    forward: bool = typer.Option(False, "--forward", help="Run a tensor-parallel forward pass on both and compare "
                                 "logits (B at --nproc ranks, each reading only its own shard files)."),
    nproc: Optional[int] = typer.Option(None, "--nproc", help="--forward: TP degree for B (default: B's own)."),
    backend: Optional[str] = typer.Option(None, "--backend", help="--forward: gloo or nccl (default: nccl "
                                          "when every process of this node gets a GPU of its own, else gloo on CPU)."),
    seq_len: Optional[int] = typer.Option(None, "--seq-len", help="--forward: tokens per sequence (default 16)."),
    batch: Optional[int] = typer.Option(None, "--batch", help="--forward: sequences (default 2)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="--forward: seed of the random token ids (default 0)."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="--forward: token ids file (JSON list(s) "
                                             "or whitespace-separated ints per line)."),
    compute_dtype: Optional[str] = typer.Option(None, "--compute-dtype", help="--forward: fp32 (default), bf16 or "
                                                "fp16."),
    timeout: Optional[float] = typer.Option(None, "--timeout", help="--forward: seconds before hung workers are "
                                            "killed (default 300)."),
    workers: Optional[int] = typer.Option(None, "--workers", help="Processes that compare tensors (digest check; "
                                          "same report; default: chosen from the cores, the memory and the bytes)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the bytes each process will read and its peak "
                                 "memory estimate; read no tensor data."),
    drop_mtp: bool = typer.Option(False, "--drop-mtp", help="Compare the main models only, leaving "
                                  "multi-token-prediction layers out (as a conversion to vLLM does)."),
):
    """Compare two checkpoints' canonical tensors (bit-exact unless dtypes differ). Exit 0 only when equal.

    With --forward: compare the logits of a tensor-parallel forward pass instead (exit 0 only within tolerance)."""
    from reshard import api

    result = api.verify(a, b, atol=atol, rtol=rtol, vocab_size=vocab_size, architecture=architecture,
                        mapping=mapping, config=config, tag=tag, master_weights=master_weights, forward=forward, nproc=nproc, backend=backend, seq_len=seq_len, batch=batch,
                        seed=seed, prompt_ids=prompt_ids, compute_dtype=compute_dtype, timeout=timeout,
                        workers=workers, dry_run=dry_run, drop_mtp=drop_mtp,
                        maxtext_model=maxtext_model,
                        progress=not as_json and sys.stderr.isatty())
    if dry_run:
        print(json.dumps(result, indent=2) if as_json else _format_estimate(result))
        return
    if forward:
        from reshard.distributed import world_size_from_env

        if world_size_from_env() <= 1 or os.environ.get("RANK") == "0":  # under torchrun: rank 0 reports
            print(result.to_json() if as_json else result.describe())
        if not result.equal:
            raise typer.Exit(1)
        return
    _print_digest_report(result, a, b, as_json)
    if not result.equal:
        raise typer.Exit(1)


def _print_version(asked: bool) -> None:
    if asked:
        from reshard.version import __version__

        print(f"reshard {__version__}")
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                          help="Print reshard's version and exit.")):
    """Options that come before the command (``--version``)."""


@app.command()
def inspect(path: str = typer.Argument(...), vocab_size: Optional[int] = VocabOpt,
            architecture: Optional[str] = ArchOpt, mapping: Optional[str] = MappingOpt,
            config: Optional[str] = ConfigOpt, tag: Optional[str] = TagOpt, master_weights: bool = MasterOpt,
            maxtext_model: Optional[str] = MaxtextModelOpt,
            as_json: bool = JsonOpt, files: bool = typer.Option(False, "--files", help="List every file of every rank (--json always "
                                       "does).")):
    """Show a checkpoint's layout, architecture, degrees, dtype, parameters, size and files per rank (a table;
    --json for machines)."""
    from reshard.inspection import format_inspection, inspect as run_inspect

    info = run_inspect(path, vocab_size=vocab_size, architecture=architecture, mapping=mapping, config=config,
                       tag=tag, master_weights=master_weights, maxtext_model=maxtext_model)
    print(json.dumps(info, indent=2) if as_json else format_inspection(info, every_file=files))


app.command()(pull)
app.command()(push)


@app.command()
def demo(workdir: Optional[str] = typer.Option(None, "--workdir", help="Write the demo checkpoints into this "
                                               "folder and keep them."),
         keep: bool = typer.Option(False, "--keep", help="Keep the temporary folder (its path is printed)."),
         backend: str = typer.Option("gloo", "--backend", help="The forward step's backend: gloo (CPU, the "
                                     "default, whatever GPUs there are), nccl (2 GPUs) or auto (as verify "
                                     "--forward chooses).")):
    """Make a tiny Llama checkpoint and run hf -> megatron tp4 -> vllm tp8 -> megatron tp2 pp2 -> torch_dist -> hf,
    verifying each step. The checkpoints go to a temporary folder deleted at the end unless --keep or --workdir
    keeps them; the last lines name three commands to try on them."""
    from reshard.demo import run_demo

    if not run_demo(workdir, keep, None if backend == "auto" else backend):
        raise typer.Exit(1)


def run() -> None:
    """The console entry point: :func:`main`, then leave without interpreter teardown. Every output file is closed
    and published by then; what teardown would do is run torch's finalizers, half a second after a conversion
    that imported it. Tracebacks (``RESHARD_DEBUG=1``) still take the normal exit. First of all, a local
    source's weight files start being read (:func:`reshard.io.heads.read_source_heads_early`): parsing the
    command line imports the parser's and the layouts' modules, half a second in which the disk would idle."""
    from reshard.io.heads import read_source_heads_early

    read_source_heads_early(sys.argv[1:])
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if "reshard.verification.forward.launch" in sys.modules:  # a forward check's worker server, if it started
        sys.modules["reshard.verification.forward.launch"].stop_worker_server()
    _remove_multiprocessing_temp_folder()
    os._exit(code)


def main() -> None:
    import signal

    from reshard.api import command_line as api_command_line

    signal.signal(signal.SIGTERM, _terminated)
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        _refresh_layout_help()
    try:
        with api_command_line():  # the API's errors keep the flags' spelling
            code = app(standalone_mode=False)  # click returns an Exit's code instead of raising it here
        if code == 130:  # typer turns Ctrl-C (and our SIGTERM handler) into exit code 130
            _error_line("interrupted; no output was published")
        if isinstance(code, int) and code:
            sys.exit(code)
    except ReshardError as exc:
        if os.environ.get("RESHARD_DEBUG") == "1":
            raise
        _error_line(str(exc))
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except OSError as exc:
        if os.environ.get("RESHARD_DEBUG") == "1":
            raise
        from reshard.errors import os_error_message

        _error_line(os_error_message(exc))
        sys.exit(3)
    except KeyboardInterrupt:
        _error_line("interrupted; no output was published")
        sys.exit(130)
    except typer.TyperException as exc:  # usage errors (bad option value, missing argument, unknown command)
        _usage_error(exc)
    except typer.Abort:
        sys.exit(1)
    except Exception as exc:  # noqa: BLE001
        if os.environ.get("RESHARD_DEBUG") == "1":
            raise
        _error_line(f"internal error: {type(exc).__name__}: {exc} (set RESHARD_DEBUG=1 for the traceback)")
        sys.exit(1)
