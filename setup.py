"""Build of the native extensions over ``csrc/``.

Environment variables:
  SPILLOVER_CFLAGS  extra compiler flags (default: ``-O3``), e.g. ``-O2 -march=native``
  SPILLOVER_DEBUG   ``1`` builds with ``-O0 -g``, C asserts (SPL_ASSERT) on, native handles
                    counted (``live_handles()``) and Cython line tracing
"""

import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("SPILLOVER_DEBUG", "") == "1"
CFLAGS = os.environ.get("SPILLOVER_CFLAGS", "-O0 -g" if DEBUG else "-O3").split()
CFLAGS += ["-std=gnu11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-Wno-unused-function"]
MACROS = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if DEBUG:
    MACROS += [("CYTHON_TRACE_NOGIL", "1"), ("SPL_DEBUG", "1")]
else:
    MACROS += [("NDEBUG", "1")]

# Each extension lists the C sources it links; csrc/ has no Python in it.
EXTENSIONS = {
    "_storage": [
        "csrc/crc32c.c",
        "csrc/frame.c",
        "csrc/writer.c",
        "csrc/reader.c",
        "csrc/section.c",
        "csrc/sockio.c",
        "csrc/wake.c",
        "csrc/bufcache.c",
        "csrc/debug.c",
    ],
    "_records": [
        "csrc/keygroups.c",
        "csrc/keysums.c",
        "csrc/records.c",
        "csrc/generate.c",
        "csrc/bufcache.c",
        "csrc/debug.c",
    ],
}


def extension(name: str, sources: list[str]) -> Extension:
    return Extension(
        f"spillover._native.{name}",
        [f"src/spillover/_native/{name}.pyx", *sources],
        include_dirs=["csrc", numpy.get_include()],
        define_macros=MACROS,
        extra_compile_args=CFLAGS,
        libraries=["pthread"],
    )


# SPILLOVER_ONLY=_storage,_records builds just those (handy while one is being edited).
ONLY = [n for n in os.environ.get("SPILLOVER_ONLY", "").split(",") if n]

setup(
    ext_modules=cythonize(
        [extension(n, s) for n, s in EXTENSIONS.items() if not ONLY or n in ONLY],
        compiler_directives={
            "language_level": "3",
            "boundscheck": DEBUG,
            "wraparound": False,
            "cdivision": True,
            "linetrace": DEBUG,
            "embedsignature": True,
        },
        include_path=["src/spillover/_native", "src/spillover/_native/includes"],
        # The C Cython makes depends on the directives above: debug and release each
        # keep their own, so a release build never compiles the debug build's C
        # (Cython regenerates by timestamp, not by directive).
        build_dir=f"build/cython-{'debug' if DEBUG else 'release'}",
    ),
)
