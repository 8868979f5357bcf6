"""The Python API takes every option of the command line under the same name (dashes as underscores) and value
(``"5MB"``, ``"bf16"``, ``"local"``), and gives the same result: the same dry-run plan, or the same refusal.
``plan`` has exactly ``convert``'s options but those that only make sense when writing. Help at 80 columns
reads ``SRC DST``. A refusal names the options as flags on the command line, as keywords from Python."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest
import typer

import reshard
from checkpoints import make_hf
from helpers import run_cli, tiny_transformers_model
from reshard.api import convert, python_terms, verify
from reshard.cli import app
from reshard.errors import ReshardError

DISPLAY_ONLY = {"as_json", "files"}  # how the CLI prints, not what it does


def cli_params(command: str) -> dict[str, object]:
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}


def option_flags(command: str) -> set[str]:
    return {flag for p in cli_params(command).values() for flag in p.opts if flag.startswith("--")}


def test_plan_has_convert_s_options_but_the_writing_ones():
    assert option_flags("convert") - {"--overwrite", "--dry-run", "--push-to", "--revision"} == option_flags("plan")
    for name, param in cli_params("plan").items():
        assert param.help, f"plan's {name} has no help text"


@pytest.mark.parametrize("command,function,python_only", [
    ("convert", reshard.convert, {"progress"}), ("verify", reshard.verify, {"progress"}),
    ("inspect", reshard.inspect, set())])
def test_every_cli_option_is_a_parameter_of_the_python_function(command, function, python_only):
    cli = set(cli_params(command)) - DISPLAY_ONLY
    python = set(inspect.signature(function).parameters) - python_only
    assert cli == python
    for name in python:  # typed: help() and IDEs show them
        assert inspect.signature(function).parameters[name].annotation is not inspect.Parameter.empty, name


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("parity")
    dense = make_hf(root / "dense", vocab=1000)
    moe = str(root / "moe")
    tiny_transformers_model(transformers, "MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                            num_key_value_heads=2).save_pretrained(moe)
    return {"dense": dense, "moe": moe}


# (source, CLI arguments after SRC DST, the same as Python keyword arguments); each option of convert appears
CONVERT_CASES = [
    ("dense", ["--to", "megatron", "--tp", "2", "--pp", "2"], dict(to="megatron", tp=2, pp=2)),
    ("dense", ["--to", "hf", "--max-shard-size", "5MB"], dict(to="hf", max_shard_size="5MB")),
    ("dense", ["--to", "vllm", "--tp", "2", "--max-shard-size", "1MiB"], dict(to="vllm", tp=2, max_shard_size="1MiB")),
    ("dense", ["--to", "hf", "--dtype", "bf16"], dict(to="hf", dtype="bf16")),
    ("dense", ["--to", "megatron", "--make-vocab-size-divisible-by", "64"],
     dict(to="megatron", make_vocab_size_divisible_by=64)),
    ("dense", ["--to", "megatron", "--megatron-spec", "local"], dict(to="megatron", megatron_spec="local")),
    ("dense", ["--to", "megatron", "--megatron-format", "torch_dist", "--tp", "2"],
     dict(to="megatron", megatron_format="torch_dist", tp=2)),
    ("dense", ["--to", "hf", "--vocab-size", "1000", "--architecture", "LlamaForCausalLM"],
     dict(to="hf", vocab_size=1000, architecture="LlamaForCausalLM")),
    ("dense", ["--to", "hf", "--mapping", "MAPPING"], dict(to="hf", mapping="MAPPING")),
    ("dense", ["--to", "vllm", "--allow-replica-mismatch", "--workers", "2", "--allow-cast-overflow",
               "--follow-symlinks", "--overwrite", "--dtype", "fp16"],
     dict(to="vllm", allow_replica_mismatch=True, workers=2, allow_cast_overflow=True, follow_symlinks=True,
          overwrite=True, dtype="fp16")),
    ("dense", ["--to", "hf", "--allow-lossy-config", "nonsense"], dict(to="hf", allow_lossy_config=["nonsense"])),
    ("dense", ["--to", "hf", "--push-to", "not a repo"], dict(to="hf", push_to="not a repo")),
    ("dense", ["--to", "hf", "--push-to", "alice/x", "--revision", "a..b"], dict(to="hf", push_to="alice/x",
                                                                                revision="a..b")),
    ("dense", ["--to", "hf", "--ep", "2"], dict(to="hf", ep=2)),  # refused: names the option that applies
    ("dense", ["--to", "vllm", "--keep-fp8"], dict(to="vllm", keep_fp8=True)),  # refused: FP8 only into hf
    ("moe", ["--to", "megatron", "--tp", "2", "--ep", "2", "--etp", "1", "--moe-grouped-gemm"],
     dict(to="megatron", tp=2, ep=2, etp=1, moe_grouped_gemm=True)),
    ("moe", ["--to", "vllm", "--tp", "2", "--expert-parallel"], dict(to="vllm", tp=2, expert_parallel=True)),
    ("moe", ["--to", "megatron", "--drop-mtp"], dict(to="megatron", drop_mtp=True)),
    # refused: DeepSpeed / torchtitan source options on a Hugging Face source, a torchtitan option for vLLM
    ("dense", ["--to", "hf", "--config", "CONFIG", "--tag", "t", "--master-weights"],
     dict(to="hf", config="CONFIG", tag="t", master_weights=True)),
    ("dense", ["--to", "vllm", "--torchtitan-names", "v0.2"], dict(to="vllm", torchtitan_names="v0.2")),
    # refused: vision-language options on a text model, a VLM option for another target
    ("dense", ["--to", "hf", "--hf-spelling", "v5"], dict(to="hf", hf_spelling="v5")),
    ("dense", ["--to", "megatron", "--megatron-vision", "native"], dict(to="megatron", megatron_vision="native")),
    ("dense", ["--to", "vllm", "--allow-missing", "vision"], dict(to="vllm", allow_missing=["vision"])),
    ("dense", ["--to", "hf", "--vllm-vision", "none"], dict(to="hf", vllm_vision="none")),
    # Llama 4's Megatron length limit: accepted by megatron (nothing to limit on a Llama), refused for vllm
    ("dense", ["--to", "megatron", "--max-seq", "4"], dict(to="megatron", max_seq=4)),
    ("dense", ["--to", "vllm", "--max-seq", "4"], dict(to="vllm", max_seq=4)),
    # MaxText (tensorstore): the model name, unscanned, MaxText's rounding; --no-scan-layers refused for hf
    ("dense", ["--to", "maxtext", "--maxtext-model", "llama3-8b", "--no-scan-layers", "--maxtext-match-converter"],
     dict(to="maxtext", maxtext_model="llama3-8b", scan_layers=False, maxtext_match_converter=True)),
    ("dense", ["--to", "hf", "--no-scan-layers"], dict(to="hf", scan_layers=False)),
    ("dense", ["--to", "hf", "--maxtext-vocab-size", "300"], dict(to="hf", maxtext_vocab_size=300)),
]


#: the cases the CLI and Python both refuse, with a word of the refusal
REFUSED = {("--to", "hf", "--allow-lossy-config", "nonsense"): "nonsense",
           ("--to", "hf", "--push-to", "not a repo"): "not a repo",
           ("--to", "hf", "--ep", "2"): "--ep",
           ("--to", "vllm", "--keep-fp8"): "--keep-fp8",
           ("--to", "hf", "--config", "CONFIG", "--tag", "t", "--master-weights"): "--config does not apply",
           ("--to", "vllm", "--torchtitan-names", "v0.2"): "--torchtitan-names",
           ("--to", "hf", "--hf-spelling", "v5"): "--hf-spelling v5 is for vision-language models",
           ("--to", "megatron", "--megatron-vision", "native"): "--megatron-vision is for vision-language models",
           ("--to", "vllm", "--allow-missing", "vision"): "for vision-language models",
           ("--to", "hf", "--vllm-vision", "none"): "--vllm-vision",
           ("--to", "vllm", "--max-seq", "4"): "--max-seq does not apply",
           ("--to", "hf", "--no-scan-layers"): "--no-scan-layers",
           ("--to", "hf", "--maxtext-vocab-size", "300"): "--maxtext-vocab-size"}


def test_the_cases_cover_every_convert_option():
    covered = {k for _, _, kwargs in CONVERT_CASES for k in kwargs} | {"dry_run"}
    assert set(cli_params("convert")) - DISPLAY_ONLY - {"src", "dst"} == covered


@pytest.mark.parametrize("source,args,kwargs", CONVERT_CASES, ids=lambda c: " ".join(c) if isinstance(c, list) else None)
def test_convert_from_python_gives_the_cli_s_result(sources, tmp_path, capsys, source, args, kwargs):
    from reshard.cli import _plan_json

    mapping = os.path.join(os.path.dirname(reshard.__file__), "..", "mappings", "llama.toml")
    args = [mapping if a == "MAPPING" else a for a in args]
    kwargs = {k: (mapping if v == "MAPPING" else v) for k, v in kwargs.items()}
    out = str(tmp_path / "out")
    code, stdout, stderr = run_cli(capsys, "convert", sources[source], out, "--dry-run", "--json", *args)
    try:
        result = reshard.convert(sources[source], out, dry_run=True, **kwargs)
    except ReshardError as exc:
        assert code == 2 and str(exc) == python_terms(stderr.strip().removeprefix("error: "), convert), (stderr, exc)
        assert REFUSED.get(tuple(args)) is not None and REFUSED[tuple(args)] in stderr, stderr
        return
    assert tuple(args) not in REFUSED
    assert code == 0, stderr
    assert {**_plan_json(result.plan), "download": result.download} == json.loads(stdout)
    assert not os.path.exists(out)


def test_verify_from_python_takes_the_cli_s_options(sources, tmp_path, capsys):
    src = sources["dense"]
    out = str(tmp_path / "bf16")
    reshard.convert(src, out, to="vllm", tp=2, dtype="bf16")
    code, stdout, _ = run_cli(capsys, "verify", src, out, "--json", "--workers", "2")
    report = reshard.verify(src, out, workers=2)
    assert code == 0 and report.to_dict() == json.loads(stdout)
    code, stdout, _ = run_cli(capsys, "verify", src, out, "--json", "--dry-run")
    assert code == 0 and reshard.verify(src, out, dry_run=True) == json.loads(stdout)
    for flag, name, value in (("--seq-len", "seq_len", 8), ("--nproc", "nproc", 2), ("--compute-dtype",
                                                                                       "compute_dtype", "bf16")):
        code, _, stderr = run_cli(capsys, "verify", src, out, flag, str(value))
        with pytest.raises(ReshardError) as exc:
            reshard.verify(src, out, **{name: value})
        assert code == 2 and str(exc.value) == python_terms(stderr.strip().removeprefix("error: "), verify)
        assert "--forward" in stderr and "forward=True" in str(exc.value)
    code, _, stderr = run_cli(capsys, "verify", src, out, "--forward", "--workers", "2")
    assert code == 2 and "--nproc" in stderr


def test_help_at_80_columns_reads_src_dst():
    env = dict(os.environ, COLUMNS="80")
    for command, usage in (("convert", "SRC DST"), ("plan", "SRC"), ("verify", "A B")):
        text = subprocess.run([sys.executable, "-m", "reshard", command, "--help"], capture_output=True, text=True,
                              env=env, timeout=120).stdout
        assert f"[OPTIONS] {usage}\n" in text and "{" not in text.split("\n")[0], text[:300]


def test_the_convert_summary_names_expert_parallelism(sources, tmp_path, capsys):
    code, stdout, _ = run_cli(capsys, "convert", sources["moe"], tmp_path / "m", "--to", "megatron", "--tp", "2",
                              "--ep", "2", "--etp", "1", "--json")
    summary = json.loads(stdout)
    assert code == 0 and (summary["layout"], summary["tp"], summary["ep"], summary["etp"]) == ("megatron", 2, 2, 1)
    code, stdout, _ = run_cli(capsys, "convert", sources["moe"], tmp_path / "v", "--to", "vllm", "--tp", "2",
                              "--expert-parallel")
    assert code == 0 and "vllm tp=2 pp=1 expert-parallel," in stdout, stdout
