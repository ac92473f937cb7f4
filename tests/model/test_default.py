"""The model cache: where it is, the default model, and once-only conversion that is safe to race."""

from __future__ import annotations

import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from tests.model.test_convert import check_shared_format
from tests.tiny_models import write_tiny_gguf
from weaved.model.convert import tensor_types
from weaved.model.default import (
    cache_dir,
    converted_name,
    default_model_path,
    ensure_native,
    models_dir,
    shipped_smollm2_path,
)


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "explicit"
    assert models_dir() == tmp_path / "explicit" / "models"
    monkeypatch.delenv("WEAVE_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "weave"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "weave"


def test_shipped_smollm2():
    path = shipped_smollm2_path()
    assert path.is_file() and path.suffix == ".gguf" and "SmolLM2-135M-Instruct" in path.name
    assert len(tensor_types(path)) == 272


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_ensure_native_keeps_a_native_model(cache, tmp_path):
    src = write_tiny_gguf(tmp_path / "native.gguf", n_layers=1, wtype=Q.Q4_0)
    logs: list[str] = []
    assert ensure_native(src, log=logs.append) == src
    assert logs == [] and not cache.exists()


def test_ensure_native_converts_once(cache, tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", n_layers=1, wtype=Q.Q4_1)
    logs: list[str] = []
    calls: list[tuple[int, int, str]] = []
    first = ensure_native(src, progress=lambda *a: calls.append(a), log=logs.append)
    assert first.parent == cache / "models"
    assert first.name.startswith("tiny-q4_1-") and first.name.endswith("-q4_0.gguf")
    # what it does, then what it cost: the requantized tensors and the weight error added
    assert len(logs) == 2 and str(src) in logs[0] and str(first) in logs[0]
    assert "requantized" in logs[1] and "Q4_1" in logs[1] and "relative weight error" in logs[1]
    assert calls and calls[-1][0] == calls[-1][1]
    check_shared_format(src, first)
    mtime = first.stat().st_mtime_ns

    again = ensure_native(src, log=logs.append)
    assert again == first and first.stat().st_mtime_ns == mtime and len(logs) == 2

    # a copy elsewhere, or a touched file, is the same content: its conversion is reused
    copy = tmp_path / "elsewhere" / src.name
    copy.parent.mkdir()
    shutil.copyfile(src, copy)
    st = src.stat()
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert ensure_native(copy, log=logs.append) == ensure_native(src, log=logs.append) == first
    assert len(logs) == 2
    # and so is a copy under another name: the conversion is linked under that name (served by it)
    renamed = tmp_path / "elsewhere" / "renamed-q4_1.gguf"
    shutil.copyfile(src, renamed)
    linked = ensure_native(renamed, log=logs.append)
    assert linked.name == converted_name(renamed) and linked != first and len(logs) == 2
    assert linked.stat().st_ino == first.stat().st_ino  # one file on disk
    # a changed source (other weights, the same size and header) is converted again, under a new name
    write_tiny_gguf(src, n_layers=1, wtype=Q.Q4_1, seed=1)
    changed = ensure_native(src, log=logs.append)
    assert changed != first and changed.name == converted_name(src) and len(logs) == 4


def test_a_model_weave_cannot_run_is_refused_before_converting(cache, tmp_path):
    src = write_tiny_gguf(tmp_path / "gpt2-q4_1.gguf", "gpt2", n_layers=1, wtype=Q.Q4_1)
    logs: list[str] = []
    with pytest.raises(ValueError, match="gpt2"):
        ensure_native(src, log=logs.append)
    assert logs == []  # nothing announced as converting
    assert not (cache / "models").exists() or list((cache / "models").iterdir()) == []  # no lock, no copy


def test_a_failed_conversion_leaves_nothing_in_the_cache(cache, tmp_path, monkeypatch):
    import weaved.model.convert as convert

    src = write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", n_layers=1, wtype=Q.Q4_1)

    def broken(*a, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(convert, "convert_gguf", broken)
    with pytest.raises(OSError, match="No space"):
        ensure_native(src, log=lambda m: None)
    # no copy, no temporary file: only the lock (removing it would let a waiting process and a newcomer
    # lock two files and convert at once)
    assert [p.name for p in (cache / "models").iterdir()] == [converted_name(src) + ".lock"]


def _convert_in_child(src: str, cache: str, log_file: str, barrier, results) -> None:
    os.environ["WEAVE_CACHE_DIR"] = cache

    def log(message: str) -> None:
        with open(log_file, "a") as f:
            f.write(message + "\n")

    barrier.wait()
    results.put(str(ensure_native(src, log=log)))


def test_concurrent_processes_convert_once(cache, tmp_path):
    src = write_tiny_gguf(tmp_path / "race.gguf", n_layers=2, wtype=Q.Q5_0)
    log_file = tmp_path / "log.txt"
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(3), ctx.Queue()
    args = (str(src), str(cache), str(log_file), barrier, results)
    procs = [ctx.Process(target=_convert_in_child, args=args) for _ in range(3)]
    for p in procs:
        p.start()
    paths = {results.get(timeout=120) for _ in procs}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert len(paths) == 1
    (path,) = paths
    assert log_file.read_text().count("converting") == 1
    path = Path(path)
    check_shared_format(src, path)
    # the converted file and its lock, no temporary leftovers
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".lock"]


def test_default_model_is_cached(smollm2_q4_0):
    mtime = smollm2_q4_0.stat().st_mtime_ns
    assert default_model_path() == smollm2_q4_0
    assert smollm2_q4_0.stat().st_mtime_ns == mtime
    assert smollm2_q4_0.parent == models_dir()
    assert smollm2_q4_0.name == converted_name(shipped_smollm2_path())
    assert set(tensor_types(smollm2_q4_0).values()) == {Q.Q4_0, Q.Q8_0, Q.F32}


def test_default_model_converted_into_a_fresh_cache(cache):
    calls: list[tuple[int, int, str]] = []
    said: list[str] = []
    first = default_model_path(progress=lambda *a: calls.append(a), log=said.append)
    assert first.parent == cache / "models" and first.is_file()
    assert len(calls) == 272 and calls[-1][:2] == (272, 272)
    # what is converted to what, and what it costs, as for a model given by path
    assert said[0].startswith("converting ") and str(first) in said[0] and len(said) == 2
    mtime = first.stat().st_mtime_ns
    calls.clear()
    said.clear()
    assert default_model_path(progress=lambda *a: calls.append(a), log=said.append) == first
    assert calls == [] and said == [] and first.stat().st_mtime_ns == mtime


def test_served_name_says_what_the_model_is_not_how_it_is_stored():
    from weaved.model.default import served_name

    assert served_name(Path("SmolLM2-135M-Instruct.Q4_1-d6680e104ddd-q4_0.gguf")) == "SmolLM2-135M-Instruct"
    assert served_name(Path("/m/gemma-3-270m-it-Q4_K_M.gguf")) == "gemma-3-270m-it"
    assert served_name(Path("Qwen3-8B-Q8_0.gguf")) == "Qwen3-8B"
    assert served_name(Path("mistral-7b-instruct-v0.2.IQ4_XS.gguf")) == "mistral-7b-instruct-v0.2"
    assert served_name(Path("my-model.gguf")) == "my-model"
    assert served_name(Path("Q4_0.gguf")) == "Q4_0"  # never empty


def test_a_damaged_cached_conversion_is_converted_again(cache, tmp_path):
    src = write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", n_layers=1, wtype=Q.Q4_1)
    said: list[str] = []
    first = ensure_native(src, log=said.append)
    whole = first.read_bytes()
    first.write_bytes(whole[: len(whole) // 2])  # cut short (a full disk, a hand)
    again = ensure_native(src, log=said.append)
    assert again == first and again.read_bytes() == whole
    assert any("is damaged: converting" in m for m in said)


def test_a_cache_that_cannot_be_written_is_named_with_the_way_out(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "file"))  # a file where the cache should be
    src = write_tiny_gguf(tmp_path / "tiny-q4_1.gguf", n_layers=1, wtype=Q.Q4_1)
    with pytest.raises(ValueError, match=r"model cache .* cannot be written .*WEAVE_CACHE_DIR"):
        ensure_native(src, log=lambda m: None)
