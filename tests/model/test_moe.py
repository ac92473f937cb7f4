"""Mixtures of experts (qwen3moe, and Mixtral's layout under llama) on the CPU backend: the metadata,
the router against the float64 softmax top-k, the experts against the dense kernels token by token,
and the whole model against the float64 reference and llama.cpp at short and long context."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from weaved.kernels import matmul
from weaved.kernels.elementwise import swiglu
from weaved.kernels.moe import moe_ffn, route

from tests.oracles import NATURAL_TEXT_PATH, llama_logits, llama_model, mean_kl, teacher_forced, top1_agreement
from tests.reference import ReferenceModel
from weaved.backends.cpu import CPUBackend
from weaved.model.architectures import check_tensors
from weaved.model.config import ModelConfig
from weaved.model.loader import open_model
from weaved.model.tokenizer import Tokenizer

MOE = ["tiny_qwen3moe", "tiny_qwen3moe_wide", "tiny_mixtral"]
NEAR_TIE = 1e-5  # relative gap of two experts' float64 probabilities below which either may be picked


@pytest.fixture(scope="module", params=MOE)
def moe(request):
    path = request.getfixturevalue(request.param)
    return path, CPUBackend.from_file(path, threads=2)


def test_the_metadata_says_how_many_experts_and_how_big(tiny_qwen3moe, tiny_mixtral):
    _, q = open_model(tiny_qwen3moe)
    assert (q.arch, q.moe, q.n_experts, q.n_experts_used, q.d_ff_expert, q.qk_norm) == (
        "qwen3moe", True, 8, 2, 32, True)
    _, m = open_model(tiny_mixtral)  # a llama file's experts are feed_forward_length long
    assert (m.arch, m.moe, m.n_experts, m.n_experts_used, m.d_ff_expert) == ("llama", True, 4, 2, 64)
    gguf, _ = open_model(tiny_qwen3moe)
    with pytest.raises(ValueError, match=r"ffn_gate_exps.weight has shape \(8, 32, 64\), the metadata says"):
        check_tensors(gguf, dataclasses.replace(q, d_ff_expert=48))
    with pytest.raises(ValueError, match="experts used"):
        dataclasses.replace(q, n_experts_used=9)


def _hidden_states(be: CPUBackend, tokens: list[int], monkeypatch) -> list[np.ndarray]:
    """Each layer's FFN input (the FFN norm's output) over ``tokens``, as the backend computed it."""
    import weaved.backends.cpu as cpu

    seen: list[np.ndarray] = []

    def record(h, w, k):
        seen.append(h.copy())
        return moe_ffn(h, w, k)

    monkeypatch.setattr(cpu, "moe_ffn", record)
    monkeypatch.setattr(be, "fused_layers", False)  # the Python loop: the compiled one's bits (test_layer_loop)
    teacher_forced(be, tokens)
    return seen


def _natural(be, n: int) -> list[int]:
    return Tokenizer(be.gguf.path, be.gguf).encode(NATURAL_TEXT_PATH.read_text())[:n]


def test_routing_is_the_float64_top_k_but_at_near_ties(moe, monkeypatch):
    """Every token's experts are the k most probable of the exact softmax, most probable first, and
    their weights its probabilities renormalized - wherever two experts' float64 probabilities differ
    by more than a rounding's worth."""
    _, be = moe
    cfg = be.config
    k = cfg.n_experts_used
    hs = _hidden_states(be, _natural(be, 120), monkeypatch)
    assert len(hs) == cfg.n_layers
    swapped = 0
    for li, h in enumerate(hs):
        ex = be.layers[li].experts
        ids, wts = route(h, ex, k)
        z = h.astype(np.float64) @ ex.router.astype(np.float64).T
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        for t in range(h.shape[0]):
            if not np.array_equal(ids[t], want[t]):  # only where the order is a near-tie
                a, b = p[t, ids[t]], p[t, want[t]]
                assert np.abs(a - b).max() <= NEAR_TIE * p[t].max(), (li, t, ids[t], want[t], a, b)
                swapped += 1
            exact = p[t, ids[t]] / p[t, ids[t]].sum()
            np.testing.assert_allclose(wts[t], exact, rtol=2e-6, atol=1e-7)
    assert swapped <= 2  # near-ties are rare: a systematic difference would show everywhere


def test_the_experts_are_the_dense_products_token_by_token(moe):
    """A step's mixture, grouped by expert over every token, is bit for bit what the dense kernels give
    each token alone: its experts' gate|up, SwiGLU and down products, weighted and added in slot order."""
    _, be = moe
    cfg = be.config
    rng = np.random.default_rng(3)
    h = rng.standard_normal((23, cfg.d_model), dtype=np.float32)
    for L in be.layers:
        ex = L.experts
        out = moe_ffn(h, ex, cfg.n_experts_used)
        ids, wts = route(h, ex, cfg.n_experts_used)
        assert len(np.unique(ids)) > cfg.n_experts_used  # the step touches several experts, shared by tokens
        for t in range(h.shape[0]):
            row = h[t:t + 1]
            ys = [matmul.linear(ex.down[e], swiglu(matmul.linear(ex.gate_up[e], row))) * c
                  for e, c in zip(ids[t], wts[t], strict=True)]
            acc = ys[0]
            for y in ys[1:]:
                acc = acc + y
            assert np.array_equal(out[t], acc[0]), t


def _stats(be, path, tokens: list[int], n_ctx: int) -> dict:
    ours = teacher_forced(be, tokens)
    theirs = llama_logits(llama_model(path, n_ctx=n_ctx), tokens)
    ref = ReferenceModel(be.gguf, be.config).logits(tokens)
    return {"kl_ours_ref": mean_kl(ref, ours), "kl_llama_ref": mean_kl(ref, theirs),
            "top1_ours_ref": top1_agreement(ref, ours), "top1_llama_ref": top1_agreement(ref, theirs),
            "kl_llama_ours": mean_kl(theirs, ours), "top1_llama_ours": top1_agreement(theirs, ours)}


@pytest.mark.llama
@pytest.mark.slow
@pytest.mark.parametrize("n_tokens", [300, 3200], ids=["short", "long"])
def test_close_to_the_truth_and_to_llama_cpp(moe, n_tokens):
    """Teacher-forced over natural text: Weave is as close to the float64 reference as llama.cpp is, and
    close to llama.cpp.  A mixture's bars are wider than a dense model's: where a router's two best
    experts are nearly tied, any two float32 engines may pick differently (llama.cpp's own sgemm and
    sort among them), and a tiny model's every token hangs on a few experts."""
    path, be = moe
    if n_tokens > 300:
        from tests.model.real_models import LONG_TEXT_PATH

        tokens = Tokenizer(path, be.gguf).encode(LONG_TEXT_PATH.read_text())[:n_tokens]
    else:
        tokens = _natural(be, n_tokens)
    assert len(tokens) == n_tokens
    s = _stats(be, path, tokens, 4096)
    print(path.name, n_tokens, {k: round(v, 4) for k, v in s.items()})
    assert s["kl_ours_ref"] <= 1.25 * s["kl_llama_ref"] + 0.005, s
    assert s["top1_ours_ref"] >= s["top1_llama_ref"] - 0.03, s
    assert s["kl_llama_ours"] <= 0.05 and s["top1_llama_ours"] >= 0.92, s


def test_a_config_refuses_impossible_experts():
    base = dict(arch="qwen3moe", name="x", n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=0,
                vocab_size=10, context_length=64, rms_eps=1e-6, rope_style="neox")
    with pytest.raises(ValueError, match="expert feed-forward length"):
        ModelConfig(**base, n_experts=8, n_experts_used=2, d_ff_expert=0)
    assert ModelConfig(**base, n_experts=8, n_experts_used=2, d_ff_expert=32).moe
