"""The `gguf` format: a GGUF model's products computed from the file's own weight blocks.

No dequantize-and-requantize: each product reads the blocks the user chose (Q4_K, Q6_K, Q5_0, ...)
through forerun's kernel library (`forerun/native`), with each row's activations quantized to int8
blocks and integer dot products inside a block, so a row's result is bit-identical alone or in any
batch. q/k/v and gate/up run as one product each (one activation quantization, one call per part,
whatever their block types). A tensor in a type the kernels do not read is dequantized and computed
as a w8a8 product (row-exact too), and the loader says which.

The `q4_0` format (`Reblocked`) is the same with every product tensor the file stores in more bits a
weight than Q4_0's 4.5 (Q5_0, Q6_K, Q8_0, F16, ...) re-blocked into Q4_0 once, and kept in the model's
cache folder: a draft model's token then reads about a fifth fewer bytes (the 0.5B draft's Q5_0 and
Q6_K products), and its weights change only how often its guesses are kept, never the output.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from forerun import native
from forerun.base import files


@dataclass
class Part:
    """One GGUF tensor's rows inside a product: `rows` outputs from the packed blocks of `type_id`."""

    type_id: int
    rows: int
    packed: torch.Tensor  # uint8: native.repack's tile layout
    raw: torch.Tensor | None  # uint8 [rows, row bytes]: the file's blocks (a memory map), for taking rows


class _Scratch(threading.local):
    """Activation buffers reused across calls, per thread (two requests may run products at once)."""

    def __init__(self) -> None:
        self.buffers: dict[int, torch.Tensor] = {}

    def act(self, rows: int, k: int) -> torch.Tensor:
        width = native.act_row_bytes(k)
        buf = self.buffers.get(k)
        if buf is None or buf.shape[0] < rows:
            with torch.inference_mode(False):
                buf = torch.empty(max(rows, 2 * (buf.shape[0] if buf is not None else 8)), width, dtype=torch.uint8)
            self.buffers[k] = buf
        return buf[:rows]


_scratch = _Scratch()


class GGUFLinear(nn.Module):
    """y = x @ W.T + bias, W the stacked rows of one or more GGUF tensors (float32 in and out).

    `fallback` parts (a module per part, or None for a native one) cover tensors in types the kernels
    do not read.
    """

    def __init__(
        self,
        in_features: int,
        parts: list[Part],
        bias: torch.Tensor | None = None,
        fallback: list[nn.Module | None] | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.parts = parts
        self.out_features = sum(p.rows for p in parts)
        self.kernel = native.path()
        self.fallback = nn.ModuleList(m for m in (fallback or []) if m is not None)
        self._fallback = fallback or [None] * len(parts)
        self.bias = None if bias is None else nn.Parameter(bias.float().contiguous(), requires_grad=False)
        self._blocks = sorted({native.block_inputs(p.type_id) for p, f in zip(parts, self._fallback) if f is None})
        for i, p in enumerate(parts):  # buffers: .to(), state_dict and byte counts see them
            self.register_buffer(f"packed{i}", p.packed, persistent=False)

    def extra_repr(self) -> str:
        kinds = ",".join(native.TYPE_NAMES.get(p.type_id, f"fallback{p.type_id}") for p in self.parts)
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, parts={kinds}, "
            f"bias={self.bias is not None}, kernel={self.kernel}"
        )

    def weight_bytes(self) -> int:
        """Bytes a pass reads: the packed blocks (and any fallback product's own weights)."""
        total = sum(p.packed.numel() for p, f in zip(self.parts, self._fallback) if f is None)
        for f in self._fallback:
            if f is not None:
                total += sum(t.numel() * t.element_size() for t in [*f.parameters(), *f.buffers()])
        return total

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or rows.stride(-1) != 1:
            rows = rows.float().contiguous()
        m = rows.shape[0]
        acts = {}
        for block in self._blocks:
            acts[block] = (
                native.quantize(rows, block, out=_scratch.act(m, self.in_features), kernel_path=self.kernel)
                if len(self._blocks) == 1
                else native.quantize(rows, block, kernel_path=self.kernel)
            )
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        start = 0
        bias = self.bias
        for part, fallback in zip(self.parts, self._fallback):
            out = y[:, start : start + part.rows]
            if fallback is not None:
                out.copy_(fallback(rows))
                if bias is not None:
                    out.add_(bias[start : start + part.rows])
            else:
                native.matmul(
                    part.type_id,
                    part.packed,
                    part.rows,
                    self.in_features,
                    acts[native.block_inputs(part.type_id)],
                    m,
                    out,
                    None if bias is None else bias[start : start + part.rows],
                    kernel_path=self.kernel,
                )
            start += part.rows
        return y.view(*shape[:-1], self.out_features)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> GGUFLinear:
        """A float weight [out, in] (in a multiple of 32) as Q8_0 blocks (gguf-py's quantizer): for
        weights that come as floats, a trained draft head's, on the same kernels as the model's."""
        import gguf

        out_features, in_features = weight.shape
        blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType.Q8_0)
        raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(out_features, -1)
        type_id = native.TYPES["Q8_0"]
        packed = native.repack(type_id, raw.reshape(-1), out_features, in_features)
        return cls(in_features, [Part(type_id, out_features, packed, raw)], bias)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [out, in] these blocks hold (fallback parts: their own float weight)."""
        pieces = []
        for part, fallback in zip(self.parts, self._fallback):
            if fallback is not None:
                from forerun.models.w8a8 import W8A8Linear

                pieces.append(
                    fallback.qweight().float() * fallback.scale[:, None]
                    if isinstance(fallback, W8A8Linear)
                    else fallback.weight.detach().float()
                )
            elif part.raw is None:
                raise TypeError("this product kept no copy of its blocks to dequantize")
            else:
                pieces.append(
                    native.dequantize_rows(
                        part.type_id, part.raw.reshape(-1), self.in_features, torch.arange(part.rows)
                    )
                )
        return torch.cat(pieces)

    def take_rows(self, ids: torch.Tensor) -> GGUFLinear:
        """A product scoring only outputs `ids` (a reduced vocabulary): the same blocks, repacked."""
        if len(self.parts) != 1 or self._fallback[0] is not None or self.parts[0].raw is None:
            raise TypeError("rows can be taken from a single native GGUF product only")
        part = self.parts[0]
        raw = part.raw[ids].contiguous()
        packed = native.repack(part.type_id, raw.view(-1), len(ids), self.in_features)
        bias = None if self.bias is None else self.bias[ids]
        return GGUFLinear(self.in_features, [Part(part.type_id, len(ids), packed, raw)], bias)


class GGUFEmbedding(nn.Module):
    """Rows of a GGUF embedding table dequantized as they are looked up (one row a token is read)."""

    def __init__(self, type_id: int, raw: torch.Tensor, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.type_id, self.raw = type_id, raw  # raw: uint8 [num_embeddings, row bytes]
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        # Dequantizing needs a tensor to say the module's device and dtype, as nn.Embedding's weight does.
        self.register_buffer("anchor", torch.zeros(0), persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table dequantized (float32, hundreds of MB for a real vocabulary): for code that
        needs the matrix itself (a checksum, training a head from it); looking rows up reads only them."""
        return native.dequantize_rows(self.type_id, self.raw, self.embedding_dim, torch.arange(self.num_embeddings))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={native.TYPE_NAMES[self.type_id]}"

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return native.dequantize_rows(self.type_id, self.raw, self.embedding_dim, flat, "token id").view(*ids.shape, -1)


def say(message: str) -> None:
    print(f"forerun: {message}", file=sys.stderr, flush=True)


def raw_rows(data: np.ndarray, rows: int) -> torch.Tensor:
    """A GGUF tensor's bytes (gguf-py's memory map) as uint8 [rows, row bytes], without copying."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only memory map: nothing here writes to it
        return torch.from_numpy(np.ascontiguousarray(data).reshape(rows, -1).view(np.uint8))


# --- the `q4_0` format: wider tensors re-blocked into 4-bit blocks ------------------------------------

REBLOCK_TYPE = "Q4_0"


def bits_per_weight(tensor_type) -> float:
    """Bits a weight of a GGUF tensor type takes (Q4_0: 4.5, Q6_K: 6.5625, F16: 16)."""
    inputs, size = _block_size(tensor_type)
    return 8 * size / inputs


def _block_size(tensor_type) -> tuple[int, int]:
    """(inputs, bytes) of one block of a GGUF tensor type (a name or gguf-py's type)."""
    import gguf

    if isinstance(tensor_type, str):
        tensor_type = gguf.GGMLQuantizationType[tensor_type]
    return gguf.GGML_QUANT_SIZES[tensor_type]


class Reblocked:
    """A GGUF file's product tensors stored in more bits a weight than Q4_0, as Q4_0 blocks (gguf-py's
    quantizer over the dequantized weights): made on the first load and kept in `store` (a safetensors
    file of uint8 rows, by tensor name), read from it afterwards."""

    def __init__(self, store: Path) -> None:
        from safetensors.torch import load_file

        self.store = store
        self.blocks: dict[str, torch.Tensor] = {}
        if store.is_file():
            try:
                self.blocks = load_file(str(store))
            except Exception as exc:  # a damaged store is made again, never trusted
                say(f"q4_0: {store} cannot be read ({exc}); re-blocking again")
        self.made: list[str] = []  # tensors re-blocked in this load (not found in the store)

    @staticmethod
    def wants(t) -> bool:
        """Whether tensor `t` is re-blocked: more bits a weight than Q4_0, inputs in whole blocks."""
        inputs, _ = _block_size(REBLOCK_TYPE)
        return bits_per_weight(t.tensor_type) > bits_per_weight(REBLOCK_TYPE) and int(t.shape[0]) % inputs == 0

    def rows(self, name: str, t) -> torch.Tensor:
        """Tensor `t`'s rows as Q4_0 blocks, uint8 [rows, row bytes], in the file's row order."""
        import gguf

        k, n = int(t.shape[0]), int(t.shape[1])
        inputs, size = _block_size(REBLOCK_TYPE)
        raw = self.blocks.get(name)
        if raw is None or tuple(raw.shape) != (n, k // inputs * size) or raw.dtype != torch.uint8:
            blocks = gguf.quants.quantize(dequantized(t).reshape(n, k), gguf.GGMLQuantizationType[REBLOCK_TYPE])
            raw = torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8).reshape(n, -1)
            self.blocks[name] = raw
            self.made.append(f"{name} ({t.tensor_type.name})")
        return raw

    def save(self) -> None:
        """Keep what this load re-blocked, and say so."""
        if not self.made:
            return
        files.save_tensors(self.store, self.blocks)
        say(
            f"q4_0: {len(self.made)} tensors re-blocked into {REBLOCK_TYPE} (once; kept in "
            f"{self.store.parent}): {', '.join(self.made[:3])}{' ...' if len(self.made) > 3 else ''}"
        )


def dequantized(t) -> np.ndarray:
    import gguf

    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
