"""A cheaper launch of an already compiled Triton kernel.

``kernel[grid](*args, **kwargs)`` costs about 30 µs of host time a launch on the H200's host
(Triton 3.6: binding and specialising every argument, the cache key of the options, the
global-value check), more than the LoRA kernels themselves take on the device at decode.
:func:`launch` keeps, per kernel and per *specialisation* of its arguments, the
``CompiledKernel`` that ``kernel[grid]`` returned the first time, and launches it again
through its launcher (``CompiledKernel.run``, the call Triton's own ``JITFunction.run``
makes), skipping the rest.

The specialisation key follows Triton's rules conservatively: a tensor argument by dtype
and whether its address is 16-byte aligned; an integer Triton specialises on by its exact
value; one it does not (``do_not_specialize``) by whether it fits in 32 bits; every
constexpr and launch option by value; the device. Two launches with equal keys get the same
binary from Triton too, so the cached one is the one Triton would run.

The first launch of every key, and every launch when Triton's launch hooks are set (a
profiler such as proton), when the kernel is interpreted (``TRITON_INTERPRET=1``) or when
the Triton version is not one whose launcher this was written against (3.3 and later),
goes through ``kernel[grid]`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # pragma: no cover - exercised by the environment
    import triton

    _VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])
except (ImportError, ValueError):  # pragma: no cover
    triton = None
    _VERSION = (0, 0)

# (kernel id, key) -> CompiledKernel
_COMPILED: dict[tuple, Any] = {}
# kernel id -> (positions of do_not_specialize arguments, names of the constexprs in order)
_SIGNATURES: dict[int, tuple[frozenset[int], tuple[str, ...]]] = {}
_INT32 = (-(2**31), 2**31)


def _unset(hook: Any) -> bool:
    """A launch hook that does nothing: None, or (Triton 3.5+) a chain of no calls."""
    return hook is None or getattr(hook, "calls", None) == []


def enabled() -> bool:
    """Whether launches may skip ``kernel[grid]`` (Triton 3.3+, no launch hooks set)."""
    if triton is None or _VERSION < (3, 3):
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None:
        return False
    return _unset(runtime.launch_enter_hook) and _unset(runtime.launch_exit_hook)


def signature(kernel: Any) -> tuple[frozenset[int], tuple[str, ...]] | None:
    """``(positions of the do_not_specialize arguments, names of the constexprs in order)``
    of a ``triton.jit`` kernel whose constexprs all come last; None for any other (or
    without Triton): launch those through ``kernel[grid]``."""
    if triton is None or not isinstance(kernel, triton.runtime.JITFunction):
        return None
    return _signature(kernel)


def launchable(compiled: Any) -> bool:
    """Whether a ``CompiledKernel`` can be launched again through its own launcher."""
    return all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata"))


def _signature(kernel: Any) -> tuple[frozenset[int], tuple[str, ...]] | None:
    sig = _SIGNATURES.get(id(kernel))
    if sig is None:
        names = list(getattr(kernel, "arg_names", ()))
        params = getattr(kernel, "params", None)
        if not names or params is None:
            return None
        no_spec = frozenset(
            i for i, p in enumerate(params) if p.do_not_specialize and not p.is_constexpr
        )
        constexprs = tuple(n for n, p in zip(names, params, strict=True) if p.is_constexpr)
        if names[len(names) - len(constexprs) :] != list(constexprs):
            return None  # a constexpr before a runtime argument: launch through Triton
        sig = _SIGNATURES[id(kernel)] = (no_spec, constexprs)
    return sig


def _key(args: tuple, no_spec: frozenset[int]) -> tuple:
    key: list[Any] = []
    for i, v in enumerate(args):
        if isinstance(v, torch.Tensor):
            key.append((v.dtype, v.data_ptr() % 16 == 0))
        elif isinstance(v, bool) or v is None or isinstance(v, float):
            key.append(v)
        elif i in no_spec:
            key.append(_INT32[0] <= v < _INT32[1])
        else:
            key.append(v)
    return tuple(key)


def launch(
    kernel: Any,
    grid: tuple[int, ...],
    args: tuple,
    constexprs: dict[str, Any],
    *,
    num_warps: int,
    num_stages: int,
    device: torch.device,
) -> None:
    """``kernel[grid](*args, **constexprs, num_warps=..., num_stages=...)``, through the
    cached compiled kernel when one matches (module docstring).

    Args:
        kernel: a ``triton.jit`` function whose non-constexpr parameters all come first.
        grid: up to three program counts.
        args: the non-constexpr arguments, in the kernel's order.
        constexprs: every constexpr argument, by name.
        device: the CUDA device the tensors are on (the current device at the launch).
    """
    fast = device.type == "cuda" and isinstance(kernel, triton.runtime.JITFunction) and enabled()
    sig = _signature(kernel) if fast else None
    if sig is None:
        kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        return
    no_spec, names = sig
    values = tuple(constexprs[n] for n in names)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (id(kernel), index, num_warps, num_stages, values, _key(args, no_spec))
    compiled = _COMPILED.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)
        if launchable(compiled):
            _COMPILED[key] = compiled
        return
    relaunch(compiled, grid, index, args, values)


def relaunch(compiled: Any, grid: tuple[int, ...], index: int, args: tuple, values: tuple) -> None:
    """Launch ``compiled`` (a ``CompiledKernel`` that :func:`launchable` accepts) again on the
    current stream of CUDA device ``index``, through its own launcher: ``args`` the
    non-constexpr arguments, ``values`` the constexprs in the kernel's order. The caller
    vouches that Triton would pick this binary for these arguments."""
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    stream = torch._C._cuda_getCurrentRawStream(index)
    compiled.run(
        grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None,
        *args, *values,
    )  # fmt: skip


def cached() -> int:
    """Compiled kernels held for the fast path (for tests)."""
    return len(_COMPILED)
