"""The CUDA kernels' source, compiled for the host by a C++ compiler, against NumPy.

CUDA C without device intrinsics is also C++: with one block of one thread, each kernel's
grid-stride loop visits every item in turn. This checks what the kernels compute (bit
layout, tail padding, residual arithmetic, bucket offsets) on machines without a GPU;
tests/gpu runs the same kernels on a GPU.
"""
import ctypes
import os
import shutil
import subprocess

import numpy as np
import pytest

from hvd_trainer import compression

CUDA = os.path.join(os.path.dirname(compression.__file__), "cuda")
COMPILER = shutil.which("c++") or shutil.which("g++")
if COMPILER is None:
    pytest.skip("needs a C++ compiler (c++ or g++) to build the kernel source for the host "
                "(apt-get install g++)", allow_module_level=True)

# One block of one thread; no fused multiply-add, as in CUDA's IEEE float arithmetic here.
PRELUDE = """
struct HostDim { unsigned x; };
static const HostDim blockIdx = {0}, threadIdx = {0}, blockDim = {1}, gridDim = {1};
#define __global__
#define __device__ static
"""


def build(source: str, tmp_path, name: str) -> ctypes.CDLL:
    src, lib = tmp_path / f"{name}.cpp", tmp_path / f"{name}.so"
    src.write_text(PRELUDE + source)
    subprocess.run([COMPILER, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(lib),
                    str(src)], check=True, capture_output=True, text=True)
    return ctypes.CDLL(str(lib))


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


@pytest.fixture(scope="module")
def codecs(tmp_path_factory):
    with open(os.path.join(CUDA, "compression.cu")) as f:
        return build(f.read(), tmp_path_factory.mktemp("codecs"), "compression")


def gradients(size: int, steps: int = 3):
    rng = np.random.default_rng(size)
    for _ in range(steps):
        g = rng.standard_normal(size).astype(np.float32)
        g[:min(size, 6)] = [0.5, -0.5, 0.25, np.nan, 1, -1][:min(size, 6)]
        yield g


@pytest.mark.parametrize("size", [1, 5, 16, 17, 1000, 65537])
def test_two_bit_kernels_match_numpy(codecs, size):
    codec = compression.TwoBit(0.5)
    threshold = np.array([0.5], np.float32)
    host_res, kern_res = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for g in gradients(size):
        expected = codec.encode(g, host_res)
        payload = np.full(codec.wire_bytes(size), 0xAB, np.uint8)  # tail must come back zero
        codecs.encode_2bit(ptr(g), ptr(kern_res), ptr(payload), ctypes.c_longlong(size),
                           ctypes.c_longlong(payload.size), ptr(threshold))
        np.testing.assert_array_equal(payload, expected)
        np.testing.assert_array_equal(kern_res, host_res)
        want, got = np.ones(size, np.float32), np.ones(size, np.float32)
        codec.decode_add(expected, want)
        codecs.decode_2bit_add(ptr(payload), ptr(threshold), ptr(got), ctypes.c_longlong(size))
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threshold", [0.0, 0.5])
@pytest.mark.parametrize("size", [1, 7, 32, 33, 65537])
def test_one_bit_kernels_match_numpy(codecs, size, threshold):
    codec = compression.OneBit(threshold)
    host_res, kern_res = np.zeros(size, np.float32), np.zeros(size, np.float32)
    for g in gradients(size):
        expected = codec.encode(g, host_res)
        payload = np.full(codec.wire_bytes(size), 0xAB, np.uint8)
        codecs.encode_1bit(ptr(g), ptr(kern_res), ptr(payload), ctypes.c_longlong(size),
                           ctypes.c_longlong(payload.size), ctypes.c_float(threshold))
        np.testing.assert_array_equal(payload, expected)
        np.testing.assert_array_equal(kern_res, host_res)
        want, got = np.zeros(size, np.float32), np.zeros(size, np.float32)
        codec.decode_add(expected, want)
        codecs.decode_1bit_add(ptr(payload), ptr(got), ctypes.c_longlong(size))
        np.testing.assert_array_equal(got, want)


ITEMS = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "int64"])
def test_bucket_gather_and_scatter_match_numpy(tmp_path, dtype):
    width = np.dtype(dtype).itemsize
    with open(os.path.join(CUDA, "fusion.cu")) as f:
        source = f.read().replace("gather_ITEM", "gather").replace("scatter_ITEM", "scatter")
    lib = build(source.replace("ITEM", ITEMS[width]), tmp_path, "fusion")
    rng = np.random.default_rng(width)
    tensors = [(rng.standard_normal(n) * 100).astype(dtype) for n in (3, 0, 0, 1, 500, 7)]
    ptrs = np.array([t.ctypes.data for t in tensors], np.uint64)
    starts = np.concatenate([[0], np.cumsum([t.size for t in tensors])]).astype(np.int64)
    flat = np.empty(int(starts[-1]), dtype)
    lib.gather(ptr(ptrs), ptr(starts), ctypes.c_int(len(tensors)), ptr(flat),
               ctypes.c_longlong(flat.size))
    np.testing.assert_array_equal(flat, np.concatenate(tensors))
    outs = [np.zeros_like(t) for t in tensors]
    ptrs = np.array([o.ctypes.data for o in outs], np.uint64)
    lib.scatter(ptr(ptrs), ptr(starts), ctypes.c_int(len(outs)), ptr(flat),
                ctypes.c_longlong(flat.size))
    for t, o in zip(tensors, outs):
        np.testing.assert_array_equal(o, t)
