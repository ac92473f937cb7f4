"""llama.cpp (through llama-cpp-python) as the practical oracle, distribution metrics, and the
closeness bars every backend is held to (docs/architecture.md, "Correctness").

The bars: teacher-forced over natural text, a backend's mean KL from the float64 reference is no
larger than llama.cpp's and its top-1 agreement with it no lower than llama.cpp's minus one point;
against llama.cpp itself mean KL <= 0.005 and top-1 >= 94 %; greedy continuations leave
llama.cpp's only at near-ties (its logit margin between the two tokens < 0.3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

NATURAL_TEXT_PATH = Path(__file__).parent / "data" / "natural_text.txt"
GREEDY_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nWrite a haiku about autumn.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
    "To make a cup of tea, first",
]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def mean_kl(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over rows of KL(ref || other) of the next-token distributions."""
    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=-1)))


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))


def llama_model(path, n_ctx: int = 1024, flash_attn: bool | None = None, logits_all: bool = True):
    import llama_cpp

    kw = dict(n_ctx=n_ctx, n_threads=2, n_batch=512, logits_all=logits_all, verbose=False)
    if flash_attn is not None:
        kw["flash_attn"] = flash_attn
    return llama_cpp.Llama(str(path), **kw)


def llama_logits(llm, tokens: list[int]) -> np.ndarray:
    """Teacher-forced next-token logits after every prefix: [T, vocab] float32."""
    llm.reset()
    llm.eval(tokens)
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def llama_greedy(llm, prompt: list[int], n: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation and the logits it chose each token from: [n, vocab]."""
    llm.reset()
    llm.eval(prompt)
    out, rows = [], []
    for _ in range(n):
        row = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        if not np.isfinite(row).all() or row.std() == 0:  # e.g. a model made without logits_all
            raise RuntimeError("llama.cpp returned no logits for the last position")
        tok = int(np.argmax(row))
        out.append(tok)
        rows.append(row)
        llm.eval([tok])
    return out, np.stack(rows)


@dataclass(frozen=True)
class Divergence:
    index: int  # position in the continuation where the tokens first differ
    ours: int
    theirs: int
    margin: float  # llama.cpp's logit of its token minus its logit of ours


def first_divergence(ours: list[int], theirs: list[int], their_logits: np.ndarray) -> Divergence | None:
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        if a != b:
            return Divergence(i, a, b, float(their_logits[i, b] - their_logits[i, a]))
    return None


# ---- a backend against the oracles ---------------------------------------------------------------
def teacher_forced(be, tokens: list[int]) -> np.ndarray:
    """A backend's next-token logits after every prefix, in one forward: [T, vocab] float32."""
    from weaved.backends.base import Logits, SeqChunk

    kv = be.new_kv(len(tokens) + 8)
    return be.forward([SeqChunk(kv, np.array(tokens, np.int32), Logits.ALL)])[0]


def greedy(be, prompt: list[int], n: int) -> list[int]:
    """A backend's greedy continuation of ``prompt``: the prompt in one step, then one token a step."""
    from weaved.backends.base import SeqChunk

    kv = be.new_kv(len(prompt) + n + 8)
    (row,) = be.forward([SeqChunk(kv, np.array(prompt, np.int32))])
    out = []
    for _ in range(n):
        tok = int(np.argmax(row[0]))
        out.append(tok)
        (row,) = be.forward([SeqChunk(kv, np.array([tok], np.int32))])
    return out


def check_against_truth_and_llama(be, path: Path, n_tokens: int) -> dict:
    """Teacher-forced bars of backend ``be`` (running the model at ``path``) on the first
    ``n_tokens`` tokens of the natural text; returns the measured numbers."""
    from tests.reference import ReferenceModel
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(path, be.gguf)
    tokens = tok.encode(NATURAL_TEXT_PATH.read_text())[:n_tokens]
    assert len(tokens) == n_tokens
    ours = teacher_forced(be, tokens)
    llm = llama_model(path, n_ctx=1024)
    theirs = llama_logits(llm, tokens)
    ref = ReferenceModel(be.gguf, be.config).logits(tokens)
    stats = {
        "kl_ours_ref": mean_kl(ref, ours),
        "kl_llama_ref": mean_kl(ref, theirs),
        "top1_ours_ref": top1_agreement(ref, ours),
        "top1_llama_ref": top1_agreement(ref, theirs),
        "kl_llama_ours": mean_kl(theirs, ours),
        "top1_llama_ours": top1_agreement(theirs, ours),
    }
    print(be.name, path.name, {k: round(v, 5) for k, v in stats.items()})
    assert stats["kl_ours_ref"] <= stats["kl_llama_ref"], stats
    assert stats["top1_ours_ref"] >= stats["top1_llama_ref"] - 0.01, stats
    assert stats["kl_llama_ours"] <= 0.005, stats
    assert stats["top1_llama_ours"] >= 0.94, stats
    return stats


def check_greedy_near_ties(be, path: Path, prompts: list[str], n: int, truth: bool = False) -> list:
    """Greedy continuations of backend ``be`` leave llama.cpp's only at near-ties (llama.cpp's margin
    between the two tokens < 0.3) - or, with ``truth``, where the float64 reference prefers ours."""
    from tests.reference import ReferenceModel
    from weaved.model.tokenizer import Tokenizer

    tok = Tokenizer(path, be.gguf)
    llm = llama_model(path, n_ctx=512)
    report = []
    for text in prompts:
        prompt = tok.encode_prompt(text)
        ours = greedy(be, prompt, n)
        theirs, their_logits = llama_greedy(llm, prompt, n)
        d = first_divergence(ours, theirs, their_logits)
        report.append((text[:30], d))
        if d is None or d.margin < 0.3:
            continue
        assert truth, f"{text!r}: diverged at token {d.index} with llama.cpp margin {d.margin:.3f}"
        ref = ReferenceModel(be.gguf, be.config).logits(prompt + ours[:d.index])[-1]
        assert ref[d.ours] >= ref[d.theirs], (f"{text!r}: diverged at token {d.index} (llama.cpp margin "
                                              f"{d.margin:.3f}) and the truth prefers llama.cpp's token")
    print(be.name, "greedy divergences:", report)
    return report
