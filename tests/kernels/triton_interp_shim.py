"""Two corrections to Triton 3.6's interpreter, so the kernels' tests can hold it to bits, and two
changes of speed.

* Runtime loop bounds under numpy 2: the interpreter holds a scalar as a one-element array and gives
  Python its ``int`` through ``int(array)``, which numpy 2 refuses for arrays that are not
  0-dimensional, so ``range(n)`` over a runtime ``n`` (a kernel argument, a value loaded from memory)
  fails there, though it compiles and runs on a GPU.  ``allow_runtime_loop_bounds`` makes it read the
  one element.
* ``tl.fma``: the interpreter computes a multiply and an add, two roundings, where a GPU rounds once.
  ``exact_fma`` makes it form the product in float64 (exact for float32 operands) and round the sum
  once - the torch path's own emulation of an fma, so a kernel's results can be compared with it bit
  for bit.  (Both differ from a true fma only when the float64 sum lands exactly on a float32 rounding
  midpoint, about 2**-29 of the time.)

* Wide products' tiles: the interpreter runs each program of a grid in Python, so a model's output
  head (49,152 or 262,144 outputs) in the default 32-output programs took minutes a forward.
  ``wide_product_tiles`` gives a product of more than ``WIDE`` outputs whose caller left the tile to the
  kernel ``WIDE_TILE`` outputs a program: a tile never changes a bit (the tile-sweep case checks it),
  and such a product takes a twentieth of the time.

* Device-function calls: the interpreter patches ``triton.language`` again at every call of one jit
  function from another, though the grid being run patched those same module attributes already; the
  paged attention's ``_fold_v`` (a recursion of 127 calls a block of keys, so that the sum keeps the
  key order) spent three quarters of a forward there.  ``device_calls_in_the_grids_patch`` skips the
  repeat while a grid runs: the same patched functions, so the same bits.

They touch only the interpreter (TRITON_INTERPRET=1), which the kernels' tests use.
"""

from __future__ import annotations

import numpy as np


def allow_runtime_loop_bounds() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_weave_index_patch", False):
        return
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._weave_index_patch = True


def exact_fma() -> None:
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        if z.data.dtype == np.float32:
            out = (x.data.astype(np.float64) * y.data.astype(np.float64) + z.data.astype(np.float64))
            return interpreter.TensorHandle(out.astype(np.float32), z.dtype.scalar)
        return interpreter.TensorHandle(x.data * y.data + z.data, z.dtype.scalar)

    interpreter.InterpreterBuilder.create_fma = create_fma


WIDE, WIDE_TILE = 4096, 2048


def wide_product_tiles() -> None:
    from weaved.kernels import triton_q4

    if getattr(triton_q4, "_weave_wide_tiles", False):
        return
    plain = triton_q4.linear_q

    def linear_q(w, a, block_n=None, **kw):
        return plain(w, a, block_n=WIDE_TILE if block_n is None and w.n_out > WIDE else block_n, **kw)

    triton_q4.linear_q = linear_q
    triton_q4._weave_wide_tiles = True


def device_calls_in_the_grids_patch() -> None:
    import inspect

    from triton.runtime import interpreter

    if getattr(interpreter, "_weave_device_calls", False):
        return
    grid_call = interpreter.GridExecutor.__call__
    device_call = interpreter.InterpretedFunction.__call__
    lang = (interpreter.tl, interpreter.tl.core)
    langs_of: dict[object, frozenset[int]] = {}  # a function's language modules, as the interpreter finds them
    patched: list[set[int]] = []  # per grid being run: the language modules patched in it so far

    def langs(fn) -> frozenset[int]:
        if fn not in langs_of:
            langs_of[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in lang)
        return langs_of[fn]

    def run_grid(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))  # the grid's own patch covers these
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        need = langs(self.fn)
        if not patched or not need <= patched[-1]:
            if patched:
                patched[-1] |= need  # (the interpreter never takes a device call's patch back either)
            return device_call(self, *args, **kwargs)
        try:  # the rest of the interpreter's device call, after its patch of triton.language
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = run_grid
    interpreter.InterpretedFunction.__call__ = call
    interpreter._weave_device_calls = True


def patch_interpreter() -> None:
    """The corrections, the wide products' tiles and the device calls' patch."""
    allow_runtime_loop_bounds()
    exact_fma()
    wide_product_tiles()
    device_calls_in_the_grids_patch()


def require_interpreter() -> None:
    """For a case module: skip it unless this process runs Triton's interpreter (``test_triton_interp``
    starts one with TRITON_INTERPRET=1), and correct the interpreter when it does."""
    import os

    import pytest

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run by test_triton_interp with TRITON_INTERPRET=1", allow_module_level=True)
    pytest.importorskip("triton")
    patch_interpreter()
