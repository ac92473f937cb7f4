"""``weave convert``: success, refusal to overwrite, --force, and one-line errors with exit code 1."""

from __future__ import annotations

import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner
from weaved.cli.app import app

from tests.tiny_models import write_tiny_gguf
from weaved.model.convert import needs_conversion, tensor_types

runner = CliRunner()


@pytest.fixture(scope="module")
def q4_1_model(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("src") / "tiny-q4_1.gguf", n_layers=1, wtype=Q.Q4_1)


def _error_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_converts(q4_1_model, tmp_path):
    out = tmp_path / "out.gguf"
    result = runner.invoke(app, ["convert", str(q4_1_model), str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stdout
    assert needs_conversion(q4_1_model) and not needs_conversion(out)
    assert tensor_types(out)["blk.0.ffn_up.weight"] == Q.Q4_0


def test_refuses_to_overwrite_then_force(q4_1_model, tmp_path):
    out = tmp_path / "out.gguf"
    out.write_bytes(b"keep me")
    result = runner.invoke(app, ["convert", str(q4_1_model), str(out)])
    assert result.exit_code == 2  # bad usage
    line = _error_line(result)
    assert "already exists" in line and "--force" in line
    assert out.read_bytes() == b"keep me"

    result = runner.invoke(app, ["convert", str(q4_1_model), str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert not needs_conversion(out)

    for flags in ([], ["--force"]):  # a directory is never overwritten, and says so before any work
        result = runner.invoke(app, ["convert", str(q4_1_model), str(tmp_path), *flags])
        assert result.exit_code == 2 and "is a directory: name the file to write" in _error_line(result)


def test_an_out_that_cannot_be_written_is_said_in_words(q4_1_model, tmp_path):
    (tmp_path / "plain").write_text("")
    result = runner.invoke(app, ["convert", str(q4_1_model), str(tmp_path / "plain" / "out.gguf")])
    assert result.exit_code == 2  # bad usage, found before any work
    assert _error_line(result) == (f"weave: error: cannot write {tmp_path / 'plain' / 'out.gguf'}: "
                                   f"{tmp_path / 'plain'} is a file, not a directory")
    # a write that fails while converting (a full disk, a read-only mount) names OUT, not its temporary file
    from weaved.cli.convert import _os_error

    src, dst = tmp_path / "in.gguf", tmp_path / "out" / "x.gguf"
    assert _os_error(OSError(28, "No space left on device", str(dst.parent / ".x.gguf.1.tmp")), src, dst) == \
        f"cannot write {dst}: No space left on device"
    assert _os_error(OSError(5, "Input/output error", str(src)), src, dst) == f"cannot read {src}: Input/output error"


@pytest.mark.parametrize(
    ("make_input", "message", "code"),
    [
        (lambda d: d / "missing.gguf", "input file not found", 2),  # bad usage
        (lambda d: d, "is a directory", 2),
        (lambda d: (d / "notes.txt", (d / "notes.txt").write_text("hello"))[0], "not a readable GGUF", 2),
        (lambda d: write_tiny_gguf(d / "gpt2.gguf", "gpt2", n_layers=1), "architecture 'gpt2' is not supported", 2),
    ],
    ids=["missing", "directory", "not-gguf", "unsupported-arch"],
)
def test_errors_are_one_line_with_their_exit_code(tmp_path, make_input, message, code):
    src = make_input(tmp_path)
    out = tmp_path / "out.gguf"
    result = runner.invoke(app, ["convert", str(src), str(out)])
    assert result.exit_code == code
    assert message in _error_line(result)
    assert not out.exists()


def test_help_explains_the_shared_format():
    result = runner.invoke(app, ["convert", "--help"])
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "Q4_0" in text and "Q8_0" in text and "--force" in text


def test_module_import_stays_light():
    code = (
        "import sys, weaved.cli.convert; "
        "print(','.join(m for m in ('numpy', 'numba', 'torch', 'gguf', 'rich.progress') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
