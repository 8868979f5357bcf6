"""The Hub integration end to end: the real huggingface_hub client (in `reshard` subprocesses, with their own
HF_* environment) against tests/hub_server.py on 127.0.0.1. Nothing here reaches the internet."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import socket
import subprocess
import sys

import pytest

from checkpoints import make_hf
from hub_server import HubServer

from reshard.hub import HubRef, parse_repo_id
from reshard.hub.selection import select_files
from reshard.errors import ReshardError

TOKENS = {"hf_alice": "alice", "hf_bob": "bob"}
SRC_REPO = "org/tiny"


def folder_files(folder) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder).replace(os.sep, "/")] = open(path, "rb").read()
    return out


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A sharded position-coded Llama checkpoint plus files a conversion must not download."""
    path = make_hf(tmp_path_factory.mktemp("hubsrc") / "tiny", shards=2, hidden=64, heads=8, kv_heads=4, ffn=96,
                   vocab=1000)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump({"model": {"vocab": {}}}, f)
    return path


def repo_files(src) -> dict[str, bytes]:
    files = folder_files(src)
    files["pytorch_model.bin"] = b"\0" * 4096  # another format of the same weights
    files["original/consolidated.00.pth"] = b"\1" * 4096
    files["README.md"] = b"# tiny\n"
    return files


@pytest.fixture
def hub(src):
    with HubServer() as server:
        server.state.tokens.update(TOKENS)
        server.state.add_repo(SRC_REPO, repo_files(src))
        yield server


class HubEnv:
    """Points huggingface_hub at a test server: HF_* variables (for subprocesses) and its ``constants`` (read at
    call time in this process), undone after the test. ``run`` calls the CLI in-process (one torch import)."""

    def __init__(self, monkeypatch, tmp_path):
        self.monkeypatch, self.tmp_path = monkeypatch, tmp_path

    def use(self, endpoint: str, token: str | None = "hf_alice", offline: bool = False, home: str = "hfhome"):
        from huggingface_hub import constants

        mp, hf_home = self.monkeypatch, self.tmp_path / home
        for key in list(os.environ):
            if key.startswith("HF_") or "proxy" in key.lower():
                mp.delenv(key)
        variables = dict(HF_ENDPOINT=endpoint, HF_HUB_DISABLE_XET="1", HF_HOME=str(hf_home),
                         HF_HUB_CACHE=str(hf_home / "hub"), HF_HUB_DISABLE_TELEMETRY="1",
                         HF_HUB_DISABLE_PROGRESS_BARS="1", HF_HUB_OFFLINE="1" if offline else "0",
                         NO_PROXY="127.0.0.1")
        if token:
            variables["HF_TOKEN"] = token
        for key, value in variables.items():
            mp.setenv(key, value)
        patched = dict(ENDPOINT=endpoint, HUGGINGFACE_CO_URL_TEMPLATE=endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                       HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"), HF_TOKEN_PATH=str(hf_home / "token"),
                       HF_STORED_TOKENS_PATH=str(hf_home / "stored_tokens"), HF_HUB_OFFLINE=offline,
                       HF_HUB_DISABLE_XET=True, HF_HUB_DISABLE_TELEMETRY=True)
        for key, value in patched.items():
            mp.setattr(constants, key, value)
        return self

    def at(self, endpoint: str, **kwargs) -> "Bound":
        return Bound(self, endpoint, kwargs)

    def run(self, *args, ok=True):
        from reshard import cli

        out, err = io.StringIO(), io.StringIO()
        self.monkeypatch.setattr(sys, "argv", ["reshard", *map(str, args)])
        code = 0
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                cli.main()
            except SystemExit as exc:
                code = exc.code or 0
        proc = subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
        if ok:
            assert code == 0, proc.stderr
        return proc

    def subprocess(self, *args):
        proc = subprocess.run([sys.executable, "-m", "reshard", *map(str, args)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc


class Bound:
    """One client configuration (endpoint, token, offline, HF_HOME), applied before each command."""

    def __init__(self, hubenv: HubEnv, endpoint: str, kwargs: dict):
        self.hubenv, self.endpoint, self.kwargs = hubenv, endpoint, kwargs

    def run(self, *args, ok=True):
        return self.hubenv.use(self.endpoint, **self.kwargs).run(*args, ok=ok)

    def subprocess(self, *args):
        return self.hubenv.use(self.endpoint, **self.kwargs).subprocess(*args)


@pytest.fixture
def hubenv(monkeypatch, tmp_path):
    return HubEnv(monkeypatch, tmp_path)


def assert_one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def closed_port_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


NEEDED = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
          "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]


# -- pure parts --------------------------------------------------------------------------------------------------

def test_parse_repo_id():
    assert parse_repo_id("hf://org/name@tp8") == HubRef("org/name", "tp8")
    assert parse_repo_id("org/name", "dev") == HubRef("org/name", "dev")
    assert str(HubRef("org/name", "v1")) == "hf://org/name@v1"
    for bad in ("hf://name", "hf://org/name@", "org/../x", "hf://a/b/c"):
        with pytest.raises(ReshardError):
            parse_repo_id(bad)


def test_select_files_prefers_safetensors_and_skips_other_formats():
    listing = ["config.json", "model.safetensors", "pytorch_model.bin", "original/consolidated.00.pth",
               "consolidated.safetensors", "tokenizer.json", "README.md", "onnx/model.onnx"]
    assert select_files(listing) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert select_files(listing, include=("README.md", "onnx/*")) == \
        ["README.md", "config.json", "model.safetensors", "onnx/model.onnx", "tokenizer.json"]
    sharded = ["config.json", "model.safetensors.index.json", "model-1.safetensors", "model-2.safetensors",
               "consolidated.safetensors", "pytorch_model.bin.index.json", "pytorch_model-1.bin"]
    index = json.dumps({"weight_map": {"a": "model-1.safetensors", "b": "model-2.safetensors"}})
    assert select_files(sharded, read_text={"model.safetensors.index.json": index}.__getitem__) == \
        ["config.json", "model-1.safetensors", "model-2.safetensors", "model.safetensors.index.json"]
    bins = ["config.json", "pytorch_model.bin.index.json", "pytorch_model-1.bin", "pytorch_model-2.bin"]
    assert select_files(bins) == sorted(bins)
    megatron = ["latest_checkpointed_iteration.txt", "iter_0000100/mp_rank_00/model_optim_rng.pt",
                "iter_0000200/mp_rank_00/model_optim_rng.pt", "iter_0000200/mp_rank_01/model_optim_rng.pt",
                "config.json", "tokenizer.json", "README.md"]
    assert select_files(megatron, read_text={"latest_checkpointed_iteration.txt": "200\n"}.__getitem__) == \
        ["config.json", "iter_0000200/mp_rank_00/model_optim_rng.pt", "iter_0000200/mp_rank_01/model_optim_rng.pt",
         "latest_checkpointed_iteration.txt", "tokenizer.json"]
    torch_dist = ["latest_checkpointed_iteration.txt", "iter_0000005/metadata.json", "iter_0000005/.metadata",
                  "iter_0000005/common.pt", "iter_0000005/__0_0.distcp", "iter_0000003/metadata.json",
                  "iter_0000003/.metadata", "iter_0000003/__0_0.distcp", "config.json", "README.md"]
    assert select_files(torch_dist, read_text={"latest_checkpointed_iteration.txt": "5\n"}.__getitem__) == \
        ["config.json", "iter_0000005/.metadata", "iter_0000005/__0_0.distcp", "iter_0000005/common.pt",
         "iter_0000005/metadata.json", "latest_checkpointed_iteration.txt"]
    vllm = ["model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors", "reshard.json", "config.json",
            "model.safetensors", "README.md"]
    assert select_files(vllm) == ["config.json", "model-rank-0-part-0.safetensors",
                                  "model-rank-1-part-0.safetensors", "reshard.json"]


# -- pull ----------------------------------------------------------------------------------------------------------

def test_pull_downloads_only_what_a_conversion_needs(hub, src, tmp_path, hubenv):
    env = hubenv.at(hub.endpoint)
    proc = env.run("pull", SRC_REPO)
    snapshot = proc.stdout.strip().splitlines()[-1]
    assert snapshot.startswith(str(tmp_path / "hfhome" / "hub"))
    assert sorted(folder_files(snapshot)) == NEEDED
    expected = folder_files(src)
    assert all(folder_files(snapshot)[f] == expected[f] for f in NEEDED)
    fetched = {path for method, path, _ in hub.state.requests if method == "GET"}
    assert not any(p.endswith((".bin", ".pth", "README.md")) for p in fetched)
    # --local-dir and --include; a second pull of the cache downloads nothing again
    proc = env.run("pull", f"hf://{SRC_REPO}", "--local-dir", tmp_path / "local", "--include", "README.md")
    assert sorted(f for f in folder_files(tmp_path / "local") if not f.startswith(".cache")) == \
        sorted(NEEDED + ["README.md"])
    before = len(hub.state.requests)
    env.run("pull", SRC_REPO)
    assert not [r for r in hub.state.requests[before:] if r[0] == "GET" and "/resolve/" in r[1]]


def test_pull_resumes_after_a_dropped_connection(tmp_path, hubenv):
    big = make_hf(tmp_path / "big", hidden=256, heads=8, kv_heads=2, ffn=256, vocab=8192, layers=1, coded=False)
    files = folder_files(big)
    assert len(files["model.safetensors"]) > 12 << 20
    with HubServer() as server:
        server.state.add_repo("org/big", files)
        cut = (10 << 20) + 12345  # past huggingface_hub's 10 MiB download chunk, so a chunk reached the disk
        server.state.drop_once["model.safetensors"] = cut
        proc = hubenv.at(server.endpoint, token=None).run("pull", "org/big")
        ranges = [r for m, p, r in server.state.requests if m == "GET" and p.startswith("/lfs-cdn/")]
    assert ranges == [None, f"bytes={10 << 20}-"]  # the retry asks only for what is missing
    assert folder_files(proc.stdout.strip().splitlines()[-1])["model.safetensors"] == files["model.safetensors"]


# -- plan from headers ---------------------------------------------------------------------------------------------

def test_plan_from_remote_headers_downloads_no_weights(hub, src, tmp_path, hubenv):
    env = hubenv.at(hub.endpoint)
    remote = json.loads(env.run("plan", f"hf://{SRC_REPO}", "--to", "megatron", "--tp", "4", "--json").stdout)
    local = json.loads(env.run("plan", src, "--to", "megatron", "--tp", "4", "--json").stdout)
    assert hub.state.weight_bytes_served == 0
    assert remote["files"] == local["files"] and len(remote["files"]) == 4
    assert remote["bytes_read_per_source"] == local["bytes_read_per_source"]
    sizes = {f: len(b) for f, b in folder_files(src).items()}
    to_fetch = [f for f in NEEDED if f not in ("config.json", "model.safetensors.index.json")]  # the plan read these
    assert remote["download"] == {"files": len(to_fetch), "bytes": sum(sizes[f] for f in to_fetch)}
    ranges = [r for m, p, r in hub.state.requests if m == "GET" and p.startswith("/lfs-cdn/")]
    assert len(ranges) == 4 and all(r == "bytes=0-7" or r.startswith("bytes=8-") for r in ranges)
    proc = env.run("convert", f"hf://{SRC_REPO}", tmp_path / "out", "--to", "megatron", "--tp", "2",
                   "--dry-run")
    assert "bytes to download:" in proc.stdout and "release/mp_rank_01/model_optim_rng.pt" in proc.stdout
    assert not (tmp_path / "out").exists() and hub.state.weight_bytes_served == 0


# -- convert from hf://, push ----------------------------------------------------------------------------------------

def test_convert_push_new_repo_branch_and_unchanged_repush(hub, src, tmp_path, hubenv):
    env = hubenv.at(hub.endpoint)
    out = tmp_path / "tp2"
    env.run("convert", f"hf://{SRC_REPO}@main", out, "--to", "megatron", "--tp", "2",
            "--push-to", "alice/tiny-tp2")
    assert "EQUAL" in env.run("verify", f"hf://{SRC_REPO}", out).stdout
    commit = hub.state.repos[SRC_REPO].branches["main"]
    local = folder_files(out)
    remote = hub.state.files("alice/tiny-tp2")
    manifest = json.loads(remote["reshard.json"])
    assert manifest["source"] == {"repo": SRC_REPO, "revision": "main", "commit": commit}
    assert (manifest["layout"], manifest["degrees"], manifest["tool"]) == ("megatron", {"tp": 2, "pp": 1}, "reshard")
    content = {f: b for f, b in local.items() if f != "reshard.json"}
    assert {f: b for f, b in remote.items() if f in content} == content
    assert manifest["sha256"] == {f: hashlib.sha256(b).hexdigest() for f, b in content.items()}
    card = remote["README.md"].decode()
    assert f"base_model: {SRC_REPO}" in card and "## How this checkpoint was produced" in card and commit in card

    # another conversion to a new branch of the same repo: the branch holds exactly that checkpoint
    tp4 = tmp_path / "tp4"
    env.run("convert", f"hf://{SRC_REPO}", tp4, "--to", "megatron", "--tp", "4", "--pp", "2")
    commits = hub.state.commit_count
    proc = env.run("push", tp4, "alice/tiny-tp2", "--revision", "megatron-tp4", "--commit-message", "tp4 pp2")
    assert "pushed" in proc.stdout and hub.state.commit_count == commits + 1
    branch = hub.state.files("alice/tiny-tp2", "megatron-tp4")
    assert {f: b for f, b in branch.items() if f not in ("reshard.json", "README.md", ".gitattributes")} == \
        {f: b for f, b in folder_files(tp4).items() if f != "reshard.json"}
    assert json.loads(branch["reshard.json"])["degrees"] == {"tp": 4, "pp": 2}
    assert hub.state.files("alice/tiny-tp2") == remote  # main untouched
    # re-pushing unchanged files makes no commit, on the branch and on main
    proc = env.run("push", tp4, "alice/tiny-tp2", "--revision", "megatron-tp4")
    assert "nothing to commit" in proc.stdout and hub.state.commit_count == commits + 1
    proc = env.run("push", out, "alice/tiny-tp2")
    assert "nothing to commit" in proc.stdout and hub.state.commit_count == commits + 1


def test_push_private_repo_and_pull_request(hub, src, tmp_path, hubenv):
    env = hubenv.at(hub.endpoint)
    out = tmp_path / "hf-out"
    env.run("convert", src, out, "--to", "hf", "--max-shard-size", "100KB")
    env.run("push", out, "alice/private-copy", "--private")
    repo = hub.state.repos["alice/private-copy"]
    assert repo.private and hub.state.files("alice/private-copy")["model.safetensors.index.json"] == \
        (out / "model.safetensors.index.json").read_bytes()
    manifest = json.loads(hub.state.files("alice/private-copy")["reshard.json"])
    assert manifest["source"] is None and manifest["layout"] == "hf"
    # private: invisible without a token, readable by the owner's token from the login file
    assert_one_line_error(hubenv.at(hub.endpoint, token=None, home="anon").run("pull",
                                  "alice/private-copy", ok=False), "not found or not accessible", "HTTP 401")
    login_env = hubenv.at(hub.endpoint, token=None, home="login")
    (tmp_path / "login").mkdir()
    (tmp_path / "login" / "token").write_text("hf_alice")  # what `hf auth login` writes
    login_env.run("inspect", "hf://alice/private-copy")
    (out / "extra.txt").write_text("changed\n")
    proc = env.run("push", out, "alice/private-copy", "--create-pr")
    assert "/discussions/1" in proc.stdout
    assert "extra.txt" in hub.state.files("alice/private-copy", "refs/pr/1")
    assert "extra.txt" not in hub.state.files("alice/private-copy")


def test_push_refuses_incomplete_output(hub, src, tmp_path, hubenv):
    env = hubenv.at(hub.endpoint)
    out = tmp_path / "m"
    env.run("convert", src, out, "--to", "megatron", "--tp", "2")
    partial = out / "release" / "mp_rank_00" / "model_optim_rng.pt.partial"
    partial.write_bytes(b"x")
    assert_one_line_error(env.run("push", out, "alice/x", ok=False), "model_optim_rng.pt.partial")
    partial.unlink()
    (out / "latest_checkpointed_iteration.txt").unlink()
    assert_one_line_error(env.run("push", out, "alice/x", ok=False), "latest_checkpointed_iteration.txt")
    staging = tmp_path / ".m.reshard-partial-abc"
    env.run("convert", src, staging, "--to", "hf")
    assert_one_line_error(env.run("push", staging, "alice/x", ok=False), "staging folder")
    sharded = tmp_path / "sharded"
    env.run("convert", src, sharded, "--to", "hf", "--max-shard-size", "100KB")
    (sharded / "model.safetensors.index.json").unlink()
    assert_one_line_error(env.run("push", sharded, "alice/x", ok=False), "model.safetensors.index.json")
    (tmp_path / "empty").mkdir()
    assert_one_line_error(env.run("push", tmp_path / "empty", "alice/x", ok=False), "not a checkpoint")
    assert "alice/x" not in hub.state.repos and not any(p == "/api/repos/create" for _, p, _ in hub.state.requests)


# -- errors ----------------------------------------------------------------------------------------------------------

def test_hub_errors_are_one_line_with_the_fix(hub, src, tmp_path, hubenv):
    hub.state.add_repo("org/gated", repo_files(src), gated=True)
    env = hubenv.at(hub.endpoint)
    assert_one_line_error(env.run("pull", "org/missing", ok=False), "org/missing", "not found", "HTTP 404")
    assert_one_line_error(env.run("pull", SRC_REPO, "--revision", "nope", ok=False),
                          "revision 'nope' does not exist")
    assert_one_line_error(env.run("plan", f"hf://{SRC_REPO}@nope", "--to", "hf", ok=False),
                          "revision 'nope' does not exist")
    assert_one_line_error(env.run("pull", "org/gated", ok=False), "gated", "HF_TOKEN")
    bad_token = hubenv.at(hub.endpoint, token="hf_wrong")
    assert_one_line_error(bad_token.run("pull", SRC_REPO, ok=False), "rejected the token", "401")
    bob = hubenv.at(hub.endpoint, token="hf_bob")
    out = tmp_path / "m"
    env.run("convert", src, out, "--to", "megatron", "--tp", "2")
    assert_one_line_error(bob.run("push", out, "alice/not-yours", ok=False), "permission denied", "403")
    anon = hubenv.at(hub.endpoint, token=None)
    assert_one_line_error(anon.run("push", out, "alice/not-yours", ok=False), "401")
    down = hubenv.at(closed_port_endpoint(), home="empty-cache")
    line = assert_one_line_error(down.run("pull", SRC_REPO, ok=False), "cannot reach the Hub")
    assert "HF_HUB_OFFLINE=1" in line and "cache" in line
    assert_one_line_error(down.run("plan", f"hf://{SRC_REPO}", "--to", "hf", ok=False), "cannot reach the Hub")
    offline = hubenv.at(hub.endpoint, offline=True, home="empty-cache")
    assert_one_line_error(offline.run("convert", f"hf://{SRC_REPO}", tmp_path / "o", "--to", "hf", ok=False),
                          "HF_HUB_OFFLINE=1", "reshard pull")
    assert not (tmp_path / "o").exists()


def test_offline_converts_hf_source_from_a_filled_cache(hub, src, tmp_path, hubenv):
    hubenv.at(hub.endpoint).run("pull", SRC_REPO)
    hub.stop()  # no server at all from here on
    offline = hubenv.at(closed_port_endpoint(), offline=True)
    out = tmp_path / "m"
    offline.subprocess("convert", f"hf://{SRC_REPO}", out, "--to", "megatron", "--tp", "2")  # env read at start-up
    assert "EQUAL" in offline.run("verify", src, out).stdout
    plan = json.loads(offline.run("plan", f"hf://{SRC_REPO}", "--to", "megatron", "--tp", "4", "--json").stdout)
    assert len(plan["files"]) == 4
    # the network being down with a filled cache works the same way without HF_HUB_OFFLINE
    down = hubenv.at(closed_port_endpoint())
    down.run("convert", f"hf://{SRC_REPO}", tmp_path / "m2", "--to", "hf")
    assert "EQUAL" in offline.run("verify", src, tmp_path / "m2").stdout


def test_manifest_merges_into_a_layout_record(tmp_path):
    from reshard.hub.manifest import build_manifest, model_card, write_manifest

    record = {"layout": "vllm", "tensor_parallel_size": 2, "files": ["model-rank-0-part-0.safetensors"]}
    (tmp_path / "reshard.json").write_text(json.dumps(record))
    (tmp_path / "model-rank-0-part-0.safetensors").write_bytes(b"abc")
    write_manifest(str(tmp_path), {"source": {"repo": SRC_REPO, "revision": "main", "commit": "c" * 40}})
    manifest = build_manifest(str(tmp_path), ["model-rank-0-part-0.safetensors"], "vllm", {"tp": 2})
    assert {k: manifest[k] for k in record} == record  # the layout's keys survive
    assert manifest["source"]["repo"] == SRC_REPO and manifest["degrees"] == {"tp": 2}
    assert manifest["sha256"] == {"model-rank-0-part-0.safetensors": hashlib.sha256(b"abc").hexdigest()}
    card = model_card("---\nlicense: mit\n---\n# Mine\n\ntext\n", "me/x", manifest)
    assert card.startswith("---\nlicense: mit\n---\n# Mine\n\ntext\n\n<!-- reshard:begin -->")
    assert model_card(card, "me/x", manifest) == card  # re-rendering is stable: an unchanged push stays a no-op


def test_push_to_an_existing_branch_deletes_nothing_without_replace(hub, src, tmp_path, hubenv):
    """Pushing to a branch that already holds files (e.g. the original weights on main) never deletes them unless
    --replace is given; a branch the push creates is cleaned of what it inherited from main."""
    env = hubenv.at(hub.endpoint)
    tp2, tp4 = tmp_path / "tp2", tmp_path / "tp4"
    env.run("convert", f"hf://{SRC_REPO}", tp2, "--to", "megatron", "--tp", "2")
    env.run("convert", f"hf://{SRC_REPO}", tp4, "--to", "megatron", "--tp", "4")
    env.run("push", tp4, "alice/model")
    proc = env.run("push", tp2, "alice/model")  # main already holds the tp4 checkpoint
    tp2_files = {f for f in folder_files(tp2) if f != "reshard.json"}
    tp4_files = {f for f in folder_files(tp4) if f != "reshard.json"}
    on_main = set(hub.state.files("alice/model"))
    stale = tp4_files - tp2_files  # mp_rank_02, mp_rank_03
    assert stale and stale <= on_main and tp2_files <= on_main
    assert "pass --replace to delete them" in proc.stderr
    env.run("push", tp2, "alice/model", "--replace")
    assert set(hub.state.files("alice/model")) - {"reshard.json", "README.md", ".gitattributes"} == tp2_files


@pytest.mark.parametrize("layout,args", [("megatron", ["--tp", "2", "--pp", "2"]), ("vllm", ["--tp", "2"])])
def test_megatron_and_vllm_repos_convert_back_from_the_hub(hub, src, tmp_path, hubenv, layout, args):
    """A pushed Megatron (tracker + iteration folder) or vLLM (model-rank files + reshard.json) repo is a source
    like any other: hf:// downloads its rank files, and converting it back to HF gives the original bytes."""
    env = hubenv.at(hub.endpoint)
    out = tmp_path / layout
    env.run("convert", src, out, "--to", layout, *args)
    env.run("push", out, f"alice/tiny-{layout}")
    proc = env.run("plan", f"hf://alice/tiny-{layout}", "--to", "hf", ok=False)
    assert_one_line_error(proc, f"holds a {layout} checkpoint", "reshard pull")
    back = tmp_path / "back"
    env.run("convert", f"hf://alice/tiny-{layout}", back, "--to", "hf")
    assert "EQUAL" in env.run("verify", src, back).stdout
    assert "EQUAL" in env.run("verify", out, f"hf://alice/tiny-{layout}").stdout
