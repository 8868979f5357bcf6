"""What the Python API hands back (issue 43): both checks answer alike (``.equal``, ``.report``, ``.to_json()``:
what ``--json`` prints), ``reshard.plan`` gives the command's plan, every result's ``repr`` is one short line, a
forward divergence names B's own tensors once, and errors name keywords from Python, flags on the command line."""

from __future__ import annotations

import argparse
import inspect
import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import typer

import reshard
from checkpoints import make_hf
from helpers import run_cli
from reshard.cli import app


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A seeded 4-layer Llama in HF, and its Megatron conversions at tp=1 and tp=2 (with the result)."""
    base = tmp_path_factory.mktemp("api_results")
    src = make_hf(base / "hf", coded=False, seed=3, hidden=64, layers=4, heads=8, ffn=96, vocab=1000, kv_heads=2)
    tp1 = str(base / "m1")
    reshard.convert(src, tp1, to="megatron", tp=1)
    tp2 = str(base / "m2")
    return SimpleNamespace(src=src, tp1=tp1, tp2=tp2, converted=reshard.convert(src, tp2, to="megatron", tp=2))


@pytest.fixture(scope="module")
def reports(models):
    """The digest and the forward check of the HF model against its tp=1 conversion (one process)."""
    return {"digest": reshard.verify(models.src, models.tp1),
            "forward": reshard.verify(models.src, models.tp1, forward=True)}


@pytest.mark.parametrize("check,flags", [("digest", []), ("forward", ["--forward"])])
def test_both_checks_answer_with_equal_report_and_the_cli_s_json(models, reports, capsys, check, flags):
    report = reports[check]
    assert report.equal is True
    assert isinstance(report.report, dict) and json.loads(report.to_json()) == report.report
    code, out, err = run_cli(capsys, "verify", models.src, models.tp1, "--json", *flags)
    assert code == 0 and out.strip() == report.to_json(), err
    with pytest.raises(TypeError, match="test its .equal"):  # `assert reshard.verify(...)` cannot pass unread
        bool(report)


def test_the_forward_report_still_reads_as_a_dict(reports):
    report = reports["forward"]
    assert report["ok"] is True and report["a"]["layout"] == "hf" and report["b"]["tp"] == 1
    assert dict(report) == report.report and "max_abs" in report


def test_every_result_has_a_short_repr(models, reports):
    """The conversion's result listed every tensor of its plan (52 KB for a 4-layer model); each result is now one
    line naming what it is."""
    shown = {"convert": repr(models.converted), "plan": repr(reshard.plan(models.src, to="megatron", tp=2)),
             "digest": repr(reports["digest"]), "forward": repr(reports["forward"])}
    for name, text in shown.items():
        assert "\n" not in text and len(text) < 300, (name, len(text), text[:400])
    assert shown["convert"].startswith(f"ConvertResult(output={models.tp2!r}, layout='megatron', tp=2, pp=1, files=2, "
                                       f"bytes={models.converted.plan.nbytes}, workers=")
    assert shown["plan"].startswith("ConversionPlan(hf -> megatron, files=2, bytes=")
    assert shown["digest"].startswith(f"VerifyReport(equal=True, a={models.src!r}, b={models.tp1!r}")
    assert shown["forward"].startswith(f"ForwardReport(equal=True, a={models.src!r}, b={models.tp1!r}")


def test_plan_gives_the_cli_s_plan(models, capsys, tmp_path):
    plan = reshard.plan(models.src, to="megatron", tp=2, dtype="bf16")
    code, out, err = run_cli(capsys, "plan", models.src, "--to", "megatron", "--tp", "2", "--dtype", "bf16")
    assert code == 0 and out == plan.describe() + "\n", err
    code, out, err = run_cli(capsys, "plan", models.src, "--to", "megatron", "--tp", "2", "--dtype", "bf16", "--json")
    assert code == 0 and json.loads(out) == plan.to_dict() == json.loads(plan.to_json())
    assert len(plan.files) == 2 and plan.nbytes == models.converted.plan.nbytes // 2  # bf16: half the bytes


def test_plan_takes_the_cli_plan_s_options_typed():
    cli = {p.name for p in typer.main.get_command(app).commands["plan"].params} - {"as_json"}
    parameters = inspect.signature(reshard.plan).parameters
    assert set(parameters) == cli
    assert all(p.annotation is not inspect.Parameter.empty for p in parameters.values())


def _edit_megatron(path, edit) -> None:
    """Load a trusted test rank file (weights_only, Namespace allowed), edit its model dict, save it back."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        blob = torch.load(path, map_location="cpu", weights_only=True)
    edit(blob["model"])
    torch.save(blob, path)


def test_a_divergence_names_b_s_tensors_in_that_layer_once(models, tmp_path):
    """A plain Llama's layer 1 MLP broken in a Megatron B: the report names B's three tensors of that block, by
    B's names, once; nothing another family has (q/k norms, latent attention, experts) nor another layout's names."""
    bad = tmp_path / "bad"
    shutil.copytree(models.tp1, bad)

    def edit(sd):
        sd["decoder.layers.1.mlp.linear_fc2.weight"] += 0.1

    _edit_megatron(bad / "release" / "mp_rank_00" / "model_optim_rng.pt", edit)
    report = reshard.verify(models.src, str(bad), forward=True)
    assert not report.equal
    assert report["first_divergence"] == ("layer 1 mlp (model/decoder.layers.1.mlp.linear_fc1.layer_norm_weight, "
                                          "model/decoder.layers.1.mlp.linear_fc1.weight, "
                                          "model/decoder.layers.1.mlp.linear_fc2.weight)")
    text = report.describe()
    assert text.count("linear_fc2") == 1 and text.endswith(f"(first divergence: {report['first_divergence']})"), text
    for other in ("q/k norm", "kv_a_proj", "latent", "expert", "vLLM", "gate_up_proj"):
        assert other not in text, (other, text)


def test_expert_names_are_collapsed():
    from reshard.verification.forward.planning import collapse

    names = [f"decoder.layers.3.mlp.experts.local_experts.{e}.linear_fc{k}.weight" for e in range(8) for k in (1, 2)]
    assert collapse(["decoder.layers.3.mlp.router.weight"] + names) == [
        "decoder.layers.3.mlp.router.weight", "decoder.layers.3.mlp.experts.local_experts.{0..7}.linear_fc1.weight",
        "decoder.layers.3.mlp.experts.local_experts.{0..7}.linear_fc2.weight"]


def test_errors_name_keywords_from_python_and_flags_on_the_command_line(models, tmp_path, capsys):
    out = str(tmp_path / "out")
    with pytest.raises(reshard.PlanError) as python:
        reshard.convert(models.src, out, to="hf", tp=2)
    code, _, err = run_cli(capsys, "convert", models.src, out, "--to", "hf", "--tp", "2")
    assert code == 2 and "--tp and --pp must be 1 for --to hf" in err
    assert str(python.value).endswith('tp and pp must be 1 for to="hf"') and "--" not in str(python.value)
    with pytest.raises(reshard.ReshardError) as python:
        reshard.verify(models.src, models.tp2, forward=True, nproc=4)
    code, _, err = run_cli(capsys, "verify", "--forward", models.src, models.tp2, "--nproc", "4")
    assert code == 2 and "use --nproc 2 (got 4)" in err and "use nproc=2 (got 4)" in str(python.value)
    with pytest.raises(reshard.ReshardError, match=r"^workers applies to the digest check; a forward check runs "
                                                   r"nproc processes$"):
        reshard.verify(models.src, models.tp2, forward=True, workers=2)


def test_python_terms_spell_only_the_function_s_options():
    from reshard.api import python_terms

    assert python_terms("--drop-mtp applies to --to hf, not --to vllm", reshard.convert) == \
        'drop_mtp=True applies to to="hf", not to="vllm"'
    assert python_terms("use --nproc 2, or torchrun --nproc-per-node 2", reshard.verify) == \
        "use nproc=2, or torchrun --nproc-per-node 2"
    assert python_terms("--config does not apply; pass --config FILE", reshard.convert) == \
        "config does not apply; pass config=FILE"


def test_the_automatic_worker_choice_is_the_api_s_default(models):
    for function in (reshard.convert, reshard.plan, reshard.verify):
        assert inspect.signature(function).parameters["workers"].default is None, function
    assert " chosen for " in models.converted.workers_reason
