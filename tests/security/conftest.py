"""The red-team suite attacks the real stack: the service's fixtures (a real Redis, the real API, the scheduler on
the session's Ray head)."""

from tests.service.conftest import api_env, api_only, stack, stack_env  # noqa: F401 (fixtures)
