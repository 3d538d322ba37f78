"""Kernels of the stand-in: the project's CUDA C sources, compiled for the host by g++.

A small prelude makes CUDA C plain C++ (``__global__`` and ``__device__`` vanish;
``blockIdx``, ``threadIdx``, ``blockDim`` and ``gridDim`` are per-thread variables), and a
generated launcher per kernel runs every thread of every block, one after another, taking
its arguments as ``cuLaunchKernel`` does (an array of pointers to the values). Threads that
run one after another cannot share memory or wait for each other, so a source that uses
shared memory, barriers, warp shuffles or atomics is refused. Each argument is checked
against the C type of its parameter, where a GPU would read garbage: a pointer takes an
array whose items are whole pointees (complex128 as two 8-byte words is fine), a scalar
takes exactly the parameter's type (Python ints are ``long long`` and floats ``double``, as
CuPy passes them). Builds are cached on disk by their source.
"""
import ctypes
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import threading
from typing import Any, Dict, List, NamedTuple, Sequence, Tuple

import numpy as np

from ._core import device_work, ndarray

__all__ = ["CompileException", "ElementwiseKernel", "RawKernel", "RawModule"]

PRELUDE = """
struct __hvd_dim3 { unsigned int x, y, z; };
static thread_local __hvd_dim3 blockIdx, threadIdx, blockDim, gridDim;
#define __global__
#define __device__
#define __forceinline__ inline
"""
_REFUSED = re.compile(r"__shared__|__syncthreads|__syncwarp|__shfl\w*|\batomic\w+|__threadfence")
_KERNEL = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(\w+)\s*\(([^)]*)\)')
_FLAGS = ["-O2", "-std=c++17", "-ffp-contract=off", "-fPIC", "-shared", "-x", "c++"]
# C scalar types -> NumPy dtype (LP64, as CUDA's device code on Linux).
C_TYPES = {"bool": "bool", "char": "int8", "signed char": "int8", "unsigned char": "uint8",
           "short": "int16", "unsigned short": "uint16", "int": "int32",
           "unsigned int": "uint32", "unsigned": "uint32", "long": "int64",
           "long long": "int64", "unsigned long": "uint64", "unsigned long long": "uint64",
           "size_t": "uint64", "float": "float32", "double": "float64", "_Float16": "float16"}
_PYTHON = {bool: "bool", int: "int64", float: "float64"}  # how CuPy passes Python scalars


class CompileException(RuntimeError):
    """A source g++ could not build, or one the stand-in cannot run."""


class Param(NamedTuple):
    """A kernel parameter: its C type as written, its name, and what an argument must be."""

    ctype: str
    name: str
    pointer: bool
    dtype: Any  # the scalar's dtype, or the pointee's (None for void)


def _param(text: str) -> Param:
    text = " ".join(text.replace("*", " * ").split())
    ctype, name = text.rsplit(" ", 1)
    base = " ".join(w for w in ctype.split() if w not in ("const", "volatile", "*",
                                                          "__restrict__"))
    pointer = "*" in ctype
    if base not in C_TYPES and not (pointer and base == "void"):
        raise CompileException(f"the stand-in does not know the C type {base!r} of {name}")
    return Param(ctype, name, pointer, np.dtype(C_TYPES[base]) if base in C_TYPES else None)


def _launcher(name: str, params: Sequence[Param]) -> str:
    call = ", ".join(f"*({p.ctype}*)args[{i}]" for i, p in enumerate(params))
    return f"""
extern "C" void __hvd_launch_{name}(unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                   unsigned by, unsigned bz, void** args) {{
    gridDim = {{gx, gy, gz}}; blockDim = {{bx, by, bz}};
    for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y)
    for (unsigned x = 0; x < gx; ++x) {{
        blockIdx = {{x, y, z}};
        for (unsigned tz = 0; tz < bz; ++tz) for (unsigned ty = 0; ty < by; ++ty)
        for (unsigned tx = 0; tx < bx; ++tx) {{
            threadIdx = {{tx, ty, tz}};
            {name}({call});
        }}
    }}
}}
"""


def _cache_dir() -> str:
    """A folder of this user's alone for built kernels (made owner-only; refused if it is
    a link, someone else's, or open to others)."""
    path = os.environ.get("HVD_STANDIN_CACHE") or os.path.join(
        tempfile.gettempdir(), f"hvd-cupy-standin-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise CompileException(f"{path} must be a folder of this user's alone (mode 700); "
                               "remove it or set HVD_STANDIN_CACHE to another")
    return path


_built: Dict[str, ctypes.CDLL] = {}
_building = threading.Lock()


def _build(source: str) -> ctypes.CDLL:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise CompileException("the stand-in builds kernels with g++ (apt-get install g++)")
    key = hashlib.sha256("\0".join([compiler, *_FLAGS, source]).encode()).hexdigest()[:32]
    with _building:
        if key in _built:
            return _built[key]
        folder = _cache_dir()
        lib = os.path.join(folder, f"{key}.so")
        if not os.path.exists(lib):
            fd, src = tempfile.mkstemp(".cpp", dir=folder)
            with os.fdopen(fd, "w") as f:
                f.write(source)
            out = src[:-len(".cpp")] + ".so"
            done = subprocess.run([compiler, *_FLAGS, src, "-o", out], capture_output=True,
                                  text=True)
            os.unlink(src)
            if done.returncode:
                raise CompileException(f"g++ could not build the kernel source:\n{done.stderr}")
            os.replace(out, lib)
        _built[key] = ctypes.CDLL(lib)
        return _built[key]


class RawModule:
    """Kernels from CUDA C source (``code``), built for the host."""

    def __init__(self, code: str, options: Sequence[str] = (), **_: Any):
        found = sorted(set(_REFUSED.findall(code)))
        if found:
            raise CompileException(
                f"the stand-in runs a kernel's threads one after another, so it cannot run "
                f"kernels whose threads share memory or synchronise ({', '.join(found)}); "
                "test such kernels on a GPU")
        self.params = {name: [_param(p) for p in args.split(",") if p.strip()]
                       for name, args in _KERNEL.findall(code)}
        launchers = "".join(_launcher(n, ps) for n, ps in self.params.items())
        self._lib = _build(PRELUDE + code + launchers)

    def get_function(self, name: str) -> "RawKernel":
        if name not in self.params:
            raise CompileException(f"no extern \"C\" __global__ kernel named {name!r} in the "
                                   f"module (it has {sorted(self.params)})")
        return RawKernel(self, name)


class RawKernel:
    """One kernel of a :class:`RawModule`; call it as ``kernel(grid, block, args)``."""

    def __init__(self, module: RawModule, name: str):
        self.name, self.params = name, module.params[name]
        self._launch = getattr(module._lib, f"__hvd_launch_{name}")
        self._launch.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_void_p]
        self._launch.restype = None

    def __call__(self, grid: Any, block: Any, args: Sequence[Any], *, shared_mem: int = 0,
                 stream: Any = None) -> None:
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        if np.prod(block) > 1024 or shared_mem:
            raise ValueError(f"{self.name}: at most 1024 threads a block and no dynamic "
                             f"shared memory, got {block} and {shared_mem} bytes")
        if len(args) != len(self.params):
            raise TypeError(f"{self.name} takes {len(self.params)} arguments "
                            f"({', '.join(p.name for p in self.params)}), got {len(args)}")
        values = [_argument(self.name, p, a) for p, a in zip(self.params, args)]
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        arrays = [a for a in args if isinstance(a, ndarray)]
        device_work(lambda: self._launch(*grid, *block, pointers) if values else None,
                    *arrays, stream=stream)  # values: what the pointers point to, kept


def _dims(value: Any, what: str) -> Tuple[int, int, int]:
    dims = tuple(int(v) for v in (value if isinstance(value, tuple) else (value,)))
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(f"{what} must be 1 to 3 positive sizes, got {value!r}")
    return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


def _argument(kernel: str, param: Param, arg: Any) -> ctypes._SimpleCData:
    """``arg`` as the value a GPU would read for ``param``; TypeError where it would read
    something else."""
    where = f"{kernel}: argument {param.name} ({param.ctype})"
    if param.pointer:
        if not isinstance(arg, ndarray):
            raise TypeError(f"{where} takes a cupy array, got {type(arg).__name__}")
        if param.dtype is not None and arg.itemsize % param.dtype.itemsize:
            raise TypeError(f"{where} points to {param.dtype.itemsize}-byte items, got a "
                            f"{arg.dtype} array (its items are not whole such items)")
        return ctypes.c_void_p(arg.data.ptr)
    if isinstance(arg, ndarray) or not np.isscalar(arg):
        raise TypeError(f"{where} takes a scalar, got {type(arg).__name__}")
    given = np.dtype(_PYTHON[type(arg)]) if type(arg) in _PYTHON else np.asarray(arg).dtype
    if given != param.dtype:
        raise TypeError(f"{where} takes {param.dtype}, got {given} (a GPU would read "
                        f"{param.dtype.itemsize} bytes of it as {param.ctype}); pass "
                        f"numpy.{param.dtype}(...)")
    value = np.asarray(arg, param.dtype)
    if param.dtype == np.float16:  # ctypes has no half: its 16 bits
        return ctypes.c_uint16(int(value.view(np.uint16)))
    return np.ctypeslib.as_ctypes_type(param.dtype)(value.item())


_DTYPE_NAMES = set(C_TYPES.values())


class _Spec(NamedTuple):
    dtype: Any  # a fixed NumPy dtype, or None for a type placeholder
    placeholder: str
    name: str
    out: bool


def _specs(params: str, out: bool) -> List[_Spec]:
    specs = []
    for text in filter(None, (p.strip() for p in params.split(","))):
        words = text.split()
        if len(words) != 2:
            raise NotImplementedError(f"the stand-in takes 'type name' parameters, got {text!r}")
        if words[0] in _DTYPE_NAMES:
            specs.append(_Spec(np.dtype(words[0]), "", words[1], out))
        else:  # a type placeholder, such as T
            specs.append(_Spec(None, words[0], words[1], out))
    return specs


_ITEM_TYPES = {np.dtype(v): k for k, v in C_TYPES.items()
               if k in ("bool", "signed char", "unsigned char", "short", "unsigned short",
                        "int", "unsigned int", "long long", "unsigned long long", "float",
                        "double", "_Float16")}


class ElementwiseKernel:
    """CuPy's ElementwiseKernel for C-contiguous arrays of one shape: ``operation`` runs per
    element, with input arrays as values and outputs as references."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel",
                 **_: Any):
        self.specs = _specs(in_params, False) + _specs(out_params, True)
        self.operation, self.name = operation, name
        self._kernels: Dict[Tuple, RawKernel] = {}

    def __call__(self, *args: Any) -> None:
        if len(args) != len(self.specs):
            raise TypeError(f"{self.name}: the stand-in takes every parameter, inputs and "
                            f"outputs ({len(self.specs)}), got {len(args)}")
        types: Dict[str, np.dtype] = {}
        shapes = set()
        for spec, arg in zip(self.specs, args):
            if isinstance(arg, ndarray):
                shapes.add(arg.shape)
                if not arg.flags.c_contiguous:
                    raise NotImplementedError(f"{self.name}: the stand-in takes C-contiguous "
                                              f"arrays, {spec.name} has strides {arg.strides}")
                if spec.placeholder and types.setdefault(spec.placeholder, arg.dtype) != arg.dtype:
                    raise TypeError(f"{self.name}: {spec.placeholder} is both "
                                    f"{types[spec.placeholder]} and {arg.dtype}")
        if len(shapes) != 1:
            raise NotImplementedError(f"{self.name}: the stand-in takes arrays of one shape, "
                                      f"got {sorted(shapes)}")
        arrays = tuple(isinstance(a, ndarray) for a in args)
        key = (tuple(sorted((k, str(v)) for k, v in types.items())), arrays)
        if key not in self._kernels:
            self._kernels[key] = self._kernel(types, arrays)
        size = np.int64(next(a.size for a in args if isinstance(a, ndarray)))
        values = [a if isinstance(a, ndarray) else self._dtype(spec, types).type(a)
                  for spec, a in zip(self.specs, args)]
        if size:
            self._kernels[key]((int(min(-(-size // 128), 1024)),), (128,), (*values, size))

    @staticmethod
    def _dtype(spec: _Spec, types: Dict[str, np.dtype]) -> np.dtype:
        return spec.dtype if spec.dtype is not None else types[spec.placeholder]

    def _kernel(self, types: Dict[str, np.dtype], arrays: Sequence[bool]) -> RawKernel:
        """The kernel for these placeholder types, arrays where ``arrays`` says so."""
        params, loads = [], []
        for spec, array in zip(self.specs, arrays):
            ctype = _ITEM_TYPES[self._dtype(spec, types)]
            if not array:
                params.append(f"const {ctype} {spec.name}")
                continue
            params.append(f"{ctype}* __{spec.name}")
            loads.append(f"{ctype}& {spec.name} = __{spec.name}[i];" if spec.out
                         else f"const {ctype} {spec.name} = __{spec.name}[i];")
        typedefs = "".join(f"typedef {_ITEM_TYPES[t]} {k};\n" for k, t in types.items())
        source = (f'{typedefs}extern "C" __global__ void {self.name}({", ".join(params)}, '
                  f"long long __n) {{\n  for (long long i = blockIdx.x * (long long)blockDim.x"
                  f" + threadIdx.x; i < __n; i += (long long)blockDim.x * gridDim.x) {{\n    "
                  f"{' '.join(loads)}\n    {self.operation};\n  }}\n}}\n")
        return RawModule(code=source).get_function(self.name)
