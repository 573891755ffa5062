"""The Backend protocol: what the planner, the checks, the steps, the renderer and the CLI may ask of a backend
(its planning part, and the types a backend's part of a plan is made of, are in qbuild.planning.backend; what a build
step hands a backend is a step's Context, qbuild.planning.step).

A backend offers capabilities and decisions (which extra source nodes a recipe needs, how its weights are sharded,
which graphs it compiles and how, what a bundle is and how it runs), never its own identity: nothing outside
qbuild.backends tests which backend it holds. Planning-time methods are pure over their inputs and import no torch;
the build-time methods (compile, package, run_prompts) import what they need when they run.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from qbuild.backends import SERVERS
from qbuild.core.errors import UserError
from qbuild.model.arch import Arch
from qbuild.planning.backend import PlanningBackend
from qbuild.planning.step import Context
from qbuild.recipe.schema import LoadedRecipe
from qbuild.store.side_cache import SideCache


@dataclass(frozen=True)
class PromptRun:
    """One reference prompt as a bundle ran it, for the verify gate to compare."""

    index: int                       # the prompt's index in the reference
    record: dict                     # the reference's record it is compared with (greedy tokens possibly cut)
    logits: object | None            # the bundle's prefill logits: (n, V), or (1, V) where last_only; None where the
                                     # bundle returns tokens only (a neuron bundle sampling on the device)
    greedy: list[int]
    last_only: bool                  # the bundle returns the last prompt position's logits only


@dataclass(frozen=True)
class ServeOptions:
    """How `qbuild serve` was asked to serve a bundle."""

    name: str                        # the model name clients send (a recipe's name, or the bundle directory's)
    host: str
    port: int                        # 0: any free port
    log: Callable[[str], None]       # progress lines for a person (stderr)
    on_ready: Callable[[str], None]  # called once with the base URL (".../v1") when requests are answered
    digests_checked: bool = False    # every file of the bundle was checked against its digest just now (a pull)
    server_args: tuple[str, ...] = ()   # the arguments after `--`, for the server a backend runs (vLLM's flags)
    # Fetch the http(s) image URLs chat requests name (a server-side request forgery hazard: off unless asked for).
    allow_image_urls: bool = False
    # The key every request must send as `Authorization: Bearer <key>` (None: none is asked for). A secret: never
    # printed, logged, or put on a command line another user can read (`ps`).
    api_key: str | None = field(default=None, repr=False)
    # A checkout of the NxDI source tree a neuron bundle's port imports from (vllm/serve.json "nxdi_tree"), whose src/
    # goes on the server's PYTHONPATH.
    nxdi_tree: Path | None = None
    # The server the user asked for (one of SERVERS); None: the bundle's own (qbuild's for a CPU bundle and a neuron VL
    # bundle, vLLM for a neuron text bundle).
    server: str | None = None

    def __post_init__(self) -> None:
        # A key a client cannot send in an HTTP header (empty, spaces, control or non-ASCII characters) could never
        # match: refused here, without repeating it.
        if self.api_key is not None and not (self.api_key and all("!" <= c <= "~" for c in self.api_key)):
            raise UserError("--api-key (or QBUILD_API_KEY): a key is one or more printable ASCII characters without "
                            "spaces")
        if self.server is not None and self.server not in SERVERS:
            raise UserError(f"--server {self.server}: not one of {', '.join(SERVERS)}")

    @property
    def open_to_others(self) -> bool:
        """Whether other machines can reach the server and no key keeps them out: `host` is not a loopback address
        and there is no API key."""
        if self.api_key is not None:
            return False
        try:
            return not ipaddress.ip_address(self.host).is_loopback
        except ValueError:   # a host name
            return self.host != "localhost"


class Backend(PlanningBackend, Protocol):
    """What planning asks (PlanningBackend: validate, plan, explain_reuse, portable), and what the renderer, the
    steps, the executors and the CLI ask."""

    def describe_compile(self, params: object) -> dict:
        """Extra fields of a compile node in `plan --json`."""

    def port_info(self, loaded: LoadedRecipe, arch: Arch) -> dict | None:
        """The port source the recipe resolves to, for `plan --json` (None where the backend runs none)."""

    def side_caches(self) -> tuple[SideCache, ...]:
        """The caches this backend keeps in the store beside its entries (a compiler's own), which gc trims and
        `store verify` checks (qbuild.store.side_cache)."""

    def host_lacks(self, resources: dict[str, int]) -> str | None:
        """Why this host cannot run a step of this backend that needs `resources` (a node's, by the backend's own
        names), as the rest of a sentence after the step's name ("runs on 8 NeuronCores and this host has no Neuron
        device; ..."); None where it can."""

    def compile(self, ctx: Context) -> None:
        """Build one compile node into ctx.out."""

    def package(self, ctx: Context) -> dict[str, str]:
        """Put the compiled graphs into the bundle at ctx.out; returns graph name -> file in the bundle."""

    def recognises(self, manifest: dict) -> bool:
        """Whether a bundle with this bundle.json is one this backend packages (its backend and its graphs' layout)."""

    def runtime(self, bundle: Path, manifest: dict, verify_digests: bool = True, shown_as: str | None = None):
        """The bundle loaded to run prompts on this host (`qbuild run`, `qbuild bench`); UserError where this host
        cannot run it. Errors name the bundle `shown_as` (default: `bundle`)."""

    def run_prompts(self, ctx: Context, reference: dict, ref_dir: Path) -> list[PromptRun]:
        """Run the bundle (ctx.inputs["bundle"]) on the reference's prompts."""


class Server(Protocol):
    """How `qbuild serve` and `qbuild pull` serve a backend's bundle (qbuild.backends.server). Apart from Backend
    because no build step serves: the registry keeps the two implementations apart, so no key holds a server's
    code."""

    name: str

    def serve_instructions(self, bundle: Path, manifest: dict) -> dict | None:
        """What `qbuild pull` prints beside a pulled bundle about serving it elsewhere (None: `qbuild serve` alone)."""

    def serve_command(self, bundle: Path, manifest: dict, options: ServeOptions) -> dict:
        """What `qbuild serve --dry-run` prints: the server this bundle would get, its URL and limits, and, where the
        server is another program, its exact command line and environment. Reads the bundle's own record only."""

    def serve(self, bundle: Path, manifest: dict, options: ServeOptions) -> int:
        """Serve the bundle's OpenAI-compatible endpoint until SIGINT or SIGTERM; returns the exit code (0 when
        stopped so). Raises InfraError where this host cannot run the server."""
