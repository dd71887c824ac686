"""Build pagedkv: setup.py drives CMakeLists.txt (Ninja) to build the compiled core.

Two extension modules come out of one CMake project:
  pagedkv._C              torch ops (CPU kernels, and CUDA kernels when nvcc is found)
  pagedkv._block_manager  the C++ block manager (pybind11, no torch dependency)

Environment knobs:
  PAGEDKV_CUDA=0|1        force the CUDA kernels off / on (default: on when nvcc is found)
  TORCH_CUDA_ARCH_LIST    CUDA architectures, e.g. "9.0" or "8.0;9.0" (default "9.0")
  CUDA_HOME               CUDA toolkit root (default: /usr/local/cuda, else nvcc's parent)
  PAGEDKV_BUILD_TYPE      CMake build type (default Release)
  MAX_JOBS                parallel compile jobs
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


class CMakeExtension(Extension):
    """An extension whose sources are built by CMake, not by setuptools."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


def _find_cmake() -> str:
    # Debian's cmake is too old for CUDA + C++20; prefer the pip one next to Python.
    beside = Path(sys.executable).parent / "cmake"
    if beside.exists():
        return str(beside)
    try:
        import cmake  # type: ignore

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except ImportError:
        return shutil.which("cmake") or "cmake"


def _find_cuda_home() -> str | None:
    if os.environ.get("PAGEDKV_CUDA", "") == "0":
        return None
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return home
    if Path("/usr/local/cuda/bin/nvcc").exists():
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(os.path.realpath(nvcc)).parent.parent)
    if os.environ.get("PAGEDKV_CUDA", "") == "1":
        raise RuntimeError("PAGEDKV_CUDA=1 but no nvcc was found; set CUDA_HOME")
    return None


def _cmake_cuda_archs(arch_list: str) -> str:
    """Translate TORCH_CUDA_ARCH_LIST ("8.0;9.0+PTX") to CMAKE_CUDA_ARCHITECTURES ("80-real;90")."""
    archs = []
    for item in arch_list.replace(",", ";").replace(" ", ";").split(";"):
        if not item:
            continue
        num = item.replace("+PTX", "").replace(".", "")
        # "90" = SASS + PTX for sm_90; "-real" = SASS only.
        archs.append(num if item.endswith("+PTX") else f"{num}-real")
    return ";".join(archs)


class CMakeBuild(build_ext):
    """Configure once per build dir, then build both modules with Ninja."""

    _built_dirs: set[Path] = set()

    def build_extension(self, ext: Extension) -> None:
        # One CMake build produces every module; setuptools then copies each.
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        if out_dir in self._built_dirs:
            return
        self._built_dirs.add(out_dir)
        import pybind11
        import torch

        # A fixed build folder inside the checkout (editable installs would use a
        # fresh temporary one each time) keeps rebuilds incremental.
        cuda_home = _find_cuda_home()
        build_dir = ROOT / "build" / f"cmake-{sys.implementation.cache_tag}-{'cuda' if cuda_home else 'cpu'}"
        build_dir.mkdir(parents=True, exist_ok=True)
        build_type = os.environ.get("PAGEDKV_BUILD_TYPE", "Release")
        args = [
            f"-S{ROOT}",
            f"-B{build_dir}",
            "-GNinja",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DPAGEDKV_OUTPUT_DIR={out_dir}",
            f"-DTORCH_DIR={Path(torch.__file__).parent}",
            f"-DTORCH_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DPAGEDKV_CUDA={'ON' if cuda_home else 'OFF'}",
        ]
        if cuda_home:
            archs = _cmake_cuda_archs(os.environ.get("TORCH_CUDA_ARCH_LIST", "9.0"))
            args += [
                f"-DCUDAToolkit_ROOT={cuda_home}",
                f"-DCMAKE_CUDA_COMPILER={cuda_home}/bin/nvcc",
                f"-DCMAKE_CUDA_ARCHITECTURES={archs}",
            ]
        cmake = _find_cmake()
        subprocess.run([cmake, *args], check=True)
        jobs = os.environ.get("MAX_JOBS", str(os.cpu_count() or 1))
        subprocess.run([cmake, "--build", str(build_dir), "-j", jobs], check=True)


setup(
    name="pagedkv",
    version="0.1.0",
    description="Paged KV-cache memory management for LLM inference: PagedAttention kernels, "
    "a C++ block manager and a continuous-batching engine.",
    package_dir={"": "python"},
    packages=find_packages("python"),
    # The dashboard page (pagedkv.server.dashboard) is read from the package at run time: wheels must carry it.
    package_data={"pagedkv.server": ["static/*.html"]},
    ext_modules=[CMakeExtension("pagedkv._C"), CMakeExtension("pagedkv._block_manager")],
    cmdclass={"build_ext": CMakeBuild},
    python_requires=">=3.10",
    # The exact pin (torch==2.14.1) lives in requirements.txt; the sources also build
    # against torch 2.11, which GPU machines may carry.
    install_requires=["torch>=2.11", "numpy", "pyzmq", "msgspec"],
    extras_require={"test": ["pytest", "hypothesis", "xxhash"], "structured": ["xgrammar"]},
    entry_points={"console_scripts": ["pagedkv = pagedkv.cli:main"]},
    zip_safe=False,
)
