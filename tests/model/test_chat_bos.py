"""Chat prompts tokenize as llama.cpp's server makes them: one BOS when the model adds one (whether or
not the template writes ``bos_token`` itself), none when it adds none; raw prompts get BOS only when
they lack it.

The oracle is llama.cpp's rule, applied here with llama.cpp's own tokenizer: when the vocabulary adds
BOS and the rendered text starts with the BOS text, that text is stripped, then the text is tokenized
with ``add_special`` (llama-server's chat path).  The templates are in ``tests/data/templates``.
"""

from __future__ import annotations

import threading
from pathlib import Path

import llama_cpp
import pytest

from weaved.bench.shape_files import shape_gguf
from weaved.model.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parents[1] / "data" / "templates"
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a primary colour."},
    {"role": "assistant", "content": "Red."},
    {"role": "user", "content": "Another one?"},
]


def llama_server_tokens(path: Path, text: str) -> list[int]:
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    try:
        add_bos = bool(llama_cpp.llama_vocab_get_add_bos(llama_cpp.llama_model_get_vocab(llm.model)))
        bos = llm.detokenize([llm.token_bos()], special=True).decode("utf-8", "replace")
        if add_bos and text.startswith(bos):
            text = text[len(bos):]
        return llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    finally:
        llm.close()


def _model(name: str, request) -> Path:
    if name == "gemma3":
        return request.getfixturevalue("gemma3_270m")
    if name == "smollm2":
        return request.getfixturevalue("smollm2_q4_0")
    return shape_gguf(name, layers=1)


# (model, template file or None for the model's own, BOS tokens the prompt must start with)
CASES = [
    ("llama-3.2-1b", "llama3.jinja", 1),  # the template writes bos_token and the model adds BOS
    ("qwen2.5-0.5b", "qwen2.5.jinja", 0),  # ChatML: neither
    ("qwen3-0.6b", "qwen3.jinja", 0),
    ("gemma3", "gemma3.jinja", 1),  # SPM vocabulary: adds BOS; the template writes it too
    ("smollm2", None, 1),  # its own ChatML template; its BOS token is <|im_start|>, which the template writes
    ("llama-3.2-1b", "qwen2.5.jinja", 1),  # a template without bos_token on a model that adds it
]


@pytest.mark.parametrize("model,template,n_bos", CASES, ids=[f"{m}-{t}" for m, t, _ in CASES])
def test_chat_prompt_has_one_bos_or_none_as_llama_server(model, template, n_bos, request):
    path = _model(model, request)
    text_t = (TEMPLATES / template).read_text() if template else None
    tok = Tokenizer(path, chat_template=text_t)
    text = tok.render_chat(CONVERSATION, add_generation_prompt=True)
    ours = tok.encode_chat(text)
    assert ours == llama_server_tokens(path, text)
    assert ours[:2] != [tok.bos_id, tok.bos_id]  # never two
    assert (ours[0] == tok.bos_id) == (n_bos == 1)


@pytest.mark.parametrize("model", ["llama-3.2-1b", "gemma3", "qwen2.5-0.5b"])
def test_raw_prompts_get_bos_only_when_they_lack_it(model, request):
    path = _model(model, request)
    tok = Tokenizer(path)
    plain = tok.encode_prompt("Once upon a time")
    assert (plain[0] == tok.bos_id) == tok.add_bos
    already = tok.encode_prompt(tok.bos_text + "Once upon a time")
    assert already.count(tok.bos_id) == 1 and already[0] == tok.bos_id
    assert already == llama_server_tokens(path, tok.bos_text + "Once upon a time") or not tok.add_bos


def test_daemon_chat_turn_starts_with_one_bos(tmp_path):
    """Through the daemon with ``chat_template`` (``weave serve --chat-template``): the session's first
    tokens are the llama-server tokens of the rendered conversation."""
    from weaved.config.load import load_profile
    from weaved.daemon.core import Daemon
    from weaved.engine.sampling import SamplingParams
    from weaved.routing.types import SLA, SLAClass

    path = shape_gguf("llama-3.2-1b", layers=1)
    template = (TEMPLATES / "llama3.jinja").read_text()
    d = Daemon(load_profile("cpu-only"), path, data_dir=tmp_path, log_fn=lambda m: None, chat_template=template)
    d.load()
    try:
        sid = d.create_session(SLA(SLAClass.INTERACTIVE))["id"]
        done, usage = threading.Event(), {}

        def emit(ev: dict) -> None:
            if ev["type"] in ("done", "error"):
                usage.update(ev.get("usage", {}))
                done.set()

        d.start_turn(session_id=sid, messages=CONVERSATION[:2], params=SamplingParams(max_tokens=2, temperature=0),
                     emit=emit)
        assert done.wait(120)
        want = llama_server_tokens(path, d.tokenizer.render_chat(CONVERSATION[:2]))
        assert usage["prompt_tokens"] == len(want)
        assert d.sessions[sid].committed[:len(want)] == want
        assert d.sessions[sid].committed.count(d.tokenizer.bos_id) == 1
    finally:
        d.shutdown()
