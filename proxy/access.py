"""Who is asking: set on each request by the auth middleware (proxy/app.py)."""

from aiohttp import web

# Whether the caller holds an admin key (or no admin keys are configured, when admin falls
# back to the API keys, or stays open with none).
ADMIN: web.RequestKey[bool] = web.RequestKey("admin", bool)
# Which API key authenticated the request, by name: a digest of the key (never the key), the
# same for every request with that key; None when no keys are configured. The prompt cache
# keeps each name's saves and slots apart (supervisor.port.CALLER carries it there).
CALLER: web.RequestKey[str | None] = web.RequestKey("caller", str)
