"""A user's own code: factory references (``pkg.module:function``), the spec's ``code`` section, and the
``POST /v1/code`` answer.

A factory reference names a function in an importable module: the user's uploaded package (``code.package``,
unpacked as the Ray job's working directory) or an installed one. Only its form is checked here, at submit;
whether it imports is the workers' business (``workers.train.user_code``). Pure pydantic.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
FACTORY_PATTERN = rf"^{IDENT}(\.{IDENT})*:{IDENT}(\.{IDENT})*$"
_FACTORY = re.compile(FACTORY_PATTERN)
PACKAGE_PATTERN = r"^sha256:[0-9a-f]{64}$"
BUILTIN_LOSSES = ("cross_entropy", "mse")
MAX_REQUIREMENTS = 64
# a pip requirement string (PEP 508 name, extras, version specifiers, markers); never a pip option such as
# ``--index-url`` or ``-e``, a path or a URL (``name @ https://...``): the cluster's own index configuration
# decides where packages come from
_REQUIREMENT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,\s-]+\])?\s*([<>=!~; ][^\n\r]*)?$")


def check_factory(value: str) -> str:
    """``pkg.module:function`` (dotted module path, a colon, a dotted attribute path), or ValueError."""
    if not _FACTORY.fullmatch(value):
        raise ValueError(f"{value!r} is not a factory reference: write it as package.module:function "
                         "(e.g. mylab.models:build), a module path, a colon and a function name")
    return value


def check_loss(value: str) -> str:
    """A built-in loss name or a factory reference."""
    if value in BUILTIN_LOSSES:
        return value
    if ":" not in value:
        raise ValueError(f"{value!r} is not a loss: use cross_entropy, mse, or package.module:function")
    return check_factory(value)


def check_requirement(value: str) -> str:
    if len(value) > 200 or not _REQUIREMENT.fullmatch(value.strip()) or "@" in value or "://" in value or " -" in value:
        raise ValueError(f"{value[:60]!r} is not a pip requirement (like 'einops==0.8.0' or 'numpy>=1.26'); "
                         "pip options (--index-url, -e), paths and URLs are not taken: packages come from the "
                         "cluster's index")
    return value.strip()


LOSS_PATTERN = rf"^({'|'.join(BUILTIN_LOSSES)}|{FACTORY_PATTERN[1:-1]})$"
# the patterns go into the JSON Schema as they are checked (by ``check_factory``/``check_loss``, whose one-line errors
# say how to write one): a generated client or a fuzzer sends no reference the server refuses
FactoryRef = Annotated[str, Field(max_length=300, description="package.module:function",
                                  json_schema_extra={"pattern": FACTORY_PATTERN}), AfterValidator(check_factory)]
LossRef = Annotated[str, Field(max_length=300, description="cross_entropy, mse, or package.module:function",
                               json_schema_extra={"pattern": LOSS_PATTERN}), AfterValidator(check_loss)]
Requirement = Annotated[str, AfterValidator(check_requirement)]


class CodeSpec(BaseModel):
    """``spec.code``: the uploaded package the job runs with, and pip requirements installed for it."""

    model_config = ConfigDict(extra="forbid")

    package: str | None = Field(None, pattern=PACKAGE_PATTERN,
                                description="the id POST /v1/code answered (sha256:<hex> of the zip's bytes); "
                                            "`tlab submit --code DIR` sets it")
    requirements: list[Requirement] = Field(
        default_factory=list, max_length=MAX_REQUIREMENTS,
        description="pip requirement strings, installed from the cluster's configured index (Ray runtime_env pip)")


class CodePackage(BaseModel):
    """``POST /v1/code`` and ``GET /v1/code/{package}``: a stored package."""

    package: str = Field(..., description="sha256:<hex> of the zip's bytes: the same bytes, the same id")
    bytes: int = Field(..., description="size of the zip")
    owner: str
    files: int = Field(..., description="files in the zip")
    unpacked_bytes: int = Field(..., description="total size of its files unpacked")
    created_at: float


def package_hex(package: str) -> str:
    """``sha256:<hex>`` -> ``<hex>`` (ValueError when it is not such an id)."""
    if not re.fullmatch(PACKAGE_PATTERN, package):
        raise ValueError(f"{package[:80]!r} is not a package id: it looks like sha256:<64 hex digits>")
    return package.removeprefix("sha256:")
