"""One tiny transformers model per family saved to disk, and the outputs converted from it on demand (each
conversion at most once per test module): shared by tests/test_families.py and tests/test_families_gemma.py."""

from __future__ import annotations

import pytest
import torch

import json
import shutil

from family_rules import diff_states, load_hf_dir, load_megatron_rank, megatron_rank_path
from helpers import run_cli


def is_extra_state(name: str) -> bool:
    return "_extra_state" in name


class FamilyCase:
    """Family ``name``: a model of ``cls_name(**settings)`` with seeded noise on every parameter, saved under
    ``root/hf``; ``arch`` is the class transformers must build and save."""

    def __init__(self, transformers, name, root, cls_name, settings, arch):
        config = getattr(transformers, cls_name)(**settings)
        config.architectures = [arch]
        torch.manual_seed(sum(map(ord, name)))
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
        assert type(model).__name__ == arch
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        self.name, self.root, self.model = name, root, model
        self.src = root / "hf"
        model.save_pretrained(self.src)
        self.hf, self.config = load_hf_dir(self.src)
        assert self.config["architectures"] == [arch]
        self.outputs = {}

    def convert(self, capsys, key, src, *args):
        if key not in self.outputs:
            dst = self.root / key
            code, out, err = run_cli(capsys, "convert", src, dst, *map(str, args))
            assert code == 0, f"{self.name}: reshard convert {src.name} -> {key} {' '.join(map(str, args))} " \
                              f"exited {code}: {err.strip()[-2000:]}"
            self.outputs[key] = dst
        return self.outputs[key]

    def megatron(self, capsys, tp=2, pp=2, spec="te"):
        return self.convert(capsys, f"megatron_tp{tp}pp{pp}_{spec}", self.src, "--to", "megatron", "--tp", tp,
                            "--pp", pp, *(["--megatron-spec", "local"] if spec == "local" else []))

    def vllm(self, capsys, tp=2):
        return self.convert(capsys, f"vllm_tp{tp}", self.src, "--to", "vllm", "--tp", tp)

    def round_trip(self, capsys, tp, check_vllm):
        """hf -> megatron (tp, pp 2) -> vllm tp -> hf, the vLLM ranks checked with ``check_vllm(case, folder,
        tp)``; asserts the final HF tensors equal the source's byte for byte; returns (folder, its config)."""
        v = self.convert(capsys, "vllm_from_megatron", self.megatron(capsys), "--to", "vllm", "--tp", tp)
        check_vllm(self, v, tp)
        back = self.convert(capsys, "hf_back", v, "--to", "hf")
        got, config = load_hf_dir(back)
        problems = diff_states(got, self.hf, "hf")
        assert not problems, f"{self.name}: round trip\n" + "\n".join(problems[:40])
        return back, config

    def assert_same_logits(self, transformers, folder, ids, atol):
        """transformers' fp32 logits of the model in ``folder`` equal the source model's."""
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(loaded).__name__ == type(self.model).__name__
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, self.model(ids).logits, atol=atol, rtol=0)


def assert_swapped_query_heads_fail(capsys, case: FamilyCase, tmp_path, rows: tuple, layer: int, pp: int = 2):
    """Swap query-head rows ``rows`` (a, b) in linear_qkv of local layer 0 on Megatron rank (tp 1, pp 1), i.e.
    global ``layer``: verify --forward must exit 1 and name that layer's attention."""
    bad = tmp_path / "bad"
    shutil.copytree(case.megatron(capsys), bad)
    path = megatron_rank_path(bad, 1, 1, pp)
    blob = load_megatron_rank(path)
    a, b = rows
    w = blob["model"]["decoder.layers.0.self_attention.linear_qkv.weight"]
    w[a], w[b] = w[b].clone(), w[a].clone()
    torch.save(blob, path)
    code, r, err = verify_forward(capsys, case.src, bad)
    assert code == 1 and r is not None, f"exit {code}: {err.strip()[-2000:]}"
    assert not r["ok"] and r["max_abs"] > 1e-3
    assert r["first_divergence"].startswith(f"layer {layer} attention"), r["first_divergence"]


def verify_forward(capsys, src, dst):
    """``reshard verify --forward SRC DST --json``: (exit code, the JSON report or None, stderr)."""
    code, out, err = run_cli(capsys, "verify", "--forward", src, dst, "--json")
    try:
        report = json.loads(out)
    except ValueError:
        report = None
    return code, report, err


def families_fixture(transformers, families: dict, archs: dict):
    """A module-scoped fixture: ``families(name)`` builds family ``name`` once (``families[name]`` = (config
    class name, settings), ``archs[name]`` = the model class)."""

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        made = {}

        def get(name):
            if name not in made:
                made[name] = FamilyCase(transformers, name, tmp_path_factory.mktemp(name), *families[name], archs[name])
            return made[name]
        return get
    return fixture


def verify_perturbed_vllm(capsys, case: FamilyCase, tmp_path, name: str, index, rank: int = 1, folder=None):
    """Copy ``case``'s vLLM tp2 output (or ``folder``), scale ``name[index]`` by 3 on vLLM rank ``rank``, and run
    ``verify --forward`` against the source: (exit code, report or None, stderr)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(folder or case.vllm(capsys), bad)
    path = bad / f"model-rank-{rank}-part-0.safetensors"
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as f:
        metadata = f.metadata()
    tensors[name][index] *= 3.0
    save_file(tensors, str(path), metadata=metadata)
    return verify_forward(capsys, case.src, bad)


def assert_hf_back(transformers, case: FamilyCase, folder, ids) -> None:
    """``folder`` (hf) holds ``case``'s tensors bit for bit and its config.json verbatim, and transformers' logits of
    it on ``ids`` equal the source model's exactly."""
    got, config = load_hf_dir(folder)
    problems = diff_states(got, case.hf, "hf")
    assert not problems, "\n".join(problems[:40])
    assert config == case.config
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(loaded).__name__ == type(case.model).__name__
    with torch.no_grad():
        assert torch.equal(loaded(ids, use_cache=False).logits, case.model(ids, use_cache=False).logits)
