"""What every command group shares: the API options and client, the spec arguments, one-line errors, tables.

Nothing heavy at the top: ``tlab --help`` imports this module, so the HTTP client (httpx, pydantic-settings)
and the spec loader are imported inside the functions that use them.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from service.cli.client import Client

CELL_MAX = 60  # a table cell longer than this ends in "…"; `show ID` or `--json` has the whole text
ELLIPSIS = "…"


def fail(message: str) -> NoReturn:
    """Exit 1 with ``error: MESSAGE`` on stderr (name the option or file, and what to do)."""
    raise SystemExit(f"error: {message}")


def client(args: argparse.Namespace) -> Client:
    from service.cli.client import Client

    return Client(args.url, args.token)


def add_remote_args(p: argparse.ArgumentParser) -> None:
    """``--url``/``--token`` after the command too; SUPPRESS keeps a value given before the command."""
    p.add_argument("--url", default=argparse.SUPPRESS, help="the API (default: TLAB_URL, else the local `tlab up`)")
    p.add_argument("--token", default=argparse.SUPPRESS, help="bearer token (default: TLAB_TOKEN)")


def add_read_command(sub: Any, name: str, help: str, func: Callable[[argparse.Namespace], int],
                     *positionals: str, options: dict[str, dict[str, Any]] | None = None) -> None:
    """A command that reads from the API: its positionals and ``options`` (flag -> add_argument keywords), then
    ``--json`` and ``--url``/``--token`` after the name."""
    p = sub.add_parser(name, help=help)
    for arg in positionals:
        p.add_argument(arg)
    for flag, kw in (options or {}).items():
        p.add_argument(flag, **kw)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=func)
    add_remote_args(p)


def get_json(args: argparse.Namespace, path: str, **params: Any) -> Any:
    """``GET path`` on the API as JSON (an ApiError carries the API's one-line ``detail``)."""
    with client(args) as c:
        return c.json("GET", path, params=params)


def add_spec_args(p: argparse.ArgumentParser, what: str = "a YAML/JSON spec file or a preset name") -> None:
    p.add_argument("spec", nargs="?", help=what)
    p.add_argument("--preset", default=None)
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[], metavar="PATH=VALUE")


def add_code_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--code", metavar="DIR", default=None,
                   help="your package's directory: zipped (honouring .gitignore and .tlabignore), uploaded once, "
                        "and set as the spec's code.package, so factories (pkg.module:function) import from it")


def spec_from(args: argparse.Namespace) -> dict[str, Any]:
    """The validated spec of ``SPEC``/``--preset`` with ``--set`` applied, as JSON data (SpecError if wrong)."""
    from api_schemas.spec_io import build_spec, load_spec_data

    source = args.preset or args.spec
    if not source:
        fail("give a SPEC file or --preset NAME (`tlab presets` lists them)")
    return build_spec(load_spec_data(source), args.overrides).model_dump(mode="json")


def fmt(value: Any, digits: int = 4) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "-" if value is None else str(value)


def cut(text: str, limit: int = CELL_MAX) -> str:
    """``text`` if it fits in ``limit`` characters, else its start and an ellipsis (``limit`` in all)."""
    return text if len(text) <= limit else text[:limit - 1] + ELLIPSIS


def print_table(rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell, every cell cut at CELL_MAX; the last column is left ragged."""
    rows = [tuple(cut(v) for v in r) for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])


def print_json(data: Any) -> int:
    print(json.dumps(data, indent=2))
    return 0


def gang(demand: dict[str, Any]) -> str:
    """A job view's ``demand`` as the scheduler's reasons write it (``policy.gang_text``)."""
    from api_schemas.jobs import Demand
    from service.rules.policy import gang_text

    return gang_text(Demand.model_validate(demand))


def progress(job: dict[str, Any]) -> str:
    p = job.get("progress") or {}
    if p.get("epoch") is None:
        return "-"
    text = f"{p['epoch']}/{p.get('epochs') or '?'}"
    return text + (f" loss {fmt(p['train_loss'])}" if p.get("train_loss") is not None else "")
