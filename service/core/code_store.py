"""Users' code packages: a zip, checked, stored once per content under ``<storage>/code/<user>/<hex>.zip``.

The id is ``sha256:<hex>`` of the zip's bytes: the same bytes twice are the same package, stored once. A package
is checked before it is kept (each refusal names what to change): a real zip, no absolute or ``..`` member
names, no symlinks, its files' total unpacked size within ``TLAB_MAX_CODE_UNPACKED_MB`` (a zip bomb never gets
unpacked: Ray's unzip stops each member at its declared size, which is what is summed here). The zip itself is
capped by the route, as it arrives (``TLAB_MAX_CODE_MB``).

The scheduler hands a job's package to Ray as its runtime_env ``working_dir`` (``runtime_env_for``): Ray uploads
the zip to its own store and unpacks it on every node; this copy stays, for a restarted cluster. No FastAPI here.

A job can write the storage, so a stored package is verified at every use (``read_package``): read without
following a link (``service.core.safe_files``), hashed against its sha256 name. A mismatch (or a link, a special file)
refuses the job naming the package; ``GET /v1/code/{id}`` answers 404 so that ``tlab submit --code`` uploads it
again, and ``store_package`` replaces it. What the scheduler hands Ray is a verified copy of its own
(``verified_copy``, under ``$TLAB_HOME/packages``), never the file in storage.
"""

from __future__ import annotations

import hashlib
import io
import logging
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
from service.core import safe_files, storage
from service.core.errors import Forbidden, InvalidInput, JobNotFound, Unstartable
from service.core.sandbox_state import sandbox_state
from service.core.settings import Settings
from service.core.zip_modes import masked

MB = 1 << 20
log = logging.getLogger("tlab.code")


class PackageNotFound(JobNotFound):
    """No such package, or another user's (both 404: whether another user's exists is not told)."""


def code_dir(settings: Settings) -> Path:
    return Path(settings.storage_path) / "code"


def package_path(settings: Settings, owner: str, package: str) -> Path:
    return code_dir(settings) / owner / f"{package_hex(package)}.zip"


def _bad(message: str) -> InvalidInput:
    return InvalidInput(message, field="body")


def check_zip(data: bytes, max_unpacked: int, max_files: int = 10_000) -> tuple[int, int]:
    """(files, unpacked bytes) of a zip that is safe to unpack, or InvalidInput (422) saying what is wrong."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError):
        raise _bad("the body is not a zip archive: send the zip of your package's directory "
                   "(tlab submit --code DIR makes it)") from None
    if len(infos) > max_files:
        raise _bad(f"the zip holds {len(infos)} members, more than {max_files} (TLAB_CODE_MAX_FILES): leave data, "
                   "environments and caches out of the package")
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


class TamperedPackage(InvalidInput):
    """A stored package that no longer hashes to its name, or is a link or special file now (422)."""


def read_package(settings: Settings, owner: str, package: str) -> bytes:
    """The stored package's bytes, read without following a link and verified against its sha256 name;
    ``FileNotFoundError`` if there is none, ``TamperedPackage`` (one line naming it, logged) if it changed."""
    path = package_path(settings, owner, package)
    rel = path.relative_to(settings.storage_path).as_posix()
    limit = int(settings.max_code_mb * MB)
    try:
        data = safe_files.read_bytes(settings.storage_path, rel, limit)
    except safe_files.UnsafeFile as err:
        raise TamperedPackage(f"code package {package}: {err.message}; upload it again (tlab submit --code DIR)",
                              field="package") from None
    if hashlib.sha256(data).hexdigest() != package_hex(package):
        log.warning("code package %s of %s does not hash to its name: written over in storage", package, owner)
        raise TamperedPackage(f"code package {package} no longer matches its sha256 (it was changed in storage): "
                              "upload it again (tlab submit --code DIR)", field="package")
    return data


def describe(data: bytes, owner: str, package: str, created_at: float) -> CodePackage:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        infos = [i for i in archive.infolist() if not i.is_dir()]
    return CodePackage(package=package, bytes=len(data), owner=owner, files=len(infos),
                       unpacked_bytes=sum(i.file_size for i in infos), created_at=created_at)


def stored(settings: Settings, owner: str, package: str) -> CodePackage | None:
    """The package as stored and verified, None if missing or tampered with (a re-upload replaces it)."""
    path = package_path(settings, owner, package)
    if not storage.fetch(settings, path):
        return None
    try:
        data = read_package(settings, owner, package)
    except (FileNotFoundError, NotADirectoryError, TamperedPackage):
        return None
    return describe(data, owner, package, path.lstat().st_mtime)


def store_package(settings: Settings, owner: str, data: bytes) -> tuple[CodePackage, bool]:
    """Check and keep ``data``: (the package, True if it was new). The same bytes again keep the first copy, once
    verified; a copy that was changed or replaced by a link in storage is written again."""
    package = f"sha256:{hashlib.sha256(data).hexdigest()}"
    path = package_path(settings, owner, package)
    if (kept := stored(settings, owner, package)) is not None:
        storage.put(settings, path, missing_only=True)  # with a bucket: its copy, if the first upload failed
        os.utime(path, follow_symlinks=False)  # uploaded again: TLAB_CODE_TTL_DAYS counts from now
        return kept, False
    check_zip(data, int(settings.max_code_unpacked_mb * MB), settings.code_max_files)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)
    storage.put(settings, path)  # with a bucket as storage: its durable copy
    return describe(data, owner, package, path.stat().st_mtime), True


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or not at all; a link or file there before is replaced, never followed."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".upload-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # atomic: a reader sees the whole zip or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verified_copy(settings: Settings, owner: str, package: str) -> Path:
    """A copy of the stored package, verified now, where no job writes (``$TLAB_HOME/packages``), its members'
    modes masked to 0644/0755 (``service.core.zip_modes``): what Ray gets."""
    data = read_package(settings, owner, package)
    folder = Path(settings.home) / "packages"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"{package_hex(package)}.zip"
    write_atomic(path, masked(data))
    return path


def find_package(settings: Settings, user: UserPublic, package: str) -> CodePackage:
    """The package if ``user`` owns it (an admin: whoever does); 404 otherwise, or when the id is not one."""
    try:
        hexdigest = package_hex(package)
    except ValueError as err:
        raise PackageNotFound(str(err), field="package") from None
    owners = [user.name] if user.role != Role.ADMIN else sorted(p.name for p in code_dir(settings).glob("*"))
    for owner in owners:
        if (kept := stored(settings, owner, f"sha256:{hexdigest}")) is not None:
            return kept
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
    state = sandbox_state(settings)  # users' code runs in a sandbox, or not at all unless turned off
    if state.startswith("unavailable"):
        raise Forbidden(f"no sandbox can hold users' code on this service{why} ({state.split(': ', 1)[1]}): ask an "
                        "admin (make sandbox; or TLAB_SANDBOX=off, knowingly)", field=field)


def check_code(settings: Settings, user: UserPublic, spec: ExperimentSpec, prefix: str) -> None:
    """User code allowed (``check_may_run_code``), and ``code.package`` one the user uploaded."""
    uses = spec.user_code_fields()
    if uses:
        check_may_run_code(settings, user, f"{prefix}.code", f", and {', '.join(uses)} would")
    package = spec.code.package if spec.code is not None else None
    if not package:
        return
    field = f"{prefix}.code.package"
    try:
        if storage.fetch(settings, package_path(settings, user.name, package)):
            read_package(settings, user.name, package)
            return
    except TamperedPackage as err:
        raise TamperedPackage(err.message, field=field) from None
    except (FileNotFoundError, NotADirectoryError):
        pass
    raise InvalidInput(f"no code package {package} of yours: upload it first (POST /v1/code; "
                       "tlab submit --code DIR does both)", field=field)


def runtime_env_for(settings: Settings, owner: str, spec: ExperimentSpec) -> dict[str, Any]:
    """The Ray runtime_env part for a job's code: ``working_dir`` (a ``verified_copy`` of the stored zip:
    ``TamperedPackage`` if it changed, ``FileNotFoundError`` if it is gone) and ``pip`` (requirements)."""
    if spec.code is None:
        return {}
    env: dict[str, Any] = {}
    if spec.code.package:
        if not storage.fetch(settings, package_path(settings, owner, spec.code.package)):
            raise FileNotFoundError(f"code package {spec.code.package} is not stored")
        env["working_dir"] = str(verified_copy(settings, owner, spec.code.package))
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
        try:
            return runtime_env_for(self.settings, owner, spec)
        except TamperedPackage as err:
            raise Unstartable(err.message) from None
        except (FileNotFoundError, NotADirectoryError):
            package = spec.code.package if spec.code else ""
            raise Unstartable(f"its code package {package} is no longer stored: upload the directory again "
                              "(tlab submit --code DIR) and resubmit") from None
