"""Builds the native tier engine, prefetchd._native (C++17, pybind11).

The extension needs only gcc, libc and libstdc++: kernel AIO is reached through
raw syscalls, so no libaio/liburing package is required at build or run time.
"""
import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ext = Pybind11Extension(
    "prefetchd._native",
    sorted(glob.glob("native/src/*.cpp")),
    include_dirs=["native/include"],
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-fvisibility=hidden"],
    extra_link_args=["-pthread"],
)

# The compute-fence kernel MindSpore loads as an AOT custom op (see its header).
fence_kernel = Pybind11Extension(
    "prefetchd._compute_fence",
    ["native/kernels/compute_fence.cc"],
    cxx_std=17,
    extra_compile_args=["-O2", "-Wall"],
)

setup(ext_modules=[ext, fence_kernel], cmdclass={"build_ext": build_ext})
