"""Build the `ngram_native._core` C++ extension with pybind11.

Portable flags only (-O3, C++17): no -march=native, so a wheel built here runs on any
x86-64 or arm64 machine. Set NGRAM_NATIVE_WERROR=1 to turn warnings into errors (CI).
"""

import glob
import os

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

# Compile the sources in parallel (NPY_NUM_BUILD_JOBS, default: every core): a GPU machine
# building the extension for the acceptance run has 16 cores and minutes.
ParallelCompile("NPY_NUM_BUILD_JOBS").install()

compile_args = ["-O3", "-Wall", "-Wextra"]
if os.environ.get("NGRAM_NATIVE_WERROR") == "1":
    compile_args.append("-Werror")

ext_modules = [
    Pybind11Extension(
        "ngram_native._core",
        sorted(glob.glob("ngram_native/csrc/*.cpp")),
        include_dirs=["ngram_native/csrc"],
        cxx_std=17,
        extra_compile_args=compile_args,
    )
]

setup(ext_modules=ext_modules, cmdclass={"build_ext": build_ext})
