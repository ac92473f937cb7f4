"""The fast GGUF header scan agrees with gguf-py's GGUFReader, key by key and tensor by tensor."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from weaved.model.default import shipped_smollm2_path
from weaved.model.gguf_scan import scan_gguf, tensor_views


def _reader_value(field):
    """A GGUFReader field in the scan's representation (strings as bytes)."""
    vtype = field.types[0]
    if vtype == GGUFValueType.STRING:
        return bytes(field.parts[-1])
    if vtype != GGUFValueType.ARRAY:
        return field.parts[-1].tolist()[0]
    if field.types[1] == GGUFValueType.STRING:
        return [bytes(field.parts[i]) for i in field.data]
    return [v for i in field.data for v in field.parts[i].tolist()]


@pytest.fixture(scope="module")
def smollm2_reader() -> GGUFReader:
    return GGUFReader(shipped_smollm2_path(), "r")


@pytest.mark.slow  # GGUFReader itself takes 2-5 s to parse SmolLM2's vocabulary
def test_metadata_matches_gguf_reader(smollm2_reader):
    header = scan_gguf(shipped_smollm2_path())
    fields = {k: f for k, f in smollm2_reader.fields.items() if not k.startswith("GGUF.")}
    assert list(header.metadata) == list(fields)
    for key, field in fields.items():
        item = header.metadata[key]
        assert item.vtype == field.types[0], key
        assert item.value == _reader_value(field), key
        if item.vtype == GGUFValueType.ARRAY:
            assert item.sub_type == field.types[1], key
    assert header.version == 3
    assert header.alignment == smollm2_reader.alignment
    assert header.data_offset == smollm2_reader.data_offset


@pytest.mark.slow
def test_tensors_match_gguf_reader(smollm2_reader):
    path = shipped_smollm2_path()
    header = scan_gguf(path, want=lambda key: False)
    assert header.metadata == {}
    views = tensor_views(path, header)
    assert [t.name for t in header.tensors] == [t.name for t in smollm2_reader.tensors]
    for ours, theirs in zip(header.tensors, smollm2_reader.tensors, strict=True):
        assert ours.type == theirs.tensor_type
        assert ours.shape == tuple(reversed(theirs.shape.tolist()))
        assert ours.nbytes == theirs.n_bytes
        view = views[ours.name]
        assert view.dtype == theirs.data.dtype and view.shape == theirs.data.shape
        assert np.array_equal(view, theirs.data)


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        scan_gguf(tmp_path / "missing.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf is not a readable GGUF file: it is empty"):
        scan_gguf(tmp_path / "empty.gguf")
    (tmp_path / "text.gguf").write_text("not a model at all, just some text")
    with pytest.raises(ValueError, match="not a readable GGUF file: no GGUF magic"):
        scan_gguf(tmp_path / "text.gguf")
    (tmp_path / "note.gguf").write_text("hello\n")  # shorter than a header: still no GGUF, not "cut short"
    with pytest.raises(ValueError, match="not a readable GGUF file: no GGUF magic"):
        scan_gguf(tmp_path / "note.gguf")
    (tmp_path / "head.gguf").write_bytes(b"GGUF\x03\x00")  # a GGUF's first bytes only
    with pytest.raises(ValueError, match="not a readable GGUF file: .*cut short"):
        scan_gguf(tmp_path / "head.gguf")
    # a real header cut short
    (tmp_path / "cut.gguf").write_bytes(shipped_smollm2_path().read_bytes()[:100_000])
    with pytest.raises(ValueError, match="not a readable GGUF"):
        scan_gguf(tmp_path / "cut.gguf")
    # header complete, tensor data missing
    header = scan_gguf(shipped_smollm2_path(), want=lambda key: False)
    (tmp_path / "short.gguf").write_bytes(shipped_smollm2_path().read_bytes()[: header.data_offset + 1000])
    with pytest.raises(ValueError, match="truncated"):
        tensor_views(tmp_path / "short.gguf", scan_gguf(tmp_path / "short.gguf"))


def test_a_file_without_a_tokenizer_is_refused_by_name(tmp_path):
    """llama.cpp's own failure only says it could not load the file: the missing vocabulary is named."""
    import gguf
    import numpy as np

    from weaved.model.tokenizer import Tokenizer

    path = tmp_path / "notok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"notok\.gguf has no tokenizer \(no tokenizer\.ggml\.model key\)"):
        Tokenizer(path)
