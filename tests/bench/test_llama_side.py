"""llama.cpp's side of ``weave bench``: each figure is the better of its flash attention settings."""

from __future__ import annotations

import pytest

from weaved.bench import BenchConfig
from weaved.bench import llama_side as ls


class FakeLlama:
    def __init__(self, path, threads, n_batch=512, flash_attn="auto"):
        self.mode = flash_attn
        self.modes: list[str] = []

    def set_flash_attn(self, mode):
        self.mode = mode
        self.modes.append(mode)

    def open(self, n_seqs, capacity):
        pass

    def prefill(self, seqs, prompts, want_logits):
        return [0]

    def free_context(self):
        pass

    def close(self):
        pass


def test_each_figure_is_the_better_of_flash_attention_auto_and_off(monkeypatch):
    speeds = {"auto": {"prefill_tps": 500.0, "decode_2k_tps": 24.0}, "off": {"prefill_tps": 250.0,
                                                                            "decode_2k_tps": 49.0}}
    engines: list[FakeLlama] = []

    def make(*a, **kw):
        engines.append(FakeLlama(*a, **kw))
        return engines[-1]

    monkeypatch.setattr(ls, "LlamaEngine", make)
    monkeypatch.setattr(ls, "measure", lambda engine, cfg, tokens, progress: dict(speeds[engine.mode]))
    said: list[str] = []
    cfg = BenchConfig(model="m", threads=1, keys=("prefill_tps", "decode_2k_tps"))
    out = ls.measure_llama(cfg, [1] * 10, said.append)
    assert out["prefill_tps"] == 500.0 and out["decode_2k_tps"] == 49.0
    assert engines[0].modes == ["auto", "off"]
    assert any("decode_2k_tps: flash attention off is faster" in m for m in said)
    only = ls.measure_llama(BenchConfig(model="m", threads=1, keys=("decode_2k_tps",), llama_flash_attn=("auto",)),
                            [1] * 10, said.append)
    assert only["decode_2k_tps"] == 24.0


def test_an_unknown_flash_attention_setting_is_refused():
    with pytest.raises(ValueError, match="llama_flash_attn"):
        BenchConfig(model="m", threads=1, llama_flash_attn=("on",))
