"""HTTP serving: the native and OpenAI-compatible APIs over the async engine (`create_app`, `serve`)."""

from mlc.server.app import create_app

__all__ = ["create_app"]
