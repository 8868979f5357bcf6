"""Reliability at the edges (issue 30): the published folder's mode, side files that are symlinks out of the
source, files that are not regular files, forced architectures and settings a mapping does not carry, options a
target does not use, messages that name the real reason, an iteration folder given directly, and ``--help`` at
80 columns."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys

import pytest
import torch

import reshard
from checkpoints import hf_config, hf_tensor_shapes, load_hf_tensors, make_hf, position_coded, write_hf
from helpers import run_cli


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A position-coded tiny Llama with a generation config beside it."""
    return make_hf(str(tmp_path_factory.mktemp("edges") / "llama"), vocab=1004)


def _one_line_refusal(code: int, err: str, *phrases: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for phrase in phrases:
        assert phrase in err, err


# ------------------------------------------------------------------------------------------ item 2: mode

@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_output_folder_gets_the_mode_a_plain_mkdir_would(llama, capsys, tmp_path, umask):
    old = os.umask(umask)
    try:
        code, _, err = run_cli(capsys, "convert", llama, tmp_path / "out", "--to", "megatron", "--tp", "2")
        os.mkdir(tmp_path / "plain")
    finally:
        os.umask(old)
    assert code == 0, err
    mode = stat.S_IMODE(os.stat(tmp_path / "out").st_mode)
    assert mode == 0o777 & ~umask == stat.S_IMODE(os.stat(tmp_path / "plain").st_mode), oct(mode)


# ------------------------------------------------------------------------------------------ item 3: side files

def test_side_file_symlink_out_of_the_source_is_skipped_with_a_warning(capsys, tmp_path):
    src = tmp_path / "src"
    make_hf(str(src), vocab=1004)
    secret = tmp_path / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("not a tokenizer\n")
    os.symlink(secret, src / "tokenizer.json")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0, err
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    assert (tmp_path / "out" / "generation_config.json").is_file()
    assert "warning" in err and "tokenizer.json" in err and "--follow-symlinks" in err, err
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out2", "--to", "hf", "--follow-symlinks")
    assert code == 0, err
    assert (tmp_path / "out2" / "tokenizer.json").read_text() == "not a tokenizer\n"


def test_side_file_symlink_inside_the_source_is_copied(capsys, tmp_path):
    src = tmp_path / "src"
    make_hf(str(src), vocab=1004)
    (src / "tokenizers").mkdir()
    (src / "tokenizers" / "tok.json").write_text("{}\n")
    os.symlink("tokenizers/tok.json", src / "tokenizer.json")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0 and "warning" not in err, err
    assert (tmp_path / "out" / "tokenizer.json").read_text() == "{}\n"


def test_side_files_of_a_cached_snapshot_resolve_into_its_blob_store(capsys, tmp_path):
    """Every file of a Hugging Face cache snapshot is a relative symlink into ``models--ORG--NAME/blobs``."""
    repo = tmp_path / "hub" / "models--org--tiny"
    staged = tmp_path / "staged"
    make_hf(str(staged), vocab=1004)
    (staged / "tokenizer.json").write_text('{"model": {}}\n')
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(staged))):
        os.rename(staged / name, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / name)
    code, _, err = run_cli(capsys, "convert", snapshot, tmp_path / "out", "--to", "hf")
    assert code == 0 and "warning" not in err, err
    assert (tmp_path / "out" / "tokenizer.json").read_text() == '{"model": {}}\n'
    assert (tmp_path / "out" / "generation_config.json").is_file()


def _reshard_subprocess(*args, timeout=60) -> subprocess.CompletedProcess:
    """``python -m reshard ARGS`` with a deadline: a read that blocks forever fails the test instead of hanging."""
    env = {k: v for k, v in os.environ.items() if k != "RESHARD_DEBUG"}
    return subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("command, fifo", [("inspect", "config.json"), ("convert", "config.json"),
                                           ("convert", "model.safetensors"),
                                           ("convert", "model-00002-of-00002.safetensors")])
def test_a_fifo_in_place_of_a_file_reshard_reads_is_refused(tmp_path, command, fifo):
    src = tmp_path / "src"
    make_hf(str(src), shards=2 if "-of-" in fifo else 1, vocab=1004)
    os.remove(src / fifo)
    os.mkfifo(src / fifo)
    args = [src] if command == "inspect" else [src, tmp_path / "out", "--to", "megatron"]
    result = _reshard_subprocess(command, *args)
    _one_line_refusal(result.returncode, result.stderr, fifo, "not a regular file")
    assert not (tmp_path / "out").exists()


def test_a_fifo_in_place_of_a_torch_dist_file_is_refused(llama, tmp_path):
    ckpt = tmp_path / "ckpt"
    reshard.convert(llama, str(ckpt), to="torch_dist")
    os.remove(ckpt / "release" / "common.pt")
    os.mkfifo(ckpt / "release" / "common.pt")
    result = _reshard_subprocess("convert", ckpt, tmp_path / "out", "--to", "hf")
    _one_line_refusal(result.returncode, result.stderr, "common.pt", "not a regular file")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ item 4: forcing

GRANITE = {"embedding_multiplier": 12.0, "attention_multiplier": 0.0078125, "residual_multiplier": 0.22,
           "logits_scaling": 8.0}


def _granite(path) -> str:
    config = hf_config(vocab=1004)
    tensors = position_coded(hf_tensor_shapes(config))
    config.update(architectures=["GraniteForCausalLM"], model_type="granite", **GRANITE)
    return write_hf(path, config, tensors)


def test_forcing_another_architecture_on_an_hf_source_is_refused(capsys, tmp_path):
    src = _granite(tmp_path / "granite")
    out = tmp_path / "out"
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "hf", "--architecture", "LlamaForCausalLM")
    _one_line_refusal(code, err, "GraniteForCausalLM", "LlamaForCausalLM", "--allow-lossy-config architecture")
    assert not out.exists()
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "hf", "--architecture", "LlamaForCausalLM",
                           "--allow-lossy-config", "architecture")
    _one_line_refusal(code, err, "embedding_multiplier = 12.0", "--allow-lossy-config embedding_multiplier")
    assert not out.exists()
    lossy = [a for key in ("architecture", *GRANITE) for a in ("--allow-lossy-config", key)]
    code, _, err = run_cli(capsys, "convert", src, out, "--to", "hf", "--architecture", "LlamaForCausalLM", *lossy)
    assert code == 0, err
    written = json.loads((out / "config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and not set(GRANITE) & set(written)
    assert "embedding_multiplier" in err and "relabelled GraniteForCausalLM" in err  # both are noted


def test_naming_the_source_architecture_is_not_forcing(llama, capsys, tmp_path):
    code, _, err = run_cli(capsys, "convert", llama, tmp_path / "out", "--to", "hf", "--architecture",
                           "LlamaForCausalLM")
    assert code == 0, err


@pytest.mark.parametrize("key, value", [("logit_scale", 0.0625), ("embedding_multiplier", 12.0)])
def test_a_setting_the_mapping_does_not_carry_is_refused(capsys, tmp_path, key, value):
    """A Llama config with a key known to change the computation, which the llama mapping does not carry."""
    config = hf_config(vocab=1004, **{key: value})
    src = write_hf(tmp_path / "src", config, position_coded(hf_tensor_shapes(config)))
    for to in ("hf", "megatron", "vllm"):
        code, _, err = run_cli(capsys, "convert", src, tmp_path / to, "--to", to)
        _one_line_refusal(code, err, f"{key} = {value}", f"--allow-lossy-config {key}")
        assert not (tmp_path / to).exists()
    neutral = hf_config(vocab=1004, **{key: 1.0})
    src = write_hf(tmp_path / "neutral", neutral, position_coded(hf_tensor_shapes(neutral)))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "n", "--to", "hf")
    assert code == 0, err


def test_a_setting_a_megatron_record_holds_is_refused_unless_dropped(llama, capsys, tmp_path):
    """A Megatron run whose args' hf_config record holds logit_scale (which the llama mapping does not carry)."""
    ckpt = tmp_path / "ckpt"
    reshard.convert(llama, str(ckpt), to="megatron")
    rank_file = ckpt / "release" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(rank_file, weights_only=False)
    state["args"].hf_config["logit_scale"] = 0.0625
    torch.save(state, rank_file)
    code, _, err = run_cli(capsys, "convert", ckpt, tmp_path / "hf", "--to", "hf")
    _one_line_refusal(code, err, "logit_scale = 0.0625", "--allow-lossy-config logit_scale")
    code, _, err = run_cli(capsys, "convert", ckpt, tmp_path / "hf", "--to", "hf", "--allow-lossy-config",
                           "logit_scale")
    assert code == 0, err
    assert "logit_scale" not in json.loads((tmp_path / "hf" / "config.json").read_text())


# ------------------------------------------------------------------------------------------ item 5: options

@pytest.mark.parametrize("to, args, hint", [
    ("vllm", ["--tp", "2", "--ep", "2"], "--expert-parallel"),
    ("vllm", ["--etp", "1"], "--expert-parallel"),
    ("vllm", ["--moe-grouped-gemm"], "--to megatron"),
    ("hf", ["--ep", "2"], "--to megatron"),
    ("hf", ["--etp", "2"], "--to megatron"),
    ("hf", ["--moe-grouped-gemm"], "--to megatron"),
    ("hf", ["--expert-parallel"], "--to vllm"),
    ("hf", ["--megatron-spec", "local"], "--to megatron"),
    ("hf", ["--make-vocab-size-divisible-by", "64"], "--to megatron"),
    ("megatron", ["--expert-parallel"], "--ep"),
    ("megatron", ["--max-shard-size", "1GB"], "--to hf"),
    ("torch_dist", ["--megatron-spec", "local"], "--megatron-spec"),
    ("trtllm", ["--ep", "2"], "--to megatron"),
    ("meta", ["--max-shard-size", "1GB"], "--to hf"),
])
def test_an_option_the_target_does_not_use_is_refused(llama, capsys, tmp_path, to, args, hint):
    out = tmp_path / "out"
    option = next(a for a in reversed(args) if a.startswith("--"))
    code, _, err = run_cli(capsys, "convert", llama, out, "--to", to, *args)
    _one_line_refusal(code, err, option, f"--to {to}", hint)
    assert not out.exists()


def test_options_a_target_uses_are_still_accepted(llama, capsys, tmp_path):
    for to, args in (("megatron", ["--megatron-spec", "local", "--make-vocab-size-divisible-by", "64"]),
                     ("vllm", ["--max-shard-size", "1GB"]), ("hf", ["--max-shard-size", "1GB"])):
        code, _, err = run_cli(capsys, "convert", llama, tmp_path / to, "--to", to, *args)
        assert code == 0, err


# ------------------------------------------------------------------------------------------ item 6: messages

def test_llama2_meta_mp2_is_refused_for_its_hidden_split_embedding_first(llama, capsys, tmp_path):
    """Llama 2's release: vocab_size -1 in params.json and ParallelEmbedding split over the hidden size."""
    meta = tmp_path / "meta"
    reshard.convert(llama, str(meta), to="meta", tp=2)
    full = load_hf_tensors(llama)["model.embed_tokens.weight"]
    for rank in range(2):
        path = meta / f"consolidated.0{rank}.pth"
        weights = torch.load(path, weights_only=True)
        weights["tok_embeddings.weight"] = full.chunk(2, dim=1)[rank].clone()
        torch.save(weights, path)
    params = json.loads((meta / "params.json").read_text())
    (meta / "params.json").write_text(json.dumps({**params, "vocab_size": -1}))
    code, _, err = run_cli(capsys, "inspect", meta)
    _one_line_refusal(code, err, "split over the hidden size")
    assert "vocab_size" not in err


def test_cohere_forced_to_llama_is_refused_for_the_forcing(capsys, tmp_path):
    """Cohere: parallel attention and MLP (no post_attention_layernorm), logit_scale, tied embeddings."""
    config = hf_config(vocab=1004, tied=True)
    shapes = {k: v for k, v in hf_tensor_shapes(config).items() if "post_attention_layernorm" not in k}
    config.update(architectures=["CohereForCausalLM"], model_type="cohere", logit_scale=0.0625, layer_norm_eps=1e-5)
    src = write_hf(tmp_path / "cohere", config, position_coded(shapes))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf", "--architecture",
                           "LlamaForCausalLM")
    _one_line_refusal(code, err, "CohereForCausalLM", "--allow-lossy-config architecture")
    assert "post_attention_layernorm" not in err and "complete" not in err


# ------------------------------------------------------------------------------------------ item 7: iterations

@pytest.mark.parametrize("layout", ["megatron", "torch_dist"])
def test_an_iteration_folder_given_directly_is_the_source(llama, capsys, tmp_path, layout):
    ckpt = tmp_path / "ckpt"
    reshard.convert(llama, str(ckpt), to=layout, tp=1 if layout == "torch_dist" else 2)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert (ckpt / "generation_config.json").is_file() and not (ckpt / "release" / "generation_config.json").exists()
    code, _, err = run_cli(capsys, "convert", ckpt / "release", ckpt / "hf", "--to", "hf")
    assert code == 0, err
    assert load_hf_tensors(ckpt / "hf").keys() == load_hf_tensors(llama).keys()
    assert all(torch.equal(t, load_hf_tensors(llama)[n]) for n, t in load_hf_tensors(ckpt / "hf").items())
    assert (ckpt / "hf" / "generation_config.json").is_file()  # from the root whose tracker names this iteration
    (ckpt / "latest_checkpointed_iteration.txt").write_text("100")
    code, _, err = run_cli(capsys, "convert", ckpt / "release", ckpt / "hf2", "--to", "hf")
    assert code == 0, err
    assert not (ckpt / "hf2" / "generation_config.json").exists()  # that root's side files are another run's
    code, _, err = run_cli(capsys, "convert", ckpt / "release", ckpt / "release" / "hf", "--to", "hf")
    _one_line_refusal(code, err, "overlaps the source")


# ------------------------------------------------------------------------------------------ item 8: --help

def test_convert_help_at_80_columns_shows_every_option_whole_and_flags_as_flags():
    import typer.main

    from reshard.cli import app

    command = typer.main.get_command(app).commands["convert"]
    env = {**os.environ, "COLUMNS": "80", "TERM": "xterm-256color"}
    env.pop("RESHARD_DEBUG", None)
    result = subprocess.run([sys.executable, "-m", "reshard", "convert", "--help"], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert max(len(line) for line in text.splitlines()) <= 80, text
    for param in command.params:
        for name in param.opts:
            if name.startswith("--"):
                assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text), (name, text)
    assert "<bool>" not in text and "…" not in text, text
    for flag in ("--overwrite", "--dry-run", "--expert-parallel", "--json"):
        line = next(line for line in text.splitlines() if re.search(rf"{flag}(?![\w-])", line))
        assert re.search(rf"{flag}\s{{2,}}[^<\s]", line), line  # the flag, then its help: no value placeholder
