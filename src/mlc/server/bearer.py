"""The bearer scheme routes declare, so that /openapi.json documents it; `server/auth.py`'s middleware does the
checking. Its own module so that observability's routes can declare it without importing auth (which records
the key's name in the audit info)."""

from __future__ import annotations

from fastapi.security import HTTPBearer

bearer_scheme = HTTPBearer(auto_error=False, description="Needed when the server runs with --api-key / MLC_API_KEY.")
