"""`ferry serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over an `AsyncEngine`.

Modules: `protocol` (wire shapes), `app` (routes and streaming), `metrics` (Prometheus), `auth` (API key
and body size middleware), `cli` (flags, process life-cycle and signals).
"""
