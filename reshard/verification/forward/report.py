"""Compare two forward runs: logits (max abs / rel error, argmax agreement, KL), padded-vocab logits, and the
hidden state after every sub-block, to name where B first diverges from A; and the report's text
(:func:`format_report`).

Logits at B's padded vocab ids must be exactly zero (a non-zero ``lm_head`` padding row fails, named); A is the
reference and its padding is only reported (real Megatron checkpoints train their output layer's padding rows).

Tolerance basis: when A and B store the same dtype and compute is fp32, the weights must be identical and only
the reduction order differs, so the fp32 tolerance applies (``|a - b| <= 1e-5 + 1e-5 |a|`` on every logit).
When the stored dtypes differ (a cast) or compute is in a 16-bit dtype, the narrowest dtype sets it: bf16
``0.1 + 0.05 |a|`` and fp16 ``0.02 + 0.01 |a|`` on every logit, plus argmax agreement >= 0.99. ``atol``/``rtol``
override the defaults.
"""

from __future__ import annotations

import torch

TOLERANCES = {  # basis -> (atol, rtol, minimum argmax agreement)
    "float32": (1e-5, 1e-5, None),
    "bfloat16": (0.1, 0.05, 0.99),
    "float16": (0.02, 0.01, 0.99),
}
_WIDTH = {torch.float32: 3, torch.float64: 4, torch.float16: 1, torch.bfloat16: 0}


def tolerance(dtype_a: torch.dtype, dtype_b: torch.dtype, compute: torch.dtype, atol: float | None = None,
              rtol: float | None = None) -> dict:
    """The tolerance for comparing A and B, chosen as the module docstring describes."""
    if dtype_a == dtype_b and compute in (torch.float32, torch.float64):
        basis = torch.float32
    else:
        basis = min((dtype_a, dtype_b, compute), key=lambda d: _WIDTH.get(d, 3))
        basis = basis if basis in (torch.float16, torch.bfloat16) else torch.float32
    name = str(basis).removeprefix("torch.")
    default_atol, default_rtol, argmax = TOLERANCES[name]
    return {"basis": name, "atol": default_atol if atol is None else atol,
            "rtol": default_rtol if rtol is None else rtol, "min_argmax_agreement": argmax}


def describe_block(name: str, tensors: dict[str, str] | None = None) -> str:
    """A step of the run (``layer 2 attention``, ``head``) and B's tensors in it (``tensors``: step -> their
    names, from :func:`reshard.verification.forward.planning.block_tensors`), where known."""
    held = (tensors or {}).get(name)
    return f"{name} ({held})" if held else name


def _padding_problem(label: str, logits: torch.Tensor, vocab: int, world: int) -> tuple[str | None, float]:
    padded = logits.shape[-1]
    pad = logits[..., vocab:]
    worst = pad.abs().max().item() if pad.numel() else 0.0
    if worst == 0.0:
        return None, 0.0
    rows = (pad.reshape(-1, padded - vocab) != 0).any(0).nonzero().flatten() + vocab
    per = padded // world
    ranks = sorted({int(r) // per for r in rows})
    return (f"{label}: lm_head padding rows {int(rows[0])}..{int(rows[-1])} (padded vocab {padded}, rank(s) "
            f"{', '.join(map(str, ranks))}) give non-zero logits (max |logit| {worst:.3g})"), worst


def _within(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> bool:
    return bool(((a - b).abs() <= atol + rtol * a.abs()).all())


def copy_problems(copies: list[dict]) -> list[str]:
    """Copies of one key (``key``, ``sha256``, ``where``, ``used``, ``why`` from every rank) that differ from the
    copy the check computed with (else the first)."""
    by_key: dict[str, list[dict]] = {}
    for c in copies:
        by_key.setdefault(c["key"], []).append(c)
    out = []
    for key, found in by_key.items():
        ref = next((c for c in found if c["used"]), found[0])
        out += [f"replicated copy differs: {key} in {c['where']} vs the copy in {ref['where']} (SHA-256 differs); "
                f"{c['why']}" for c in found if c["sha256"] != ref["sha256"]]
    return out


def first_non_finite(label: str, run: dict, tensors: dict[str, str] | None = None) -> str | None:
    """Where ``run``'s hidden state (after each block), else its logits, first hold a NaN or an infinity."""
    for name, state in run["states"]:
        if not torch.isfinite(state).all():
            return f"{label}: non-finite values first appear after {describe_block(name, tensors)}"
    if not torch.isfinite(run["logits"]).all():
        return f"{label}: non-finite values first appear in the logits, after {describe_block('head', tensors)}"
    return None


def compare(a: dict, b: dict, vocab: int, tol: dict, findings: list[str] = (),
            tensors: dict[str, str] | None = None) -> dict:
    """``a``/``b``: {"logits", "states", "world"}; returns the comparison part of the report. ``findings``: what
    the ranks found while reading (non-finite weights, replicated copies that differ), each a problem. Non-finite
    values (weights, hidden states or logits) are reported as such, first: the comparisons that follow them
    (padding, divergence) are not. ``tensors``: B's tensors per step, named with a diverging step."""
    non_finite = [f for f in findings if "non-finite" in f]
    non_finite += [m for m in (first_non_finite("A", a), first_non_finite("B", b, tensors)) if m]
    others = [f for f in findings if "non-finite" not in f]
    if non_finite:
        result = compare_finite(a, b, vocab, tol)
        result.update(problems=non_finite + others, first_divergence=non_finite[0], ok=False)
        return result
    result = compare_finite(a, b, vocab, tol, tensors)
    if others:
        result["problems"] += others
        result["first_divergence"] = result["first_divergence"] or others[0]
        result["ok"] = False
    return result


def compare_finite(a: dict, b: dict, vocab: int, tol: dict, tensors: dict[str, str] | None = None) -> dict:
    """The comparison of two runs whose values are finite (``tensors``: as :func:`compare`)."""
    la, lb = a["logits"].double(), b["logits"].double()
    ra, rb = la[..., :vocab], lb[..., :vocab]
    diff = (ra - rb).abs()
    max_abs = diff.max().item()
    scale = ra.abs().max().item()
    argmax = (ra.argmax(-1) == rb.argmax(-1)).double().mean().item()
    logp_a, logp_b = torch.log_softmax(ra, -1), torch.log_softmax(rb, -1)
    kl = (logp_a.exp() * (logp_a - logp_b)).sum(-1).mean().item()
    logits_ok = _within(ra, rb, tol["atol"], tol["rtol"])
    if tol["min_argmax_agreement"] is not None:
        logits_ok &= argmax >= tol["min_argmax_agreement"]
    # B (the checkpoint under test) must hold zero padding rows; the reference A may not (megatron-core's own
    # GPTModel initialises its output layer's padding rows like any other): reported, not failed.
    pad_a, pad_max_a = _padding_problem("A", la, vocab, a["world"])
    pad_b, pad_max_b = _padding_problem("B", lb, vocab, b["world"])
    problems = [f"{pad_b}; padding rows must be zero"] if pad_b else []
    notes = [f"{pad_a}: the reference's own padding, not a failure"] if pad_a else []

    blocks, first = [], None
    for (name, sa), (name_b, sb) in zip(a["states"], b["states"]):
        assert name == name_b, (name, name_b)
        sa, sb = sa.double(), sb.double()
        block_abs = (sa - sb).abs().max().item()
        ok = _within(sa, sb, tol["atol"], tol["rtol"])
        blocks.append({"block": name, "max_abs": block_abs, "max_abs_a": sa.abs().max().item(), "ok": ok})
        if not ok and first is None:
            first = describe_block(name, tensors)
    if not logits_ok and first is None:
        first = describe_block("head", tensors)
    if first is None and pad_b:
        first = "lm_head padding rows" + (f" ({tensors['head']})" if tensors and tensors.get("head") else "")
    if not logits_ok:
        problems.insert(0, f"logits differ beyond tolerance (max abs {max_abs:.3g}, argmax agreement "
                           f"{argmax:.4f})")
    return {
        "max_abs": max_abs, "max_rel": max_abs / scale if scale else 0.0, "max_abs_logit_a": scale,
        "argmax_agreement": argmax, "kl_mean": kl, "logits_within_tolerance": logits_ok,
        "padding_max_abs_a": pad_max_a, "padding_max_abs_b": pad_max_b,
        "first_divergence": first if problems else None, "blocks": blocks, "problems": problems, "notes": notes,
        "ok": not problems,
    }


def format_report(r) -> str:
    """A few human-readable lines (``r``: the report, or its dict); the first divergence is named once."""
    tol = r["tolerance"]
    def side(label: str) -> list[str]:
        s = r[label.lower()]
        out = [f"{label} {s['layout']} tp={s['tp']} pp={s.get('pp', 1)} {s['dtype']} {s['path']}"]
        return out + ([f"  {label} runs {s['run']}"] if s.get("run") else [])

    argmax = f", argmax >= {tol['min_argmax_agreement']}" if tol["min_argmax_agreement"] else ""
    lines = side("A") + side("B") + [
             f"{r['batch']}x{r['seq_len']} tokens, {r['backend']}, compute {r['compute_dtype']}, tolerance "
             f"{tol['basis']}: atol {tol['atol']:g}, rtol {tol['rtol']:g}{argmax}",
             f"logits: max abs {r['max_abs']:.3g}, max rel {r['max_rel']:.3g}, argmax agreement "
             f"{r['argmax_agreement']:.4f}, KL(A||B) {r['kl_mean']:.3g}"]
    lines += [f"  {p}" for p in r["problems"]] + [f"  note: {n}" for n in r.get("notes", [])]
    first = r["first_divergence"]
    if r["ok"]:
        lines.append("FORWARD EQUAL")
    else:
        lines.append("FORWARD DIFFERENT" + ("" if first is None or first in r["problems"] else
                                            f" (first divergence: {first})"))
    return "\n".join(lines)
