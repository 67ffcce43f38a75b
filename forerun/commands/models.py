"""`forerun models list|fetch`: the embedded models and their state on disk."""

from __future__ import annotations

import argparse
import json

from forerun.base.errors import ForerunError
from forerun.models.embedded import EMBEDDED, EmbeddedModel
from forerun.models.fetch import fetch, list_models, model_file


def register(sub) -> None:
    p = sub.add_parser("models", help="list or fetch the embedded models")
    verbs = p.add_subparsers(dest="verb", required=True)
    ls = verbs.add_parser("list", help="the embedded models and whether they are on disk")
    ls.add_argument("--json", action="store_true", help="one JSON object per model")
    ls.set_defaults(func=_list)
    fe = verbs.add_parser("fetch", help="download, assemble and check embedded models (all by default)")
    fe.add_argument("names", nargs="*", help=f"models to fetch; default: {', '.join(EMBEDDED)}")
    fe.add_argument("--force", action="store_true", help="fetch again even if the file is intact")
    fe.set_defaults(func=_fetch)


def _list(args: argparse.Namespace) -> int:
    rows = list_models()
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for row in rows:
        state = "fetched" if row["fetched"] else "not fetched"
        print(f"{row['name']:32} {row['role']:7} {row['bytes'] / 1e9:5.2f} GB  {state:11}  {row['path']}")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    for model in _to_fetch(args.names or list(EMBEDDED)):
        print(fetch(model.name, force=args.force))
    return 0


def _to_fetch(names: list[str]) -> list[EmbeddedModel]:
    """The models named, each once, checked before any download starts: a typo in the last name
    must not cost the download of the first, nor a folder in a model file's place its download."""
    known = ", ".join(EMBEDDED)
    for name in names:
        if name not in EMBEDDED:
            raise ForerunError(
                f"unknown model name {name!r}; embedded models are: {known} (`forerun models list` shows them)"
            )
    models = [EMBEDDED[name] for name in dict.fromkeys(names)]
    for model in models:
        if (path := model_file(model)).is_dir():
            raise ForerunError(
                f"{path} is a folder, where `forerun models fetch` writes {model.name}; "
                "move it away, or point FORERUN_HOME at another folder"
            )
    return models
