"""The soak's crowd of bad clients, held for the whole run beside the request mix: idle connections that send
nothing (each reopened as soon as the server cuts it) and slow readers that ask for a long stream and read it a
byte a second. Neither may slow /health, the mix, or the engine."""

from __future__ import annotations

import asyncio
import json

SLOW_READ_BYTES_PER_S = 1


class Crowd:
    def __init__(self, host: str, port: int, model: str, idle: int, slow: int) -> None:
        self.host, self.port, self.model = host, port, model
        self.idle, self.slow = idle, slow
        self.open_idle = 0
        self.cuts = 0  # idle connections the server closed (its header deadline, or its connection limit)
        self.slow_streams = 0
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._idle_one()) for _ in range(self.idle)]
        self._tasks += [asyncio.create_task(self._slow_one()) for _ in range(self.slow)]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def stats(self) -> dict:
        return {"idle_open": self.open_idle, "idle_cuts": self.cuts, "slow_streams": self.slow_streams}

    async def _idle_one(self) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(1.0)
                continue
            self.open_idle += 1
            try:
                await reader.read()  # nothing is sent: the server closes it at its header deadline
            except OSError:
                pass
            finally:
                self.open_idle -= 1
                self.cuts += 1
                writer.close()
            await asyncio.sleep(0.1)

    async def _slow_one(self) -> None:
        body = json.dumps({"model": self.model, "max_tokens": 256, "stream": True, "ignore_eos": True,
                           "messages": [{"role": "user", "content": "Tell me a long story."}]}).encode()
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, limit=64)
                writer.transport.set_write_buffer_limits(0)
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    import socket

                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)  # so the server feels the slowness
                writer.write(head + body)
                await writer.drain()
                self.slow_streams += 1
                while await reader.read(SLOW_READ_BYTES_PER_S):
                    await asyncio.sleep(1.0)
                writer.close()
            except OSError:
                await asyncio.sleep(1.0)
