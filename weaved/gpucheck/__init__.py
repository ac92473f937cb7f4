"""The GPU validation: one command, run on a bare GPU machine, that says whether the torch backend on
CUDA computes what the CPU backend computes and how fast.

``python -m weaved.gpucheck MODEL.gguf`` (or ``--shape llama-3.2-1b`` to write a random-weight file
of that shape first) loads the model into the CPU backend and the torch backend on ``cuda``, feeds
both the same token ids, and prints: per decode step, whether the logits are bit-equal (else their
KL and whether greedy agrees, or the two disagree only at a near-tie); prefill and single-stream
decode tokens/s; batched decode tokens/s at 16 and 64 sequences; promotion (host-to-device KV
migration) GB/s beside the raw copy bandwidth; device memory used.  Its exit code is 0 when the
logits agree (bit-equal, or KL within 0.0005 with greedy equal but at near-ties), 1 when they do not.

It needs only numpy, numba, torch (triton on CUDA) and gguf: no server, no llama.cpp, no tokenizer.
See docs/gpu.md for how to run it on a machine that has nothing else.
"""
