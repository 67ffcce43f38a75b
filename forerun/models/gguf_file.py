"""A GGUF file's header read straight from a memory map: its metadata and where each tensor's bytes are.

gguf-py's reader makes a numpy view of every value, the ~450,000 strings of a tokenizer's vocabulary
and merges included, which takes seconds; loading needs the scalar metadata and the tensor table, so
this reader skips arrays it is not asked for and makes one view per tensor. It offers what the loader
uses of gguf-py's reader (`fields[key].contents()`, `tensors` with `name`, `tensor_type`, `shape`,
`data`, `data_offset`, `n_bytes`), and refuses a file whose header or a tensor's bytes run past its
end, naming what was cut.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count
_DENSE = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands, or is cut short; the message says where,
    and `remedy` what to do where it is not to download the file again."""

    def __init__(self, message: str, remedy: str | None = None) -> None:
        super().__init__(message)
        self.remedy = remedy


@dataclass
class Field:
    value: object

    def contents(self):
        return self.value


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # dims, fastest first (as GGUF writes them)
    data_offset: int  # absolute, in the file
    n_bytes: int
    data: np.ndarray  # read-only view of the file: float arrays shaped [..., dims reversed],
    # block types as uint8 [rows, row bytes]


class GGUFFile:
    """The header of the GGUF file at `path` (a memory map stays open while tensors are used)."""

    def __init__(self, path: Path | str) -> None:
        import gguf

        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.size = len(self._map)
        self._at = 0
        if self._take(4) != b"GGUF":
            raise GGUFFormatError("it does not start with GGUF")
        version = self._scalar("<I")
        if version not in (2, 3):
            raise GGUFFormatError(
                f"GGUF version {version}; forerun reads versions 2 and 3",
                "write it again with a converter that writes version 3 (llama.cpp's convert_hf_to_gguf.py)",
            )
        n_tensors, n_fields = self._scalar("<Q"), self._scalar("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key, kind = self._string(), self._scalar("<I")
            # A tokenizer's arrays (its vocabulary, merges, scores) are skipped; its strings kept.
            self.fields[key] = Field(self._value(kind, keep=kind != _ARRAY or not key.startswith("tokenizer.")))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
            infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
        alignment = self.fields["general.alignment"].value if "general.alignment" in self.fields else 32
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            # Tensors would be read from the wrong offsets: garbage weights, no error (llama.cpp refuses it too).
            raise GGUFFormatError(f"its general.alignment {alignment} is not a power of two: the file is corrupt")
        start = -(-self._at // alignment) * alignment
        self.tensors: list[Tensor] = [self._tensor(gguf, start, *info) for info in infos]

    def _tensor(self, gguf, start: int, name: str, dims: list[int], type_id: int, offset: int) -> Tensor:
        try:
            qtype = gguf.GGMLQuantizationType(type_id)
            block, type_bytes = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"tensor {name} has type {type_id}, which no GGUF reader knows") from None
        count = int(np.prod(dims)) if dims else 1
        n_bytes = count * type_bytes // block
        at = start + offset
        if at + n_bytes > self.size:
            raise GGUFFormatError(
                f"tensor {name} runs past the end of the file (to byte {at + n_bytes:,} of "
                f"{self.size:,}): the file is truncated"
            )
        shape = tuple(reversed(dims))
        dense = _DENSE.get(qtype.name)
        if dense is not None:
            data = np.frombuffer(self._map, dtype=dense, count=count, offset=at).reshape(shape)
        else:
            data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=at)
            data = data.reshape(gguf.quant_shape_to_byte_shape(shape, qtype) if shape else (n_bytes,))
        return Tensor(name, qtype, np.array(dims, dtype=np.uint64), at, n_bytes, data)

    # --- the header's encoding -------------------------------------------------------------------

    def _take(self, n: int) -> bytes:
        if self._at + n > self.size:
            raise GGUFFormatError(f"its header ends early (at byte {self.size:,}): the file is truncated")
        out = self._map[self._at : self._at + n]
        self._at += n
        return out

    def _scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self._at + size > self.size:
            raise GGUFFormatError(f"its header ends early (at byte {self.size:,}): the file is truncated")
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += size
        return value

    def _string(self) -> str:
        return self._take(self._scalar("<Q")).decode("utf-8", errors="replace")

    def _skip_strings(self, count: int) -> None:
        """Step over `count` strings (a vocabulary's hundreds of thousands) without decoding them."""
        at, size, length = self._at, self.size, _LENGTH.unpack_from
        for _ in range(count):
            if at + 8 > size:
                raise GGUFFormatError("a string in its header runs past the end: the file is truncated")
            at += 8 + length(self._map, at)[0]
        if at > size:
            raise GGUFFormatError("a string in its header runs past the end: the file is truncated")
        self._at = at

    def _value(self, kind: int, keep: bool = True):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            if keep:
                return self._string()
            length = self._scalar("<Q")  # skipped: not decoded
            self._at += length
            if self._at > self.size:
                raise GGUFFormatError("a string in its header runs past the end: the file is truncated")
            return None
        if kind == _ARRAY:
            item, count = self._scalar("<I"), self._scalar("<Q")
            if item in _SCALARS and not keep:  # skipped: one jump
                self._at += struct.calcsize(_SCALARS[item]) * count
                if self._at > self.size:
                    raise GGUFFormatError("an array in its header runs past the end: the file is truncated")
                return None
            if item == _STRING and not keep:
                self._skip_strings(count)
                return None
            values = [self._value(item, keep) for _ in range(count)]
            return values if keep else None
        raise GGUFFormatError(f"a metadata value of unknown type {kind}: the file is corrupt")
