"""A small Hugging Face Hub-compatible HTTP server for tests, bound to 127.0.0.1 only.

It implements just what huggingface_hub 2.x calls for a pull and a push (no Xet: run the client with
``HF_HUB_DISABLE_XET=1``): repo info by revision, tree listing, ``resolve`` (HEAD/GET with ETag, X-Repo-Commit,
LFS files redirected to a second "CDN" origin that honours Range), create repo, create branch, preupload,
the LFS batch API with PUT + verify, and the ndjson commit endpoint. Repos live in memory as commits of
``{path: blob}``; every request is logged and the bytes of safetensors data (after the header) served are counted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class Blob:
    data: bytes
    lfs: bool

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def oid(self) -> str:
        """What the Hub reports as a file's oid: the LFS sha256 for LFS files, the git blob sha1 otherwise."""
        return self.sha256 if self.lfs else git_blob_oid(self.data)


@dataclass
class Repo:
    owner: str
    private: bool = False
    gated: bool = False
    branches: dict[str, str] = field(default_factory=dict)  # branch or refs/pr/N -> commit sha
    commits: dict[str, dict[str, Blob]] = field(default_factory=dict)  # sha -> tree
    prs: int = 0


class HubState:
    """Repos, LFS objects, tokens (token -> user), the request log and fault injection."""

    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.tokens: dict[str, str] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.weight_bytes_served = 0  # safetensors bytes past the header, over all GETs
        self.commit_count = 0
        self.drop_once: dict[str, int] = {}  # file path -> bytes to send before dropping the connection once
        self.lock = threading.Lock()
        self._counter = 0

    def add_repo(self, repo_id: str, files: dict[str, bytes], *, private=False, gated=False) -> str:
        repo = self.repos[repo_id] = Repo(owner=repo_id.split("/")[0], private=private, gated=gated)
        sha = self._commit(repo, {}, files, "initial commit")
        repo.branches["main"] = sha
        return sha

    def _commit(self, repo: Repo, base: dict[str, Blob], files: dict[str, bytes | None], message: str) -> str:
        tree = dict(base)
        for path, data in files.items():
            if data is None:
                del tree[path]
                continue
            tree[path] = Blob(data, path.endswith(LFS_SUFFIXES))
            if tree[path].lfs:
                self.lfs_objects[tree[path].sha256] = data
        self._counter += 1
        sha = hashlib.sha1(f"{self._counter}:{message}".encode()).hexdigest()
        repo.commits[sha] = tree
        return sha

    def tree(self, repo_id: str, revision: str = "main") -> dict[str, Blob]:
        repo = self.repos[repo_id]
        return repo.commits[repo.branches.get(revision, revision)]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        return {p: b.data for p, b in self.tree(repo_id, revision).items()}


class HubError(Exception):
    def __init__(self, status: int, code: str | None = None, message: str | None = None):
        self.status, self.code, self.message = status, code, message


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "TestHub/1"
    state: HubState
    cdn_origin: str

    def log_message(self, *args):  # quiet
        pass

    # -- plumbing --------------------------------------------------------------------------------------------
    def _body(self) -> bytes:
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _json(self, obj, status: int = 200, headers: dict | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _user(self) -> str | None:
        auth = self.headers.get("Authorization") or ""
        if not auth.startswith("Bearer "):
            return None
        user = self.state.tokens.get(auth[len("Bearer "):])
        if user is None:
            raise HubError(401, None, "Invalid credentials in Authorization header")
        return user

    def _repo(self, repo_id: str, write: bool = False) -> Repo:
        user = self._user()
        repo = self.state.repos.get(repo_id)
        if repo is None or (repo.private and user != repo.owner):
            raise HubError(401 if user is None else 404, "RepoNotFound", "Repository not found")
        if write and user != repo.owner:
            raise HubError(401 if user is None else 403, None, "You don't have the rights to write to this repo")
        return repo

    @staticmethod
    def _resolve(repo: Repo, revision: str) -> str:
        if revision in repo.branches:
            return repo.branches[revision]
        if revision in repo.commits:
            return revision
        raise HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def _dispatch(self, method: str) -> None:
        url = urlsplit(self.path)
        with self.state.lock:
            self.state.requests.append((method, url.path, self.headers.get("Range")))
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        query = parse_qs(url.query)
        try:
            self._route(method, parts, query)
        except HubError as err:
            headers = {}
            if err.code:
                headers["X-Error-Code"] = err.code
            if err.message:
                headers["X-Error-Message"] = err.message
            body = {"error": err.message or "error"}
            if err.status == 409 and err.code == "RepoExists":
                body["url"] = f"{self.server.endpoint}/{err.message}"
            self._send(err.status, json.dumps(body).encode(), {"Content-Type": "application/json", **headers},
                       head=method == "HEAD")

    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    # -- routes ----------------------------------------------------------------------------------------------
    def _route(self, method: str, p: list[str], query: dict) -> None:
        if method in ("GET", "HEAD") and len(p) == 2 and p[0] == "lfs-cdn":
            return self._serve_lfs(p[1], head=method == "HEAD")
        if method == "PUT" and len(p) == 2 and p[0] == "lfs-upload":
            with self.state.lock:
                self.state.lfs_objects[p[1]] = self._body()
            return self._send(200)
        if method == "POST" and len(p) == 2 and p[0] == "lfs-verify":
            self._body()
            return self._send(200 if p[1] in self.state.lfs_objects else 404)
        if p[:1] == ["api"]:
            return self._api(method, p[1:], query)
        if len(p) >= 5 and p[2] == "resolve" and method in ("GET", "HEAD"):
            return self._serve_resolve("/".join(p[:2]), p[3], "/".join(p[4:]), head=method == "HEAD")
        if len(p) == 6 and p[1].endswith(".git") and p[2:] == ["info", "lfs", "objects", "batch"] and method == "POST":
            return self._lfs_batch(f"{p[0]}/{p[1][:-4]}")
        raise HubError(404, None, f"no route for {method} /{'/'.join(p)}")

    def _api(self, method: str, p: list[str], query: dict) -> None:
        if method == "POST" and p == ["repos", "create"]:
            return self._create_repo(json.loads(self._body() or b"{}"))
        if method == "POST" and p == ["validate-yaml"]:
            self._body()
            return self._json({"errors": [], "warnings": []})
        if len(p) < 3 or p[0] != "models":
            raise HubError(404, None, "unknown api route")
        repo_id, rest = f"{p[1]}/{p[2]}", p[3:]
        if method == "GET" and (not rest or (len(rest) == 2 and rest[0] == "revision")):
            repo = self._repo(repo_id)
            sha = self._resolve(repo, rest[1] if rest else "main")
            siblings = [{"rfilename": path} for path in sorted(repo.commits[sha])]
            return self._json({"id": repo_id, "sha": sha, "private": repo.private, "gated": repo.gated,
                               "siblings": siblings})
        if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
            repo = self._repo(repo_id)
            tree = repo.commits[self._resolve(repo, rest[1])]
            prefix = "/".join(rest[2:])
            entries = []
            for path, blob in sorted(tree.items()):
                if prefix and not path.startswith(prefix + "/"):
                    continue
                entry = {"type": "file", "path": path, "size": len(blob.data), "oid": git_blob_oid(blob.data)}
                if blob.lfs:
                    entry["lfs"] = {"oid": blob.sha256, "size": len(blob.data), "pointerSize": 134}
                entries.append(entry)
            return self._json(entries)
        if method == "POST" and len(rest) == 2 and rest[0] == "branch":
            return self._create_branch(repo_id, rest[1], json.loads(self._body() or b"{}"))
        if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
            repo = self._repo(repo_id, write=True)
            payload = json.loads(self._body())
            tree = repo.commits.get(repo.branches.get(rest[1], ""), {})
            files = []
            for f in payload["files"]:
                existing = tree.get(f["path"])
                files.append({"path": f["path"], "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular",
                              "shouldIgnore": False, "oid": existing.oid if existing else None})
            return self._json({"files": files})
        if method == "POST" and len(rest) == 2 and rest[0] == "commit":
            return self._create_commit(repo_id, rest[1], self._body(), query.get("create_pr") == ["1"])
        raise HubError(404, None, "unknown api route")

    def _create_repo(self, payload: dict) -> None:
        user = self._user()
        repo_id = f"{payload.get('organization') or user}/{payload['name']}"
        if user is None:
            raise HubError(401, None, "You must be authenticated to create a repo")
        if repo_id.split("/")[0] != user:
            raise HubError(403, None, "You don't have the rights to create a model under this namespace")
        with self.state.lock:
            if repo_id in self.state.repos:
                raise HubError(409, "RepoExists", repo_id)
            private = payload.get("visibility") == "private" or bool(payload.get("private"))
            repo = self.state.repos[repo_id] = Repo(owner=user, private=private)
            repo.branches["main"] = self.state._commit(repo, {}, {".gitattributes": b"*.safetensors filter=lfs\n"},
                                                       "initial commit")
        self._json({"url": f"{self.server.endpoint}/{repo_id}", "name": repo_id, "id": repo_id})

    def _create_branch(self, repo_id: str, branch: str, payload: dict) -> None:
        repo = self._repo(repo_id, write=True)
        with self.state.lock:
            if branch in repo.branches:
                raise HubError(409, None, "Reference already exists")
            repo.branches[branch] = self._resolve(repo, payload.get("startingPoint") or "main")
        self._json({})

    def _create_commit(self, repo_id: str, revision: str, body: bytes, create_pr: bool) -> None:
        repo = self._repo(repo_id, write=True)
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(x["value"] for x in lines if x["key"] == "header")
        files: dict[str, bytes | None] = {}  # None: delete
        for line in lines:
            value = line["value"]
            if line["key"] == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif line["key"] == "lfsFile":
                data = self.state.lfs_objects.get(value["oid"])
                if data is None:
                    raise HubError(400, None, f"LFS object {value['oid']} was never uploaded")
                files[value["path"]] = data
            elif line["key"] == "deletedFile":
                files[value["path"]] = None
            elif line["key"] != "header":
                raise HubError(400, None, f"unsupported commit line {line['key']}")
        with self.state.lock:
            base_sha = self._resolve(repo, revision)
            sha = self.state._commit(repo, repo.commits[base_sha], files, header["summary"])
            self.state.commit_count += 1
            pr_url = None
            if create_pr:
                repo.prs += 1
                repo.branches[f"refs/pr/{repo.prs}"] = sha
                pr_url = f"{self.server.endpoint}/{repo_id}/discussions/{repo.prs}"
            else:
                repo.branches[revision] = sha
        self._json({"commitOid": sha, "commitUrl": f"{self.server.endpoint}/{repo_id}/commit/{sha}",
                    "pullRequestUrl": pr_url})

    def _lfs_batch(self, repo_id: str) -> None:
        self._repo(repo_id, write=True)
        payload = json.loads(self._body())
        objects = []
        for obj in payload["objects"]:
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.state.lfs_objects:
                entry["actions"] = {"upload": {"href": f"{self.server.endpoint}/lfs-upload/{obj['oid']}"},
                                    "verify": {"href": f"{self.server.endpoint}/lfs-verify/{obj['oid']}"}}
            objects.append(entry)
        self._json({"transfer": "basic", "objects": objects})

    def _serve_resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id)
        sha = self._resolve(repo, revision)
        blob = repo.commits[sha].get(path)
        if blob is None:
            raise HubError(404, "EntryNotFound", f"{path} does not exist")
        if repo.gated and self._user() != repo.owner:
            raise HubError(403, "GatedRepo", "Access to this model is restricted")
        headers = {"X-Repo-Commit": sha}
        if blob.lfs:
            headers.update({"X-Linked-Etag": f'"{blob.sha256}"', "X-Linked-Size": len(blob.data),
                            "ETag": f'"{git_blob_oid(blob.data)}"',
                            "Location": f"{self.cdn_origin}/lfs-cdn/{blob.sha256}?path={quote(path)}"})
            return self._send(302, b"", headers, head=True)
        headers["ETag"] = f'"{blob.oid}"'
        self._send_data(blob.data, path, headers, head)

    def _serve_lfs(self, sha256: str, head: bool) -> None:
        data = self.state.lfs_objects.get(sha256)
        if data is None:
            raise HubError(404, None, "no such object")
        path = parse_qs(urlsplit(self.path).query).get("path", [""])[0]
        self._send_data(data, path, {"ETag": f'"{sha256}"'}, head)

    def _send_data(self, data: bytes, path: str, headers: dict, head: bool) -> None:
        """Serve ``data`` honouring ``Range: bytes=a-b``; count safetensors bytes past the header."""
        start, end, status = 0, len(data) - 1, 200
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)), len(data) - 1) if m.group(2) else len(data) - 1
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        headers["Accept-Ranges"] = "bytes"
        body = data[start:end + 1]
        if head:
            return self._send(status, body, headers, head=True)
        if path.endswith(".safetensors") and len(data) >= 8:
            data_start = 8 + struct.unpack("<Q", data[:8])[0]
            with self.state.lock:
                self.state.weight_bytes_served += max(0, end + 1 - max(start, data_start))
        with self.state.lock:
            cut = self.state.drop_once.pop(path, None)
        if cut is not None:  # send part of the body, then drop the connection
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, str(v))
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body[:cut])
            self.wfile.flush()
            self.close_connection = True
            return
        self._send(status, body, headers)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    endpoint = ""


class HubServer:
    """Two threaded servers on 127.0.0.1 (ephemeral ports): the Hub itself and a "CDN" origin for LFS objects."""

    def __init__(self, state: HubState | None = None):
        self.state = state or HubState()
        handler = type("BoundHandler", (Handler,), {"state": self.state})
        self._hub = _Server(("127.0.0.1", 0), handler)
        self._cdn = _Server(("127.0.0.1", 0), handler)
        self.endpoint = f"http://127.0.0.1:{self._hub.server_address[1]}"
        handler.cdn_origin = f"http://127.0.0.1:{self._cdn.server_address[1]}"
        self._hub.endpoint = self._cdn.endpoint = self.endpoint
        self._stopped = False
        self._threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (self._hub, self._cdn)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for s in (self._hub, self._cdn):
            s.shutdown()
            s.server_close()
        for t in self._threads:
            t.join()
