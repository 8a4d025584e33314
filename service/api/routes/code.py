"""Code packages: upload a zip of your package (content-addressed), read a package's metadata (owner or admin)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.concurrency import run_in_threadpool

from api_schemas.code import CodePackage
from service.api.deps import CurrentUser, StateDep
from service.api.responses import AUTHED, error
from service.core.code_store import MB, check_may_run_code, find_package, store_package
from service.core.errors import InvalidInput, PayloadTooLarge, UnsupportedMediaType

router = APIRouter(prefix="/v1/code", tags=["code"], responses=AUTHED)
BINARY = {"schema": {"type": "string", "format": "binary"}}
# what the schema can say of the body: a zip (the server also takes it sent as application/octet-stream or
# application/x-zip-compressed, and checks that it is a safe zip: 422 otherwise)
ZIP_BODY = {"requestBody": {"required": True, "content": {"application/zip": BINARY}}}


async def read_capped(request: Request, limit: int) -> bytes:
    """The raw body, refused (413 naming the cap) from its Content-Length or as soon as it passes ``limit``."""
    too_big = PayloadTooLarge(f"the package is over this service's limit of {limit / MB:g} MiB (TLAB_MAX_CODE_MB): "
                              "leave data, checkpoints and virtualenvs out (.tlabignore)", field="body")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_big
    chunks, seen = [], 0
    async for chunk in request.stream():
        seen += len(chunk)
        if seen > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


@router.post("", status_code=201, openapi_extra=ZIP_BODY, responses={
    200: {"description": "the same bytes were uploaded before: the stored package"},
    403: error("user code is turned off on this service (TLAB_USER_CODE=off), or for you (can_submit_code)"),
    413: error("the zip is over TLAB_MAX_CODE_MB"),
    415: error("the body is not sent as application/zip"),
    422: error("not a zip, an absolute, '..' or symlink member, or over TLAB_MAX_CODE_UNPACKED_MB unpacked")})
async def upload(request: Request, response: Response, st: StateDep, user: CurrentUser) -> CodePackage:
    """Store a zip of your package; its id is ``sha256:<hex>`` of the bytes (the same bytes: the same id, 200)."""
    check_may_run_code(st.settings, user, "code")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in ("application/zip", "application/x-zip-compressed", "application/octet-stream"):
        raise UnsupportedMediaType(f"send the zip as Content-Type: application/zip (got {kind or 'none'})",
                                   field="Content-Type")
    data = await read_capped(request, int(st.settings.max_code_mb * MB))
    if not data:
        raise InvalidInput("the body is empty: send the zip of your package's directory", field="body")
    package, created = await run_in_threadpool(store_package, st.settings, user.name, data)
    if not created:
        response.status_code = 200
    return package


@router.get("/{package}", responses={404: error("no such package of yours (another user's is not shown)")})
def get_package(package: str, st: StateDep, user: CurrentUser) -> CodePackage:
    """A package's size, file count and owner: yours (admins: anyone's)."""
    return find_package(st.settings, user, package)
