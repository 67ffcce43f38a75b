"""The numeric formats a model's products can be stored in, which devices run each, and how a
float decoder becomes one (in place) or is rebuilt from a cached state dict of one."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from forerun import native
from forerun.base import cpu
from forerun.base.errors import ForerunError
from forerun.models import w8a8
from forerun.models.linear import quantize_int8_


@dataclass(frozen=True)
class Format:
    name: str
    summary: str  # one line for --help and errors
    quantize: Callable[[nn.Module], nn.Module]  # float decoder -> this format, in place
    load: Callable[[nn.Module, dict], nn.Module]  # meta decoder + its cached state dict -> ready
    devices: tuple[str, ...]  # device types that run it
    shows_progress: bool = False  # quantize takes progress=
    cache_name: str = ""  # file tag of cached weights; bumped when their layout changes

    @property
    def cache_tag(self) -> str:
        return self.cache_name or self.name


# PyTorch's int8 weight-only kernel reads its weights with aligned vector loads on CPUs with
# AVX-512 bf16 and crashes the process on a weight that is not 16-byte aligned; a memory-mapped
# safetensors file aligns its tensors to 8 bytes only. Such weights are copied (the allocator aligns).
WEIGHT_ALIGNMENT = 64


def _aligned(t: torch.Tensor) -> torch.Tensor:
    return t if t.device.type != "cpu" or t.data_ptr() % WEIGHT_ALIGNMENT == 0 else t.clone()


def _load_int8(decoder: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    quantize_int8_(decoder, from_meta=True)
    decoder.load_state_dict({k: _aligned(state[k]) for k in decoder.state_dict()}, assign=True, strict=True)
    return decoder


FORMATS: dict[str, Format] = {
    "int8": Format(
        "int8",
        "int8 weights, activations in the model's dtype (PyTorch's weight-only kernel)",
        quantize_int8_,
        _load_int8,
        ("cpu", "cuda"),
    ),
    "w8a8": Format(
        "w8a8",
        "int8 weights and per-row int8 activations (fbgemm, onednn): flat cost to ~8 rows, "
        "rows bit-identical alone or batched",
        w8a8.quantize_decoder_,
        w8a8.load_decoder_,
        ("cpu",),
        shows_progress=True,
        cache_name="w8a8v2",
    ),  # v2: norms folded into the fused products, q prescaled
}


def _gguf_from_float(decoder: nn.Module, progress: bool = False) -> nn.Module:
    raise ForerunError(
        "--quantization gguf computes a GGUF file's own blocks, and this model was not loaded "
        "from a .gguf file; use w8a8 (or auto)"
    )


FORMATS["gguf"] = Format(
    "gguf",
    "a GGUF file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...) through forerun's "
    "native kernels: the file's bytes, rows bit-identical alone or batched",
    _gguf_from_float,
    lambda decoder, state: _gguf_from_float(decoder),
    ("cpu",),
)
GGUF = "gguf"
Q4_0 = "q4_0"
AUTO = "auto"


def _q4_0_from_float(decoder: nn.Module, progress: bool = False) -> nn.Module:
    raise ForerunError(
        "--quantization q4_0 re-blocks a GGUF file's tensors, and this model was not loaded from a "
        ".gguf file; use w8a8 (or auto)"
    )


FORMATS[Q4_0] = Format(
    Q4_0,
    "a GGUF file's tensors in more bits than 4.5 a weight (Q5_0, Q6_K, Q8_0, F16, ...) re-blocked "
    "into Q4_0 once, the rest as stored, on the native kernels: fewer bytes a pass, for a draft model",
    _q4_0_from_float,
    lambda decoder, state: _q4_0_from_float(decoder),
    ("cpu",),
)
NATIVE = (GGUF, Q4_0)  # the formats forerun's native kernels compute


def choose_auto(
    device: torch.device | str, source_kind: str | None = None, draft: bool = False
) -> tuple[str | None, str]:
    """(format or None for the weights' own dtype, why) for `--quantization auto`.

    A GGUF file on a CPU where forerun's native kernels run: `gguf`, the file's own blocks (the
    fewest bytes a pass reads, and no conversion); for a `draft` model `q4_0`, its wider tensors
    re-blocked into 4-bit blocks: a draft's weights change only how often its guesses are kept, and
    on the embedded pair a draft token reads 22 % fewer bytes, and coding decoded 7.8 % faster
    (docs/benchmarks.md, run 71). Otherwise w8a8 wherever fbgemm runs: measured on
    the 1.5B target, one pass at 1 / 8 / 16 rows, without native bf16 matrix
    units (AVX2) bf16 costs 190 ms and more per row while w8a8 stays near flat; with AMX bf16 is
    flat (215 / 208 / 218 ms) but w8a8 is faster still (78 / 130 / 152 ms).
    """
    kind = torch.device(device).type
    if kind != "cpu":
        return None, f"on {kind} the weights stay in their dtype"
    if source_kind == "gguf" and native.available():
        if draft:
            return Q4_0, (
                f"a draft model's GGUF file on a CPU the native kernels run ({native.path()} path): its tensors "
                "wider than 4.5 bits a weight re-blocked into Q4_0, fewer bytes a draft token; drafts change only "
                "the speed"
            )
        return GGUF, (
            f"a GGUF file on a CPU the native kernels run ({native.path()} path): its own blocks, "
            "the fewest bytes a pass reads, rows bit-identical alone or batched"
        )
    if w8a8.available(device):
        units = "AMX bf16 units, but" if cpu.has_amx() else "no native bf16 matrix units:"
        return "w8a8", (
            f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has {units} int8 products "
            f"({w8a8.kernel()}) verify 8 rows for under twice the cost of one, faster than bf16"
        )
    if cpu.has_amx():
        return None, "no fbgemm in this PyTorch, and AMX bf16 rows are nearly free: the weights stay bf16"
    return "int8", "no fbgemm in this PyTorch: int8 weights"


def resolve(
    name: str | None, device: torch.device | str, source_kind: str | None = None, draft: bool = False
) -> str | None:
    """`name` with "auto" replaced by the choice for `device` and a model from `source_kind` ("gguf"
    for a GGUF file; `draft`: a draft model's), said on stderr once; `gguf` or `q4_0` where the native
    kernels cannot run here becomes w8a8, said once."""
    flag = "--speculative-quantization" if draft else "--quantization"
    if name in NATIVE and torch.device(device).type == "cpu" and not native.available():
        _say_once(f"{flag} {name}: {native.problem()}; using w8a8 instead")
        return "w8a8"
    if name != AUTO:
        return name
    chosen, why = choose_auto(device, source_kind, draft)
    _say_once(f"{flag} auto: {chosen or 'none'} ({why})")
    return chosen


_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"forerun: {message}", file=sys.stderr, flush=True)


def get(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ForerunError(
            f"unknown quantization {name!r}; use one of {', '.join(FORMATS)}, {AUTO} or leave it out"
        ) from None


def check_device(name: str, device: torch.device | str) -> None:
    """A clear error when `device` cannot run format `name`, naming the formats it can."""
    kind = torch.device(device).type
    fmt = get(name)
    if not _runs(name, device):
        usable = [f.name for f in FORMATS.values() if _runs(f.name, device)]
        needs = " with fbgemm" if name == "w8a8" else " with forerun's native kernels" if name in NATIVE else ""
        raise ForerunError(
            f"--quantization {name} does not run on {kind} (it needs "
            f"{' or '.join(fmt.devices)}{needs}); on {kind} use "
            f"{' or '.join(usable) if usable else 'no quantization'}, or leave --quantization out"
        )


def _runs(name: str, device: torch.device | str) -> bool:
    if torch.device(device).type not in FORMATS[name].devices:
        return False
    if name == "w8a8":
        return w8a8.available(device)
    if name in NATIVE:
        return native.available()
    return True


def current(decoder: nn.Module) -> str | None:
    """The format `decoder`'s products are in, None for float weights."""
    from forerun.models.gguf_format import GGUFLinear
    from forerun.models.linear import Int8Linear

    for module, name in ((GGUFLinear, GGUF), (w8a8.W8A8Linear, "w8a8"), (Int8Linear, "int8")):
        if isinstance(decoder.lm_head, module):
            return name
    return None


def quantize_(decoder: nn.Module, name: str, progress: bool = False) -> nn.Module:
    """`decoder` (float weights) to format `name`, in place; `progress`: a bar on stderr where the
    format can show one (a 1.5B model takes minutes). A decoder already in a format keeps it for
    "auto" or that format's name, and is refused another."""
    already = current(decoder)
    if already is not None:
        if name in (AUTO, already):
            return decoder
        raise ForerunError(f"the model is already in {already}; load it again to use {name}")
    name = resolve(name, decoder.device)
    if name is None:
        return decoder
    check_device(name, decoder.device)
    fmt = get(name)
    return fmt.quantize(decoder, progress=progress) if fmt.shows_progress else fmt.quantize(decoder)
