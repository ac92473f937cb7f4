"""Step-time models for a simulated host and model shape (``weaved.calibration.cost.StepCost``).

- A CPU pool: this host's calibration (measured on the model it was measured with) scaled to the
  shape - a step's fixed part and its per-token part by the weights a step reads and multiplies, its
  per-(token, key) part by the attention work per key - and to the simulated CPU (threads x a
  thread's relative speed), its decode step never faster than reading the weights at the CPU's
  memory bandwidth.
- A GPU pool: a roofline.  A step reads every weight once (Q4_0: 18 bytes per 32 weights) and pays a
  launch overhead per layer; each token costs its matrix products at the device's matrix throughput;
  a decode token reads its sequence's K/V rows at the memory bandwidth (or does its attention's
  arithmetic, if slower), a prefill token does its attention's arithmetic.
"""

from __future__ import annotations

from weaved.calibration.cost import Linear, StepCost
from weaved.model.config import ModelConfig
from weaved.sim.hardware import CPUSpec, GPUSpec

Q4_0_BYTES_PER_WEIGHT = 18 / 32


def matrix_weights(cfg: ModelConfig) -> int:
    """Weights a step multiplies by: every layer's matrices and the output matrix."""
    d, q, kv = cfg.d_model, cfg.q_dim, cfg.kv_dim
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * cfg.d_ff
    return cfg.n_layers * per_layer + cfg.vocab_size * d


def attention_work(cfg: ModelConfig) -> int:
    """Multiply-adds of one query over one key, every layer and head (q.k and p.v)."""
    return cfg.n_layers * cfg.n_heads * cfg.head_dim * 2


def kv_bytes(cfg: ModelConfig) -> int:
    return cfg.kv_bytes_per_token


def scaled_cpu(calibrated: StepCost, measured_on: ModelConfig, measured_threads: int, cfg: ModelConfig,
               cpu: CPUSpec | None) -> StepCost:
    """This host's calibrated step model moved to model ``cfg`` on ``cpu`` (None: this host as is)."""
    rw = matrix_weights(cfg) / matrix_weights(measured_on)
    ra = attention_work(cfg) / attention_work(measured_on)
    speed = 1.0 if cpu is None else cpu.threads * cpu.speed / max(1, measured_threads)
    floor = 0.0 if cpu is None else matrix_weights(cfg) * Q4_0_BYTES_PER_WEIGHT / cpu.mem_bw

    def move(part: Linear, decode: bool) -> Linear:
        base = part.base * rw / speed
        return Linear(max(base, floor) if decode else base, part.per_token * rw / speed,
                      part.per_token_context * ra / speed)

    return StepCost(move(calibrated.prefill, False), move(calibrated.decode, True))


def gpu_roofline(cfg: ModelConfig, gpu: GPUSpec) -> StepCost:
    weights = matrix_weights(cfg)
    base = gpu.launch_s * cfg.n_layers + weights * Q4_0_BYTES_PER_WEIGHT / gpu.mem_bw
    per_token = 2 * weights / gpu.matmul_flops
    attend = 2 * attention_work(cfg) / gpu.matmul_flops
    return StepCost(Linear(base, per_token, attend),
                    Linear(base, per_token, max(attend, kv_bytes(cfg) / gpu.mem_bw)))


def describe(cost: StepCost) -> dict:
    """A cost model's numbers as printed beside a simulated result."""
    return {"prefill": {"base_s": cost.prefill.base, "per_token_s": cost.prefill.per_token,
                        "per_token_key_s": cost.prefill.per_token_context},
            "decode": {"base_s": cost.decode.base, "per_token_s": cost.decode.per_token,
                       "per_token_key_s": cost.decode.per_token_context}}
