"""Weave's CPU kernels (numba), and the GPU kernels' torch/Triton code.

This package imports nothing from ``weaved``: it is plain arrays in, plain arrays out.  Every
kernel has a numpy reference beside it and a test against that reference.

Modules
-------
``ggml``        GGML type ids and block sizes this package understands.
``quants``      Q4_0 / Q8_0 quantize and dequantize (bit-exact with ``gguf.quants``), and the
                Q8_0 quantization of activations (llama.cpp's ``quantize_row_q8_0``).
``matmul``      ``PackedWeight`` (a weight matrix repacked once at load) and ``linear``:
                y = x @ W.T for Q4_0 / Q8_0 weights with Q8_0 activations and integer block dot
                products, or F16 / F32 weights in float.  Batch invariant: row t of the result
                is bit-identical whatever the other rows of x are and however many there are.
``attention``   ragged causal attention over per-sequence KV arrays (prefill and decode are the
                same kernel: one query row at a time), returning the output and the
                log-sum-exp of every head; the merge of partial results; KV row stores.
``elementwise`` RMSNorm, RoPE (norm and neox styles), SwiGLU, softmax.
``residual``    the logits product: one-level Q8_0 activations for every logit, the second level
                (the first one's rounding error) for each row's candidates (``refine_rule``,
                ``_refine``): near-float accuracy where it matters.
``layer_loop``  every layer of a step in one compiled call (the same kernels, order and bits).
``threads``     the thread budget shared by every parallel kernel.

The torch backend's kernels (torch tensors on any device; they do not touch numba):
``torch_q4``        Q8_0 activation quantization, Q4_0 / Q8_0 products with integer block dot
                    products, the refined logits product and embedding rows - the same operations
                    in the same order as the CPU kernels, so the bits match on torch's CPU device.
``torch_rowwise``   RMSNorm, RoPE and SwiGLU in the CPU kernels' operation order.
``torch_attention`` per-row causal attention with the CPU kernel's chunking and summation order.
``triton_q4``       the Q4_0 x Q8_0 product as a Triton kernel (CUDA; tested in the interpreter).
``triton_rowwise``  RMSNorm, RoPE, SwiGLU, GeGLU and activation quantization as Triton kernels, the
                    torch_rowwise / torch_q4 recipes op for op (CUDA; tested in the interpreter).
``triton_attention`` every row of a step attending over the paged device KV in one launch, with
                    torch_attention's (the CPU kernel's) chunks, blocks and summation order.
``triton_moe``      a mixture of experts' products grouped by expert: every expert's rows of a step in
                    one launch per product, each element with its expert's ``linear_q`` bits.
``triton_fused``    operations that follow one another in every layer in one launch each (residual
                    add + RMSNorm + quantization; GLU + quantization; q/k norms + RoPE + the float16
                    K/V stores), with the bits of the kernels they replace.
``triton_router``   a mixture of experts' router: every token's experts and weights in one launch.
"""

from . import _env  # noqa: F401  (sets NUMBA_CACHE_DIR before numba is first imported)
