"""The CPU kernels (dflash_agent/kernels/cpu/) built when the package installs, one library per ISA variant, so the
code users run is the code CI tested and no compiler is needed at run time. kernels/cpu/build.py compiles them, the
one builder (the tests that compile for other ISAs and under sanitizers call it too); setuptools' extension
machinery names and places the libraries, for wheel tagging and editable installs. DFLASH_AGENT_CPU_DOT=native at
install adds a build for the installing machine (-march=native). A variant that fails to build is skipped with a
warning (optional): the loader (kernels/cpu/cpu_dot.py) then picks another, or leaves the matmuls to torch."""

import importlib.util
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

ROOT = Path(__file__).parent
PREFIX = "dflash_agent.kernels.cpu._cpu_dot_"


def _builder():
    """kernels/cpu/build.py by its path: a build need not have the package being built on its import path."""
    spec = importlib.util.spec_from_file_location("dflash_agent_cpu_build", ROOT / "dflash_agent/kernels/cpu/build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


build = _builder()


def _relative(paths) -> list[str]:
    return [str(path.relative_to(ROOT)) for path in paths]


class BuildKernels(build_ext):
    """Each variant is the same sources compiled by build.compile_kernels with its own target flags."""

    def build_extension(self, ext: Extension) -> None:
        out = Path(self.get_ext_fullpath(ext.name))
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            build.compile_kernels(out, build.TARGETS[ext.name.removeprefix(PREFIX)])
        except build.BuildError as exc:
            raise CompileError(str(exc)) from exc


setup(
    ext_modules=[
        Extension(f"{PREFIX}{name}", _relative(build.SOURCES), depends=_relative(build.HEADERS), optional=True)
        for name in build.variants()
    ],
    cmdclass={"build_ext": BuildKernels},
)
