"""How a GPU pool's device memory is split: weights, a step's activations, and the paged KV pool.

The budget is the profile's ``device_memory`` for the device (or, by default, what the device has
free when the daemon starts).  Weights stay in their GGUF encoding on the device, so they take the
bytes of the file's tensors.  A step's workspace is bounded by the pools' token budget and batch:
its activations (the widest layer's inputs and outputs for every token of the step), the logits rows
it returns, and the keys one sequence's attention gathers from its blocks.  What is left is the KV
pool, allocated once; a budget that leaves less than one session context of KV (the daemon's
context limit) is refused at start, with the numbers, instead of failing on the first long session.
"""

from __future__ import annotations

from dataclasses import dataclass

from weaved.errors import WeaveError
from weaved.model.config import ModelConfig
from weaved.sizes import human_size

SLACK = 0.05  # of the budget, for the allocator's fragmentation and the framework's own buffers


class DeviceMemoryError(WeaveError):
    """A device budget that cannot hold the model, a step and one context of KV."""


@dataclass(frozen=True)
class DevicePlan:
    budget: int  # bytes the backend may use on its device
    weights: int
    workspace: int
    slack: int

    @property
    def kv(self) -> int:
        return self.budget - self.weights - self.workspace - self.slack

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget, "weights_bytes": self.weights, "workspace_bytes": self.workspace,
                "slack_bytes": self.slack, "kv_bytes": self.kv}


def workspace_bytes(cfg: ModelConfig, step_tokens: int, logits_rows: int, context: int) -> int:
    """An upper bound of one step's transient device memory (float32 activations unless said), for
    sequences of up to ``context`` positions."""
    from weaved.kernels.torch_attention import CHUNK  # (torch is loaded only where a torch pool is)

    T = step_tokens
    widest = max(cfg.d_model, cfg.q_dim + 2 * cfg.kv_dim, 2 * cfg.d_ff)
    acts = T * 4 * (3 * cfg.d_model + 2 * widest)  # residual, normed input, a product's output and its input
    quant = T * (widest + widest // 32 * 8)  # the Q8_0 activations (int8 values, a scale and a sum per block)
    new_kv = cfg.n_layers * T * cfg.kv_dim * 2 * 2  # the step's K/V rows, float16
    gathered = context * cfg.kv_dim * 2 * 2  # one sequence's keys and values at a full context
    # attention's partial results: per row, head and chunk of CHUNK keys an unnormalised output and its
    # running max and sum (the Triton kernel's [T, H, n_chunks, D + 2]; the torch path holds a row
    # group's share of the same), never a row's scores over the whole context
    partials = T * cfg.n_heads * -(-context // CHUNK) * (cfg.head_dim + 2) * 4
    logits = logits_rows * cfg.vocab_size * 4 * 2  # the rows and their refinement
    return acts + quant + new_kv + gathered + partials + logits


def plan(cfg: ModelConfig, *, budget: int, weights: int, step_tokens: int, logits_rows: int, context: int,
         device: str) -> DevicePlan:
    """Split ``budget``; DeviceMemoryError when the KV pool would hold less than one ``context``."""
    p = DevicePlan(budget, weights, workspace_bytes(cfg, step_tokens, logits_rows, context), int(budget * SLACK))
    need = context * cfg.kv_bytes_per_token
    if p.kv < need:
        raise DeviceMemoryError(
            f"device {device} has a budget of {human_size(budget)}, but the model needs {human_size(weights)} "
            f"of weights + {human_size(p.workspace)} for a step (up to {step_tokens} tokens) + "
            f"{human_size(p.slack)} of slack + {human_size(need)} of KV for one {context}-token context; "
            f"raise the pool's device_memory, lower its token_budget, or serve a smaller model there")
    return p
