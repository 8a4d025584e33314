"""Users and their quotas (admin only), token rotation (an admin, or the user for themself), and who a token is."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from api_schemas.jobs import Role, UserCreate, UserCreated, UserPublic, UserUpdate
from api_schemas.notify import WebhookSecret
from service.api.deps import AdminUser, CurrentUser, StateDep, admin_user
from service.api.responses import ADMIN, AUTHED, BODY, USER, error
from service.api.strict import strict_json
from service.core.errors import Forbidden, InvalidState
from service.core.storage_lifecycle import GB, used_bytes

router = APIRouter(prefix="/v1", tags=["users"], responses=AUTHED)


@router.post("/users", status_code=201, responses=ADMIN | BODY | {409: error("the name is taken")},
             dependencies=[Depends(strict_json(UserCreate, admin_user))])
def create_user(body: UserCreate, st: StateDep, admin: AdminUser) -> UserCreated:
    """Create a user with quotas (admin only); the token is in this response and nowhere else."""
    user, token = st.store.create_user(body)
    return UserCreated(user=user, token=token)


@router.get("/users", responses=ADMIN)
def list_users(st: StateDep, admin: AdminUser) -> list[UserPublic]:
    """Every user and their quotas (admin only)."""
    return st.store.users()


@router.patch("/users/{name}", responses=ADMIN | USER | BODY | {409: error("an admin asked to disable themself")},
              dependencies=[Depends(strict_json(UserUpdate, admin_user))])
def update_user(name: str, body: UserUpdate, st: StateDep, admin: AdminUser) -> UserPublic:
    """Change a user's quotas (field by field), ``can_submit_code`` or ``disabled`` (admin only); a disabled
    user's tokens are refused at once, in every API process."""
    if name == admin.name and body.disabled:
        raise InvalidState("an admin cannot disable themself: ask another admin", field="disabled")  # (a state)
    return st.store.update_user(name, body)


@router.post("/users/{name}/token", responses={403: error("a user may rotate only their own token")} | USER)
def rotate_token(name: str, st: StateDep, user: CurrentUser) -> UserCreated:
    """A new token for ``name`` (an admin, or the user for themself), shown once; the old token is refused from
    now on, and a stream it opened ends within 2 s."""
    if user.role != Role.ADMIN and user.name != name:
        raise Forbidden("you can rotate only your own token", field="name")
    changed, token = st.store.rotate_token(name)
    return UserCreated(user=changed, token=token)


@router.get("/me")
def me(st: StateDep, user: CurrentUser) -> UserPublic:
    """Who this token belongs to, and the storage their ended jobs hold (``quotas.max_storage_gb``)."""
    return user.model_copy(update={"storage_used_gb": round(used_bytes(st.store, user.name) / GB, 3)})


@router.get("/me/webhook-secret")
def webhook_secret(st: StateDep, user: CurrentUser) -> WebhookSecret:
    """The key your job webhooks are signed with (made on first use): each POST carries
    ``X-Tlab-Signature: sha256=<HMAC-SHA256 of the raw body, hex>``."""
    return WebhookSecret(secret=st.store.webhook_secret(user.name))
