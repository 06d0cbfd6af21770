"""The server's hang watch (``--engine-timeout``): ``/health`` answers 503 naming the engine
while a request waits on a step that does not end, and 200 again once the engine answers. The
step is held in the engine's thread (``Hold``), as a stopped engine would hold it."""

from __future__ import annotations

import logging

import anyio
from helpers.live_serve import Hold, Stream, serving


async def test_health_names_an_engine_whose_step_does_not_end(llama, caplog):
    caplog.set_level(logging.ERROR, logger="bootstrap.serve")
    async with serving(llama, engine_timeout_s=1e-9) as server:
        assert (await server.http.get("/health")).json() == {"status": "ok"}  # nothing waits: no stall
        hold, stream = Hold(server.state.boot.executor), Stream(server.app, server.completion())
        async with anyio.create_task_group() as tg:
            try:
                tg.start_soon(stream.run)
                await stream.next_chunk()  # the next forward waits in the engine's thread
                stalled = [await server.http.get("/health") for _ in range(2)]
            finally:
                hold.release()
            events = await stream.rest()
        healthy = await server.http.get("/health")
    assert [r.status_code for r in stalled] == [503, 503]
    body = stalled[0].json()
    assert body["status"] == "engine_stalled" and body["message"].startswith("engine: no step has answered for ")
    assert "while 1 request(s) wait on it (--engine-timeout 1e-09)" in body["message"]
    assert [r.getMessage() for r in caplog.records if "/health" in r.getMessage()] == [f"/health: {body['message']}"]
    assert events[-1] == "[DONE]" and healthy.status_code == 200
