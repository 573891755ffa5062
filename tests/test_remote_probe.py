"""A missing bucket, or an endpoint that answers a bare 404 to everything, is one line exit 3 naming the bucket and
the endpoint: never an empty remote that `compile --remote` silently builds around or `pull` asks to publish to."""

from __future__ import annotations

import http.server
import json
import shutil
import threading

import pytest

from tests.s3server import free_port, shared_server
from tests.test_remote_pipeline import base_env, make_project, ok, run_qbuild


class _NotFound(http.server.BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def not_found_endpoint():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _one_line_exit_3(proc, *fragments: str) -> None:
    assert proc.returncode == 3, f"exit {proc.returncode}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for f in fragments:
        assert f in errors[0], errors[0]
    assert "publish it there" not in errors[0]


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = make_project(tmp_path_factory.mktemp("probe"))
    ok(run_qbuild(root, "compile", "recipes/alpha.yaml", "--store", "store", "--mem", "1T"))
    return root


def _cases(project, tmp_path, remote: str, env: dict, endpoint: str) -> None:
    host = tmp_path / "host"
    host.mkdir()
    shutil.copytree(project / "recipes", host / "recipes")
    shutil.copytree(project / "model", host / "model")
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    lock_before = (host / "artifacts.lock").read_bytes()
    bucket = remote.split("/")[2]
    proc = run_qbuild(host, "compile", "recipes/alpha.yaml", "--store", "store", "--mem", "1T", "--remote", remote,
                      env=env)
    _one_line_exit_3(proc, f"no such bucket {bucket}", endpoint)
    assert not list((host / "store").glob("ac/*/*.json")), "nothing may be built around an unusable remote"
    assert (host / "artifacts.lock").read_bytes() == lock_before
    proc = run_qbuild(host, "pull", "alpha", "--to", "bundle", "--store", "store", "--remote", remote, env=env)
    _one_line_exit_3(proc, f"no such bucket {bucket}", endpoint)
    assert not (host / "bundle").exists()
    proc = run_qbuild(project, "publish", "--all", "--store", "store", "--remote", remote, env=env)
    _one_line_exit_3(proc, f"no such bucket {bucket}", endpoint)


@pytest.mark.slow
def test_a_missing_bucket_is_one_line_exit_3(project, tmp_path):
    shared_server()
    env = base_env()
    endpoint = env["QBUILD_S3_ENDPOINT_URL"].removeprefix("http://")
    _cases(project, tmp_path, "s3://qb-probe-no-such-bucket/p", env, endpoint)


@pytest.mark.slow
def test_an_endpoint_answering_404_to_everything_is_one_line_exit_3(project, tmp_path, not_found_endpoint):
    env = {**base_env(), "QBUILD_S3_ENDPOINT_URL": not_found_endpoint}
    _cases(project, tmp_path, "s3://qb-probe/p", env, not_found_endpoint.removeprefix("http://"))
    proc = run_qbuild(project, "gc", "--keep-size", "1T", "--store", "store", "--remote", "s3://qb-probe/p",
                      env=env)
    _one_line_exit_3(proc, "no such bucket qb-probe", not_found_endpoint.removeprefix("http://"))
    assert json.loads((project / "artifacts.lock").read_text())["recipes"]
