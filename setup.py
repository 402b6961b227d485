"""The optional compiled part: ``metric_core.offline.engine._exact`` (exact sums, in C).

Everything else about the package is in pyproject.toml. The extension is built where a C
compiler is there and skipped where it is not (PyYAML's pattern: ``build_ext`` catches
the compile error and says so), so ``pip install -e .`` succeeds either way; without it
``metric_core.offline.engine.exact`` takes its pure numpy path, which gives the same
bits. ``metriclog --version`` says which path is in use.
"""

from __future__ import annotations

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, CompileError, ExecError, LinkError, PlatformError

_FAILED = (CCompilerError, CompileError, ExecError, LinkError, PlatformError, OSError)
_WARNING = (
    "metriclog: the C extension {name} was not built ({error}); exact sums take the pure "
    "numpy path, which gives the same results more slowly. Install a C compiler and the "
    "Python headers, then reinstall, to build it."
)


class optional_build_ext(build_ext):
    """build_ext that falls back to no extension when there is no working compiler."""

    def run(self) -> None:
        try:
            super().run()
        except _FAILED as error:  # no compiler found at all
            self._skipped("all", error)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except _FAILED as error:
            self._skipped(ext.name, error)

    @staticmethod
    def _skipped(name: str, error: BaseException) -> None:
        print(_WARNING.format(name=name, error=error), file=sys.stderr)


setup(
    ext_modules=[
        Extension(
            "metric_core.offline.engine._exact",
            ["metric_core/offline/engine/_exact.c"],
            extra_compile_args=[] if sys.platform == "win32" else ["-O2", "-std=c99"],
            libraries=[] if sys.platform == "win32" else ["m"],  # sqrt, for the std's root
            optional=True,  # an editable install then copies it into the source only if built
        )
    ],
    cmdclass={"build_ext": optional_build_ext},
)
