"""Deployment profiles: a TOML file describing a host's pools, thread budget, routing thresholds and peers.

``load_profile(name_or_path)`` reads one into frozen dataclasses.  A bare name (``"cpu-only"``) is a
profile shipped in ``weaved.profiles``; anything with a slash or a ``.toml`` suffix is a file path; no
argument picks a shipped profile by probing the hardware (``detect_profile``).  ``"auto"`` values are
resolved from ``weaved.hardware`` at load, so the dataclasses hold plain numbers.

Every mistake is a ``ProfileError`` naming the file, the key and the reason: unknown keys (typos must
not pass silently), wrong types, bad enum values, out-of-range numbers, duplicate pool or peer names.
A torch pool on ``cuda`` loads fine on a host without CUDA: whether a device exists is the daemon's
check when it starts the pool.  The keys are documented in docs/profiles.md.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import re
import socket
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weaved.profile_toml import AUTO, ProfileError, _Invalid, _Table, parse_size

if TYPE_CHECKING:
    from weaved.hardware import Hardware

__all__ = ["ProfileError", "parse_size", "load_profile", "detect_profile", "Profile", "FederationConfig"]

BACKENDS = ("cpu", "torch")
STRATEGIES = ("standard", "qring")
CPU_RATE_UNITS = ("pool", "thread")
POLICIES = ("sla", "isolation", "fifo")  # Weave's router, and the two baselines the agents benchmark compares


def _check(ok: bool, field_name: str, reason: str) -> None:
    if not ok:
        raise _Invalid(field_name, reason)


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

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must not be empty")
        _positive(self, "kv_cap_bytes", "max_sessions")


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

    def __post_init__(self) -> None:
        _check(re.fullmatch(r"[a-z0-9][a-z0-9_.-]*", self.name) is not None, "name",
               f"{self.name!r} is not a pool name (lower-case letters, digits, '-', '_', '.')")
        _check(self.backend in BACKENDS, "backend", f"must be one of {BACKENDS}, got {self.backend!r}")
        ok_dev = self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device) is not None
        _check(ok_dev, "device", f"must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        _check(self.backend == "torch" or self.device == "cpu", "device",
               "the cpu backend runs on device 'cpu' only")
        _check(self.strategy in STRATEGIES, "strategy", f"must be one of {STRATEGIES}, got {self.strategy!r}")
        _check(self.strategy != "qring" or self.backend == "cpu", "backend",
               "a qring pool runs on the cpu backend (the ring's home runs the dense layers with the CPU kernels)")
        _check(not (self.speculative and self.strategy != "standard"), "speculative",
               "speculative decoding runs in standard decode pools only")
        if self.speculative:
            _positive(self, "spec_max_concurrency")
        else:
            _check(self.spec_max_concurrency == 0, "spec_max_concurrency", "set only with speculative = true")
        _positive(self, "spec_draft_tokens", "spec_ngram_min")
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

    cpu_prefill_tokens_per_s: float  # the CPU pool's prefill rate (whole pool)
    cpu_decode_tokens_per_s: float  # the CPU pool's aggregate decode rate over its batch
    long_prompt_tokens: int = 2048  # background/batch prompts this long prefill on a GPU or a pipeline
    ttft_margin: float = 0.8  # the CPU meets a TTFT target if its prediction is within this share of it
    ring_batch_depth: int = 16  # Q-Ring decode pays off once this many sessions share the ring
    node_kv_tokens: int | None = None  # most context one node holds; None: the daemon's KV-cap figure
    pipeline_min_prompt_tokens: int = 8192  # shortest prompt that keeps a prefill pipeline full
    # "sla": the decision tree.  The baselines of the agents benchmark (docs/benchmarks.md):
    # "isolation" binds a session to a pool by its class at creation and never moves it or changes
    # its priority; "fifo" puts every session in the first standard pool, first come first served.
    policy: str = "sla"

    def __post_init__(self) -> None:
        _check(self.policy in POLICIES, "policy", f"must be one of {POLICIES}, got {self.policy!r}")
        _positive(self, "cpu_prefill_tokens_per_s", "cpu_decode_tokens_per_s", "long_prompt_tokens",
                  "ttft_margin", "ring_batch_depth", "pipeline_min_prompt_tokens")
        _check(self.ttft_margin <= 1.0, "ttft_margin", f"must be in (0, 1], got {self.ttft_margin}")
        if self.node_kv_tokens is not None:
            _positive(self, "node_kv_tokens")


@dataclass(frozen=True)
class PeerConfig:
    name: str
    url: str  # the peer daemon's control-plane address, e.g. http://10.0.0.12:7411
    token: str = field(repr=False)  # shared secret sent with every request (kept out of reprs)

    def __post_init__(self) -> None:
        _check(bool(self.name), "name", "must not be empty")
        m = re.fullmatch(r"https?://(\[[0-9a-fA-F:.]+\]|[^/\s:\[\]]+)(:\d+)?/?", self.url)
        _check(m is not None, "url", f"must be http(s)://host[:port], got {self.url!r}")
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
               f"must be a host address, got {self.bind!r}")
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


# --- resolving a profile --------------------------------------------------------------------------

_TOP_KEYS = ("description", "host", "threads", "pools", "routing", "peers", "federation")


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/weave``, else ``~/.local/share/weave`` (a relative XDG_DATA_HOME is ignored)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share") / "weave"


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with Weave."""
    root = importlib.resources.files("weaved.profiles")
    return sorted(p.name[: -len(".toml")] for p in root.iterdir() if p.name.endswith(".toml"))


def _read(spec: str | os.PathLike[str]) -> tuple[str, str, bytes]:
    """(profile name, source, bytes) of a shipped name or a path."""
    text = os.fspath(spec)
    if isinstance(spec, os.PathLike) or "/" in text or os.sep in text or text.endswith(".toml"):
        path = Path(text).expanduser()
        try:
            return path.stem, str(path), path.read_bytes()
        except OSError as e:
            raise ProfileError(path, "", f"cannot read the profile: {e.strerror or e}") from None
    res = importlib.resources.files("weaved.profiles").joinpath(f"{text}.toml")
    if not res.is_file():
        names = ", ".join(shipped_profiles())
        raise ProfileError(text, "", f"no shipped profile of that name (shipped: {names}; "
                                     "give a path to use your own file)")
    return text, str(res), res.read_bytes()


def load_profile(name_or_path: str | os.PathLike[str] | None = None, *,
                 hardware: Hardware | None = None) -> Profile:
    """Read, validate and resolve a profile.  ``hardware`` replaces detection (tests, dry runs)."""
    if name_or_path is None:
        return detect_profile(hardware)
    name, source, raw = _read(name_or_path)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ProfileError(source, "", f"not valid TOML: {e}") from None
    return _resolve(name, source, data, hardware)


def pick_profile_name(hw: Hardware) -> str:
    """The shipped profile for this hardware: cpu-only without a GPU, l40s-epyc for that pairing,
    else workstation (which sizes itself from the detected hardware)."""
    if not hw.gpus:
        return "cpu-only"
    if any("L40S" in g.name.upper() for g in hw.gpus) and "EPYC" in hw.cpu_model.upper():
        return "l40s-epyc"
    return "workstation"


def detect_profile(hardware: Hardware | None = None) -> Profile:
    """Probe the hardware (psutil, NVML) and load the shipped profile that fits it."""
    if hardware is None:
        from weaved.hardware import detect

        hardware = detect()
    name = pick_profile_name(hardware)
    gpus = ", ".join(g.name for g in hardware.gpus) or "no GPU"
    prof = load_profile(name, hardware=hardware)
    note = f"profile {name!r} picked for {hardware.physical_cores} cores and {gpus}"
    return dataclasses.replace(prof, notes=(note, *prof.notes))


def _resolve(name: str, source: str, data: dict[str, Any], hardware: Hardware | None) -> Profile:
    hw_cache: list[Hardware] = [hardware] if hardware is not None else []

    def hw() -> Hardware:  # probe only when an "auto" value or only_if_gpu needs it
        if not hw_cache:
            from weaved.hardware import detect

            hw_cache.append(detect())
        return hw_cache[0]

    root = _Table(source, "", data)
    root.seen.update(_TOP_KEYS)
    root.done()  # a misspelt section must be reported as such, not as its keys missing
    description = root.text("description", "")
    notes: list[str] = []
    pools = _pools(root, hw, notes)
    threads = _threads(root.sub("threads"), pools, hw)
    host = _host(root.sub("host"), source, hw)
    routing = _routing(root.sub("routing"), threads)
    peers = _peers(root)
    federation = _federation(root.sub("federation"))
    return Profile(name=name, source=source, host=host, threads=threads, pools=tuple(pools),
                   routing=routing, peers=tuple(peers), federation=federation, description=description,
                   notes=tuple(notes))


def _pools(root: _Table, hw: Callable[[], Hardware], notes: list[str]) -> list[PoolConfig]:
    pools: list[PoolConfig] = []
    names: set[str] = set()
    for t in root.array("pools"):
        pname = t.text("name")
        if pname in names:
            raise t.err("name", f"duplicate pool name {pname!r}")
        names.add(pname)
        backend = t.text("backend", choices=BACKENDS)
        speculative = t.flag("speculative", False)
        max_batch, chunk = t.integer("max_batch", 16), t.integer("prefill_chunk", 512)
        pool = t.build(
            PoolConfig, name=pname, backend=backend,
            device=t.text("device", "cpu" if backend == "cpu" else "cuda"),
            strategy=t.text("strategy", "standard", STRATEGIES), speculative=speculative,
            spec_max_concurrency=t.integer("spec_max_concurrency", 4 if speculative else 0),
            **_spec_drafts(t, speculative),
            max_batch=max_batch, prefill_chunk=chunk,
            token_budget=t.integer("token_budget", chunk + max_batch),
            idle_demote_s=t.number("idle_demote_s", None),
            interactive_token_budget=t.integer("interactive_token_budget", None),
        )
        only_if_gpu = t.flag("only_if_gpu", False)
        if only_if_gpu and pool.cuda_device is None:
            raise t.err("only_if_gpu", "applies to pools on a cuda device only")
        t.done()
        if only_if_gpu and not hw().has_gpu:
            notes.append(f"pool {pname!r} left out: no CUDA GPU detected")
            continue
        pools.append(pool)
    if not any(p.strategy == "standard" for p in pools):
        raise root.err("pools", 'needs at least one [[pools]] table with strategy = "standard"')
    return pools


def _spec_drafts(t: _Table, speculative: bool) -> dict[str, int]:
    """The draft knobs of a pool's speculative variant; on a plain pool they would silently do nothing."""
    d = PoolConfig.__dataclass_fields__
    keys = ("spec_draft_tokens", "spec_ngram_min", "spec_ngram_max")
    if not speculative:
        for k in keys:
            if k in t.data:
                raise t.err(k, "set only with speculative = true")
    return {k: t.integer(k, d[k].default) for k in keys}


def _threads(t: _Table, pools: list[PoolConfig], hw: Callable[[], Hardware]) -> ThreadBudget:
    driver = t.integer("gpu_driver", AUTO, auto=True)
    if driver == AUTO:  # one launching thread per CUDA device the pools use
        driver = len({p.cuda_device for p in pools if p.cuda_device is not None})
    api = t.integer("api", 1)
    kernels = t.integer("kernels", AUTO, auto=True)
    if kernels == AUTO:
        kernels = max(1, hw().physical_cores - driver - api)
    budget = t.build(ThreadBudget, kernels=kernels, gpu_driver=driver, api=api)
    t.done()
    return budget


def _host(t: _Table, source: str, hw: Callable[[], Hardware]) -> HostConfig:
    hname = t.text("name", AUTO)
    data_dir = t.text("data_dir", AUTO)
    if not data_dir:
        raise t.err("data_dir", 'must be a path or "auto"')
    path = default_data_dir() if data_dir == AUTO else Path(os.path.expandvars(data_dir)).expanduser()
    if not path.is_absolute():  # relative to the profile file, not to wherever the daemon was started
        path = Path(source).resolve().parent / path
    cap = t.get("kv_cap_bytes", lambda v: isinstance(v, int | str) and not isinstance(v, bool),
                'a size: bytes, a string like "8GiB", or "auto"', AUTO)
    if cap == AUTO:
        cap = hw().memory_bytes // 2  # the page-cache tier is what keeps file-backed KV fast
    else:
        try:
            cap = parse_size(cap)
        except ValueError as e:
            raise t.err("kv_cap_bytes", str(e)) from None
    host = t.build(HostConfig, name=socket.gethostname() if hname == AUTO else hname, data_dir=path,
                   kv_cap_bytes=cap, max_sessions=t.integer("max_sessions", 256))
    t.done()
    return host


def _routing(t: _Table, threads: ThreadBudget) -> RoutingThresholds:
    unit = t.text("cpu_rate_unit", "pool", CPU_RATE_UNITS)
    node_kv = t.integer("node_kv_tokens", AUTO, auto=True)
    d = RoutingThresholds.__dataclass_fields__
    kw = {k: t.integer(k, d[k].default) for k in ("long_prompt_tokens", "ring_batch_depth",
                                                  "pipeline_min_prompt_tokens")}
    scale = threads.kernels if unit == "thread" else 1  # per-thread estimates scale with the budget
    th = t.build(RoutingThresholds, **kw,
                 cpu_prefill_tokens_per_s=t.number("cpu_prefill_tokens_per_s") * scale,
                 cpu_decode_tokens_per_s=t.number("cpu_decode_tokens_per_s") * scale,
                 ttft_margin=t.number("ttft_margin", d["ttft_margin"].default),
                 policy=t.text("policy", "sla", POLICIES),
                 node_kv_tokens=None if node_kv == AUTO else node_kv)
    t.done()
    return th


def _token(t: _Table, required: bool) -> str | None:
    """``token`` or ``token_env`` (the name of a variable holding it): exactly one when required,
    at most one otherwise."""
    token, env = t.text("token", None), t.text("token_env", None)
    if token is not None and env is not None:
        raise t.err("token", "give exactly one of token or token_env")
    if required and token is None and env is None:
        raise t.err("token", "give exactly one of token or token_env")
    if env is not None:
        token = os.environ.get(env, "")
        if not token:
            raise t.err("token_env", f"environment variable {env} is not set")
    return token


def _federation(t: _Table) -> FederationConfig:
    d = FederationConfig.__dataclass_fields__
    port = t.integer("port", None)
    fed = t.build(FederationConfig, port=port, bind=t.text("bind", d["bind"].default), token=_token(t, False),
                  health_interval_s=t.number("health_interval_s", d["health_interval_s"].default),
                  health_timeout_s=t.number("health_timeout_s", d["health_timeout_s"].default),
                  ring_timeout_s=t.number("ring_timeout_s", d["ring_timeout_s"].default),
                  ring_idle_timeout_s=t.number("ring_idle_timeout_s", d["ring_idle_timeout_s"].default),
                  ring_heads_per_group=t.integer("ring_heads_per_group", d["ring_heads_per_group"].default))
    t.done()
    return fed


def _peers(root: _Table) -> list[PeerConfig]:
    peers: list[PeerConfig] = []
    for t in root.array("peers"):
        pname, url = t.text("name"), t.text("url")
        if any(p.name == pname for p in peers):
            raise t.err("name", f"duplicate peer name {pname!r}")
        token = _token(t, True)
        peers.append(t.build(PeerConfig, name=pname, url=url, token=token))
        t.done()
    return peers
