"""A deployment profile as frozen dataclasses: the host, its thread budget, pools, routing thresholds,
peers and federation settings.

Each dataclass checks its own values when built (``Invalid`` names the field); ``weaved.config.load``
reads a TOML file into them and turns those into ``ProfileError``s naming the file and key.  The keys
are documented in docs/profiles.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from weaved.config.tables import Invalid, one_of, toml_repr

BACKENDS = ("cpu", "torch")
STRATEGIES = ("standard", "qring")
CPU_RATE_UNITS = ("pool", "thread")
POLICIES = ("sla", "isolation", "fifo")  # Weave's router, and the two baselines the agents benchmark compares
DURABILITY = ("page-cache", "fsync")


def _check(ok: bool, field_name: str, reason: str) -> None:
    if not ok:
        raise Invalid(field_name, reason)


def _positive(obj: object, *names: str, zero_ok: bool = False) -> None:
    for n in names:
        v = getattr(obj, n)
        ok = v >= 0 if zero_ok else v > 0
        _check(ok and math.isfinite(v), n, f"must be {'>= 0' if zero_ok else '> 0'}, got {v}")


@dataclass(frozen=True)
class HostConfig:
    name: str
    data_dir: Path  # session KV files and the journal live here
    kv_cap_bytes: int  # the most KV this node keeps (file-backed: disk + page cache)
    max_sessions: int
    default_context: int = 32768  # a session's context when it names none (capped by the model's)
    # what a committed token survives: "page-cache" - a killed daemon (the kernel writes the pages back);
    # "fsync" - also a power loss or OS crash (the KV rows and the journal reach the disk before each
    # commit, at a cost per token measured in docs/benchmarks.md)
    durability: str = "page-cache"
    # shared prefixes (weaved.kv.prefixes): a prompt that starts with stored KV blocks maps them instead
    # of prefilling them again; off only to measure what it saves
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must not be empty")
        _positive(self, "kv_cap_bytes", "max_sessions", "default_context")
        _check(self.durability in DURABILITY, "durability",
               f"must be {one_of(DURABILITY)}, got {toml_repr(self.durability)}")


@dataclass(frozen=True)
class ThreadBudget:
    kernels: int  # threads of the CPU pools' numba kernels (one process-wide pool)
    gpu_driver: int  # cores left for the Python threads that launch GPU work (one per CUDA device)
    api: int  # cores left for the HTTP API and the engines' scheduling loops

    def __post_init__(self) -> None:
        _positive(self, "kernels")
        _positive(self, "gpu_driver", "api", zero_ok=True)


@dataclass(frozen=True)
class PoolConfig:
    """One batch engine: a backend on a device running one decode strategy with one variant."""

    name: str
    backend: str  # "cpu" (numba kernels) | "torch"
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    strategy: str = "standard"  # decode strategy: "standard" | "qring"
    speculative: bool = False
    spec_max_concurrency: int = 0  # speculative variant: used while the pool runs fewer sessions
    # speculative variant's prompt-lookup drafts (weaved.engine.speculative): the most draft tokens a
    # sequence verifies per step, and the context suffix lengths (n-grams) looked up, longest first
    spec_draft_tokens: int = 8
    spec_ngram_min: int = 2
    spec_ngram_max: int = 3
    max_batch: int = 16  # sequences decoding together
    prefill_chunk: int = 512  # prompt tokens one sequence may prefill per step
    token_budget: int = 528  # tokens per engine step, prefill chunks and decode tokens together
    idle_demote_s: float | None = None  # GPU pools: demote a session idle this long (None: never)
    # tokens per step while an interactive turn decodes in this pool (None: token_budget): bounds the
    # inter-token gap of an interactive turn that shares the pool with prefilling background turns
    interactive_token_budget: int | None = None
    # torch pools: bytes of the device its backend may use - weights, a step's workspace and the paged KV
    # pool (weaved.backends.device_memory); None: what a CUDA device has free at start (the CPU device,
    # a stand-in, gets a 1 GiB KV pool).  Pools on one device share one backend: the smallest applies.
    device_memory: int | None = None

    def __post_init__(self) -> None:
        _check(re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", self.name) is not None, "name",
               f"{toml_repr(self.name)} is not a pool name (lower-case letters, digits, '-', '_', '.')")
        _check(self.backend in BACKENDS, "backend", f"must be {one_of(BACKENDS)}, got {toml_repr(self.backend)}")
        ok_dev = self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device) is not None
        _check(ok_dev, "device", f'must be "cpu", "cuda" or "cuda:N", got {toml_repr(self.device)}')
        _check(self.backend == "torch" or self.device == "cpu", "device",
               "the cpu backend runs on device 'cpu' only")
        _check(self.strategy in STRATEGIES, "strategy", f"must be {one_of(STRATEGIES)}, got {toml_repr(self.strategy)}")
        _check(self.strategy != "qring" or self.backend == "cpu", "backend",
               "a qring pool runs on the cpu backend (the ring's home runs the dense layers with the CPU kernels)")
        _check(not (self.speculative and self.strategy != "standard"), "speculative",
               "speculative decoding runs in standard decode pools only")
        if self.speculative:
            _positive(self, "spec_max_concurrency")
        else:
            _check(self.spec_max_concurrency == 0, "spec_max_concurrency", "set only with speculative = true")
        _positive(self, "spec_draft_tokens", "spec_ngram_min")
        _check(self.device_memory is None or (self.backend == "torch" and self.device_memory > 0), "device_memory",
               "a positive size, for torch pools only")
        _check(self.spec_ngram_max >= self.spec_ngram_min, "spec_ngram_max",
               f"must be >= spec_ngram_min ({self.spec_ngram_min}), got {self.spec_ngram_max}")
        _positive(self, "max_batch", "prefill_chunk", "token_budget")
        _check(self.token_budget >= self.prefill_chunk, "token_budget",
               f"must hold one prefill chunk ({self.prefill_chunk} tokens), got {self.token_budget}")
        _check(self.token_budget >= self.max_batch, "token_budget",
               f"must hold one decode token per sequence of a full batch ({self.max_batch}), "
               f"got {self.token_budget}")
        if self.interactive_token_budget is not None:
            _positive(self, "interactive_token_budget")
            _check(self.interactive_token_budget <= self.token_budget, "interactive_token_budget",
                   f"must not exceed token_budget ({self.token_budget}), got {self.interactive_token_budget}")
        if self.idle_demote_s is not None:
            _check(self.backend == "torch", "idle_demote_s", "only GPU (torch) pools demote idle sessions")
            _positive(self, "idle_demote_s", zero_ok=True)

    @property
    def cuda_device(self) -> int | None:
        """CUDA device index, or None for a pool on the CPU."""
        return None if self.device == "cpu" else int(self.device.partition(":")[2] or 0)


@dataclass(frozen=True)
class RoutingThresholds:
    """Every number the router decides with (calibration measures them per host)."""

    # the CPU pool's prefill rate (whole pool) and aggregate decode rate over its batch; None: the daemon
    # measures them on its host (weaved.calibration) - a value given here overrides the measurement
    cpu_prefill_tokens_per_s: float | None = None
    cpu_decode_tokens_per_s: float | None = None
    long_prompt_tokens: int = 2048  # background/batch prompts this long prefill on a GPU or a pipeline
    ttft_margin: float = 0.8  # the CPU meets a TTFT target if its prediction is within this share of it
    ring_batch_depth: int = 16  # Q-Ring decode pays off once this many sessions share the ring
    node_kv_tokens: int | None = None  # most context one node holds; None: the daemon's KV-cap figure
    pipeline_min_prompt_tokens: int = 8192  # shortest prompt that keeps a prefill pipeline full
    # the TTLT budget of a background / batch turn whose SLA names none: throughput-tolerant is not
    # "never" - the scheduler paces such a turn to end within it, and admission refuses what cannot
    background_ttlt_s: float = 600.0
    batch_ttlt_s: float = 3600.0
    # the answer a throughput-tolerant turn is assumed to generate when the router predicts whether the
    # CPU pool would meet its TTLT budget (a turn that it would not is decoded on a GPU pool with room)
    answer_tokens: int = 256
    # the inter-token gap an interactive turn is promised: while one decodes, a pool whose step-time model
    # is known cuts its steps' prefill share so a step is predicted within ttft_margin of this
    interactive_itl_ms: float = 100.0
    # a throughput-tolerant session spilled to a GPU pool returns to a CPU pool predicted to end its turn
    # within this share of ttft_margin x its budget (below 1: a band in which it stays where it is)
    return_share: float = 0.75
    # the share of a GPU pool's device KV a spilling throughput-tolerant turn must leave free, for the
    # interactive sessions promoted to it
    gpu_interactive_reserve: float = 0.25
    # "sla": the decision tree.  The baselines of the agents benchmark (docs/benchmarks.md):
    # "isolation" binds a session to a pool by its class at creation and never moves it or changes
    # its priority; "fifo" puts every session in the first standard pool, first come first served.
    policy: str = "sla"

    @property
    def step_target_s(self) -> float:
        """The step time a pool aims for while an interactive turn decodes: the promised gap, with the
        margin the predictions keep."""
        return self.interactive_itl_ms / 1000.0 * self.ttft_margin

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, "policy", f"must be {one_of(POLICIES)}, got {toml_repr(self.policy)}")
        for rate in ("cpu_prefill_tokens_per_s", "cpu_decode_tokens_per_s"):
            if getattr(self, rate) is not None:
                _positive(self, rate)
        _positive(self, "long_prompt_tokens", "ttft_margin", "ring_batch_depth", "pipeline_min_prompt_tokens",
                  "background_ttlt_s", "batch_ttlt_s", "answer_tokens", "interactive_itl_ms")
        _check(self.ttft_margin <= 1.0, "ttft_margin", f"must be in (0, 1], got {self.ttft_margin}")
        _check(0 < self.return_share <= 1.0, "return_share", f"must be in (0, 1], got {self.return_share}")
        _check(0 <= self.gpu_interactive_reserve < 1.0, "gpu_interactive_reserve",
               f"must be in [0, 1), got {self.gpu_interactive_reserve}")
        if self.node_kv_tokens is not None:
            _positive(self, "node_kv_tokens")


PEER_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # a run-time peer's name (it travels in URL paths)
PEER_NAME_RULE = "use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"


@dataclass(frozen=True)
class PeerConfig:
    name: str
    url: str  # the peer daemon's control-plane address, e.g. http://10.0.0.12:7411
    token: str = field(repr=False)  # shared secret sent with every request (kept out of reprs)

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must not be empty")
        m = re.fullmatch(r"https?://(\[[0-9a-fA-F:.]+\]|[^/\s:\[\]]+)(:\d+)?/?", self.url)
        _check(m is not None, "url", f"must be http(s)://host[:port], got {toml_repr(self.url)}")
        _check(bool(self.token), "token", "must not be empty")
        _check(self.token.isprintable() and not any(c.isspace() for c in self.token), "token",
               "must be printable and without spaces (it travels in an HTTP header)")


DEFAULT_FEDERATION_PORT = 7411  # the control plane's TCP port when the profile names peers but no port


@dataclass(frozen=True)
class FederationConfig:
    """This node's side of the control plane: where it listens for its peers and the shared token
    every request must carry (the token its peers send; see docs/federation.md, control plane)."""

    port: int | None = None  # TCP port of the control plane (0: any free port); None: not listening
    bind: str = "127.0.0.1"  # loopback unless the operator opens it to the network on purpose
    token: str | None = field(default=None, repr=False)  # kept out of reprs and logs
    health_interval_s: float = 5.0  # how often every peer is checked
    health_timeout_s: float = 2.0  # bound on one check's connect and read
    ring_timeout_s: float = 30.0  # every data-plane wait of a ring or pipeline (longer than a layer's work)
    ring_idle_timeout_s: float = 60.0  # a member waiting for the home's next command (the home pings at 1/3)
    ring_heads_per_group: int = 1  # kv heads per travelling Q-Ring packet (must divide the model's)

    def __post_init__(self) -> None:
        if self.port is not None:
            _check(0 <= self.port <= 65535, "port", f"must be in 0..65535, got {self.port}")
        _check(bool(self.bind) and not any(c.isspace() for c in self.bind), "bind",
               f"must be a host address, got {toml_repr(self.bind)}")
        if self.token is not None:
            _check(bool(self.token), "token", "must not be empty")
            _check(self.token.isprintable() and not any(c.isspace() for c in self.token), "token",
                   "must be printable and without spaces (it travels in an HTTP header)")
        _positive(self, "health_interval_s", "health_timeout_s", "ring_timeout_s", "ring_idle_timeout_s",
                  "ring_heads_per_group")
        _check(self.health_timeout_s <= self.health_interval_s, "health_timeout_s",
               f"must not exceed health_interval_s ({self.health_interval_s}), got {self.health_timeout_s}")


@dataclass(frozen=True)
class Profile:
    name: str
    source: str  # the file it was read from
    host: HostConfig
    threads: ThreadBudget
    pools: tuple[PoolConfig, ...]
    routing: RoutingThresholds
    peers: tuple[PeerConfig, ...] = ()
    federation: FederationConfig = field(default_factory=FederationConfig)
    description: str = ""
    notes: tuple[str, ...] = ()  # what load-time detection decided (e.g. a GPU pool left out)

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"profile {self.name!r} has no pool {name!r}")


def operator_profile_file(profile: Profile) -> str | None:
    """The file a profile was read from when it is the operator's own (None for a shipped profile,
    which its name says)."""
    from importlib.resources import files

    src = Path(profile.source)
    return None if src.parent == Path(str(files("weaved.profiles"))) else str(src.resolve())
