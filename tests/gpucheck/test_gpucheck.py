"""The GPU validation command, run here with the torch backend on torch's CPU device (where it must
find the two backends bit-equal), and its pass/fail rule on logits that differ."""

from __future__ import annotations

import json

import numpy as np
import pytest

from weaved.gpucheck.agreement import KL_BAR, Agreement, compare_step

pytest.importorskip("torch")


def test_the_command_reports_agreement_speed_and_memory(tiny_llama, tmp_path, capsys):
    from weaved.gpucheck.__main__ import main

    out = tmp_path / "r.json"
    code = main([str(tiny_llama), "--device", "cpu", "--threads", "2", "--prompt", "40", "--steps", "4",
                 "--batches", "2,3", "--context", "16", "--promote", "256", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "agreement: PASS (bit-equal)" in printed
    r = json.loads(out.read_text())
    assert r["agreement"] == {"passed": True, "bit_equal": True, "mean_kl": 0.0, "max_kl": 0.0,
                              "greedy_disagreements": 0, "near_ties": 0, "steps": 5}
    assert r["device_speed"]["prefill_tok_s"] > 0 and r["device_speed"]["decode_tok_s"] > 0
    assert [b["batch"] for b in r["batched"]] == [2, 3] and all(b["tok_s"] > 0 for b in r["batched"])
    assert r["copy_bytes_per_s"] > 0 and "errors" not in r
    from weaved.model.loader import open_model

    cfg = open_model(tiny_llama)[1]
    for b in r["batched"]:  # the roofline: the weights once, plus each sequence's KV at its mean length
        assert b["step_bytes"] > b["batch"] * 16 * cfg.kv_bytes_per_token
        assert b["roofline_fraction"] == pytest.approx(b["step_bytes"] / r["copy_bytes_per_s"] / b["step_seconds"])
    assert r["promotion"]["bytes"] == 256 * cfg.kv_bytes_per_token and r["promotion"]["gb_s"] > 0
    assert r["promotion"]["rows_equal"]  # read back from the device pool
    assert r["memory"]["weights_bytes"] > 0 and r["memory"]["kv_pool_bytes"] > 0


def test_a_part_that_raises_fails_the_check_but_not_the_rest(tiny_llama, tmp_path, capsys, monkeypatch):
    """One failing part (here the batched timing) is reported with its traceback and fails the exit
    code; the agreement, promotion and memory parts still run and are recorded."""
    from weaved.gpucheck import __main__ as gc
    from weaved.gpucheck import speed

    def broken(*a, **k):
        raise RuntimeError("no room for the batch")

    monkeypatch.setattr(speed, "batched_decode", broken)
    out = tmp_path / "r.json"
    code = gc.main([str(tiny_llama), "--device", "cpu", "--threads", "2", "--prompt", "12", "--steps", "2",
                    "--batches", "2", "--context", "8", "--promote", "64", "--json", str(out)])
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert code == 1 and "batch 2: ERROR RuntimeError: no room for the batch" in printed
    assert "no room for the batch" in r["errors"]["batch 2"] and r["agreement"]["passed"]
    assert r["promotion"]["bytes"] > 0 and r["memory"]["weights_bytes"] > 0


def test_the_profile_of_decode_steps(tiny_llama, tmp_path, capsys):
    """``--profile``: each batch's step time and its costliest operations (torch's CPU device here: the
    step's torch operations by host time; on CUDA its kernels by device time)."""
    from weaved.gpucheck.__main__ import main

    out = tmp_path / "r.json"
    code = main([str(tiny_llama), "--device", "cpu", "--threads", "2", "--prompt", "12", "--steps", "2",
                 "--batches", "", "--context", "8", "--promote", "64", "--profile", "1,3", "--json", str(out)])
    r = json.loads(out.read_text())
    assert code == 0 and [p["batch"] for p in r["profile"]] == [1, 3]
    for p in r["profile"]:
        assert p["wall_ms"] > 0 and p["launches"] > 0 and p["top"] and all(ms >= 0 for _, ms, _ in p["top"])
    assert "profile, batch 3 at 8" in capsys.readouterr().out


def test_the_sweep_needs_the_triton_path(tiny_llama, tmp_path, capsys):
    from weaved.gpucheck.__main__ import main

    out = tmp_path / "r.json"
    code = main([str(tiny_llama), "--device", "cpu", "--threads", "2", "--prompt", "8", "--steps", "1",
                 "--batches", "", "--promote", "16", "--sweep", "--json", str(out)])
    assert code == 1 and "Triton kernels" in json.loads(out.read_text())["errors"]["sweep"]


class _CountingGraphs:
    """Stands in for a backend's decode graphs on torch's CPU device (the torch path makes none): takes
    no step, so both sides of the comparison run the plain path - what the harness alone must keep equal."""

    made, seconds, asked = 0, 0.0, 0

    def takes(self, chunks) -> bool:
        self.asked += 1
        return False


def test_the_graphs_comparison_feeds_both_sides_the_same_steps(tiny_llama):
    from weaved.backends.torch import TorchBackend
    from weaved.gpucheck.graphs import graphs_ab

    be = TorchBackend.from_file(tiny_llama, threads=1)
    with pytest.raises(RuntimeError, match="no decode graphs"):
        graphs_ab(be, 2, 8, 2)
    stand_in = be.graphs = _CountingGraphs()
    r = graphs_ab(be, 3, 8, 2)
    assert r["equal"] and r["graphs_tok_s"] > 0 and r["eager_tok_s"] > 0 and r["batch"] == 3
    assert be.graphs is stand_in and stand_in.asked == 3  # its side's 3 decode steps (the prompts ran without it)
    assert be.kv_pool.used_blocks() == 0  # every sequence released


def _row(top: int, gap: float, vocab: int = 50) -> np.ndarray:
    row = np.linspace(-1, 0, vocab).astype(np.float32)
    row[top] = 1.0 + gap
    return row


def test_the_rule_fails_logits_that_disagree():
    ref = _row(3, 2.0)
    assert compare_step(0, ref, ref.copy()).bit_equal
    close = ref.copy()
    close[10] += 1e-4  # a hair: not bit-equal, tiny KL, same greedy token
    step = compare_step(0, ref, close)
    assert not step.bit_equal and step.greedy_equal and step.kl < KL_BAR
    assert Agreement([step]).passed
    far = _row(7, 2.0)  # another token on top by a wide margin: not a near-tie
    step = compare_step(1, ref, far)
    assert not step.greedy_equal and not step.near_tie
    assert not Agreement([compare_step(0, ref, close), step]).passed
    tie = ref.copy()
    tie[5] = tie[3] + 0.01  # the other engine prefers a token the reference had within 0.3
    a = ref.copy()
    a[5] = a[3] - 0.01
    step = compare_step(2, a, tie)
    assert step.near_tie and not step.greedy_equal
