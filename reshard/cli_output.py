"""How the ``reshard`` commands print results: a conversion plan (text or JSON) and its download line, a digest
report, ``verify --dry-run``'s estimate (bytes read and peak memory per process), a push's outcome."""

from __future__ import annotations

import json
import sys


def _describe_plan(plan, out=None) -> None:
    from reshard.results import describe_plan

    print(describe_plan(plan), file=out or sys.stdout)



def _describe_download(download: dict, out=None) -> None:
    from reshard.results import download_line

    print(download_line(download), file=out or sys.stdout)



def _plan_json(plan) -> dict:
    from reshard.results import plan_json

    return plan_json(plan)



def _print_digest_report(report, a: str, b: str, as_json: bool) -> None:
    from reshard.verification.digest import format_report

    print(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report))



def _format_estimate(estimate: dict) -> str:
    """``verify --dry-run`` (digest or forward): what is read how, then one line per process (bytes read from A
    and B, peak memory estimate)."""
    from reshard.progress import binary_size

    lines = [f"A {estimate['layout_a']} {estimate['a']}", f"B {estimate['layout_b']} {estimate['b']}"]
    if "tensors" in estimate:  # the digest check
        lines.append(f"{estimate['tensors']} canonical tensors and {estimate['replica_checks']} stored replicas, read "
                     f"in blocks of at most {binary_size(estimate['block_bytes'])} a side, by "
                     f"{len(estimate['processes'])} process{'es' if len(estimate['processes']) > 1 else ''}:")
    lines += estimate.get("lines", [])
    for i, p in enumerate(estimate["processes"]):
        lines.append(f"  process {i}: reads {binary_size(p['read_a'])} of A and {binary_size(p['read_b'])} of B, "
                     f"peak memory about {binary_size(p['peak_estimate'])}")
    return "\n".join(lines)



def _report_push(folder: str, pushed) -> None:
    if pushed.others:
        print(f"warning: {len(pushed.others)} file(s) on {pushed.repo_id}@{pushed.revision} are not part of this "
              f"checkpoint (e.g. {pushed.others[0]}); pass --replace to delete them", file=sys.stderr)
    if not pushed.changed:
        print(f"{pushed.repo_id}@{pushed.revision} already has these files: nothing to commit")
    else:
        print(f"pushed {folder} to {pushed.repo_id}@{pushed.revision}: {pushed.pr_url or pushed.url}")
