"""Files a user may bring that Weave must refuse by name - or read as llama.cpp reads them - rather
than load and compute something else: a split model, hyper-parameters per layer, tensors the
architecture does not take, a model larger than the RAM (refused before it is converted), and rope
scaling keys in llama.cpp's defaults."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from tests.tiny_models import write_tiny_gguf
from weaved.model.architectures import check_tensors, read_config
from weaved.model.default import ensure_native
from weaved.model.footprint import weights_bytes
from weaved.model.gguf_file import GGUFFile
from weaved.model.gguf_scan import scan_gguf

Q = GGMLQuantizationType


def test_one_part_of_a_split_model_is_refused_with_the_way_out(tmp_path):
    def split(w, add):
        w.add_uint16("split.no", 0)
        w.add_uint16("split.count", 3)

    path = write_tiny_gguf(tmp_path / "m-00001-of-00003.gguf", n_layers=1, wtype=Q.Q4_1, extra=split)
    with pytest.raises(ValueError, match=r"one of the 3 parts of a split model.*llama-gguf-split --merge"):
        ensure_native(path, log=lambda m: None)


def test_a_hyper_parameter_given_per_layer_is_read_when_alike_and_refused_when_not(tmp_path):
    alike = write_tiny_gguf(tmp_path / "alike.gguf", n_layers=2, n_kv_heads=[2, 2])
    assert read_config(GGUFFile(alike)).n_kv_heads == 2
    varies = write_tiny_gguf(tmp_path / "varies.gguf", n_layers=2, n_kv_heads=[2, 1])
    with pytest.raises(ValueError, match=r"head_count_kv varies by layer"):
        read_config(GGUFFile(varies))


def test_a_tensor_the_architecture_does_not_take_is_refused_by_name(tmp_path):
    """A llama file with q biases (a port of a model trained with them): llama.cpp adds them, so a
    Weave that left them out would compute another function."""
    def bias(w, add):
        add("blk.0.attn_q.bias", np.full(64, 0.1, np.float32), Q.F32)

    path = write_tiny_gguf(tmp_path / "bias.gguf", n_layers=1, extra=bias)
    f = GGUFFile(path)
    with pytest.raises(ValueError, match=r"does not implement for llama.*blk\.0\.attn_q\.bias"):
        check_tensors(f, read_config(f))


@pytest.mark.parametrize(("keys", "scale"), [({"scale_linear": 4.0}, 0.25), ({"scaling.factor": 4.0}, 0.25),
                                             ({"scaling.type": "none", "scaling.factor": 4.0}, 1.0)])
def test_a_rope_factor_without_a_type_scales_linearly(tmp_path, keys, scale):
    """llama.cpp: the scaling type defaults to linear (freq_scale 1/factor); "none" never scales."""
    def rope(w, add):
        for k, v in keys.items():
            (w.add_string if isinstance(v, str) else w.add_float32)(f"llama.rope.{k}", v)

    path = write_tiny_gguf(tmp_path / "rope.gguf", n_layers=1, extra=rope)
    assert read_config(GGUFFile(path)).rope.freq_scale == scale


def test_a_model_larger_than_the_ram_is_refused_before_it_is_converted(tmp_path, monkeypatch):
    import psutil

    path = write_tiny_gguf(tmp_path / "q41.gguf", n_layers=1, wtype=Q.Q4_1)
    fake = psutil.virtual_memory()._replace(total=weights_bytes(path) // 2)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: fake)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"needs about .* GiB of memory .* this host has .* GiB of RAM"):
        ensure_native(path, log=lambda m: None)
    assert not list((tmp_path / "cache").rglob("*.gguf"))  # nothing converted


def test_the_weights_footprint_counts_float_matrices_at_32_bits(tmp_path):
    q4 = write_tiny_gguf(tmp_path / "q4.gguf", n_layers=2, wtype=Q.Q4_0, embd_type=Q.Q8_0)
    f16 = write_tiny_gguf(tmp_path / "f16.gguf", n_layers=2, wtype=Q.F16, embd_type=Q.F16, norm_type=Q.F16)
    q41 = write_tiny_gguf(tmp_path / "q41.gguf", n_layers=2, wtype=Q.Q4_1, embd_type=Q.Q8_0)
    def stored(path) -> int:
        return sum(t.nbytes for t in scan_gguf(path, want=lambda key: False).tensors)

    assert weights_bytes(q4) == stored(q4)  # as stored (its norms F32 already)
    assert weights_bytes(f16) == 2 * stored(f16)  # every tensor F16, widened
    assert weights_bytes(q41) == weights_bytes(q4)  # what the conversion writes


def test_a_vocabulary_llama_cpp_refuses_is_refused_with_its_words(tmp_path):
    from weaved.model.tokenizer import Tokenizer

    path = write_tiny_gguf(tmp_path / "odd.gguf", "bogusarch", n_layers=1)
    with pytest.raises(ValueError, match=r"cannot read its vocabulary.*unknown model architecture"):
        Tokenizer(path)


def test_the_refusal_keeps_its_words_after_another_log_callback_was_set(tmp_path):
    """llama.cpp holds one process-wide log callback: one set since (a benchmark's, a reference run's)
    must not leave the refusal with only "failed to load"."""
    import ctypes

    import llama_cpp

    from weaved.model.tokenizer import Tokenizer, quiet_llama_logs

    quiet_llama_logs(llama_cpp)  # ours first, as when a tokenizer was loaded earlier in the process
    drop = llama_cpp.llama_log_callback(lambda level, text, user: None)
    llama_cpp.llama_log_set(drop, ctypes.c_void_p(0))
    path = write_tiny_gguf(tmp_path / "odd.gguf", "bogusarch", n_layers=1)
    with pytest.raises(ValueError, match=r"cannot read its vocabulary.*unknown model architecture"):
        Tokenizer(path)


def test_an_arm_repacked_q4_0_file_is_named_as_such(tmp_path):
    """Q4_0_4_4 (type 31), which llama.cpp retired: not "not a GGUF", but what it is and the way out."""
    import struct

    from weaved.model.gguf_scan import scan_gguf as scan

    path = write_tiny_gguf(tmp_path / "q4044.gguf", n_layers=1)
    data = bytearray(path.read_bytes())
    header = scan(path, want=lambda key: False)
    name = header.tensors[-1].name.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    (n_dims,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 31)  # its type
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"is Q4_0_4_4, an ARM repacking.*plain Q4_0"):
        scan(path)


def test_a_tensor_whose_shape_contradicts_the_metadata_is_refused_by_name(tmp_path):
    """The kernels trust the shapes the metadata implies: a matrix of another shape would be read past
    its end, or computed as something else.  llama.cpp refuses it; so does Weave (before converting)."""
    def short_heads(w, add):
        w.add_key_length(32)  # the file's heads are 16 wide
        w.add_value_length(32)

    path = write_tiny_gguf(tmp_path / "shape.gguf", n_layers=1, extra=short_heads)
    f = GGUFFile(path)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has shape \(64, 64\), the metadata says \(128, 64\)"):
        check_tensors(f, read_config(f))
    kquant = write_tiny_gguf(tmp_path / "shape-q4_1.gguf", n_layers=1, wtype=Q.Q4_1, extra=short_heads)
    with pytest.raises(ValueError, match=r"attn_q\.weight has shape"):
        ensure_native(kquant, log=lambda m: None)


@pytest.mark.parametrize(("kw", "words"), [({"context_length": 0}, "context_length must be at least 1"),
                                           ({"n_kv_heads": 3}, "heads do not share 3 key/value heads evenly")])
def test_hyper_parameters_that_cannot_run_are_refused_in_words(tmp_path, kw, words):
    path = write_tiny_gguf(tmp_path / "bad.gguf", n_layers=1, **kw)
    with pytest.raises(ValueError, match=words):
        read_config(GGUFFile(path))


def test_a_vocabulary_larger_than_the_embedding_is_refused(tmp_path, monkeypatch):
    from tests import tiny_models
    from weaved.model.tokenizer import Tokenizer

    monkeypatch.setattr(tiny_models, "smollm2_vocab_size", lambda: 1024)  # 1,024 rows for 49,152 tokens
    path = write_tiny_gguf(tmp_path / "rows.gguf", n_layers=1)
    with pytest.raises(ValueError, match=r"49152 tokens, its token embedding 1024 rows"):
        Tokenizer(path)


def test_special_token_ids_past_the_vocabulary_are_llama_cpps_reading_not_the_raw_ids(tmp_path, monkeypatch):
    """An eos id past the vocabulary crashed the process (llama.cpp's detokenizer threw): the ids are
    llama.cpp's own reading of the metadata, which never names a token the vocabulary lacks."""
    from tests import tiny_models
    from weaved.model.gguf_scan import MetaValue
    from weaved.model.tokenizer import Tokenizer

    real = tiny_models.smollm2_tokenizer_metadata()
    bad = dict(real)
    old = real["tokenizer.ggml.eos_token_id"]
    bad["tokenizer.ggml.eos_token_id"] = MetaValue(999_999, old.vtype, old.sub_type)
    monkeypatch.setattr(tiny_models, "smollm2_tokenizer_metadata", lambda: bad)
    tok = Tokenizer(write_tiny_gguf(tmp_path / "eos.gguf", n_layers=1),
                    chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tok.eos_id is None or tok.eos_id < tok.vocab_size
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "hi"
