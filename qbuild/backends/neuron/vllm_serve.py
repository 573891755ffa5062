"""Serving a neuron bundle with vLLM's Neuron plugin (docs/vllm.md): the command line and environment made of the
bundle's own record (vllm/serve.json and the plugin the package step wrote), the checks before vLLM starts (the host's
vLLM stack, the bundle's files), the process that runs it, and the check after it stops that the bundle is unchanged.

Upstream facts are cited as file:line @ commit: vllm-neuron @ 3afb0a9 (release 0.5.0; vllm_neuron/...), vLLM 0.16.0
(the release's wheel; vllm/...), and the SDK docs (aws-neuron-sdk @ a3247f5b8c30).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from pathlib import Path

from qbuild.backends.base import ServeOptions
from qbuild.backends.neuron import long_context, nxdi_tree
from qbuild.backends.neuron.package import VLLM_DIR, VLLM_PLUGIN, VLLM_SERVE
from qbuild.backends.neuron.ports import LINEAGES
from qbuild.backends.neuron.releases import GLUE_STACK, stack_matches
from qbuild.backends.neuron.server_process import child_env, free_ports, run_children
from qbuild.core.errors import InfraError, UserError

# vLLM's OpenAI server: vllm/entrypoints/openai/api_server.py L519-531 (its __main__) @ vLLM 0.16.0.
VLLM_ENTRY = "vllm.entrypoints.openai.api_server"
# (import name, distribution) of the server's packages: vLLM, the Neuron plugin, and NxDI under it.
VLLM_PACKAGES = (("vllm", "vllm"), ("vllm_neuron", "vllm-neuron"),
                 ("neuronx_distributed_inference", "neuronx-distributed-inference"))
# The flags qbuild sets that are not made of the bundle (vllm_args): the server's address and the model's name.
_ADDRESS_FLAGS = ("--model", "--served-model-name", "--host", "--port")
# vLLM's spellings of the flags qbuild sets, where one has several (vllm/engine/arg_utils.py L799 `-tp`; a boolean
# flag's `--no-` form, argparse.BooleanOptionalAction, L289).
_ALIASES = {"--tensor-parallel-size": ("-tp",), "--no-enable-prefix-caching": ("--enable-prefix-caching",),
            "--no-enable-chunked-prefill": ("--enable-chunked-prefill",),
            "--enable-prefix-caching": ("--no-enable-prefix-caching",),
            "--enable-chunked-prefill": ("--no-enable-chunked-prefill",)}
_SECRET_FLAGS = ("--api-key",)
# docs/vllm.md section 13: vLLM hands the port no image inputs for a text prompt, and a port whose every context
# encoding takes them (ports.Lineage.text_prompt_dummy "always") then zeroes the prompt's last token's embedding.
TEXT_PROMPT_NOTE = ("the port's text model zeroes the embedding of each prompt's last token under vLLM, which passes "
                    "it no image inputs (docs/vllm.md section 13); qbuild's verify gave its prompts the padding "
                    "inputs")
# A bundle compiled with on-device sampling (do_sample off): vllm-neuron hands each request's sampling parameters to the
# compiled sampler (model runner L1715-1750 @ 3afb0a9), whose argmax ignores them (NxDI modules/generation/sampling.py
# L459-464 @ ef2731e), and its sampler output holds no logprobs (loader L542-552); docs/vllm.md section 12.
ON_DEVICE_NOTE = ("the compiled graphs pick every token by argmax (do_sample off): a request's temperature, top_p and "
                  "top_k do not change the tokens, and vllm-neuron's sampler output holds no logprobs")


def vllm_args(serve: dict) -> list[tuple[str, str | None]]:
    """The vLLM flags a bundle fixes, as (flag, value or None for a switch): everything vLLM must agree on with the
    compile. Serving features that change them are added here and in package.serve_record, and nowhere else; a
    pass-through flag naming one of these is refused.

    - --tensor-parallel-size: the compiled tp degree; --dtype: the compiled dtype (PR 173's launcher passes both,
      vllm/start_vllm_server.sh L652-653 @ 03db3ef).
    - --max-model-len: the largest token-generation bucket; --additional-config max_prompt_length: the compiled
      max_context_length (package.serve_record).
    - --max-num-seqs: the batch size.
    - A bundle with chunked prefill: its block KV layout, chunked prefill and (where the recipe opts in) prefix caching,
      as qbuild.backends.neuron.long_context.vllm_flags says; otherwise `contiguous_flags`.
    """
    lc = serve.get("long_context")
    return [("--tensor-parallel-size", str(serve["tensor_parallel_size"])), ("--dtype", serve["dtype"]),
            ("--max-model-len", str(serve["max_model_len"])), ("--max-num-seqs", str(serve["max_num_seqs"])),
            ("--additional-config", json.dumps(additional_config(serve), sort_keys=True)),
            *(long_context.vllm_flags(lc) if lc else contiguous_flags(serve))]


def contiguous_flags(serve: dict) -> list[tuple[str, str | None]]:
    """The flags of a bundle compiled with NxDI's contiguous KV cache.

    - --num-gpu-blocks-override: the batch size. Without prefix caching the platform sets block_size = max_model_len
      (platform.py L378-383), so one block per sequence; it adds the null block itself (L318-332), and the loader's
      default NeuronConfig counts num_gpu_blocks_override as pa_num_blocks (loader L1082-1087).
    - --no-enable-prefix-caching, --no-enable-chunked-prefill: either feature asks the loader for a block KV layout
      (L1108-1111) that such a bundle does not have. The platform's scheduler turns chunked prefill off anyway
      (platform.py L355-358); PR 173's launcher passes the same without them (L662, L694).
    """
    return [("--num-gpu-blocks-override", str(serve["max_num_seqs"])), ("--no-enable-prefix-caching", None),
            ("--no-enable-chunked-prefill", None)]


def additional_config(serve: dict) -> dict:
    """vLLM's --additional-config (a JSON object: vllm/engine/arg_utils.py L314-315, L1211-1213), which vllm-neuron
    reads: max_prompt_length (platform.py L314-316). A contiguous bundle passes no override_neuron_config: with a
    precompiled directory the loader ignores it (loader L250-255); a long-context bundle adds what the port's launcher
    passes (long_context.additional_config)."""
    lc = serve.get("long_context")
    return {"max_prompt_length": serve["max_prompt_length"], **(long_context.additional_config(serve) if lc else {})}


def owned_flags(serve: dict) -> set[str]:
    """Every spelling of a flag qbuild sets, which the pass-through may not repeat."""
    flags = {flag for flag, _ in vllm_args(serve)} | set(_ADDRESS_FLAGS)
    return flags | {alias for flag in flags for alias in _ALIASES.get(flag, ())}


def check_passthrough(extra: tuple[str, ...], serve: dict) -> None:
    """UserError naming the first pass-through argument that sets what the bundle or qbuild's options fix."""
    owned = owned_flags(serve)
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in owned:
            raise UserError(f"{arg}: set by qbuild from the bundle ({VLLM_SERVE}) or its own options; the arguments "
                            f"after -- may not repeat {', '.join(sorted(owned))}")


def read_serve(bundle: Path) -> tuple[dict, dict]:
    """(vllm/serve.json, the plugin's spec), refusing a bundle whose glue an older qbuild wrote."""
    try:
        serve = json.loads((bundle / VLLM_SERVE).read_text())
        plugin = json.loads((bundle / VLLM_DIR / "qbuild_vllm_plugin.json").read_text())
    except FileNotFoundError as e:
        raise UserError(f"{e.filename}: missing; this neuron bundle was packaged without vLLM's glue (by an older "
                        "qbuild): build it again") from None
    missing = [k for k in ("stack", "max_prompt_length", "continuous_batching") if k not in serve]
    if missing:
        raise UserError(f"{bundle / VLLM_SERVE}: no {missing[0]!r}; this bundle was packaged for another vLLM stack "
                        "by an older qbuild: build it again")
    return serve, plugin


def check_servable(bundle: Path, serve: dict) -> None:
    """UserError where qbuild's glue cannot serve the bundle whatever the host: a stack other than the one the glue
    was read against, or a batch above 1 without continuous batching (docs/vllm.md section 4)."""
    stack = serve["stack"]
    if (stack["vllm"], stack["vllm_neuron"]) != (GLUE_STACK.vllm, GLUE_STACK.vllm_neuron):
        raise UserError(f"{bundle / VLLM_SERVE}: SDK {', '.join(stack['releases'])} serves with vllm-neuron "
                        f"{stack['vllm_neuron']} on vLLM {stack['vllm']}; qbuild's serving glue was read against "
                        f"vllm-neuron {GLUE_STACK.vllm_neuron} on vLLM {GLUE_STACK.vllm} (SDK 2.29.0-2.31.0) and "
                        "serves those releases' bundles only")
    if serve["max_num_seqs"] > 1 and not serve["continuous_batching"]:
        raise UserError(f"{bundle / VLLM_SERVE}: batch size {serve['max_num_seqs']} compiled without continuous "
                        "batching; vllm-neuron prefills one request at a time into its own batch line "
                        "(scheduler.py L118-129, model runner L1303-1329 @ 3afb0a9), which needs it: serve a batch-1 "
                        "bundle")


def serve_command(bundle: Path, manifest: dict, name: str, host: str, port: int, python: str,
                  extra: tuple[str, ...] = (), api_key: str | None = None, tree: Path | None = None,
                  backend_port: int | None = None) -> dict:
    """The environment and command line that serve `bundle` with vLLM's Neuron plugin, made of the bundle's own
    record, never of the recipe, then the pass-through arguments `extra`.

    - NEURON_COMPILED_ARTIFACTS: the directory the loader loads instead of compiling (loader L221-223, L242-245).
    - PYTHONPATH: the bundle's vllm/ (the plugin that registers the model, qbuild.backends.neuron.vllm_plugin) and the
      port's import root; VLLM_PLUGINS names the Neuron platform plugin and the bundle's (vllm/plugins/__init__.py
      L28-65 filters both groups by it).
    - VLLM_API_KEY: the key clients must send, read where no --api-key is given (api_server.py L239-240), so that it
      never stands on a command line; the printed document shows it masked.
    - DISABLE_NEURON_CUSTOM_SCHEDULER, for a bundle with chunked prefill (long_context.serve_env).
    - A long-context bundle is served behind the port's chat proxy (serve.json "chat_proxy", long_context.CHAT_PROXY):
      `proxy` holds its command, on the public host and port, and vLLM listens on 127.0.0.1 at `backend_port`.
    - The NxDI tree's src/ after the port on PYTHONPATH, where the bundle records one and `tree` (--nxdi-tree) names
      a checkout of it (nxdi_tree_src), as the Qwen3.6-27B port's launcher orders them (start_vllm_server.sh L123).
    VLLM_NEURON_FRAMEWORK is not set: nothing in vllm-neuron @ 3afb0a9 reads it (the platform checks that NxDI
    imports: platform.py L402-428)."""
    serve, plugin = read_serve(bundle)
    check_servable(bundle, serve)
    check_passthrough(extra, serve)
    src = nxdi_tree_src(serve, tree)
    pythonpath = [bundle / VLLM_DIR, (bundle / VLLM_DIR / plugin["port_dir"]).resolve(), *([src] if src else [])]
    env = {**serve["env"], "NEURON_COMPILED_ARTIFACTS": str(bundle), "VLLM_PLUGINS": f"neuron,{VLLM_PLUGIN}",
           "PYTHONPATH": os.pathsep.join(str(p) for p in pythonpath)}
    if serve.get("long_context"):
        env.update(long_context.serve_env(serve["long_context"]))
    if api_key:
        env["VLLM_API_KEY"] = api_key
    proxy = serve.get("chat_proxy")
    if proxy:
        check_proxy_address(host, port)
    # Behind the port's chat proxy vLLM listens on loopback only ("Keep the backend private and expose the proxy on
    # the public port": the port's vllm/README.md L251-253), on the port after the public one unless told another.
    vllm_host, vllm_port = ("127.0.0.1", backend_port or (port + 1 if port else 0)) if proxy else (host, port)
    command = [python, "-m", VLLM_ENTRY, "--model", str(bundle), "--served-model-name", name,
               "--host", vllm_host, "--port", str(vllm_port)]
    for flag, value in vllm_args(serve):
        command += [flag] if value is None else [flag, value]
    host_in_url = f"[{host}]" if ":" in host else host
    doc = {"server": "vllm", "backend": manifest["backend"], "bundle": str(bundle), "model": name,
           "url": f"http://{host_in_url}:{port}/v1", "max_model_len": serve["max_model_len"],
           "max_prompt_length": serve["max_prompt_length"], "stack": serve["stack"], "env": env,
           "command": command + list(extra)}
    if proxy:
        doc["proxy"] = {"command": [python, str(bundle / proxy), "--host", host, "--port", str(port),
                                    "--backend-url", f"http://127.0.0.1:{vllm_port}"],
                        "refuses": "raw /v1/completions (a 400: use /v1/chat/completions, whose chat template the "
                                   "port's hybrid state expects); chat requests are sent with thinking off"}
    if serve.get("nxdi_tree"):
        doc["nxdi_tree"] = {"tree": tree_name(serve["nxdi_tree"]), "imports": serve["nxdi_tree"]["imports"],
                            "on_path": str(src) if src else None}
    if (serve.get("sampling") or {}).get("on_device"):
        doc["sampling"] = {**serve["sampling"], "note": ON_DEVICE_NOTE}
    if LINEAGES[serve["lineage"]].text_prompt_dummy == "always":
        doc["text_prompts"] = TEXT_PROMPT_NOTE
    return doc


def check_proxy_address(host: str, port: int) -> None:
    """UserError, before anything starts, for an address the port's chat proxy cannot take: it serves IPv4 only
    (ThreadingHTTPServer((host, port)), qwen36_chat_proxy.py L432 @ 03db3ef), and vLLM behind it listens on the port
    after the public one."""
    if ":" in host:
        raise UserError(f"--host {host}: this bundle is served behind the port's chat proxy, which listens on IPv4 "
                        "only; give an IPv4 address (0.0.0.0 for every interface)")
    if port == 65535:
        raise UserError("--port 65535: this bundle's vLLM listens on the port after the public one, behind the "
                        "port's chat proxy; give a lower port")


# --- the NxDI source tree a port imports from (qbuild.backends.neuron.nxdi_tree) ----------------------------------

def tree_name(tree: dict) -> str:
    where = f"{tree['git']} @ {tree['rev']}" if tree.get("git") else "the recipe's NxDI source tree"
    return f"{where}, {tree['src']}/ (version {tree['version']})"


def nxdi_tree_src(serve: dict, given: Path | None) -> Path | None:
    """The src/ of the NxDI tree `given` (--nxdi-tree), checked against what vllm/serve.json says the port imports
    from it and the tree's version; None where none is given. UserError where it is not that tree."""
    tree = serve.get("nxdi_tree")
    if given is None:
        return None
    if tree is None:
        raise UserError(f"--nxdi-tree {given}: this bundle's port imports NxDI as its SDK release installs it "
                        f"({VLLM_SERVE} records no NxDI tree); drop --nxdi-tree")
    src = (given / tree["src"]).resolve()
    package = src / nxdi_tree.PACKAGE
    gaps = nxdi_tree.missing(package, tree["imports"]) if package.is_dir() else [str(package)]
    have = nxdi_tree.version(package)
    # Where the tree is a git checkout, its commit must be the recorded one: PR 173 changes NxDI files beyond the
    # names its port imports (its block KV cache manager, its model wrapper), and another tree of the same version
    # can hold those names.
    head = nxdi_tree.checkout_commit(given)
    wrong = f"it lacks {gaps[0]}" if gaps else f"its _version.py says {have}" if have != tree["version"] else \
        f"it is checked out at {head}" if head is not None and tree.get("rev") and head != tree["rev"] else None
    if wrong:
        raise UserError(f"--nxdi-tree {given}: not the NxDI tree this bundle's port imports from ({tree_name(tree)}): "
                        + wrong)
    return src


def require_nxdi(serve: dict, src: Path | None) -> None:
    """InfraError where the bundle's port imports from an NxDI tree and neither --nxdi-tree (`src`) nor this
    interpreter's NxDI provides what it imports: vLLM would die with an ImportError while it loads the bundle's
    plugin."""
    tree = serve.get("nxdi_tree")
    if tree is None or src is not None:
        return
    package = nxdi_tree.installed_package()
    gaps = nxdi_tree.missing(package, tree["imports"]) if package else [nxdi_tree.PACKAGE]
    if gaps:
        raise InfraError(f"this host's NxDI ({package}) has no {gaps[0]}, which the bundle's port imports from the "
                         f"NxDI tree it was built with ({tree_name(tree)}): pass --nxdi-tree with a checkout of that "
                         "commit (its src/ goes on PYTHONPATH, as the port's launcher puts it) or install NxDI from it")


def printable(doc: dict) -> dict:
    """`doc` with every credential masked, for --dry-run and logs: the values after --api-key (vLLM takes one or
    more: cli_args.py L99), --api-key=KEY, and VLLM_API_KEY."""
    command, secret = [], False
    for arg in doc["command"]:
        name = arg.split("=", 1)[0]
        if name in _SECRET_FLAGS and "=" in arg:
            command.append(f"{name}=***")
        else:
            command.append("***" if secret and not arg.startswith("-") else arg)
        secret = arg in _SECRET_FLAGS or (secret and not arg.startswith("-"))
    env = {k: "***" if k == "VLLM_API_KEY" else v for k, v in doc["env"].items()}
    return {**doc, "command": command, "env": env}


# --- the host and the bundle, before and after -----------------------------------------------------------------

def require_vllm(stack: dict) -> None:
    """InfraError naming the first package of the server that does not import here, or, in one line, the host's
    vLLM and vllm-neuron versions where they are not the bundle's stack."""
    for module, dist in VLLM_PACKAGES:
        if importlib.util.find_spec(module) is None:
            raise InfraError(f"serving a neuron bundle needs vLLM with the Neuron plugin and the Neuron SDK in this "
                             f"interpreter; {dist} (`import {module}`) is not installed here. `qbuild serve --dry-run` "
                             "prints the command for a host that has them")
    have = {dist: _version(dist) for dist in ("vllm", "vllm-neuron")}
    want = {"vllm": stack["vllm"], "vllm-neuron": stack["vllm_neuron"]}
    if not all(have[d] is not None and stack_matches(have[d], want[d]) for d in want):
        raise InfraError(f"this host has vLLM {have['vllm']} with vllm-neuron {have['vllm-neuron']}; the bundle "
                         f"(SDK {', '.join(stack['releases'])}) is served by vLLM {want['vllm']} with vllm-neuron "
                         f"{want['vllm-neuron']} ({VLLM_SERVE}): use that release's vLLM environment")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_load_preconditions(bundle: Path, serve: dict) -> None:
    """What `App(dir).load(dir)` needs, checked before vLLM starts so that a failing load is named here rather than
    found by vllm-neuron (which would compile instead): NxDI's compiled neuron_config.json agrees with what vLLM is
    told (the runner refuses a max_prompt_length other than the compiled max_context_length: model runner
    L604-694), and every rank's shard is there."""
    path = bundle / "neuron_config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path}: unreadable ({e}); this is not a loadable NxDI compiled directory") from None
    nc = saved.get("neuron_config", saved)
    expected = {"tp_degree": serve["tensor_parallel_size"], "max_context_length": serve["max_prompt_length"],
                "batch_size": serve["max_num_seqs"]}
    for key, value in expected.items():
        if nc.get(key) != value:
            raise UserError(f"{path}: neuron_config.{key} is {nc.get(key)!r} where {VLLM_SERVE} says {value}; the "
                            "bundle's files do not belong together: pull or build it again")
    long_context.check_compiled(path, nc, serve)
    for rank in range(nc.get("world_size") or serve["tensor_parallel_size"]):
        shard = bundle / "weights" / f"tp{rank}_sharded_checkpoint.safetensors"
        if not shard.is_file():
            raise UserError(f"{shard}: missing; NxDI's load reads one shard per rank")


# --- the server ------------------------------------------------------------------------------------------------

def serve(bundle: Path, manifest: dict, options: ServeOptions) -> int:
    """Check the host and the bundle, run vLLM's OpenAI server on it in a child process (server_process: a session of
    its own, Ctrl-C and SIGTERM handed on, the URL announced once /v1/models answers), and check after it stopped that
    the bundle is as it was. Returns 0 when vLLM ended after such a signal; InfraError when it ended by itself, or
    changed the bundle."""
    import sys

    from qbuild.model.bundle import check_files

    serve_doc, _ = read_serve(bundle)
    check_servable(bundle, serve_doc)
    check_passthrough(options.server_args, serve_doc)
    require_vllm(serve_doc["stack"])
    require_nxdi(serve_doc, nxdi_tree_src(serve_doc, options.nxdi_tree))
    check_files(bundle, manifest, digests=not options.digests_checked)
    check_load_preconditions(bundle, serve_doc)
    proxied = bool(serve_doc.get("chat_proxy"))
    # vLLM is told its port, so one is chosen before it starts (--port 0); behind the proxy it takes the next port,
    # as --dry-run says, unless --port 0 left both to choose.
    if options.port:
        port, backend = options.port, options.port + 1 if proxied else None
    else:
        chosen = free_ports(options.host, 2 if proxied else 1)
        port, backend = chosen[0], chosen[1] if proxied else None
    doc = serve_command(bundle, manifest, options.name, options.host, port, sys.executable,
                        options.server_args, getattr(options, "api_key", None), options.nxdi_tree, backend)
    options.log(f"starting vLLM on {bundle} (prompts up to {doc['max_prompt_length']} tokens, "
                f"{doc['max_model_len']} in all)" + (" behind the port's chat proxy" if backend else ""))
    commands = [(doc["command"], child_env(doc["env"]))]
    if backend:
        commands.append((doc["proxy"]["command"], dict(os.environ)))
    # vLLM first: the proxy answers nothing useful before vLLM does.
    urls = [f"http://127.0.0.1:{backend}/v1", doc["url"]] if backend else [doc["url"]]
    return run_children(commands, urls, options, bundle, manifest, ["vLLM", "the port's chat proxy"])
