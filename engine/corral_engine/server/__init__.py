"""The engine's OpenAI-compatible HTTP server: routes, streaming, errors, metrics, lifecycle.

`create_app(engine)` builds the FastAPI app; `corral engine` runs it under uvicorn. Nothing here
imports torch; only the engine it serves does.
"""

from __future__ import annotations

from corral_engine.server.app import create_app

__all__ = ["create_app"]
