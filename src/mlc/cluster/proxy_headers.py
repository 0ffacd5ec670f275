"""A middleware for Ray Serve's HTTP proxy (loaded through `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH`, set on the
head node's `ray start`): Serve appends its own `x-request-id` to every response, after the server's; keeping only
the first leaves clients the server's request id, as under `mlc-cli serve`."""

from __future__ import annotations

from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ENV_VAR = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
IMPORT_PATH = "mlc.cluster.proxy_headers:middlewares"


class FirstRequestId:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_first_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers, seen = [], False
                for key, value in message.get("headers", []):
                    if key.lower() == b"x-request-id":
                        if seen:
                            continue
                        seen = True
                    headers.append((key, value))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_first_id)


def middlewares() -> list[Middleware]:
    return [Middleware(FirstRequestId)]
