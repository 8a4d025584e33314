"""One APIRouter per resource (the FastAPI template's ``api/routes/``): find a route by its file name."""
