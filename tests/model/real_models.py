"""Teacher-forced agreement with llama.cpp over long texts, measured without holding [T, vocab] arrays.

At a few thousand positions a 128k-262k vocabulary's logits take gigabytes per engine, so each side
reduces its logits to two numbers per position as they come: the log-probability of the actual next
token and the top-1 token.  Over a long text llama.cpp computes the logits of every ``every``-th
position only: its output projection over the whole vocabulary at every position was half of what a
shape cut to a few layers cost it, and a thousand positions measure the agreement as well.  The
yardstick is llama.cpp against itself - the same file with flash attention on and off - since exact
equality is not the bar (its own paths disagree at near-ties).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

LONG_TEXT_PATH = Path(__file__).parents[1] / "data" / "long_text.txt"


@dataclass(frozen=True)
class TokenStats:
    logprob: np.ndarray  # [T-1] float64: log p(token t+1 | tokens 0..t)
    top1: np.ndarray  # [T-1] str: the argmax after tokens 0..t, as its text (how the API reports it)

    def mean_abs_diff(self, other: TokenStats) -> float:
        return float(np.mean(np.abs(self.logprob - other.logprob)))

    def top1_agreement(self, other: TokenStats) -> float:
        return float(np.mean(self.top1 == other.top1))

    def every(self, step: int) -> TokenStats:
        """The positions 0, step, 2 step, ... (those ``llama_stats(..., every=step)`` computes)."""
        return TokenStats(self.logprob[::step], self.top1[::step])


def piece(tokenizer, token_id: int) -> str:
    """A token's text as the API reports it (its bytes decoded leniently)."""
    return tokenizer.token_bytes(int(token_id)).decode("utf-8", errors="replace")


def stats_from_rows(rows, nexts: list[int], tokenizer, block: int = 256) -> TokenStats:
    """TokenStats from ``rows`` ([n, vocab] logits, row i predicting token ``nexts[i]``), a block at a time."""
    n = len(nexts)
    lp, top = np.empty(n), np.empty(n, object)
    for a in range(0, n, block):
        z = np.asarray(rows[a:min(n, a + block)], dtype=np.float64)
        m = z.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(z - m).sum(-1, keepdims=True)))[:, 0]
        nxt = np.asarray(nexts[a:a + len(z)])
        lp[a:a + len(z)] = z[np.arange(len(z)), nxt] - lse
        top[a:a + len(z)] = [piece(tokenizer, i) for i in z.argmax(-1)]
    return TokenStats(lp, top)


def llama_stats(path: Path, tokens: list[int], tokenizer, flash_attn: bool, every: int = 1) -> TokenStats:
    """llama.cpp's teacher-forced TokenStats on the same file at positions 0, ``every``, 2 ``every``, ...:
    the prompt is decoded in batches whose other positions ask for no logits (its C API's per-token
    flag), so the output projection runs for the chosen positions alone."""
    import llama_cpp

    from tests.oracles import llama_model

    n, n_batch = len(tokens) - 1, 512
    want = range(0, n, every)
    llm = llama_model(path, n_ctx=len(tokens) + 16, flash_attn=flash_attn, logits_all=False)
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    try:
        vocab = llm.n_vocab()
        rows = np.empty((len(want), vocab), np.float32)
        k = 0
        for a in range(0, len(tokens), n_batch):
            chunk = tokens[a:a + n_batch]
            batch.n_tokens = len(chunk)
            outputs = []
            for j, token in enumerate(chunk):
                t = a + j
                batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.seq_id[j][0] = token, t, 1, 0
                batch.logits[j] = t < n and t % every == 0
                if batch.logits[j]:
                    outputs.append(j)
            if llama_cpp.llama_decode(llm.ctx, batch) != 0:
                raise RuntimeError(f"llama.cpp could not decode positions {a}-{a + len(chunk) - 1}")
            for j in outputs:
                rows[k] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, j), shape=(vocab,))
                k += 1
        assert k == len(want)
        return stats_from_rows(rows, [tokens[t + 1] for t in want], tokenizer)
    finally:
        llama_cpp.llama_batch_free(batch)
        llm.close()


def api_stats(http, text: str, tokens: list[int]) -> TokenStats:
    """Weave's TokenStats through ``/v1/completions`` (echo with logprobs: the prompt's tokens come back
    with their log-probabilities and their top alternative), the prompt given as text."""
    r = http.post("/v1/completions", json={"prompt": text, "max_tokens": 1, "temperature": 0, "echo": True,
                                           "logprobs": 1})
    assert r.status_code == 200, r.text
    lps = r.json()["choices"][0]["logprobs"]
    n = len(tokens)
    assert len(lps["tokens"]) == n + 1, (len(lps["tokens"]), n)  # the prompt, then the generated token
    assert lps["token_logprobs"][0] is None
    top = np.empty(n - 1, object)
    for t in range(1, n):  # the token itself is listed beside its top alternative: take the most probable
        top[t - 1] = max(lps["top_logprobs"][t].items(), key=lambda kv: kv[1])[0]
    return TokenStats(np.array(lps["token_logprobs"][1:n], np.float64), top)
