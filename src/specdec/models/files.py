"""Writing a model folder so that a reader never sees half of it."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from specdec.errors import InvalidArgumentError


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike):
    """Yield a temporary folder next to ``out_dir``; on success each file written there replaces its
    namesake in ``out_dir`` (os.replace), on failure nothing in ``out_dir`` changes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".write-", dir=out_dir))
    try:
        yield work
        for item in sorted(work.iterdir(), key=lambda p: p.name == "config.json"):  # config.json last
            os.chmod(item, 0o644)
            os.replace(item, out_dir / item.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@contextlib.contextmanager
def replaced_dir(out_dir: str | os.PathLike):
    """Yield a temporary folder beside ``out_dir``; on success it replaces ``out_dir`` whole (its files
    readable by all), on failure it is removed and ``out_dir`` stays as it was."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        yield work
        os.chmod(work, 0o755)
        for item in work.iterdir():
            os.chmod(item, 0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def save_folder(out_dir, config: dict, weights_file: str, tensors: dict, dtype, extra: dict[str, str] | None = None):
    """config.json + safetensors weights (floating tensors in ``dtype``) + ``extra`` text files, atomically."""
    import json

    from safetensors.torch import save_file

    stored = {}
    for name, value in tensors.items():
        value = value.detach().cpu()
        stored[name] = value.to(dtype).contiguous() if value.is_floating_point() else value.contiguous()
    with atomic_dir(out_dir) as work:
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(stored, str(work / weights_file), metadata={"format": "pt"})
        for name, text in (extra or {}).items():
            (work / name).write_text(text)
    return Path(out_dir)


def check_weights(weights: dict, expected: dict, file) -> None:
    """Every expected tensor present with the shape the config implies; one-line ModelLoadError otherwise."""
    from specdec.errors import ModelLoadError

    missing = [name for name in expected if name not in weights]
    if missing:
        raise ModelLoadError(f"{file} lacks {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    for name, value in expected.items():
        if tuple(weights[name].shape) != tuple(value.shape):
            raise ModelLoadError(f"{file}: {name} has shape {tuple(weights[name].shape)}, config.json implies "
                                 f"{tuple(value.shape)}")


def save_net(net, out_dir, weights_file: str, dtype, extra: dict[str, str] | None = None):
    """A drafter network's folder: its config's config.json and its state dict, atomically."""
    return save_folder(out_dir, net.config.to_json(), weights_file, net.state_dict(), dtype, extra)


def load_weights_into(net, folder):
    """``net`` with the folder's model.safetensors loaded (shapes checked, one-line errors), in eval mode."""
    from pathlib import Path

    from specdec.models.llama import read_weights

    weights = read_weights(Path(folder))
    expected = net.state_dict()
    check_weights(weights, expected, Path(folder) / "model.safetensors")
    net.load_state_dict({name: weights[name].to(value.dtype) for name, value in expected.items()})
    return net.eval()


def check_output_path(path: str | os.PathLike | None) -> None:
    """Fail before any work when an output file could not be written."""
    if path is not None and not Path(path).parent.is_dir():
        raise InvalidArgumentError(f"output folder does not exist: {Path(path).parent}")


def write_atomic(path: str | os.PathLike, text: str) -> None:
    """Write text to path via a temporary file in the same folder, so readers never see half a file."""
    check_output_path(path)
    path = Path(path)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
