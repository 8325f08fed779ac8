"""Build shadowprefill: the pybind11 extensions (_C, _C_kv, and _C_cuda where nvcc is found) through CMake.

Environment: SHADOWPREFILL_CUDA=auto|0|1 (default auto: build the CUDA copies whenever nvcc is found),
CMAKE_BUILD_PARALLEL_LEVEL (default: all cores).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
MAIN_MODULE = "shadowprefill._C"
CUDA_MODULE = "shadowprefill._C_cuda"


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        if ext.name != MAIN_MODULE:
            return  # built by the same CMake run as _C
        import pybind11

        mode = os.environ.get("SHADOWPREFILL_CUDA", "auto")
        if mode not in ("auto", "0", "1"):
            raise ValueError(f"SHADOWPREFILL_CUDA must be auto, 0 or 1, got {mode!r}")
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_dir = Path(self.build_temp).resolve() / "cmake"
        build_dir.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DSHADOWPREFILL_CUDA={mode}",
            "-DCMAKE_BUILD_TYPE=Release",
        ]
        if shutil.which("ninja") or _ninja_module():
            args += ["-G", "Ninja"]
            if not shutil.which("ninja"):
                args.append(f"-DCMAKE_MAKE_PROGRAM={_ninja_module()}")
        subprocess.run(["cmake", str(ROOT), *args], cwd=build_dir, check=True)
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_dir, check=True)
        # CMake decides whether the CUDA module is built (nvcc found); declare it only when it was, so
        # setuptools copies it next to _C (editable installs) and packs it into wheels.
        cuda_path = Path(self.get_ext_fullpath(CUDA_MODULE))
        if cuda_path.exists() and all(e.name != CUDA_MODULE for e in self.extensions):
            cuda_ext = CMakeExtension(CUDA_MODULE)
            # attributes setuptools' finalize_options sets on declared extensions
            cuda_ext._full_name = CUDA_MODULE
            cuda_ext._links_to_dynamic = False
            cuda_ext._needs_stub = False
            self.extensions.append(cuda_ext)


def _ninja_module() -> str | None:
    try:
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        return None


setup(
    # triton_kernels/ installs as shadowprefill.triton_kernels only: a top-level `triton_kernels`
    # module would shadow the unrelated package of that name that vLLM imports.
    packages=find_packages(include=["shadowprefill", "shadowprefill.*"]) + ["shadowprefill.triton_kernels"],
    package_dir={"shadowprefill": "shadowprefill", "shadowprefill.triton_kernels": "triton_kernels"},
    ext_modules=[CMakeExtension(MAIN_MODULE), CMakeExtension("shadowprefill._C_kv")],
    cmdclass={"build_ext": CMakeBuild},
)
