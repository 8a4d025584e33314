"""Domain errors, each with its HTTP status; the API maps them to responses in one place."""

from __future__ import annotations


class ServiceError(Exception):
    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message, self.field = message, field


class InvalidInput(ServiceError):
    status = 422


class Unauthorized(ServiceError):
    status = 401


class Forbidden(ServiceError):
    status = 403


class JobNotFound(ServiceError):
    status = 404


class UserExists(ServiceError):
    status = 409


class IdempotencyConflict(ServiceError):
    status = 409


class InvalidState(ServiceError):
    """The job is in a state the request does not apply to (cancel a finished job)."""

    status = 409


class DoesNotFit(ServiceError):
    """The gang can never fit the cluster: refused at submit."""

    status = 422


class UserNotFound(ServiceError):
    status = 404


class TooManyRequests(ServiceError):
    """Over a per-user cap that frees up by itself (queued jobs, open streams): try again after a while."""

    status = 429

    def __init__(self, message: str, field: str | None = None, retry_after_s: int = 30) -> None:
        super().__init__(message, field)
        self.retry_after_s = retry_after_s


class PayloadTooLarge(ServiceError):
    """A body over its own cap (a code package over TLAB_MAX_CODE_MB)."""

    status = 413


class UnsupportedMediaType(ServiceError):
    status = 415


class Unstartable(Exception):
    """A queued job that can never start as it is stored (its code package is gone, its stored spec no longer
    validates): the scheduler fails it at once with this one line instead of retrying it every tick."""
