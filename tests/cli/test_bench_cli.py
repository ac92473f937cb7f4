import json
import os
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner
from weaved.cli import bench as bench_cli

from weaved.bench import DERIVED_KEYS, INFO_KEYS, KEYS, LLAMA_INFO_KEYS, BenchConfig, batch_size
from weaved.bench.harness import filler_text, measure
from weaved.bench.report import build_report, format_table, ratios
from weaved.bench.runner import run_bench

TOKENS = list(range(100, 8200))


class FakeMeasure:
    """Test double for a side's measurement: fixed figures, records what it was asked."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple[str, BenchConfig, int]] = []
        self.fail = fail

    def __call__(self, side, cfg, tokens):
        self.calls.append((side, cfg, len(tokens)))
        if side == self.fail:
            raise RuntimeError("no backend")
        base = {"weave": 30.0, "llama_cpp": 60.0}[side]
        out = {k: base * (i + 1) for i, k in enumerate(KEYS) if k in cfg.keys}
        if side == "weave":
            out.update(load_s=1.5, file_mb=100.0, rss_mb=250.0, rss_anon_mb=200.0, rss_end_mb=260.0, weights_mb=90.0,
                       decode_gbs=3.0, stream_gbs=20.0)
        else:
            out.update(load_s=0.5, rss_mb=400.0, rss_anon_mb=300.0, rss_end_mb=420.0)
        return out


def _app(fake: FakeMeasure, progress: list[str]):
    app = typer.Typer()

    @app.callback()
    def main() -> None:  # a group, so the command is addressed by name as in `weave bench`
        pass

    bench_cli.register(
        app, run=lambda cfg: run_bench(cfg, measure=fake, tokens=TOKENS, progress=progress.append)
    )
    return app


@pytest.fixture
def model(tiny_llama):
    """A GGUF the engine runs as it is (so the command does not convert it): --model is checked from its
    header before anything is measured."""
    return tiny_llama


def test_json_shape_and_ratios(model):
    fake, progress = FakeMeasure(), []
    res = CliRunner().invoke(
        _app(fake, progress), ["bench", "--model", str(model), "--threads", "3", "--json"]
    )
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert set(out) == {"model", "threads", "weave", "llama_cpp", "ratio"}
    assert out["model"] == str(model) and out["threads"] == 3
    assert set(out["weave"]) == set(KEYS) | set(INFO_KEYS)
    assert set(out["llama_cpp"]) == set(KEYS) | set(LLAMA_INFO_KEYS)
    assert out["ratio"] == {k: pytest.approx(0.5) for k in KEYS}
    # alternating rounds expose both sides to the same drift of the machine
    assert [c[0] for c in fake.calls] == ["weave", "llama_cpp"] * 3
    assert all(c[1].rounds == 3 and c[1].reps == 1 and c[1].n_gen == 128 and c[1].threads == 3 for c in fake.calls)
    assert any("measuring weave" in m for m in progress) and any("measuring llama_cpp" in m for m in progress)


def test_table_output(model):
    res = CliRunner().invoke(_app(FakeMeasure(), []), ["bench", "--model", str(model), "--threads", "2"])
    assert res.exit_code == 0, res.output
    text = res.stdout
    assert "threads 2" in text and "median of 3" in text
    row = next(line for line in text.splitlines() if line.startswith("decode @2000"))
    assert row.split()[-3:] == ["90.0", "180.0", "0.50"]
    assert "load until ready (s)" in text and "1.50" in text
    assert "model file (MB)" in text
    # memory and load time side by side (llama.cpp measures no file size, so that row has one column)
    row = next(line for line in text.splitlines() if line.startswith("resident after load (MB)"))
    assert row.split()[-2:] == ["250", "400"]
    assert next(line for line in text.splitlines() if line.startswith("model file")).split()[-1] == "100"
    assert "resident after load, of the file: weave 2.50x, llama.cpp 4.00x" in text
    assert "its own part (not file pages), of the file: weave 2.00x, llama.cpp 3.00x" in text
    assert "decode streams (GB/s)" in text and "of what the machine streams: 15%" in text


def test_only_and_quick(model):
    fake = FakeMeasure()
    args = ["bench", "--model", str(model), "--quick", "--only", "decode_2k, batch64_tps,decode_2k", "--json"]
    res = CliRunner().invoke(_app(fake, []), args)
    assert res.exit_code == 0, res.output
    cfg = fake.calls[0][1]
    assert cfg.keys == ("decode_2k_tps", "batch64_tps")
    assert cfg.rounds == 1 and cfg.reps == 1 and cfg.n_gen < 128 and cfg.n_long == 2000
    assert cfg.threads == (os.cpu_count() or 2)
    out = json.loads(res.stdout)
    assert set(out["ratio"]) == {"decode_2k_tps", "batch64_tps"}


@pytest.mark.parametrize("only", ["decode,bogus", ",", "prefill_tp"])
def test_only_rejects_unknown_keys(model, only):
    res = CliRunner().invoke(_app(FakeMeasure(), []), ["bench", "--model", str(model), "--only", only])
    assert res.exit_code == 2
    assert "--only" in res.output or "measurement" in res.output


def test_missing_model_file_is_a_usage_error(tmp_path):
    res = CliRunner().invoke(_app(FakeMeasure(), []), ["bench", "--model", str(tmp_path / "nope.gguf")])
    assert res.exit_code == 2


def test_failing_side_keeps_the_other_and_exits_nonzero(model):
    fake = FakeMeasure(fail="weave")
    res = CliRunner().invoke(_app(fake, []), ["bench", "--model", str(model), "--json"])
    assert res.exit_code == 1
    out = json.loads(res.stdout)
    assert out["weave"] == {"error": "RuntimeError: no backend"}
    assert set(out["llama_cpp"]) == set(KEYS) | set(LLAMA_INFO_KEYS)
    assert out["ratio"] == {}
    table = format_table(out)
    assert "weave failed: RuntimeError: no backend" in table


def test_the_long_prompt_prefill_has_a_ratio_and_a_row_beside_the_short_one():
    from weaved.bench.report import build_report, format_table

    w = {"prefill_tps": 900.0, "prefill_8k_tps": 130.0, "decode_8k_tps": 40.0}
    b = {"prefill_tps": 450.0, "prefill_8k_tps": 100.0, "decode_8k_tps": 20.0}
    rep = build_report("m", 2, w, b)
    assert rep["ratio"] == {"prefill_tps": 2.0, "prefill_8k_tps": pytest.approx(1.3), "decode_8k_tps": 2.0}
    rows = [line.split()[:3] for line in format_table(rep).splitlines()[2:5]]
    assert rows == [["prefill", "512", "tokens"], ["prefill", "8000", "tokens"], ["decode", "@8000", "(tok/s)"]]


def test_ratios_skip_info_keys_missing_and_zero():
    w = {"prefill_tps": 10.0, "decode_tps": 5.0, "batch16_tps": 1.0, "load_s": 2.0}
    b = {"prefill_tps": 20.0, "decode_tps": 0.0, "load_s": 1.0}
    assert ratios(w, b) == {"prefill_tps": 0.5}
    rep = build_report("m", 1, w, b)
    assert rep["ratio"] == {"prefill_tps": 0.5}
    row = next(line for line in format_table(rep).splitlines() if line.startswith("batch 16"))
    assert row.split()[-3:] == ["1.0", "-", "-"]  # no llama.cpp figure, no ratio


def test_option_helpers():
    assert bench_cli.parse_only(None) is None
    assert bench_cli.parse_only("prefill, batch16") == ("prefill_tps", "batch16_tps")
    assert batch_size("batch64_tps") == 64 and batch_size("decode_tps") is None
    with pytest.raises(ValueError, match="unknown measurement"):
        BenchConfig(model="m", threads=1, keys=("fast_tps",))
    with pytest.raises(ValueError, match="threads"):
        BenchConfig(model="m", threads=0)


class CountingEngine:
    """Test double for a side: tracks lengths and counts calls; tokens are the position mod 7."""

    def __init__(self):
        self.lengths: list[int] = []
        self.capacity = 0
        self.steps = 0
        self.step_tokens = 0
        self.prefill_tokens = 0

    def open(self, n_seqs, capacity):
        self.lengths, self.capacity = [0] * n_seqs, capacity

    def prefill(self, seqs, prompts, want_logits):
        for s, p in zip(seqs, prompts, strict=True):
            assert 1 <= len(p) <= 512
            self.lengths[s] += len(p)
            assert self.lengths[s] <= self.capacity
            self.prefill_tokens += len(p)
        return [self.lengths[s] % 7 for s in seqs] if want_logits else []

    def step(self, tokens):
        assert len(tokens) == len(self.lengths)
        self.steps += 1
        self.step_tokens += len(tokens)
        for s in range(len(tokens)):
            self.lengths[s] += 1
            assert self.lengths[s] <= self.capacity
        return [n % 7 for n in self.lengths]

    def truncate(self, seq, length):
        assert length <= self.lengths[seq]
        self.lengths[seq] = length


def test_harness_runs_warmup_plus_reps_with_rewinds():
    cfg = BenchConfig(model="m", threads=1, reps=2, n_gen=5, batch_steps=3)
    eng, msgs = CountingEngine(), []
    out = measure(eng, cfg, TOKENS, msgs.append)
    i = KEYS.index("decode_8k_tps") + 1  # decode @8000 also gives the rate its context was prefilled at
    assert list(out) == [*KEYS[:i], "prefill_8k_tps", *KEYS[i:]]
    assert all(v > 0 for v in out.values())
    # decode, decode_2k and decode_8k: (1 warm-up + 2 reps) x 5 tokens; batches: 3 runs x 3 steps
    assert eng.steps == 3 * 3 * 5 + 2 * 3 * 3
    assert eng.step_tokens == 3 * 3 * 5 + (16 + 64) * 3 * 3
    # prefill 512 three times, 16 + 2000 + 8000 once each, 16 tokens per batch sequence once
    assert eng.prefill_tokens == 3 * 512 + 16 + 2000 + 8000 + 16 * (16 + 64)
    assert sum("rep" in m for m in msgs) == 2 * len(KEYS)


def test_filler_text_is_deterministic():
    assert filler_text() == filler_text()
    assert len(filler_text().split()) > 6000


def test_importing_the_command_stays_light():
    code = (
        "import sys, weaved.cli.bench as b, typer; b.register(typer.Typer()); "
        "heavy = {'numba', 'llama_cpp', 'torch', 'weaved.bench.harness'} & set(sys.modules); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_measure_side_rejects_unknown_side():
    from weaved.bench.runner import measure_side

    with pytest.raises(ValueError, match="unknown side"):
        measure_side("vllm", BenchConfig(model="m", threads=1), TOKENS)


# --- the real sides, on tiny sizes (wiring, not speed) -------------------------------------------


@pytest.fixture(scope="module")
def real_model():
    from weaved.model.default import default_model_path

    return default_model_path()


def _tiny(model) -> BenchConfig:
    # n_long > n_batch so the long context is prefilled in two pieces, as the real 2,000 is
    return BenchConfig(model=model, threads=1, reps=1, n_prefill=32, n_long=600, n_longer=700, n_gen=4,
                       batch_steps=2)


def _rewind_is_exact(engine, tokens) -> None:
    engine.open(2, 64)
    first = engine.prefill([0, 1], [tokens[:16], tokens[16:32]], want_logits=True)

    def gen(n):
        cur, out = first, []
        for _ in range(n):
            cur = engine.step(cur)
            out.append(cur)
        return out

    a = gen(6)
    engine.truncate(0, 16)
    engine.truncate(1, 16)
    assert gen(6) == a


@pytest.mark.llama
@pytest.mark.slow
def test_llama_side_in_a_subprocess(real_model):
    from weaved.bench.harness import filler_tokens
    from weaved.bench.llama_side import LlamaEngine
    from weaved.bench.runner import measure_in_subprocess

    cfg = _tiny(real_model)
    tokens = filler_tokens(real_model, cfg.tokens_needed)
    engine = LlamaEngine(str(real_model), 1)
    try:
        _rewind_is_exact(engine, tokens)
    finally:
        engine.close()
    out = measure_in_subprocess("llama_cpp", cfg, tokens)
    assert set(out) == set(KEYS) | set(DERIVED_KEYS) | set(LLAMA_INFO_KEYS) and all(v > 0 for v in out.values())
    assert out["rss_mb"] > real_model.stat().st_size / 2**20 / 2  # the weights' pages were touched


@pytest.mark.slow
def test_weave_side_in_a_subprocess(real_model):
    from weaved.bench.harness import filler_tokens
    from weaved.bench.runner import measure_in_subprocess
    from weaved.bench.weave_side import WeaveEngine, load_backend

    cfg = _tiny(real_model)
    tokens = filler_tokens(real_model, cfg.tokens_needed)
    be, load_s = load_backend(cfg)
    assert load_s > 0
    _rewind_is_exact(WeaveEngine(be), tokens)
    out = measure_in_subprocess("weave", cfg, tokens)
    assert set(out) == set(KEYS) | set(DERIVED_KEYS) | set(INFO_KEYS) and all(v > 0 for v in out.values())


def test_rounds_report_each_sides_median_and_a_failed_side_stops():
    from weaved.bench.runner import run_bench

    seen: dict[str, int] = {"weave": 0, "llama_cpp": 0}

    def measure(side, cfg, tokens):
        seen[side] += 1
        if side == "llama_cpp" and seen[side] == 2:
            raise RuntimeError("boom")
        return {"decode_tps": [100.0, 300.0, 200.0][seen[side] - 1], "load_s": 1.0, "rss_mb": 10.0} \
            if side == "weave" else {"decode_tps": 50.0}

    cfg = BenchConfig(model="m", threads=1, keys=("decode_tps",), rounds=3)
    out = run_bench(cfg, measure=measure, tokens=[1, 2, 3], progress=lambda m: None)
    assert out["weave"]["decode_tps"] == 200.0  # median of 100, 300, 200
    assert seen == {"weave": 3, "llama_cpp": 2}  # not run again after it failed
    assert "boom" in out["llama_cpp"]["error"]


@pytest.mark.parametrize("amx", [True, False])
def test_a_crashed_llama_process_is_named_with_the_amx_hint_when_its_build_has_amx(monkeypatch, amx):
    from concurrent.futures.process import BrokenProcessPool

    import llama_cpp

    from weaved.bench.runner import run_bench

    info = b"CPU : AVX512 = 1 | " + (b"AMX_INT8 = 1 | " if amx else b"") + b"REPACK = 1 | "
    monkeypatch.setattr(llama_cpp, "llama_print_system_info", lambda: info)

    def measure(side, cfg, tokens):
        if side == "llama_cpp":
            raise BrokenProcessPool("A process in the process pool was terminated abruptly")
        return {"decode_tps": 100.0}

    cfg = BenchConfig(model="m", threads=1, keys=("decode_tps",), rounds=1)
    err = run_bench(cfg, measure=measure, tokens=[1], progress=lambda m: None)["llama_cpp"]["error"]
    assert err.startswith("its process crashed")
    assert ("AMX" in err and "README" in err) is amx


@pytest.mark.slow
def test_grammar_scenario_reports_mask_costs(smollm2_q4_0):
    app = typer.Typer()
    bench_cli.register(app)
    app.command("noop")(lambda: None)
    res = CliRunner().invoke(app, ["bench", "--scenario", "grammar", "--model", str(smollm2_q4_0), "--quick",
                                   "--threads", "1", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout.strip().splitlines()[-1])
    (m,) = report["models"]
    assert m["vocab"] == 49152 and m["decode_step_ms"] > 0
    assert set(m["grammars"]) == {"json_schema", "tools_required", "tools_auto"}
    for g in m["grammars"].values():
        assert g["tokens"] == 300 and 0 < g["p50_us"] <= g["p99_us"] <= g["max_us"]
    bad = CliRunner().invoke(app, ["bench", "--scenario", "grammar", "--agents", "3"])
    assert bad.exit_code == 2 and "grammar scenario takes" in bad.output


def test_shape_help_names_every_shape():
    import inspect

    from weaved.bench.shapes import SHAPES

    app = _app(FakeMeasure(), [])
    command = typer.main.get_command(app).commands["bench"]
    (opt,) = [p for p in command.params if p.name == "shape"]
    listed = inspect.cleandoc(opt.help).split("cached (")[1].split(")")[0]
    assert sorted(n.strip() for n in listed.split(",")) == sorted(SHAPES)


def test_a_busy_machine_is_said_in_the_report_and_the_table_explains_its_columns(tmp_path, monkeypatch):
    import psutil

    from weaved.bench import runner

    fake = FakeMeasure()
    monkeypatch.setattr(runner, "measure_in_subprocess", fake)
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 100.0)
    said: list[str] = []
    rep = runner.run_bench(BenchConfig(tmp_path / "m.gguf", threads=2, rounds=1), tokens=[1] * 9000,
                           progress=said.append)
    assert len(rep["warnings"]) == 1 and "CPUs were busy before starting" in rep["warnings"][0]
    assert any("warning:" in m for m in said) and json.loads(json.dumps(rep))["warnings"] == rep["warnings"]
    table = format_table(rep)
    assert table.splitlines()[-1] == f"warning: {rep['warnings'][0]}"
    assert "ratio: Weave / llama.cpp (above 1: Weave is faster)" in table
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 0.0)
    assert "warnings" not in runner.run_bench(BenchConfig(tmp_path / "m.gguf", threads=1, rounds=1),
                                              tokens=[1] * 9000, progress=said.append)


@pytest.mark.parametrize(("args", "says"), [
    (["--scenario", "agents", "--validate", "--quick"], "without --quick or --only"),
    (["--scenario", "agents", "--validate", "--only", "weave"], "without --quick or --only"),
    (["--scenario", "agents", "--validate", "--clients", "8"], "--clients needs --scenario load"),
    (["--scenario", "agents", "--simulate", "this-host", "--shape", "qwen3-1.7b", "--clients", "8"],
     "--clients needs --scenario load"),
])
def test_options_a_scenario_would_drop_are_refused(args, says, monkeypatch, capsys):
    """--validate and --simulate run before the other scenarios' checks: an option they would not use is
    still refused by name (one line, bad usage), never dropped."""
    from weaved.cli.app import main

    monkeypatch.setattr(sys, "argv", ["weave", "bench", *args])
    with pytest.raises(SystemExit) as ended:
        main()
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.startswith("weave: error: ") and says in err and err.count("\n") == 1
