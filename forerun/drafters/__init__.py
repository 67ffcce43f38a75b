"""Drafters: anything that proposes tokens (the protocol: base.py). Found by name in a registry,
never by an if/elif chain; each entry says what the API, the CLI and the bench need to know of it."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from forerun.base.config import is_finite, is_whole
from forerun.base.errors import ForerunError
from forerun.drafters.base import Drafter

DrafterFactory = Callable[..., Drafter]


@dataclass(frozen=True)
class Entry:
    """A registered drafter: how to build it, and what its callers need to know before they do."""

    factory: DrafterFactory
    needs_draft_model: bool = False  # its options name a draft model (model, quantize, dtype, device)
    cli_options: Mapping[str, str] = field(default_factory=dict)  # CLI flag destination -> drafter keyword


_REGISTRY: dict[str, Entry] = {}


def register(
    name: str, needs_draft_model: bool = False, cli_options: Mapping[str, str] | None = None
) -> Callable[[DrafterFactory], DrafterFactory]:
    def add(factory: DrafterFactory) -> DrafterFactory:
        _REGISTRY[name] = Entry(factory, needs_draft_model, dict(cli_options or {}))
        return factory

    return add


def available() -> list[str]:
    _import_all()
    return sorted(_REGISTRY)


def entries() -> dict[str, Entry]:
    """Every registered drafter by name, in the order they registered."""
    _import_all()
    return dict(_REGISTRY)


def needs_draft_model(name: str | None) -> bool:
    """Whether method `name` runs a draft model (False for an unknown name or None)."""
    _import_all()
    entry = _REGISTRY.get(name) if name is not None else None
    return entry is not None and entry.needs_draft_model


def draft_model_methods() -> tuple[str, ...]:
    """The methods that run a draft model, in the order they registered."""
    return tuple(name for name, entry in entries().items() if entry.needs_draft_model)


def cli_options(name: str) -> Mapping[str, str]:
    """Method `name`'s CLI flags (destination -> drafter keyword); none for an unknown name."""
    _import_all()
    entry = _REGISTRY.get(name)
    return entry.cli_options if entry is not None else {}


def lookup(name: str) -> Entry:
    """Method `name`'s entry; a clear error naming the known methods where there is none."""
    _import_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ForerunError(
            f"unknown speculative method {name!r}; choose one of {', '.join(sorted(_REGISTRY))}"
        ) from None


def create(name: str, target, options: dict) -> Drafter:
    """Build drafter `name` for `target` (a LoadedModel) from its own settings alone."""
    found = lookup(name)
    _check_options(name, found.factory, options)
    return found.factory(target, **options)


def _check_options(name: str, factory, options: dict) -> None:
    """A clear error for settings drafter `name` does not take (a typo, another drafter's)."""
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    takes = [p for p in list(params)[1:] if params[p].kind is not inspect.Parameter.VAR_POSITIONAL]
    unknown = sorted(set(options) - set(takes))
    if unknown:
        raise ForerunError(
            f"speculative method {name!r} takes no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(takes) or 'none'}"
        )
    for key, value in options.items():
        _check_kind(name, key, value, params[key].default)


def _check_kind(name: str, key: str, value: object, default: object) -> None:
    """An option of the kind its default is: a whole number or a finite number (none of a drafter's
    counts, lengths, shares or thresholds is below 0), True or False, text. Options without a
    default of one of those kinds are the drafter's own to check."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "True or False"
    elif isinstance(default, int):
        ok, kind = is_whole(value) and value >= 0, "a whole number >= 0"
    elif isinstance(default, float):
        ok, kind = is_finite(value) and value >= 0, "a finite number >= 0"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "text"
    else:
        return
    if not ok:
        flags = [f"--{dest.replace('_', '-')}" for dest, kw in cli_options(name).items() if kw == key]
        said = f"option {key} ({flags[0]})" if flags else f"option {key}"
        raise ForerunError(f"speculative method {name!r}: {said} must be {kind}, got {value!r}")


def _import_all() -> None:
    # Each module registers itself on import.
    from forerun.drafters import (  # noqa: F401
        auto,
        auto_head,
        draft_model,
        eagle,
        early_exit,
        lookahead,
        medusa,
        ngram,
        suffix,
    )
