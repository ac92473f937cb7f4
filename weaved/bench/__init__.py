"""``weave bench``: Weave's CPU backend against llama.cpp on the same GGUF file and thread count.

Both sides run the same workload (``harness``) through a small ``Engine`` interface: the same token
ids, the same chunking, greedy argmax inside every timed decode loop.  Each side runs in its own
spawned process, one after the other, so llama.cpp's and numba's thread pools never coexist and
the resident memory reported for Weave is Weave's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Measurements, in report order.  Every value is tokens per second (median over repetitions).
KEYS: tuple[str, ...] = ("prefill_tps", "decode_tps", "decode_2k_tps", "decode_8k_tps", "batch16_tps",
                         "batch64_tps")
# Measured on the way to another measurement, with a ratio like KEYS but not selectable by itself:
# the 8,000-token context decode_8k_tps prefills first, in n_batch-token chunks (one sample per round,
# after the earlier measurements warmed both sides).  What an agent's long prompt costs, attention
# over the growing context included.
DERIVED_KEYS: tuple[str, ...] = ("prefill_8k_tps",)
# Informational figures (no ratio), all measured on Weave's side and some on llama.cpp's: load time, the
# file's size and the resident memory after loading and after the measurements, the bytes a decode
# token reads (weights), the rate single-stream decode streams them at and what this machine streams.
INFO_KEYS: tuple[str, ...] = ("load_s", "file_mb", "rss_mb", "rss_anon_mb", "rss_end_mb", "weights_mb",
                              "decode_gbs", "stream_gbs")

# The informational figures llama.cpp's side measures too (the same way; no ratio): load time and
# resident memory (all of it, and its own part: ``harness.anonymous_mb``), so each side's memory is read
# against the file and against the other's.
LLAMA_INFO_KEYS: tuple[str, ...] = ("load_s", "rss_mb", "rss_anon_mb", "rss_end_mb")

SIDES: tuple[str, ...] = ("weave", "llama_cpp")


@dataclass(frozen=True)
class BenchConfig:
    """What one ``weave bench`` run measures.  Sizes follow the team's llama.cpp baseline."""

    model: Path
    threads: int
    keys: tuple[str, ...] = KEYS
    rounds: int = 3  # alternating rounds: weave, llama.cpp, weave, ... each a fresh process
    reps: int = 1  # recorded repetitions per measurement and round (after one unrecorded warm-up)
    n_batch: int = 512  # most tokens per forward call in prefill (llama.cpp's n_batch = n_ubatch)
    n_prefill: int = 512  # prefill_tps: one prompt of this many tokens as a single batch
    n_short: int = 16  # decode_tps: prompt length before decoding
    n_long: int = 2000  # decode_2k_tps: context length before decoding
    n_longer: int = 8000  # decode_8k_tps: context length before decoding
    n_gen: int = 128  # tokens decoded per single-stream repetition
    n_batch_prompt: int = 16  # batchB_tps: prompt length of each sequence
    batch_steps: int = 32  # batchB_tps: decode steps per repetition (B tokens each)
    llama_flash_attn: tuple[str, ...] = ("auto", "off")  # llama.cpp's figures: the best of these settings

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", Path(self.model))
        unknown = [k for k in self.keys if k not in KEYS]
        if unknown:
            raise ValueError(f"unknown measurement(s) {', '.join(unknown)}; choose from {', '.join(KEYS)}")
        if not self.keys:
            raise ValueError("no measurement selected")
        object.__setattr__(self, "keys", tuple(k for k in KEYS if k in self.keys))  # report order
        for name in (
            "threads",
            "rounds",
            "reps",
            "n_batch",
            "n_prefill",
            "n_short",
            "n_long",
            "n_longer",
            "n_gen",
            "n_batch_prompt",
            "batch_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        bad = [m for m in self.llama_flash_attn if m not in ("auto", "off")]
        if bad or not self.llama_flash_attn:
            raise ValueError(f"llama_flash_attn takes 'auto' and/or 'off', got {self.llama_flash_attn}")
        if self.n_prefill > self.n_batch:
            raise ValueError(f"n_prefill ({self.n_prefill}) must fit one batch of {self.n_batch} tokens")

    @classmethod
    def quick(cls, model: Path, threads: int, keys: tuple[str, ...] = KEYS) -> BenchConfig:
        """Fewer repetitions and tokens; the same prompt and context sizes, so the same meaning."""
        return cls(model=model, threads=threads, keys=keys, rounds=1, reps=1, n_gen=32, batch_steps=8)

    @property
    def tokens_needed(self) -> int:
        """Filler tokens the workload reads (the longest prompt, or 64 distinct batch prompts)."""
        longest = self.n_longer if "decode_8k_tps" in self.keys else self.n_long
        return max(self.n_prefill, longest, self.n_short, 64 * self.n_batch_prompt) + 1


def batch_size(key: str) -> int | None:
    """16 for ``batch16_tps``, 64 for ``batch64_tps``, None for single-stream keys."""
    if key.startswith("batch") and key.endswith("_tps"):
        return int(key[len("batch") : -len("_tps")])
    return None
