"""Users and their quotas (admin only), and who a token belongs to."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.jobs import UserCreate, UserCreated, UserPublic
from service.deps import AdminUser, CurrentUser, StateDep

router = APIRouter(prefix="/v1", tags=["users"])


@router.post("/users", status_code=201, responses={409: {"description": "name taken"}})
def create_user(body: UserCreate, st: StateDep, admin: AdminUser) -> UserCreated:
    """Create a user with quotas (admin only); the token is in this response and nowhere else."""
    user, token = st.store.create_user(body)
    return UserCreated(user=user, token=token)


@router.get("/users")
def list_users(st: StateDep, admin: AdminUser) -> list[UserPublic]:
    """Every user and their quotas (admin only)."""
    return st.store.users()


@router.get("/me")
def me(user: CurrentUser) -> UserPublic:
    """Who this token belongs to."""
    return user
