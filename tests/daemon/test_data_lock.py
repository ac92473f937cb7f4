"""One daemon per data directory: a second one is refused before it touches the directory, naming the
first's pid; the lock goes with the daemon that held it."""

from __future__ import annotations

import os

import pytest

from tests.daemon.support import make_daemon
from weaved.errors import Conflict


def test_a_second_daemon_on_a_data_directory_is_refused_until_the_first_stops(tiny_llama, tmp_path):
    first = make_daemon(tiny_llama, tmp_path / "data")
    try:
        journal = (tmp_path / "data" / "journal.sqlite").stat().st_mtime_ns
        with pytest.raises(Conflict, match=f"another daemon \\(pid {os.getpid()}\\) uses the data directory"):
            make_daemon(tiny_llama, tmp_path / "data")
        assert (tmp_path / "data" / "journal.sqlite").stat().st_mtime_ns == journal
        make_daemon(tiny_llama, tmp_path / "other").shutdown()  # another directory is another daemon's
    finally:
        first.shutdown()
    make_daemon(tiny_llama, tmp_path / "data").shutdown()


def test_a_load_that_fails_lets_go_of_the_data_directory(tiny_llama, tmp_path):
    import dataclasses

    from weaved.config.load import load_profile
    from weaved.daemon.core import Daemon
    from weaved.errors import WeaveError

    prof = load_profile("cpu-only")
    tiny = dataclasses.replace(prof, host=dataclasses.replace(prof.host, kv_cap_bytes=1024))
    with pytest.raises(WeaveError, match="kv_cap_bytes"):
        Daemon(tiny, tiny_llama, data_dir=tmp_path / "data", log_fn=lambda m: None).load()  # never shut down
    make_daemon(tiny_llama, tmp_path / "data").shutdown()  # the directory is free


def test_a_data_directory_that_cannot_be_made_or_written_is_said_in_words(tiny_llama, tmp_path):
    from weaved.errors import WeaveError

    (tmp_path / "file").write_text("")
    with pytest.raises(WeaveError, match="cannot make the data directory .*: Not a directory: pass another") as e:
        make_daemon(tiny_llama, tmp_path / "file" / "data")
    assert "[Errno" not in str(e.value)
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "daemon.lock").mkdir()  # (root may write anywhere: a lock path that cannot be opened stands in)
    with pytest.raises(WeaveError, match="cannot write in the data directory .*; pass another --data-dir"):
        make_daemon(tiny_llama, ro)


def test_a_daemon_that_execs_itself_again_keeps_its_data_directory_in_between(tiny_llama, tmp_path, monkeypatch):
    """The first start's restart (an exec in the same process, after compiling) hands the directory's
    lock over: nobody can take the directory in between, and the new image adopts it."""
    import subprocess
    import sys

    from weaved.daemon import data_lock

    first = make_daemon(tiny_llama, tmp_path / "data")
    fd = first.hand_over_data_dir()
    first.shutdown()  # the old image's end: the directory stays locked
    probe = [sys.executable, "-c", "import sys; from weaved.daemon.data_lock import lock_data_dir; "
             "from weaved.errors import Conflict\ntry: lock_data_dir(sys.argv[1])\nexcept Conflict: sys.exit(3)",
             str(tmp_path / "data")]
    assert subprocess.run(probe).returncode == 3  # another process is refused meanwhile
    monkeypatch.setenv(data_lock.INHERITED_ENV, str(fd))  # the new image finds the descriptor
    again = make_daemon(tiny_llama, tmp_path / "data")
    try:
        assert again._data_lock == fd and data_lock.INHERITED_ENV not in os.environ
    finally:
        again.shutdown()
    assert subprocess.run(probe).returncode == 0  # gone with the daemon that held it


@pytest.mark.parametrize(("change", "words"), [({"max_batch": 10**6, "token_budget": 10**6}, "max_batch")])
def test_a_batch_the_host_cannot_hold_is_refused_before_calibration(tiny_llama, tmp_path, change, words):
    """One zero too many in a profile: refused with the numbers, not calibrated until the host's memory
    runs out.  (A prefill chunk past the model's context is calibrated up to the context.)"""
    import dataclasses

    from weaved.config.load import load_profile
    from weaved.daemon.core import Daemon
    from weaved.errors import WeaveError

    prof = load_profile("cpu-only")
    pools = tuple(dataclasses.replace(p, **change) for p in prof.pools)
    said: list[str] = []
    with pytest.raises(WeaveError, match=f"pool .*: {words} .*lower it"):
        Daemon(dataclasses.replace(prof, pools=pools), tiny_llama, data_dir=tmp_path / "data",
               log_fn=said.append).load(progress=said.append)
    assert not any("calibrating" in m for m in said)
