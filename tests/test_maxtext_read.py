"""maxtext layout, reading (maxtext-orbax.md sections 1-4, 7.2, 7.3, 7.6): checkpoints written here with TensorStore
alone by the spec's rules (test_maxtext_build.py) read back bit for bit into the original HF tensors, every storage
variant, scanned and unscanned, chunks spanning layers (unstack pass) or not; folders; refusals."""

from __future__ import annotations

import builtins
import os
import shutil

import numpy as np
import pytest

from test_maxtext_build import P, maxtext_leaves, np_of, llama_state, write_checkpoint
from helpers import run_cli

import reshard


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny Llama (head_dim 16: the query pre-scale 1/4 is exact) and its scanned llama2-convention leaves."""
    tmp = tmp_path_factory.mktemp("mt")
    cfg, sd = llama_state(str(tmp / "hf"), head_dim=16, save=True)
    return tmp, cfg, sd


def load_out(path):
    from safetensors.torch import load_file

    return {k: np_of(v) for k, v in load_file(os.path.join(path, "model.safetensors")).items()}


def same(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def convert_hf(src, out, config, **kw):
    reshard.convert(str(src), str(out), to="hf", config=str(config), **kw)
    return load_out(out)


@pytest.mark.parametrize("ocdbt,zarr3,scan,split,layer_chunk", [
    (True, True, True, 2, None),    # MaxText's default storage; chunks span all layers (unstack pass)
    pytest.param(True, False, False, 1, None, marks=pytest.mark.slow),  # OCDBT + zarr2, unscanned
    pytest.param(False, True, True, 1, 1, marks=pytest.mark.slow),  # per-array zarr3, one layer per chunk
    pytest.param(False, False, True, 4, 2, marks=pytest.mark.slow),  # per-array zarr2, 2-layer chunks over 3
])
def test_storage_variants_read_bit_exact(llama, tmp_path, ocdbt, zarr3, scan, split, layer_chunk):
    tmp, cfg, sd = llama
    leaves = maxtext_leaves("llama2", cfg, sd, scan)
    step = write_checkpoint(str(tmp_path / "ck"), leaves, ocdbt=ocdbt, zarr3=zarr3, split=split,
                            layer_chunk=layer_chunk, scan=scan, custom={"reshard": {"maxtext_model": "llama3-8b"}})
    got = convert_hf(step, tmp_path / "out", tmp / "hf" / "config.json")
    assert set(got) == set(sd)
    assert [k for k in sd if not same(got[k], sd[k])] == []
    info = reshard.inspect(step, config=str(tmp / "hf" / "config.json"))
    unstack = info["maxtext"]["unstack_pass"]
    assert unstack.startswith("yes") == bool(scan and layer_chunk != 1)
    listed = info["maxtext"]["leaves"]  # spec 7.2: each leaf's chunk shape (as written above)
    assert sorted(listed) == sorted(n[len(P):] for n in leaves)
    for name, x in leaves.items():
        chunks = list(x.shape)
        if chunks and split > 1 and chunks[0] % split == 0:
            chunks[0] //= split
        if layer_chunk and scan and "decoder.layers." in name and len(chunks) > 1:
            chunks[1] = layer_chunk
        assert f" {list(x.shape)} chunks {chunks} " in listed[name[len(P):]], (name, listed[name[len(P):]])


def test_llama31_rope_and_inexact_scale(tmp_path):
    """Llama 3.1 conventions at head_dim 32 (1/sqrt(32) is inexact): q/k rows back from Meta's order, q * f32(sqrt(32))
    in fp32, rounded once; an independent numpy inverse is the reference."""
    cfg, sd = llama_state(str(tmp_path / "hf"), head_dim=32, seed=1)
    leaves = maxtext_leaves("llama31", cfg, sd, True)
    step = write_checkpoint(str(tmp_path / "ck"), leaves, split=2)
    got = convert_hf(step, tmp_path / "out", tmp_path / "hf" / "config.json", maxtext_model="llama3.1-8b")
    q = leaves[P + "decoder.layers.self_attention.query.kernel"][:, 1]  # [H, nh, d], interleaved, scaled
    back = (q.astype(np.float32) * np.float32(np.sqrt(32))).astype(q.dtype)
    back = np.concatenate([back[..., ::2], back[..., 1::2]], axis=-1).reshape(64, -1).T
    assert same(got["model.layers.1.self_attn.q_proj.weight"], np.ascontiguousarray(back))
    assert same(got["model.layers.2.self_attn.k_proj.weight"], sd["model.layers.2.self_attn.k_proj.weight"])
    moved = (got["model.layers.1.self_attn.q_proj.weight"] != sd["model.layers.1.self_attn.q_proj.weight"]).mean()
    assert 0 < moved < 0.5  # some q elements moved one ulp on the way, as MaxText's own round trip


def scanned(llama, tmp_path, name="ck", **kw):
    tmp, cfg, sd = llama
    return write_checkpoint(str(tmp_path / name), maxtext_leaves("llama2", cfg, sd, True),
                            custom={"reshard": {"maxtext_model": "llama2-7b"}}, **kw)


def test_refusals_one_line_exit_2(llama, tmp_path, capsys):
    """Spec 7.6: a family whose conventions differ by model name without one, a wrong name, no config, an unfinished
    save, an unmapped leaf: one line, exit 2, nothing written."""
    tmp, cfg, sd = llama
    config = str(tmp / "hf" / "config.json")
    step = write_checkpoint(str(tmp_path / "ck"), maxtext_leaves("llama2", cfg, sd, True))
    out = tmp_path / "out"
    cases = [((step, "--config", config), "pass --maxtext-model NAME"),
             ((step, "--config", config, "--maxtext-model", "gemma2-2b"), "not a MaxText model of the llama family"),
             ((step, "--config", config, "--maxtext-model", "mistral-7b"), "MistralForCausalLM model, not"),
             ((step,), "pass --config FILE")]
    tmp_save = tmp_path / "run" / "5.orbax-checkpoint-tmp"
    shutil.copytree(step, tmp_save)
    cases.append(((str(tmp_save), "--config", config), "unfinished Orbax save"))
    unmerged = tmp_path / "unmerged"
    shutil.copytree(step, unmerged)
    os.remove(unmerged / "items" / "manifest.ocdbt")
    os.makedirs(unmerged / "items" / "ocdbt.process_0")
    cases.append(((str(unmerged), "--config", config, "--maxtext-model", "llama2-7b"), "an unmerged save"))
    extra = dict(maxtext_leaves("llama2", cfg, sd, True))
    extra[P + "vision_encoder.patch.kernel"] = np.zeros((4, 4), np.float32)
    odd = write_checkpoint(str(tmp_path / "odd"), extra, custom={"reshard": {"maxtext_model": "llama2-7b"}})
    cases.append(((odd, "--config", config), "vision_encoder.patch.kernel' is not part of"))
    for args, words in cases:
        code, stdout, err = run_cli(capsys, "convert", *args, out, "--to", "hf")
        assert code == 2, (args, err)
        assert words in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_training_checkpoint_run_folder(llama, tmp_path):
    """A run's checkpoints/ folder: the newest complete step (an unfinished one ignored); fp32 params beside
    opt_state and step: parameters only, with a note; --tag picks another step."""
    tmp, cfg, sd = llama
    leaves = {k: v.astype(np.float32) for k, v in maxtext_leaves("llama2", cfg, sd, True).items()}
    opt = {"opt_state.0.mu." + k[len("params."):]: np.zeros_like(v) for k, v in leaves.items()}
    opt["step"] = np.array(2, np.int32)
    run = tmp_path / "run" / "checkpoints"
    custom = {"reshard": {"maxtext_model": "llama2-7b"}}
    write_checkpoint(str(run), {k: v * 0 for k, v in leaves.items()}, step=1, extra=opt, custom=custom)
    write_checkpoint(str(run), leaves, step=2, extra=opt, custom=custom)
    os.makedirs(run / "3.orbax-checkpoint-tmp" / "items")
    result = reshard.convert(str(tmp_path / "run"), str(tmp_path / "out"), to="hf", config=str(tmp / "hf" / "config.json"),
                             workers=2, max_shard_size=60000)
    assert result.workers == 1 and "TensorStore" in result.workers_reason  # it aborts in a forked worker
    got = {}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            got.update({k: np_of(v) for k, v in load_file(os.path.join(tmp_path / "out", name)).items()})
    assert len(got) == len(sd) and all(got[k].dtype == sd[k].dtype and same(got[k], sd[k]) for k in sd)  # fp32 -> bf16 (config dtype), exact
    assert any("optimizer state is not converted" in n for n in result.notes)
    assert any("read step 2" in n for n in result.notes)
    info = reshard.inspect(str(tmp_path / "run"), config=str(tmp / "hf" / "config.json"))
    assert info["maxtext"]["step"] == "2" and info["maxtext"]["not_read"] == ["opt_state", "step"]
    reshard.convert(str(run), str(tmp_path / "out1"), to="hf", config=str(tmp / "hf" / "config.json"), tag="1",
                    dtype="fp32")
    assert not load_out(tmp_path / "out1")["model.norm.weight"].any()


def test_without_tensorstore(llama, tmp_path, monkeypatch, capsys):
    """Spec 7.7 item 7: without tensorstore every other layout works and a MaxText source says how to install it."""
    step = scanned(llama, tmp_path)
    real = builtins.__import__

    def no_tensorstore(name, *a, **kw):
        if name == "tensorstore" or name.startswith("tensorstore."):
            raise ImportError("No module named 'tensorstore'")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tensorstore)
    code, _, err = run_cli(capsys, "convert", step, tmp_path / "o", "--to", "hf", "--config",
                           str(llama[0] / "hf" / "config.json"))
    assert code == 2 and "pip install 'reshard[maxtext]'" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, "inspect", llama[0] / "hf")
    assert code == 0 and "LlamaForCausalLM" in out
    code, _, err = run_cli(capsys, "convert", llama[0] / "hf", tmp_path / "w", "--to", "maxtext", "--maxtext-model",
                           "llama2-7b")
    assert code == 2 and "pip install 'reshard[maxtext]'" in err and not (tmp_path / "w").exists()


def test_round_trip_verify_load_rank_live_plan(llama, tmp_path, capsys):
    """hf -> maxtext -> hf bit for bit (llama2 conventions: the 1/4 query scale is exact); the output carries its
    provenance (no --config, no --maxtext-model on the way back); verify (digest and --forward), plan, load_rank
    (from a MaxText source; a MaxText "rank" is the whole model) and live.plan know the layout."""
    import torch

    tmp, cfg, sd = llama
    out = tmp_path / "mt"
    result = reshard.convert(str(tmp / "hf"), str(out), to="maxtext", maxtext_model="llama2-7b")
    assert any("load_parameters_path=<output>/0/items scan_layers=True" in n for n in result.notes)
    assert sorted(os.listdir(out / "0")) == ["_CHECKPOINT_METADATA", "commit_success.txt", "items"]
    info = reshard.inspect(str(out))
    assert info["layout"] == "maxtext" and info["maxtext"]["unstack_pass"] == "no"
    from reshard.io.orbax_store import Item

    item = Item(str(out / "0" / "items"))  # spec 7.5: one layer per chunk, the leading axis in 16, zstd level 1
    wi0 = item.leaf(P + "decoder.layers.mlp.wi_0.kernel")
    assert (wi0.shape, wi0.chunks, wi0.codec) == ((64, 3, 96), (4, 1, 96), "zstd")
    assert not os.path.exists(out / "0" / "items" / "_sharding") and sorted(item.paths)[-1] == "step"
    assert same_state(convert_hf(out, tmp_path / "back", tmp / "hf" / "config.json"), sd)
    code, text, err = run_cli(capsys, "verify", out, tmp / "hf")
    assert code == 0 and "EQUAL" in text, err
    plan = reshard.plan(str(out), to="vllm", tp=2)
    assert plan.plan.source_layout == "maxtext"
    rank = reshard.load_rank(str(out), "vllm", tp=2, rank=1)
    o = torch.from_numpy(sd["model.layers.1.self_attn.o_proj.weight"].view(np.uint16)).view(torch.bfloat16)
    assert torch.equal(rank["model.layers.1.self_attn.o_proj.weight"], o[:, 32:])
    assert len(reshard.load_rank(str(tmp / "hf"), "maxtext")) == len(sd)
    from reshard import live

    assert live.plan(str(tmp / "hf"), source={"layout": "maxtext"}, target={"layout": "vllm", "tp": 2},
                     source_ranks=[0], target_ranks=[1, 2]) is not None
    code, _, err = run_cli(capsys, "convert", tmp / "hf", tmp_path / "x", "--to", "maxtext", "--tp", 2,
                           "--maxtext-model", "llama2-7b")
    assert code == 2 and "--tp and --pp must be 1" in err


@pytest.mark.slow
def test_verify_forward(llama, tmp_path, capsys):
    tmp, cfg, sd = llama
    out = tmp_path / "mt"
    reshard.convert(str(tmp / "hf"), str(out), to="maxtext", maxtext_model="llama2-7b", scan_layers=False)
    code, text, err = run_cli(capsys, "verify", out, tmp / "hf", "--forward", "--seq-len", 4, "--batch", 1)
    assert code == 0 and "FORWARD EQUAL" in text, text + err


def same_state(got: dict, want: dict) -> bool:
    return set(got) == set(want) and all(same(got[k], want[k]) for k in want)


def test_detection_listings():
    """Spec 1.8: an item, a step, a folder of steps, a run folder are detected from a depth-3 listing; other
    layouts' listings are not."""
    from reshard.layouts.maxtext_folders import detect_names

    item = ["_METADATA", "manifest.ocdbt", "d/", "d/abc"]
    assert detect_names(item)
    assert detect_names(["_METADATA", "params.params.x/", "params.params.x/zarr.json"])
    assert detect_names(["_CHECKPOINT_METADATA", "items/", "items/_METADATA", "items/manifest.ocdbt"])
    assert detect_names(["0/", "0/items/", "0/items/_METADATA"])
    assert detect_names(["checkpoints/", "checkpoints/7/", "checkpoints/7/items/"])
    assert not detect_names(["config.json", "model.safetensors"])
    assert not detect_names(["latest", "global_step2/", "global_step2/mp_rank_00_model_states.pt"])
    assert not detect_names([".metadata", "__0_0.distcp"])


def test_nnx_post_training_tree(llama, tmp_path):
    """Spec 2: a post-training save (item folder model_params, the bare model tree with a trailing value key)
    reads as the Linen layout."""
    tmp, cfg, sd = llama
    leaves = {k[len(P):] + ".value": v for k, v in maxtext_leaves("llama2", cfg, sd, False).items()}
    step = write_checkpoint(str(tmp_path / "sft"), leaves, scan=False, item="model_params",
                            custom={"reshard": {"maxtext_model": "llama2-7b"}})
    assert same_state(convert_hf(step, tmp_path / "out", tmp / "hf" / "config.json"), sd)


def test_unstack_scratch_in_staging_folder(llama, tmp_path, monkeypatch):
    """Spec 7.3: a conversion's unstack pass writes its scratch inside the output's staging folder (the output's
    disk), not $RESHARD_SCRATCH; it is gone after a successful run (the output holds none of it) and after an
    interrupted one (nothing of the output either); inspect / verify keep $RESHARD_SCRATCH."""
    from reshard.layouts.maxtext_scratch import Scratch

    tmp, cfg, sd = llama
    step = scanned(llama, tmp_path, split=2)
    elsewhere = tmp_path / "scratch-env"
    elsewhere.mkdir()
    monkeypatch.setenv("RESHARD_SCRATCH", str(elsewhere))
    seen = []
    unstack = Scratch.unstack

    def spy(self, item, leaf, stacked=True):
        seen.append((self.folder, sorted(os.listdir(self.folder))))
        return unstack(self, item, leaf, stacked)

    monkeypatch.setattr(Scratch, "unstack", spy)
    got = convert_hf(step, tmp_path / "out", tmp / "hf" / "config.json")
    assert same(got["model.layers.1.mlp.up_proj.weight"], sd["model.layers.1.mlp.up_proj.weight"])
    folders = {os.path.dirname(f) for f, _ in seen}
    assert len(folders) == 1 and os.path.basename(folders.pop()).startswith(".out.reshard-partial-")
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    assert not any(os.path.exists(f) for f, _ in seen) and os.listdir(elsewhere) == []

    def interrupted(self, item, leaf, stacked=True):
        seen.append((self.folder, None))
        unstack(self, item, leaf, stacked)
        raise KeyboardInterrupt  # Ctrl-C in the middle of the pass, a scratch file written

    monkeypatch.setattr(Scratch, "unstack", interrupted)
    seen.clear()
    with pytest.raises(KeyboardInterrupt):
        reshard.convert(step, str(tmp_path / "out2"), to="hf", config=str(tmp / "hf" / "config.json"))
    assert seen and not os.path.exists(seen[0][0]) and not (tmp_path / "out2").exists()
    assert [n for n in os.listdir(tmp_path) if "reshard" in n] == []  # no staging folder, no lock left

    monkeypatch.setattr(Scratch, "unstack", spy)
    seen.clear()
    reshard.verify(step, str(tmp_path / "out"), config=str(tmp / "hf" / "config.json"))
    assert seen and all(os.path.dirname(f) == str(elsewhere) for f, _ in seen)
    assert os.listdir(elsewhere) == []
