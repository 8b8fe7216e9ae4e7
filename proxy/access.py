"""Who is asking: set on each request by the auth middleware (proxy/app.py)."""

from aiohttp import web

# Whether the caller holds an admin key (or no admin keys are configured, when admin falls
# back to the API keys, or stays open with none).
ADMIN: web.RequestKey[bool] = web.RequestKey("admin", bool)
