"""Users' code packages: a zip, checked, stored once per content under ``<storage>/code/<user>/<hex>.zip``.

The id is ``sha256:<hex>`` of the zip's bytes: the same bytes twice are the same package, stored once. A package
is checked before it is kept (each refusal names what to change): a real zip, no absolute or ``..`` member
names, no symlinks, its files' total unpacked size within ``TLAB_MAX_CODE_UNPACKED_MB`` (a zip bomb never gets
unpacked: Ray's unzip stops each member at its declared size, which is what is summed here). The zip itself is
capped by the route, as it arrives (``TLAB_MAX_CODE_MB``).

The scheduler hands a job's package to Ray as its runtime_env ``working_dir`` (``runtime_env_for``): Ray uploads
the zip to its own store and unpacks it on every node; this copy stays, for a restarted cluster. No FastAPI here.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import ValidationError

from api_schemas import keys
from api_schemas.code import CodePackage, package_hex
from api_schemas.jobs import Role, UserPublic
from api_schemas.spec import ExperimentSpec
from service import storage
from service.errors import Forbidden, InvalidInput, JobNotFound, Unstartable
from service.settings import Settings

MB = 1 << 20


class PackageNotFound(JobNotFound):
    """No such package, or another user's (both 404: whether another user's exists is not told)."""


def code_dir(settings: Settings) -> Path:
    return Path(settings.storage_path) / "code"


def package_path(settings: Settings, owner: str, package: str) -> Path:
    return code_dir(settings) / owner / f"{package_hex(package)}.zip"


def _bad(message: str) -> InvalidInput:
    return InvalidInput(message, field="body")


def check_zip(data: bytes, max_unpacked: int) -> tuple[int, int]:
    """(files, unpacked bytes) of a zip that is safe to unpack, or InvalidInput (422) saying what is wrong."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError):
        raise _bad("the body is not a zip archive: send the zip of your package's directory "
                   "(tlab submit --code DIR makes it)") from None
    total, files = 0, 0
    for info in infos:
        name = info.filename
        parts = PurePosixPath(name.replace("\\", "/")).parts
        if name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
            raise _bad(f"member {name[:100]!r} has an absolute name: zip the directory's contents with relative names")
        if ".." in parts:
            raise _bad(f"member {name[:100]!r} has '..' in its name: it would unpack outside the package")
        if stat.S_ISLNK(info.external_attr >> 16):
            raise _bad(f"member {name[:100]!r} is a symbolic link: put the file itself in the package")
        if not info.is_dir():
            files += 1
            total += info.file_size
        if total > max_unpacked:
            raise _bad(f"the files unpack to more than {max_unpacked / MB:g} MiB (TLAB_MAX_CODE_UNPACKED_MB): "
                       "leave data and checkpoints out of the package")
    if files == 0:
        raise _bad("the zip holds no files: zip your package's directory")
    return files, total


def describe(path: Path, owner: str, package: str) -> CodePackage:
    with zipfile.ZipFile(path) as archive:
        infos = [i for i in archive.infolist() if not i.is_dir()]
    st = path.stat()
    return CodePackage(package=package, bytes=st.st_size, owner=owner, files=len(infos),
                       unpacked_bytes=sum(i.file_size for i in infos), created_at=st.st_mtime)


def store_package(settings: Settings, owner: str, data: bytes) -> tuple[CodePackage, bool]:
    """Check and keep ``data``: (the package, True if it was new). The same bytes again keep the first copy."""
    package = f"sha256:{hashlib.sha256(data).hexdigest()}"
    path = package_path(settings, owner, package)
    if path.exists():
        storage.put(settings, path, missing_only=True)  # with a bucket: its copy, if the first upload failed
        return describe(path, owner, package), False
    check_zip(data, int(settings.max_code_unpacked_mb * MB))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the whole zip or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    storage.put(settings, path)  # with a bucket as storage: its durable copy
    return describe(path, owner, package), True


def find_package(settings: Settings, user: UserPublic, package: str) -> CodePackage:
    """The package if ``user`` owns it (an admin: whoever does); 404 otherwise, or when the id is not one."""
    try:
        hexdigest = package_hex(package)
    except ValueError as err:
        raise PackageNotFound(str(err), field="package") from None
    owners = [user.name] if user.role != Role.ADMIN else sorted(p.name for p in code_dir(settings).glob("*"))
    for owner in owners:
        path = code_dir(settings) / owner / f"{hexdigest}.zip"
        if storage.fetch(settings, path):
            return describe(path, owner, package)
    raise PackageNotFound(f"no code package {package} of yours: upload it with POST /v1/code "
                          "(tlab submit --code DIR does)", field="package")


def check_may_run_code(settings: Settings, user: UserPublic, field: str, why: str = "") -> None:
    """403 unless user code is on for the service (``TLAB_USER_CODE``) and for the user (``can_submit_code``;
    admins may)."""
    if not settings.user_code:
        raise Forbidden(f"this service runs no user code (TLAB_USER_CODE=off){why}: use built-in model kinds, "
                        "datasets and losses, or ask an admin", field=field)
    if user.role != Role.ADMIN and not user.can_submit_code:
        raise Forbidden(f"your user may not run its own code{why}: ask an admin to allow it "
                        f"(tlab users set {user.name} --can-submit-code yes)", field=field)


def check_code(settings: Settings, user: UserPublic, spec: ExperimentSpec, prefix: str) -> None:
    """User code allowed (``check_may_run_code``), and ``code.package`` one the user uploaded."""
    uses = spec.user_code_fields()
    if uses:
        check_may_run_code(settings, user, f"{prefix}.code", f", and {', '.join(uses)} would")
    package = spec.code.package if spec.code is not None else None
    if package and not storage.fetch(settings, package_path(settings, user.name, package)):
        raise InvalidInput(f"no code package {package} of yours: upload it first (POST /v1/code; "
                           "tlab submit --code DIR does both)", field=f"{prefix}.code.package")


def runtime_env_for(settings: Settings, owner: str, spec: ExperimentSpec) -> dict[str, Any]:
    """The Ray runtime_env part for a job's code: ``working_dir`` (the stored zip) and ``pip`` (requirements)."""
    if spec.code is None:
        return {}
    env: dict[str, Any] = {}
    if spec.code.package:
        env["working_dir"] = str(package_path(settings, owner, spec.code.package))
    if spec.code.requirements:
        env["pip"] = list(spec.code.requirements)
    return env


class JobCode:
    """What ``RayJobs.submit`` asks for a job's runtime_env: its package and requirements, read from Redis."""

    def __init__(self, settings: Settings, redis_client: Any) -> None:
        self.settings, self.r = settings, redis_client

    def __call__(self, job_id: str) -> dict[str, Any]:
        """Raises ``Unstartable`` when the job can never start as stored (the scheduler fails it at once)."""
        owner, raw = self.r.hmget(keys.job(job_id), ["owner", "spec"])
        if not owner or not raw:
            return {}
        try:
            spec = ExperimentSpec.model_validate_json(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "spec"
            raise Unstartable(f"its stored spec no longer validates (spec.{where}: {first['msg']}): "
                              "submit it again with a corrected spec") from None
        env = runtime_env_for(self.settings, owner, spec)
        if "working_dir" in env and not storage.fetch(self.settings, Path(env["working_dir"])):
            raise Unstartable(f"its code package {spec.code.package if spec.code else ''} is no longer stored: "
                              "upload the directory again (tlab submit --code DIR) and resubmit")
        return env
