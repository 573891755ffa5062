"""`publish --what bundles` uploads what `pull` and a rebuild elsewhere need, and nothing that only verifies a bundle
again; with the converted weights described, every weight byte goes up once, as the bundle's. Against the moto server
(tests/s3server.py), with conftest's dense_project (a tiny Qwen3.5 built with the export backend)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.s3server import shared_server
from tests.test_remote_pipeline import assert_no_dangling_manifest, remote_state
from tests.test_remote_real_bundle import qb

BUCKET = "qb-bundles"


@pytest.mark.slow
def test_publishing_bundles_uploads_the_bundle_and_its_descriptions_and_a_rebuild_elsewhere_reuses_them(
        dense_project, tmp_path):
    client = shared_server().client()
    client.create_bucket(Bucket=BUCKET)
    remote = f"s3://{BUCKET}/{tmp_path.name}"
    project = Path(shutil.copytree(dense_project, tmp_path / "project", symlinks=True))
    lock = json.loads((project / "artifacts.lock").read_text())
    out = json.loads(qb(project, "publish", "--all", "--what", "bundles", "--store", "store", "--remote", remote,
                        "--json").stdout)
    manifests, blobs = remote_state(client, BUCKET, tmp_path.name)
    kinds = {n["key"]: n["kind"] for n in lock["nodes"].values()}
    assert set(manifests) == {k for k, kind in kinds.items() if kind != "reference"}
    assert_no_dangling_manifest(client, BUCKET, tmp_path.name)
    # Each blob once: the shards and graphs are the bundle's own blobs, the converted text weights only described.
    bundle = next(n for n in lock["nodes"].values() if n["kind"] == "package")
    bundle_bytes = sum({m["digest"]: m["size"] for m in bundle["outputs"].values()}.values())
    assert out["bytes_uploaded"] == sum(blobs.values()) < 1.02 * bundle_bytes
    convert = next(n for n in lock["nodes"].values() if n["kind"] == "convert")
    assert [rel for rel in convert["outputs"] if rel.startswith("text/")] == ["text/description.json"]

    # A machine with nothing but the lockfile pulls the bundle, and a rebuild there makes only the reference again.
    host = tmp_path / "host"
    host.mkdir()
    shutil.copyfile(project / "artifacts.lock", host / "artifacts.lock")
    qb(host, "pull", "tiny-dense", "--to", "bundle", "--store", "store", "--remote", remote)
    assert (host / "bundle" / "bundle.json").is_file()
    (host / "recipes").mkdir()
    shutil.copytree(project / "recipes", host / "recipes", dirs_exist_ok=True)
    rebuilt = json.loads(qb(host, "compile", "--all", "--frozen", "--json", "--store", "store", "--remote",
                            remote).stdout)
    assert [n.split()[0] for n in rebuilt["built"]] == ["reference"], rebuilt["built"]
    # `gc --remote` keeps what the lockfile references, published in part or whole.
    local, on_remote = json.loads(qb(project, "gc", "--remote", remote, "--grace", "0", "--json", "--store",
                                     "store").stdout)
    assert on_remote["removed"] == [] and on_remote["kept_manifests"] == len(manifests)
    published_all = json.loads(qb(project, "publish", "--all", "--store", "store", "--remote", remote,
                                  "--json").stdout)
    reference = next(n for n in lock["nodes"].values() if n["kind"] == "reference")
    assert published_all["bytes_uploaded"] == sum({m["digest"]: m["size"]
                                                   for m in reference["outputs"].values()}.values())
