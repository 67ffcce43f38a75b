"""Where a model's weights are: an embedded name, a `.gguf` file, a Hugging Face model folder, or a hub id."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from forerun.base.errors import ForerunError
from forerun.models import fetch as fetching
from forerun.models.embedded import EMBEDDED


@dataclass
class ModelSource:
    kind: str  # "gguf" or "hf"
    path: Path  # the .gguf file or the model folder
    name: str  # what the user called it

    @property
    def file_format(self) -> str:
        """The weights' file format as model lists name it: gguf or safetensors; "" for a model
        built in memory."""
        return {"gguf": "gguf", "hf": "safetensors"}.get(self.kind, "")


def resolve(spec: str) -> ModelSource:
    """Find the weights behind `spec`, fetching an embedded model if needed."""
    if spec in EMBEDDED:
        return ModelSource("gguf", fetching.fetch(spec), spec)
    if not spec.strip():  # Path("") is the current folder: never what an empty name meant
        raise ForerunError(
            f"the model name is empty: pass a .gguf file, a model folder or an embedded model name "
            f"({', '.join(sorted(EMBEDDED))})"
        )
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ForerunError(f"{path} is not a .gguf file; pass a .gguf file or a model folder")
        return ModelSource("gguf", path, spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ForerunError(
                f"{path} has no config.json; a model folder needs config.json, *.safetensors and tokenizer files"
            )
        return ModelSource("hf", path, spec)
    known = ", ".join(sorted(EMBEDDED))
    if path.suffix == ".gguf" or spec.startswith((".", "/", "~")):
        raise ForerunError(
            f"{spec}: no such file or folder. Pass an existing .gguf file or model folder, "
            f"or an embedded model name ({known})"
        )
    if spec.count("/") == 1:
        return ModelSource("hf", _hub_download(spec), spec)
    raise ForerunError(
        f"unknown model {spec!r}: not an embedded name ({known}), "
        "not an existing .gguf file or model folder, and not a hub id (owner/name)"
    )


def _hub_download(repo_id: str) -> Path:
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as exc:
        raise ForerunError(
            f"could not download {repo_id!r} from the Hugging Face hub ({type(exc).__name__}). "
            "Without a network, pass a local path instead: a .gguf file or a model folder."
        ) from None
    return Path(folder)
