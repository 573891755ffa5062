"""A neuron recipe's port as a pinned git source (`port: {git, rev, subdir}`): validated in one line, planned without
the network or the port's files, fetched by the build with the git CLI (a bare clone per URL under the store), locked
with its url, rev, subdir and tree digest; its rev changes the keys of everything built with it.

The repository is a local one (tests.nxdi_double.port_repository: the double's ports under contrib/models/<Port> at
two commits, the second reachable only from a pull-request ref) served by file:// URL.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qbuild.backends.neuron.params import PortGit
from qbuild.planning.step import Context
from qbuild.steps.port import Port
from qbuild.core.errors import InfraError, RecipeError, UserError
from qbuild.core.hashing import digest_file
from qbuild.recipe.schema import load_recipe
from qbuild.store.spec import StoreSpec
from qbuild.store.manifest import tree_digest
from tests.conftest import qbuild
from tests.githttp import GitHttpServer
from tests.nxdi_double import MAIN_PORT, MAIN_SUBDIR, MOE_SUBDIR, port_repository
from tests.test_neuron_double import Build, compiled, require_bundle, write_recipe

MISSING = "0123456789abcdef0123456789abcdef01234567"
PINS = 'toolchain: {sdk: "2.31.0"}\n'


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return port_repository(tmp_path_factory.mktemp("nxdi") / "neuronx-distributed-inference")


def _port_files(directory: Path) -> dict[str, str]:
    return {p.relative_to(directory).as_posix(): digest_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}


def _double_main_port() -> dict[str, str]:
    """The double's main port as a build must copy it: its .py files, nothing under __pycache__."""
    return {rel: d for rel, d in _port_files(MAIN_PORT).items() if rel.endswith(".py") and "__pycache__" not in rel}


def _build_port(tmp_path: Path, params: PortGit, store: Path) -> Path:
    out = tmp_path / f"out-{params.rev[:8]}"
    out.mkdir(parents=True)
    (tmp_path / "scratch").mkdir(exist_ok=True)
    Port.run(Context(params, {}, out, tmp_path / "scratch", log=lambda s: None, store=StoreSpec(local=str(store))))
    return out


# --- the schema ------------------------------------------------------------------------------------------------------

BAD_PORTS = {
    "short rev": ("{git: https://example.com/nxdi.git, rev: 4bcdc54, subdir: contrib/models/X}", "port.rev",
                  "not a full commit"),
    "branch as rev": ("{git: https://example.com/nxdi.git, rev: main, subdir: contrib/models/X}", "port.rev",
                      "not a full commit"),
    "upper-case rev": ("{git: https://example.com/nxdi.git, rev: " + "A" * 40 + ", subdir: x}", "port.rev",
                       "not a full commit"),
    "no rev": ("{git: https://example.com/nxdi.git, subdir: contrib/models/X}", "port", "needs `rev`"),
    "no subdir": ("{git: https://example.com/nxdi.git, rev: " + MISSING + "}", "port", "needs `subdir`"),
    "rev without git": ("{path: ./p, rev: " + MISSING + "}", "port", "give `git` too"),
    "git and path": ("{git: https://example.com/nxdi.git, rev: " + MISSING + ", subdir: x, path: ./p}", "port",
                     "only one of `git`, `path` or `module`"),
    "option as url": ("{git: --upload-pack=touch, rev: " + MISSING + ", subdir: x}", "port.git", "not a git URL"),
    "command transport": ("{git: 'ext::sh -c touch', rev: " + MISSING + ", subdir: x}", "port.git",
                          "not a git URL"),
    "token in the url": ("{git: 'https://user:s3cr3t@example.com/nxdi.git', rev: " + MISSING + ", subdir: x}",
                         "port.git", "carries credentials"),
    "token as the user": ("{git: 'https://s3cr3t@github.com/aws-neuron/nxdi.git', rev: " + MISSING + ", subdir: x}",
                          "port.git", "carries credentials"),
    "password in an ssh url": ("{git: 'ssh://git:s3cr3t@example.com/nxdi.git', rev: " + MISSING + ", subdir: x}",
                               "port.git", "carries credentials"),
    "token in a url that is no git url": ("{git: 'https://u:s3cr3t@exa mple.com/x', rev: " + MISSING + ", subdir: x}",
                                          "port.git", "carries credentials"),
    "subdir escapes": ("{git: https://example.com/nxdi.git, rev: " + MISSING + ", subdir: ../x}", "port.subdir",
                       "not a directory of the repository"),
    "absolute subdir": ("{git: https://example.com/nxdi.git, rev: " + MISSING + ", subdir: /etc}", "port.subdir",
                        "not a directory of the repository"),
}


@pytest.mark.parametrize("case", sorted(BAD_PORTS))
def test_a_bad_git_port_is_one_line_naming_the_field(tmp_path, case):
    port, field, needle = BAD_PORTS[case]
    f = tmp_path / "r.yaml"
    f.write_text(f"model: {{hf: Qwen/Qwen3.5-2B}}\nbackend: neuron\nport: {port}\n"
                 "text: {seq_len: 128, cte_buckets: [64]}\n" + PINS)
    with pytest.raises(RecipeError) as info:
        load_recipe(f)
    line = str(info.value)
    assert "\n" not in line and line.startswith(f"{f}:3:") and f": {field}: " in line and needle in line, line
    assert "s3cr3t" not in line


def test_the_cli_refuses_a_short_rev_with_exit_2_and_writes_nothing(tmp_path):
    f = tmp_path / "r.yaml"
    f.write_text("model: {hf: Qwen/Qwen3.5-2B}\nbackend: neuron\n"
                 "port: {git: https://example.com/nxdi.git, rev: 4bcdc54, subdir: contrib/models/X}\n"
                 "text: {seq_len: 128, cte_buckets: [64]}\n" + PINS)
    proc = qbuild("compile", str(f), "--store", str(tmp_path / "store"), "--lock", str(tmp_path / "artifacts.lock"))
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "port.rev" in proc.stderr and "4bcdc54" in proc.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "artifacts.lock").exists()


@pytest.mark.parametrize("command", [["plan", "r.yaml", "--json", "--store", "store"],
                                     ["compile", "r.yaml", "--store", "store"],
                                     ["recipe", "validate", "r.yaml", "--json"]])
def test_a_token_in_the_port_url_is_refused_and_reaches_no_output_no_key_no_file(tmp_path, command):
    """Refused, not scrubbed (docs/architecture.md, "Credentials"): nothing is planned, keyed, locked or fetched."""
    f = tmp_path / "r.yaml"
    f.write_text("model: {hf: Qwen/Qwen3.5-2B}\nbackend: neuron\n"
                 "port: {git: 'https://ci:ghp_s3cr3tToken@github.com/aws-neuron/nxdi.git', rev: " + MISSING +
                 ", subdir: contrib/models/X}\ntext: {seq_len: 128, cte_buckets: [64]}\n" + PINS)
    proc = qbuild(*command, cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "r.yaml:3:" in proc.stderr and "port.git" in proc.stderr and "carries credentials" in proc.stderr
    assert "s3cr3t" not in proc.stdout + proc.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "artifacts.lock").exists()


# --- planning reads nothing of a git port ----------------------------------------------------------------------------

def test_plan_and_validate_read_no_port_and_run_no_git(tmp_path, small_checkpoints):
    """A git port whose repository does not exist plans, with git not even on PATH: its key is (url, rev, subdir),
    and nothing is fetched (no clone in the store) until the port node is built."""
    recipe = write_recipe(tmp_path / "r.yaml", small_checkpoints["qwen3_5"], None,
                          port={"git": (tmp_path / "no-such-repo").as_uri(), "rev": MISSING, "subdir": MAIN_SUBDIR})
    env = {"PATH": str(tmp_path / "empty-bin")}
    validated = qbuild("recipe", "validate", str(recipe), env=env)
    assert validated.returncode == 0, validated.stderr
    proc = qbuild("plan", str(recipe), "--json", "--store", str(tmp_path / "store"), "--lock",
                  str(tmp_path / "artifacts.lock"), env=env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    (port,) = [n for n in doc["nodes"] if n["kind"] == "port"]
    assert port["status"] == "build" and port["key"]
    assert port["params"] == {"url": (tmp_path / "no-such-repo").as_uri(), "rev": MISSING, "subdir": MAIN_SUBDIR}
    info = doc["recipes"]["r"]["port"]
    assert (info["git"], info["rev"], info["subdir"], info["lineage"]) == (port["params"]["url"], MISSING,
                                                                           MAIN_SUBDIR, "main")
    assert not (tmp_path / "store" / "git").exists()


# --- building the port node ------------------------------------------------------------------------------------------

def test_building_a_rev_gives_that_commits_port_files(tmp_path, repo):
    """rev `first` gives the double's main port as shipped: its .py files, not the README nor the port's tests; rev
    `second` (only on refs/pull/1/head) its edited module and the module it added. Both come from one bare clone."""
    store = tmp_path / "store"
    first = _build_port(tmp_path, PortGit(repo.url, repo.first, MAIN_SUBDIR), store)
    assert _port_files(first) == _double_main_port()
    second = _build_port(tmp_path, PortGit(repo.url, repo.second, MAIN_SUBDIR + "/"), store)
    files = _port_files(second)
    assert set(files) == set(_double_main_port()) | {"src/added_in_second.py"}
    assert files["src/modeling_qwen35.py"] != _double_main_port()["src/modeling_qwen35.py"]
    assert (second / "src" / "modeling_qwen35.py").read_text().endswith("# the second commit's edit\n")
    assert [p.name for p in (store / "git").glob("*.git")] == [next((store / "git").glob("*.git")).name]
    # The other port of the same commit, from the same clone (no fetch: the commit is there).
    moe = _build_port(tmp_path / "moe", PortGit(repo.url, repo.first, MOE_SUBDIR), store)
    assert sorted(_port_files(moe)) == ["src/__init__.py", "src/modeling_qwen35_moe.py", "src/nki_deltanet.py"]


def test_a_missing_commit_is_a_recipe_error_and_an_unreachable_url_infrastructure(tmp_path, repo):
    """A commit the repository does not have is the recipe's mistake (exit 2); a repository that does not answer is
    the environment's (exit 3). Each is one line naming the commit and the URL."""
    with pytest.raises(UserError) as info:
        _build_port(tmp_path / "a", PortGit(repo.url, MISSING, MAIN_SUBDIR), tmp_path / "store")
    assert type(info.value) is UserError and "\n" not in str(info.value)
    assert str(info.value) == f"port: commit {MISSING} is not in {repo.url} (no ref of it reaches that commit); " \
                              "check port.rev"
    gone = (tmp_path / "gone").as_uri()
    with pytest.raises(InfraError) as info:
        _build_port(tmp_path / "b", PortGit(gone, repo.first, MAIN_SUBDIR), tmp_path / "store")
    assert repo.first in str(info.value) and gone in str(info.value) and "\n" not in str(info.value)
    assert "does not appear to be a git repository" in str(info.value)     # git's first fatal line, not its last
    with pytest.raises(UserError, match="contrib/models/Nope is not a directory of"):
        _build_port(tmp_path / "d", PortGit(repo.url, repo.first, "contrib/models/Nope"), tmp_path / "store")


@pytest.mark.parametrize("url", ["https://user:s3cr3t-token@127.0.0.1:9/nxdi.git", "https://s3cr3t-token@127.0.0.1:9/x",
                                 "ssh://git:s3cr3t-token@127.0.0.1:9/x"])
def test_the_port_step_refuses_credentials_in_the_url_before_git_sees_it(tmp_path, repo, url):
    """The recipe schema refuses such a URL; the step refuses it too, so that no git config under the store (where the
    clone's remote.origin.url would keep it) ever holds one."""
    with pytest.raises(UserError) as info:
        _build_port(tmp_path, PortGit(url, repo.first, MAIN_SUBDIR), tmp_path / "store")
    assert "carries credentials" in str(info.value) and "s3cr3t" not in str(info.value)
    assert not (tmp_path / "store" / "git").exists()


@pytest.fixture(scope="module")
def private_host(tmp_path_factory):
    """The double's repository on a git host that wants a password (tests.githttp: git http-backend behind Basic
    authentication, on loopback)."""
    root = tmp_path_factory.mktemp("private-host")
    repo = port_repository(root / "nxdi")
    server = GitHttpServer(root, "ci", SECRET)
    yield server, repo
    server.stop()


SECRET = "s3cr3t-from-the-helper"


def test_a_private_port_is_fetched_with_gits_credential_helper_and_its_secret_is_kept_nowhere(
        tmp_path, private_host, monkeypatch):
    """Credentials come from git itself (here a credential helper given through git's environment; a user's
    `git config credential.helper`, GIT_ASKPASS), never from the recipe: the URL, and so the key, the lock and the
    clone's config under the store, hold none."""
    server, repo = private_host
    url, store = f"{server.url}/nxdi", tmp_path / "store"
    with pytest.raises(InfraError) as info:       # no helper: the host refuses, and git may not prompt
        _build_port(tmp_path / "a", PortGit(url, repo.first, MAIN_SUBDIR), store)
    assert f"cannot fetch commit {repo.first} from {url}: could not read Username" in str(info.value)
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "credential.helper")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", f"!f() {{ echo username=ci; echo password={SECRET}; }}; f")
    out = _build_port(tmp_path / "b", PortGit(url, repo.second, MAIN_SUBDIR), store)
    assert (out / "src" / "added_in_second.py").is_file()       # the commit only a pull-request ref reaches
    assert (url + "/info/refs?service=git-upload-pack", 200) in [(server.url + p, c) for p, c in server.requests]
    leaked = [p for p in store.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == [] and (store / "git").is_dir()


# --- through the CLI, with the double ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_rev_changes_the_keys_of_port_shard_compile_package_and_the_lock_records_the_source(tmp_path, repo,
                                                                                             small_checkpoints):
    """The tiny Qwen3.5 built with the git port at `first`, then at `second`: fetch and convert are shared, the
    port, shard, compile and package keys change; the lock's recipe entry names the url, rev, subdir and the port's
    tree digest, and the bundle carries the files of the rev it was built with."""
    build = Build(tmp_path / "build")
    locks = {}
    for name in ("first", "second"):
        rev = getattr(repo, name)
        recipe = write_recipe(build.root / "recipes" / "git.yaml", small_checkpoints["qwen3_5"], None,
                              port={"git": repo.url, "rev": rev, "subdir": MAIN_SUBDIR})
        locks[name] = build.root / f"{name}.lock"
        result, stderr = build.compile(recipe, lock=locks[name])
        compiled(result, stderr)
        require_bundle(result, stderr)
    docs = {name: json.loads(path.read_text()) for name, path in locks.items()}

    def keys(doc: dict) -> dict[str, str]:
        return {role: doc["nodes"][nid]["key"] for role, nid in doc["recipes"]["git"]["nodes"].items()}

    first, second = keys(docs["first"]), keys(docs["second"])
    assert {role for role in first if first[role] != second[role]} == {"port", "shard", "compile text", "package"}
    for name, doc in docs.items():
        entry = doc["recipes"]["git"]
        port = doc["nodes"][entry["nodes"]["port"]]
        assert entry["port"] == {"url": repo.url, "rev": getattr(repo, name), "subdir": MAIN_SUBDIR,
                                 "digest": port["digest"]}
        assert port["digest"] == tree_digest(port["outputs"])
    shutil.copyfile(locks["second"], build.lock)
    bundle = build.node_outputs("git", "package", tmp_path / "bundle")
    assert (bundle / "port" / "src" / "added_in_second.py").is_file()   # the second build's bundle


@pytest.mark.slow
def test_a_missing_rev_fails_the_build_with_exit_2_in_one_line(tmp_path, repo, small_checkpoints):
    """The repository answers and has no such commit: the recipe's port.rev is wrong (bad input, exit 2)."""
    build = Build(tmp_path / "build")
    recipe = write_recipe(build.root / "recipes" / "git.yaml", small_checkpoints["qwen3_5"], None,
                          port={"git": repo.url, "rev": MISSING, "subdir": MAIN_SUBDIR})
    proc = build.cli("compile", str(recipe), "--skip-device")
    assert proc.returncode == 2, proc.stderr
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("FAILED port")]
    assert MISSING in line and repo.url in line
    assert "Traceback" not in proc.stderr
