"""Deployment profiles: the shipped files, "auto" resolution, and every way a profile is rejected."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from weaved.config import hardware
from weaved.config.hardware import GPUInfo, Hardware
from weaved.config.load import default_data_dir, detect_profile, load_profile, pick_profile_name, shipped_profiles
from weaved.config.tables import ProfileError, parse_size

CPU_BOX = Hardware(physical_cores=8, logical_cpus=16, memory_bytes=32 * 2**30, cpu_model="AMD EPYC 7B13")
L40S = GPUInfo(index=0, name="NVIDIA L40S", memory_bytes=48 * 10**9, uuid="GPU-1234")
L40S_EPYC = Hardware(physical_cores=32, logical_cpus=64, memory_bytes=256 * 2**30,
                     cpu_model="AMD EPYC 7R13 Processor", gpus=(L40S,))
RTX_BOX = Hardware(physical_cores=16, logical_cpus=32, memory_bytes=64 * 2**30, cpu_model="Intel Core i9",
                   gpus=(GPUInfo(index=0, name="NVIDIA GeForce RTX 4090", memory_bytes=24 * 2**30),))

MINIMAL = """
[[pools]]
name = "cpu"
backend = "cpu"

[routing]
cpu_prefill_tokens_per_s = 100
cpu_decode_tokens_per_s = 200
"""


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def rejects(tmp_path: Path, text: str, key: str, *words: str, hw: Hardware = CPU_BOX) -> ProfileError:
    path = write(tmp_path, text)
    with pytest.raises(ProfileError) as info:
        load_profile(path, hardware=hw)
    e = info.value
    assert e.file == str(path) and e.key == key, str(e)
    assert str(e).startswith(f"{path}: {key}: ")
    for w in words:
        assert w in e.reason, str(e)
    return e


# --- the shipped profiles -------------------------------------------------------------------------

def test_shipped_profiles_are_listed():
    assert {"cpu-only", "workstation", "l40s-epyc"} <= set(shipped_profiles())


@pytest.mark.parametrize("hw", [CPU_BOX, L40S_EPYC, RTX_BOX])
@pytest.mark.parametrize("name", ["cpu-only", "workstation", "l40s-epyc"])
def test_every_shipped_profile_loads_on_any_hardware(name, hw):
    prof = load_profile(name, hardware=hw)  # a cuda pool on a host without CUDA is the daemon's concern
    assert prof.name == name and prof.source.endswith(f"{name}.toml")
    assert any(p.strategy == "standard" for p in prof.pools)
    assert prof.threads.kernels >= 1 and prof.host.kv_cap_bytes > 0


def test_cpu_only_uses_every_core_and_leaves_its_rates_to_calibration():
    prof = load_profile("cpu-only", hardware=CPU_BOX)
    assert [p.name for p in prof.pools] == ["cpu", "ring"] and prof.pools[0].backend == "cpu"
    assert prof.pools[1].strategy == "qring"  # used only when the daemon federates
    assert prof.threads.kernels == 8 and prof.threads.gpu_driver == 0
    for name in ("cpu-only", "workstation", "l40s-epyc"):  # measured on the host by the daemon
        r = load_profile(name, hardware=CPU_BOX).routing
        assert r.cpu_prefill_tokens_per_s is None and r.cpu_decode_tokens_per_s is None
    assert prof.routing.ring_batch_depth == 16
    assert prof.host.kv_cap_bytes == CPU_BOX.memory_bytes // 2


def test_workstation_adds_a_gpu_pool_only_with_a_gpu():
    without = load_profile("workstation", hardware=CPU_BOX)
    assert [p.name for p in without.pools] == ["cpu", "ring"]
    assert any("no CUDA GPU" in n for n in without.notes)
    with_gpu = load_profile("workstation", hardware=RTX_BOX)
    assert [p.name for p in with_gpu.pools] == ["gpu", "cpu", "ring"]
    assert with_gpu.pool("gpu").cuda_device == 0 and with_gpu.pool("gpu").idle_demote_s == 300
    # the CPU pool gets the cores the GPU's driver thread and the API leave
    assert with_gpu.threads.gpu_driver == 1 and with_gpu.threads.kernels == 16 - 1 - 1
    assert without.threads.gpu_driver == 0 and without.threads.kernels == 8 - 1


def test_l40s_epyc_has_two_gpu_variants_and_28_cpu_threads():
    prof = load_profile("l40s-epyc", hardware=L40S_EPYC)
    spec, plain = prof.pool("gpu-spec"), prof.pool("gpu")
    assert spec.speculative and spec.spec_max_concurrency >= 1 and not plain.speculative
    assert spec.device == plain.device == "cuda:0" and prof.pool("cpu").backend == "cpu"
    assert prof.threads.kernels == 28
    with pytest.raises(KeyError):
        prof.pool("nope")


def test_detection_picks_a_profile_by_hardware():
    assert pick_profile_name(CPU_BOX) == "cpu-only"
    assert pick_profile_name(L40S_EPYC) == "l40s-epyc"
    assert pick_profile_name(RTX_BOX) == "workstation"
    prof = detect_profile(L40S_EPYC)
    assert prof.name == "l40s-epyc" and "picked" in prof.notes[0]
    assert load_profile(hardware=CPU_BOX).name == "cpu-only"  # no argument: detection


def test_detection_on_this_machine():
    prof = load_profile()  # real psutil + NVML probing
    assert prof.name in shipped_profiles() and prof.threads.kernels >= 1


# --- finding the file -----------------------------------------------------------------------------

def test_path_string_and_path_object(tmp_path):
    path = write(tmp_path, MINIMAL, "mine.toml")
    assert load_profile(str(path), hardware=CPU_BOX).name == "mine"
    assert load_profile(path, hardware=CPU_BOX).source == str(path)


def test_unknown_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="cpu-only"):
        load_profile("no-such-profile")


def test_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "absent.toml")


def test_invalid_toml(tmp_path):
    with pytest.raises(ProfileError, match="not valid TOML") as info:
        load_profile(write(tmp_path, "[host\nname = 1"))
    assert info.value.file.endswith("p.toml")


# --- defaults and "auto" --------------------------------------------------------------------------

def test_minimal_profile_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    prof = load_profile(write(tmp_path, MINIMAL), hardware=CPU_BOX)
    pool = prof.pools[0]
    assert (pool.device, pool.strategy, pool.speculative, pool.max_batch) == ("cpu", "standard", False, 16)
    assert pool.token_budget == pool.prefill_chunk + pool.max_batch and pool.idle_demote_s is None
    assert prof.host.data_dir == tmp_path / "xdg" / "weave"
    assert prof.host.name and prof.host.max_sessions == 256 and prof.host.default_context == 32768
    assert prof.host.durability == "page-cache"
    assert prof.threads.kernels == 8 - 1 and prof.threads.api == 1  # no cuda pool: no driver thread
    assert prof.routing.node_kv_tokens is None and prof.peers == ()


def test_speculative_pool_draft_knobs(tmp_path):
    from weaved.engine.speculative import SpecConfig

    text = POOL + "speculative = true\nspec_draft_tokens = 5\nspec_ngram_min = 1\nspec_ngram_max = 4\n" + ROUTING
    pool = load_profile(write(tmp_path, text), hardware=CPU_BOX).pools[0]
    assert (pool.spec_max_concurrency, pool.spec_draft_tokens, pool.spec_ngram_min, pool.spec_ngram_max) == (4, 5, 1, 4)
    assert SpecConfig.from_pool(pool) == SpecConfig(draft_tokens=5, ngram_sizes=(4, 3, 2, 1), max_concurrency=4)
    default = load_profile(write(tmp_path, POOL + "speculative = true\n" + ROUTING, "d.toml"), hardware=CPU_BOX)
    assert SpecConfig.from_pool(default.pools[0]) == SpecConfig()  # the profile's defaults are the engine's
    plain = load_profile(write(tmp_path, MINIMAL, "m.toml"), hardware=CPU_BOX).pools[0]
    with pytest.raises(ValueError, match="not speculative"):
        SpecConfig.from_pool(plain)


def test_data_dir_without_xdg(monkeypatch):
    monkeypatch.delenv("XDG_DATA_HOME", raising=False)
    assert default_data_dir() == Path.home() / ".local" / "share" / "weave"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/dir")  # the XDG spec says to ignore it
    assert default_data_dir() == Path.home() / ".local" / "share" / "weave"


def test_relative_data_dir_is_relative_to_the_profile(tmp_path):
    prof = load_profile(write(tmp_path, '[host]\ndata_dir = "state"\n' + MINIMAL), hardware=CPU_BOX)
    assert prof.host.data_dir == tmp_path.resolve() / "state"
    prof = load_profile(write(tmp_path, '[host]\ndata_dir = "~/w"\n' + MINIMAL), hardware=CPU_BOX)
    assert prof.host.data_dir == Path.home() / "w"


def test_a_data_dir_naming_an_unset_variable_is_refused(tmp_path, monkeypatch):
    """A service manager that lacks the variable would otherwise serve from a directory named after it."""
    monkeypatch.delenv("WEAVE_TEST_UNSET", raising=False)
    rejects(tmp_path, '[host]\ndata_dir = "$WEAVE_TEST_UNSET/data"\n' + MINIMAL, "host.data_dir")
    monkeypatch.setenv("WEAVE_TEST_SET", str(tmp_path / "x"))
    prof = load_profile(write(tmp_path, '[host]\ndata_dir = "${WEAVE_TEST_SET}/data"\n' + MINIMAL), hardware=CPU_BOX)
    assert prof.host.data_dir == tmp_path / "x" / "data"


@pytest.mark.parametrize("text, n", [
    ("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", 3 * 2**29), ("4096", 4096), (1024, 1024),
    ("2kib", 2048), ("1TB", 10**12),
])
def test_sizes(text, n, tmp_path):
    assert parse_size(text) == n
    value = f'"{text}"' if isinstance(text, str) else text
    prof = load_profile(write(tmp_path, f"[host]\nkv_cap_bytes = {value}\n" + MINIMAL), hardware=CPU_BOX)
    assert prof.host.kv_cap_bytes == n


@pytest.mark.parametrize("bad", ['"8 gigs"', '"GiB"', '"-1GiB"', "true", "0"])
def test_bad_sizes(bad, tmp_path):
    rejects(tmp_path, f"[host]\nkv_cap_bytes = {bad}\n" + MINIMAL, "host.kv_cap_bytes")


def test_durability(tmp_path):
    prof = load_profile(write(tmp_path, '[host]\ndurability = "fsync"\n' + MINIMAL), hardware=CPU_BOX)
    assert prof.host.durability == "fsync"
    rejects(tmp_path, '[host]\ndurability = "always"\n' + MINIMAL, "host.durability")


def test_explicit_thread_budget(tmp_path):
    text = "[threads]\nkernels = 3\ngpu_driver = 2\napi = 0\n" + MINIMAL
    t = load_profile(write(tmp_path, text), hardware=CPU_BOX).threads
    assert (t.kernels, t.gpu_driver, t.api) == (3, 2, 0)


def test_gpu_driver_counts_cuda_devices(tmp_path):
    gpus = "".join(f'[[pools]]\nname = "g{i}"\nbackend = "torch"\ndevice = "{d}"\n'
                   for i, d in enumerate(["cuda", "cuda:0", "cuda:1"]))
    t = load_profile(write(tmp_path, gpus + MINIMAL), hardware=CPU_BOX).threads
    assert t.gpu_driver == 2 and t.kernels == 8 - 2 - 1


def test_rates_per_thread(tmp_path):
    text = MINIMAL + 'cpu_rate_unit = "thread"\n[threads]\nkernels = 4\n'
    r = load_profile(write(tmp_path, text), hardware=CPU_BOX).routing
    assert (r.cpu_prefill_tokens_per_s, r.cpu_decode_tokens_per_s) == (400.0, 800.0)


def test_peers_with_token_and_token_env(tmp_path, monkeypatch):
    monkeypatch.setenv("WEAVE_TEST_PEER_TOKEN", "s3cret")
    text = MINIMAL + """
[[peers]]
name = "a"
url = "http://10.0.0.2:7411"
token = "plain"
[[peers]]
name = "b"
url = "https://b.example:7411/"
token_env = "WEAVE_TEST_PEER_TOKEN"
[[peers]]
name = "c"
url = "http://[fd00::2]:7411"
token = "v6"
"""
    peers = load_profile(write(tmp_path, text), hardware=CPU_BOX).peers
    assert [(p.name, p.token) for p in peers] == [("a", "plain"), ("b", "s3cret"), ("c", "v6")]
    assert "s3cret" not in repr(peers) and "plain" not in repr(peers)


# --- rejections: file, key and reason ------------------------------------------------------------

POOL = '[[pools]]\nname = "cpu"\nbackend = "cpu"\n'
ROUTING = "[routing]\ncpu_prefill_tokens_per_s = 100\ncpu_decode_tokens_per_s = 200\n"


@pytest.mark.parametrize("text, key, words", [
    # unknown keys, with a hint
    (MINIMAL + "[hots]\n", "hots", ["unknown key", "host"]),
    (POOL + "max_bach = 4\n" + ROUTING, "pools[0].max_bach", ["unknown key", "max_batch"]),
    (MINIMAL + "ring_bach_depth = 4\n", "routing.ring_bach_depth", ["unknown key", "ring_batch_depth"]),
    (MINIMAL + "[threads]\nkernals = 2\n", "threads.kernals", ["unknown key", "kernels"]),
    (MINIMAL + "[host]\nzzz = 1\n", "host.zzz", ["unknown key", "known keys"]),
    (POOL + "[routing]\ncpu_prefil_tokens_per_s = 1\ncpu_decode_tokens_per_s = 2\n",
     "routing.cpu_prefil_tokens_per_s", ["unknown key", "did you mean 'cpu_prefill_tokens_per_s'"]),
    # wrong types
    (POOL + 'max_batch = "8"\n' + ROUTING, "pools[0].max_batch", ["integer"]),
    (POOL + "max_batch = true\n" + ROUTING, "pools[0].max_batch", ["integer, got true"]),
    (POOL + "max_batch = 8.5\n" + ROUTING, "pools[0].max_batch", ["integer"]),
    (POOL + 'speculative = "yes"\n' + ROUTING, "pools[0].speculative", ['true or false, got "yes"']),
    (POOL + 'max_batch = [1, true]\n' + ROUTING, "pools[0].max_batch", ["integer, got [1, true]"]),
    (MINIMAL + 'ttft_margin = "high"\n', "routing.ttft_margin", ["number"]),
    (MINIMAL + "[host]\nname = 3\n", "host.name", ["string"]),
    ('threads = "all"\n' + MINIMAL, "threads", ["table"]),
    (ROUTING.replace("[routing]", 'pools = "cpu"\n[routing]'), "pools", ["array of tables"]),
    # bad enum values
    ('[[pools]]\nname = "x"\nbackend = "gpu"\n' + ROUTING, "pools[0].backend", ['one of "cpu" or "torch", got "gpu"']),
    (POOL + 'strategy = "ring"\n' + ROUTING, "pools[0].strategy", ['one of "standard" or "qring"']),
    ('[[pools]]\nname = "g"\nbackend = "torch"\ndevice = "rocm"\n' + ROUTING, "pools[0].device", ["cuda:N"]),
    (POOL + 'device = "cuda"\n' + ROUTING, "pools[0].device", ["cpu backend"]),
    (MINIMAL + 'cpu_rate_unit = "core"\n', "routing.cpu_rate_unit", ["pool", "thread"]),
    (POOL.replace('"cpu"\nb', '"CPU Pool"\nb') + ROUTING, "pools[0].name", ["not a pool name"]),
    # out of range
    (POOL + "max_batch = -3\n" + ROUTING, "pools[0].max_batch", ["> 0", "-3"]),
    (POOL + "prefill_chunk = 0\n" + ROUTING, "pools[0].prefill_chunk", ["> 0"]),
    (POOL + ROUTING.replace("= 100", "= -5"), "routing.cpu_prefill_tokens_per_s",
     ["> 0"]),
    (MINIMAL + "ttft_margin = 1.5\n", "routing.ttft_margin", ["(0, 1]"]),
    (MINIMAL + "ring_batch_depth = 0\n", "routing.ring_batch_depth", ["> 0"]),
    (MINIMAL + "node_kv_tokens = -1\n", "routing.node_kv_tokens", ["> 0"]),
    (MINIMAL + "[host]\nmax_sessions = 0\n", "host.max_sessions", ["> 0"]),
    (MINIMAL + "[host]\ndefault_context = 0\n", "host.default_context", ["> 0"]),
    (MINIMAL + '[host]\ndata_dir = ""\n', "host.data_dir", ["path"]),
    (MINIMAL + "[threads]\nkernels = 0\n", "threads.kernels", ["> 0"]),
    (MINIMAL + "[threads]\napi = -1\n", "threads.api", [">= 0"]),
    (POOL + "token_budget = 100\nprefill_chunk = 512\n" + ROUTING, "pools[0].token_budget",
     ["prefill chunk"]),
    (POOL + "token_budget = 8\nprefill_chunk = 4\nmax_batch = 16\n" + ROUTING, "pools[0].token_budget",
     ["decode token"]),
    # inconsistent pools
    (POOL + POOL + ROUTING, "pools[1].name", ["duplicate pool name 'cpu'"]),
    (POOL + "spec_max_concurrency = 4\n" + ROUTING, "pools[0].spec_max_concurrency", ["speculative = true"]),
    (POOL + 'speculative = true\nstrategy = "qring"\n' + ROUTING, "pools[0].speculative", ["standard"]),
    (POOL + "speculative = true\nspec_max_concurrency = 0\n" + ROUTING, "pools[0].spec_max_concurrency",
     ["> 0"]),
    (POOL + "spec_draft_tokens = 4\n" + ROUTING, "pools[0].spec_draft_tokens", ["speculative = true"]),
    (POOL + "spec_ngram_max = 4\n" + ROUTING, "pools[0].spec_ngram_max", ["speculative = true"]),
    (POOL + "speculative = true\nspec_draft_tokens = 0\n" + ROUTING, "pools[0].spec_draft_tokens", ["> 0"]),
    (POOL + 'speculative = true\nspec_draft_tokens = "8"\n' + ROUTING, "pools[0].spec_draft_tokens",
     ["integer"]),
    (POOL + "speculative = true\nspec_ngram_min = 0\n" + ROUTING, "pools[0].spec_ngram_min", ["> 0"]),
    (POOL + "speculative = true\nspec_ngram_min = 3\nspec_ngram_max = 2\n" + ROUTING, "pools[0].spec_ngram_max",
     [">= spec_ngram_min (3)", "2"]),
    (POOL + "idle_demote_s = 60\n" + ROUTING, "pools[0].idle_demote_s", ["GPU"]),
    ('[[pools]]\nname = "g"\nbackend = "torch"\nidle_demote_s = -1\n' + ROUTING, "pools[0].idle_demote_s",
     [">= 0"]),
    (POOL + "only_if_gpu = true\n" + ROUTING, "pools[0].only_if_gpu", ["cuda"]),
    (ROUTING, "pools", ['strategy = "standard"']),
    (POOL.replace("backend", 'strategy = "qring"\nbackend') + ROUTING, "pools", ['strategy = "standard"']),
    # peers
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "http://h:1"\n', "peers[0].token", ["exactly one"]),
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "http://h:1"\ntoken = "t"\ntoken_env = "X"\n', "peers[0].token",
     ["exactly one"]),
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "http://h:1"\ntoken_env = "WEAVE_SURELY_UNSET_VAR"\n',
     "peers[0].token_env", ["WEAVE_SURELY_UNSET_VAR", "not set"]),
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "ftp://h"\ntoken = "t"\n', "peers[0].url", ["http"]),
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "http://h:1/api"\ntoken = "t"\n', "peers[0].url",
     ["host[:port]"]),
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "http://h:1"\ntoken = ""\n', "peers[0].token", ["empty"]),
    (MINIMAL + '[[peers]]\nname = "a"\nurl = "http://h:1"\ntoken = "t"\nport = 3\n', "peers[0].port",
     ["unknown key"]),
    (MINIMAL + ('[[peers]]\nname = "a"\nurl = "http://h:1"\ntoken = "t"\n' * 2), "peers[1].name",
     ["duplicate peer name"]),
])
def test_rejected(tmp_path, text, key, words):
    rejects(tmp_path, text, key, *words)


def test_a_cuda_pool_without_cuda_is_not_a_load_error(tmp_path):
    text = '[[pools]]\nname = "g"\nbackend = "torch"\ndevice = "cuda:3"\n' + MINIMAL
    prof = load_profile(write(tmp_path, text), hardware=CPU_BOX)
    assert prof.pool("g").cuda_device == 3


def test_duplicate_names_are_errors_even_for_pools_left_out(tmp_path):
    gpu = '[[pools]]\nname = "cpu"\nbackend = "torch"\nonly_if_gpu = true\n'
    rejects(tmp_path, MINIMAL.replace("[routing]", gpu + "[routing]"), "pools[1].name", "duplicate")


# --- hardware detection ---------------------------------------------------------------------------

def test_detect_this_host():
    hw = hardware.detect()
    assert 1 <= hw.physical_cores <= hw.logical_cpus and hw.memory_bytes > 0
    assert isinstance(hw.gpus, tuple)


def test_hardware_validation():
    with pytest.raises(ValueError):
        Hardware(physical_cores=0, logical_cpus=1, memory_bytes=1)
    with pytest.raises(ValueError):
        Hardware(physical_cores=4, logical_cpus=2, memory_bytes=1)
    with pytest.raises(ValueError):
        Hardware(physical_cores=1, logical_cpus=1, memory_bytes=0)


class _FakeNVML(types.ModuleType):
    """Just enough of pynvml: two GPUs, or a library that is not there."""

    class NVMLError(Exception):
        pass

    def __init__(self, present: bool = True):
        super().__init__("pynvml")
        self.present, self.shut = present, False

    def nvmlInit(self):
        if not self.present:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA L40S" if h == 0 else "NVIDIA H100"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}aaa"

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(total=(48 if h == 0 else 80) * 10**9)


@pytest.mark.parametrize("visible, names", [
    (None, ["NVIDIA L40S", "NVIDIA H100"]), ("1", ["NVIDIA H100"]), ("1,0", ["NVIDIA H100", "NVIDIA L40S"]),
    ("", []), ("-1", []), ("0,7,1", ["NVIDIA L40S"]), ("GPU-1", ["NVIDIA H100"]),
])
def test_gpus_from_nvml(monkeypatch, visible, names):
    fake = _FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    gpus = hardware.detect_gpus()
    assert [g.name for g in gpus] == names and fake.shut
    if names[:1] == ["NVIDIA L40S"]:
        assert gpus[0].memory_bytes == 48 * 10**9 and gpus[0].uuid == "GPU-0aaa"


def test_no_driver_means_no_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNVML(present=False))
    assert hardware.detect_gpus() == ()
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: the import fails
    assert hardware.detect_gpus() == ()


def test_an_nvml_failure_while_listing_means_no_gpu(monkeypatch):
    fake = _FakeNVML()
    fake.nvmlDeviceGetMemoryInfo = lambda h: (_ for _ in ()).throw(fake.NVMLError("GPU is lost"))
    fake.nvmlDeviceGetUUID = lambda h: (_ for _ in ()).throw(fake.NVMLError("not supported"))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert hardware.detect_gpus() == () and fake.shut


def test_the_documented_example_loads(tmp_path, monkeypatch):
    doc = (Path(__file__).parents[2] / "docs" / "profiles.md").read_text()
    example = doc.split("## Example", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    monkeypatch.setenv("WEAVE_PEER_TOKEN", "t0k")
    prof = load_profile(write(tmp_path, example), hardware=L40S_EPYC)
    assert [p.name for p in prof.pools] == ["gpu-spec", "gpu", "cpu", "ring"]
    assert prof.threads.kernels == 32 - 1 - 1 and prof.peers[0].token == "t0k"
    assert prof.host.kv_cap_bytes == 64 * 2**30


def test_device_memory(tmp_path):
    gpu = '\n[[pools]]\nname = "gpu"\nbackend = "torch"\ndevice = "cuda:0"\ndevice_memory = "40GiB"\n'
    prof = load_profile(write(tmp_path, MINIMAL + gpu), hardware=L40S_EPYC)
    assert [p.device_memory for p in prof.pools] == [None, 40 * 2**30]
    prof = load_profile(write(tmp_path, MINIMAL + gpu.replace('"40GiB"', '"auto"')), hardware=L40S_EPYC)
    assert prof.pools[1].device_memory is None
    rejects(tmp_path, MINIMAL + gpu.replace('"40GiB"', '"lots"'), "pools[1].device_memory", hw=L40S_EPYC)
    rejects(tmp_path, MINIMAL.replace('backend = "cpu"', 'backend = "cpu"\ndevice_memory = "1GiB"'),
            "pools[0].device_memory", "torch pools only")


def test_a_profile_file_is_the_operators_unless_shipped(tmp_path, monkeypatch):
    from importlib.resources import files

    from weaved.config.profile import operator_profile_file

    assert operator_profile_file(load_profile("cpu-only")) is None
    path = tmp_path / "mine.toml"
    path.write_text(files("weaved.profiles").joinpath("cpu-only.toml").read_text())
    assert operator_profile_file(load_profile(str(path))) == str(path.resolve())
    # given relative to where the daemon starts, it is shown whole (status is read from anywhere)
    monkeypatch.chdir(tmp_path)
    assert operator_profile_file(load_profile("./mine.toml")) == str(path.resolve())


def test_more_kernel_threads_than_cpus_is_noted(tmp_path):
    import os
    from importlib.resources import files

    shipped = files("weaved.profiles").joinpath("cpu-only.toml").read_text()
    assert 'kernels = "auto"' in shipped
    path = tmp_path / "many.toml"
    path.write_text(shipped.replace('kernels = "auto"', f"kernels = {(os.cpu_count() or 1) + 30}", 1))
    assert any("threads.kernels is" in n and "more than this host's" in n for n in load_profile(str(path)).notes)
    assert not any("threads.kernels" in n for n in load_profile("cpu-only").notes)
