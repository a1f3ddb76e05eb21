"""The one web stack of psyswarm's two web services, the auth service and the dashboard: starlette apps served
by uvicorn, under one set of limits (``limits.WebLimits``) that both use.

Why uvicorn: it already serves the dashboard, is widely kept, and parses with h11, whose size cap on a request's
headers it exposes. What it lacks is added here, in the small hooks uvicorn gives (its h11 protocol class and
the ASGI app): a deadline for a request's headers (``connections``; uvicorn's ``timeout_keep_alive`` only starts
once an answer is sent, so a connection that trickles a byte a second is held for ever), a cap on open
connections that refuses at once (``limit_concurrency`` answers 503 only once a request's headers are in, so held
connections are never refused), a cap per client address, and a deadline and a size cap for the body (``body``).
Hypercorn, the other candidate, would be a new dependency and lacks the same: its ``read_timeout`` bounds each
read, which a byte a second resets, and it has no cap on connections or bodies.

``server.WebServer`` serves one app on its socket under these limits; ``answers`` is how either service refuses
a request it cannot serve.

May import: local_backend.logs, local_backend.open_files.
"""
