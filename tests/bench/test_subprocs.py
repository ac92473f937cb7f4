"""run_processes: logs captured, exit codes returned, a process past the deadline killed."""

from __future__ import annotations

import sys

from weaved.bench.subprocs import run_processes


def test_exit_codes_logs_and_the_deadline(tmp_path):
    cmds = [[sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
            [sys.executable, "-c", "import time; time.sleep(60)"]]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    late: list[int] = []
    codes = run_processes(cmds, logs, deadline_s=3.0, on_overdue=late.append)
    assert codes[0] == 3 and codes[1] is not None and codes[1] < 0  # killed by a signal
    assert late == [1]
    assert logs[0].read_text().strip() == "hello"


def test_only_the_awaited_ones_are_waited_for(tmp_path):
    cmds = [[sys.executable, "-c", "pass"], [sys.executable, "-c", "import time; time.sleep(60)"]]
    codes = run_processes(cmds, [tmp_path / "a.log", tmp_path / "b.log"], deadline_s=60.0, wait_for=[0])
    assert codes[0] == 0 and codes[1] is not None and codes[1] < 0
