"""Build llama.cpp's ``llama-server`` from the sources vendored in the llama-cpp-python sdist.

The benchmark anchor for ``causaldraft serve``: the C++ server (continuous batching) built from the
same llama.cpp that llama-cpp-python 0.3.36 wraps. The sdist is taken from ``--sdist``, else from a
pip unpack directory under /tmp, else downloaded with ``pip download``. The build is CPU-only, static,
without the web UI (no network at build time), and compiles only the ``llama-server`` target.

Needs cmake >= 3.14 and a C++17 compiler; ninja is used when present. Without cmake:
``.venv/bin/pip install cmake``. Idempotent: an existing binary is reused. The binary's path is the
last line on stdout.

    .venv/bin/python bench/build_llama_server.py [--out DIR] [--jobs 2]
"""

from __future__ import annotations

import argparse
import glob
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from causaldraft.paths import causaldraft_home

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
BINARY_NAME = "llama-server"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one self-contained binary that can be copied out of the build tree
    "-DLLAMA_CURL=OFF",  # deprecated in this llama.cpp (only a warning), kept for older trees
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",  # the server lives under tools/
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else the build downloads the web UI
    "-DGGML_NATIVE=ON",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
)


def default_out_dir() -> Path:
    """``$CAUSALDRAFT_HOME/llama-server`` (by default ``~/.cache/causaldraft/llama-server``)."""
    return causaldraft_home() / "llama-server"


def sdist_name(version: str) -> str:
    return f"llama_cpp_python-{version}.tar.gz"


def find_sdist(version: str) -> Path | None:
    """An sdist pip already unpacked under /tmp (``/tmp/pip-unpack-*/``), if any."""
    matches = sorted(glob.glob(f"/tmp/pip-unpack-*/{sdist_name(version)}"))
    return Path(matches[0]) if matches else None


def download_sdist(version: str, dest: Path) -> Path:
    """``pip download`` the sdist (no wheels, no dependencies) into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*command, f"llama-cpp-python=={version}", "-d", str(dest)], check=True, stdout=sys.stderr)
    return dest / sdist_name(version)


def extract_llama_cpp(sdist: Path, dest: Path) -> Path:
    """Extract only ``<sdist root>/vendor/llama.cpp/`` into ``dest/llama.cpp`` and return that folder.

    Example: member ``llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt`` becomes
    ``dest/llama.cpp/CMakeLists.txt``.
    """
    source = dest / "llama.cpp"
    if (source / "CMakeLists.txt").is_file():
        return source
    with tarfile.open(sdist) as archive:
        root = archive.getnames()[0].split("/")[0]
        prefix = f"{root}/vendor/"
        members = [member for member in archive.getmembers() if member.name.startswith(prefix + "llama.cpp/")]
        if not members:
            raise SystemExit(f"build_llama_server: {sdist} has no vendor/llama.cpp")
        for member in members:
            member.name = member.name[len(prefix) :]
        archive.extractall(dest, members=members, filter="data")
    return source


def require_cmake() -> str:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise SystemExit("build_llama_server: cmake not found; install it, e.g. `.venv/bin/pip install cmake`")
    return cmake


def configure(cmake: str, source: Path, build_dir: Path) -> None:
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    command = [cmake, "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_OPTIONS]
    subprocess.run(command, check=True, stdout=sys.stderr)


def build(cmake: str, build_dir: Path, jobs: int) -> Path:
    """Build the ``llama-server`` target only; return the binary inside the build tree."""
    command = [cmake, "--build", str(build_dir), "--target", BINARY_NAME, "-j", str(jobs)]
    subprocess.run(command, check=True, stdout=sys.stderr)
    binary = build_dir / "bin" / BINARY_NAME
    if not binary.is_file():
        raise SystemExit(f"build_llama_server: the build finished but {binary} is missing")
    return binary


def build_llama_server(out_dir: Path, version: str, jobs: int, sdist: Path | None) -> Path:
    """Return ``out_dir/llama-server``, building it first unless it already exists.

    The work folder (``out_dir/work``: sources and build tree) is kept when the build fails, so a
    rerun resumes, and removed once the binary is in place.
    """
    binary = out_dir / BINARY_NAME
    if binary.is_file():
        return binary
    cmake = require_cmake()
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    archive = sdist or find_sdist(version) or download_sdist(version, Path(tempfile.mkdtemp(dir=work)))
    print(f"build_llama_server: building from {archive}", file=sys.stderr)
    source = extract_llama_cpp(archive, work)
    configure(cmake, source, work / "build")
    built = build(cmake, work / "build", jobs)
    shutil.copy2(built, binary)
    shutil.rmtree(work)
    return binary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=default_out_dir(), help="cache folder for the binary")
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist version")
    parser.add_argument("--sdist", type=Path, default=None, help="use this sdist instead of finding one")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.perf_counter()
    binary = build_llama_server(args.out.expanduser(), args.version, args.jobs, args.sdist)
    print(f"build_llama_server: ready after {time.perf_counter() - started:.0f} s", file=sys.stderr)
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
