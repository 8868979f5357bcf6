"""The README and docs/ are the user's documents: short README, links that resolve, no development-machine paths
or dates, and the two commands first (the test command being the one .ci/run runs)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

INSTALL_DEMO = "pip install torch==2.13.0 -e . && reshard demo"
INSTALL_TEST = "pip install torch==2.13.0 -e '.[test]' && python -m pytest -q"


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_commands(text: str) -> list[str]:
    """The command lines of the fenced shell blocks, in order (comments and blank lines skipped)."""
    commands = []
    for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if lang not in ("bash", "sh", "shell", "console", ""):
            continue
        commands += [line.strip() for line in body.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return commands


def test_docs_exist():
    assert {p.name for p in DOCS} >= {"layouts.md", "moe.md", "verification.md", "vllm.md", "hub.md",
                                      "scaling-out.md", "benchmarks.md", "plugins.md", "testing.md"}


def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 300, len(lines)


def test_readme_first_two_commands_are_install_demo_and_install_test():
    assert code_commands(README.read_text())[:2] == [INSTALL_DEMO, INSTALL_TEST]


def test_ci_runs_the_readme_test_command_verbatim():
    ci_commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#")]
    assert ci_commands[-1] == code_commands(README.read_text())[1]


def test_readme_says_how_to_get_the_cpu_torch_build():
    text = README.read_text()
    assert "--index-url https://download.pytorch.org/whl/cpu" in text


def test_readme_names_every_builtin_layout():
    text = README.read_text()
    assert "--to {hf,megatron,vllm}" not in text
    for layout in ("hf", "megatron", "torch_dist", "vllm", "trtllm", "meta"):
        assert f"`{layout}`" in text, layout


def links(text: str) -> list[str]:
    """Targets of markdown links and images, minus code spans and fenced blocks."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]\n]*\]\(([^)\s]+)\)", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file."""
    found = set()
    for heading in re.findall(r"^#+\s+(.*)$", path.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_resolve(page):
    checked = 0
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        assert dest.exists(), f"{page_id(page)} links to {target}, which does not exist"
        if anchor and dest.suffix == ".md":
            assert anchor in anchors(dest), f"{page_id(page)} links to {target}: no such heading"
        checked += 1
    if page == README:
        assert checked >= len(DOCS), "the README links every doc"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_machine_paths_or_dates(page):
    text = page.read_text()
    for path in (f"/{folder}/" for folder in ("tmp", "work", "root", "home")):  # machine paths
        assert path not in text, f"{page_id(page)} names {path}"
    dates = re.findall(r"\b\d{4}-\d{2}-\d{2}\b", text)
    assert not dates, f"{page_id(page)} has dates {dates}"


NARRATIVE = re.compile(r"\b(this|that|an earlier|earlier|last|previous) (session|working day)s?\b|\bsessions\b",
                       re.I)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_no_session_narrative(page):
    found = NARRATIVE.findall(page.read_text())
    assert not found, f"{page_id(page)} dates figures to a session: {found}"


def test_every_doc_is_linked_from_the_readme():
    linked = {Path(t.partition("#")[0]).name for t in links(README.read_text()) if t.startswith("docs/")}
    assert {p.name for p in DOCS} <= linked


def python_blocks(text: str) -> list[str]:
    """The bodies of the fenced Python blocks, in order."""
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M) if lang == "python"]


def test_the_readme_python_section_runs(tmp_path):
    """The README's Python API block, run as a plain script (no ``__main__`` guard) on a tiny Llama folder named
    as in the README, at tp=2 instead of 8 (8 forward processes on a small machine take long); it prints the plan,
    a one-line result, and both checks pass."""
    import os
    import subprocess
    import sys

    import reshard
    from checkpoints import make_hf

    block = next(b for b in python_blocks(README.read_text()) if b.startswith("import reshard\n"))
    assert "reshard.plan(" in block and ".equal" in block and "forward=True" in block
    make_hf(tmp_path / "Llama-3-8B", coded=False, seed=3, hidden=64, layers=2, heads=8, ffn=96, vocab=1000, kv_heads=2)
    script = tmp_path / "readme.py"
    script.write_text(block.replace("tp=8", "tp=2").replace("rank=3", "rank=1"))
    here = os.path.dirname(os.path.dirname(reshard.__file__))
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get(
                              "PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "plan: hf -> megatron, 2 files, 0.7 MiB to write", proc.stdout
    assert any(line.startswith("ConvertResult(output='llama-tp8', layout='megatron', tp=2, pp=1, files=2")
               for line in lines), proc.stdout
    assert lines[-1] == "1024", proc.stdout  # the padded vocab: 1000 up to a multiple of 128 x tp
