"""Reading a deployment profile: a TOML file describing a host's pools, thread budget, routing thresholds
and peers, into the frozen dataclasses of ``weaved.config.profile``.

``load_profile(name_or_path)`` reads one.  A bare name (``"cpu-only"``) is a profile shipped in
``weaved.profiles``; anything with a slash or a ``.toml`` suffix is a file path; no argument picks a
shipped profile by probing the hardware (``detect_profile``).  ``"auto"`` values are resolved from
``weaved.config.hardware`` at load, so the dataclasses hold plain numbers.

Every mistake is a ``ProfileError`` naming the file, the key and the reason: unknown keys (typos must
not pass silently), wrong types, bad enum values, out-of-range numbers, duplicate pool or peer names.
A torch pool on ``cuda`` loads fine on a host without CUDA: whether a device exists is the daemon's
check when it starts the pool.  The keys are documented in docs/profiles.md.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
import socket
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weaved.config.profile import (
    BACKENDS,
    CPU_RATE_UNITS,
    DURABILITY,
    POLICIES,
    STRATEGIES,
    FederationConfig,
    HostConfig,
    PeerConfig,
    PoolConfig,
    Profile,
    RoutingThresholds,
    ThreadBudget,
)
from weaved.config.tables import AUTO, ProfileError, Table, parse_size

if TYPE_CHECKING:
    from weaved.config.hardware import Hardware

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
        from weaved.config.hardware import detect

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
            from weaved.config.hardware import detect

            hw_cache.append(detect())
        return hw_cache[0]

    root = Table(source, "", data)
    root.seen.update(_TOP_KEYS)
    root.done()  # a misspelt section must be reported as such, not as its keys missing
    description = root.text("description", "")
    notes: list[str] = []
    pools = _pools(root, hw, notes)
    threads = _threads(root.sub("threads"), pools, hw)
    cpus = os.cpu_count() or 1
    if threads.kernels > cpus:  # (numba's team has at most one thread per CPU)
        notes.append(f"threads.kernels is {threads.kernels}, more than this host's {cpus} CPUs: the kernels run "
                     f"on {cpus} threads")
    host = _host(root.sub("host"), source, hw)
    routing = _routing(root.sub("routing"), threads)
    peers = _peers(root)
    federation = _federation(root.sub("federation"))
    return Profile(name=name, source=source, host=host, threads=threads, pools=tuple(pools),
                   routing=routing, peers=tuple(peers), federation=federation, description=description,
                   notes=tuple(notes))


def _device_memory(t: Table, backend: str) -> int | None:
    v = t.get("device_memory", lambda v: isinstance(v, int | str) and not isinstance(v, bool),
              'a size: bytes, a string like "40GiB", or "auto"', AUTO)
    if v == AUTO:
        return None
    if backend != "torch":
        raise t.err("device_memory", "applies to torch pools only (a cpu pool's KV is in the host's files)")
    try:
        return parse_size(v)
    except ValueError as e:
        raise t.err("device_memory", str(e)) from None


def _pools(root: Table, hw: Callable[[], Hardware], notes: list[str]) -> list[PoolConfig]:
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
            device_memory=_device_memory(t, backend),
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


def _spec_drafts(t: Table, speculative: bool) -> dict[str, int]:
    """The draft knobs of a pool's speculative variant; on a plain pool they would silently do nothing."""
    d = PoolConfig.__dataclass_fields__
    keys = ("spec_draft_tokens", "spec_ngram_min", "spec_ngram_max")
    if not speculative:
        for k in keys:
            if k in t.data:
                raise t.err(k, "set only with speculative = true")
    return {k: t.integer(k, d[k].default) for k in keys}


def _threads(t: Table, pools: list[PoolConfig], hw: Callable[[], Hardware]) -> ThreadBudget:
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


def _host(t: Table, source: str, hw: Callable[[], Hardware]) -> HostConfig:
    hname = t.text("name", AUTO)
    data_dir = t.text("data_dir", AUTO)
    if not data_dir:
        raise t.err("data_dir", 'must be a path or "auto"')
    unset = [v for v in re.findall(r"\$\{?(\w+)\}?", data_dir) if v not in os.environ]
    if unset and data_dir != AUTO:  # (kept as text, it would make a directory named after the variable)
        raise t.err("data_dir", f"names environment variable(s) not set here: {', '.join(unset)}")
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
                   kv_cap_bytes=cap, max_sessions=t.integer("max_sessions", 256),
                   default_context=t.integer("default_context", 32768),
                   durability=t.text("durability", "page-cache", DURABILITY),
                   prefix_cache=t.flag("prefix_cache", True))
    t.done()
    return host


def _routing(t: Table, threads: ThreadBudget) -> RoutingThresholds:
    unit = t.text("cpu_rate_unit", "pool", CPU_RATE_UNITS)
    node_kv = t.integer("node_kv_tokens", AUTO, auto=True)
    d = RoutingThresholds.__dataclass_fields__
    kw = {k: t.integer(k, d[k].default) for k in ("long_prompt_tokens", "ring_batch_depth",
                                                  "pipeline_min_prompt_tokens", "answer_tokens")}
    scale = threads.kernels if unit == "thread" else 1  # per-thread estimates scale with the budget
    prefill, decode = t.number("cpu_prefill_tokens_per_s", None), t.number("cpu_decode_tokens_per_s", None)
    th = t.build(RoutingThresholds, **kw,
                 cpu_prefill_tokens_per_s=None if prefill is None else prefill * scale,
                 cpu_decode_tokens_per_s=None if decode is None else decode * scale,
                 ttft_margin=t.number("ttft_margin", d["ttft_margin"].default),
                 background_ttlt_s=t.number("background_ttlt_s", d["background_ttlt_s"].default),
                 batch_ttlt_s=t.number("batch_ttlt_s", d["batch_ttlt_s"].default),
                 interactive_itl_ms=t.number("interactive_itl_ms", d["interactive_itl_ms"].default),
                 return_share=t.number("return_share", d["return_share"].default),
                 gpu_interactive_reserve=t.number("gpu_interactive_reserve", d["gpu_interactive_reserve"].default),
                 policy=t.text("policy", "sla", POLICIES),
                 node_kv_tokens=None if node_kv == AUTO else node_kv)
    t.done()
    return th


def _token(t: Table, required: bool) -> str | None:
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


def _federation(t: Table) -> FederationConfig:
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


def _peers(root: Table) -> list[PeerConfig]:
    peers: list[PeerConfig] = []
    for t in root.array("peers"):
        pname, url = t.text("name"), t.text("url")
        if any(p.name == pname for p in peers):
            raise t.err("name", f"duplicate peer name {pname!r}")
        token = _token(t, True)
        peers.append(t.build(PeerConfig, name=pname, url=url, token=token))
        t.done()
    return peers
