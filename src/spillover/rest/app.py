"""The job master's REST API (Starlette): Flink's paths and JSON names, Prometheus
metrics at ``/metrics``, and the dashboard at ``/``. Reads are open; mutating calls
need ``Authorization: Bearer <token>`` with the job's token (401 otherwise). Errors
are Flink's ``{"errors": [...]}``: 400 bad input, 404 unknown job or checkpoint,
409 a job that has ended."""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from spillover.errors import ConfigError, JobNotRunningError, SpilloverError
from spillover.rest import views
from spillover.rest.job import ServedJob
from spillover.rest.metrics import registry_for

Handler = Callable[[Request], Awaitable[Response]]


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"errors": [message]}, status_code=status)


def _static(name: str) -> bytes:
    return (resources.files("spillover.rest") / "static" / name).read_bytes()


def create_app(job: ServedJob, token: str, on_command: Callable[[], None]) -> Starlette:
    """The API of one job. ``on_command()`` is called after every accepted mutating
    call (which ``job.commands`` records), on a worker thread."""
    registry = registry_for(job)

    def for_job(handler: Callable[[Request], Any], mutating: bool = False) -> Handler:
        async def endpoint(request: Request) -> Response:
            if request.path_params.get("jid") != job.job_id:
                return _error(404, f"Job {request.path_params.get('jid')} not found")
            if mutating:
                given = request.headers.get("authorization", "")
                if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return _error(401, "a mutating call needs the job's token (Bearer)")
            try:
                out = handler(request)
                if isinstance(out, Awaitable):
                    out = await out
            except JobNotRunningError as e:
                return _error(409, str(e))
            except (ConfigError, ValueError) as e:
                return _error(400, str(e))
            except SpilloverError as e:
                return _error(500, str(e))
            return out if isinstance(out, Response) else JSONResponse(out)

        return endpoint

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        if not raw:
            return {}
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ConfigError("the request body must be a JSON object")
        return data

    # -- reads --------------------------------------------------------------------------

    async def jobs(request: Request) -> Response:
        return JSONResponse(views.jobs_overview_json(job))

    async def overview(request: Request) -> Response:
        st = job.executor.status.snapshot()
        return JSONResponse(
            {
                "jobs": [
                    {
                        "jid": job.job_id,
                        "name": job.name,
                        "state": st.state,
                        "start-time": st.start_ms,
                        "end-time": st.end_ms or -1,
                    }
                ]
            }
        )

    def details(request: Request) -> Any:
        return views.job_json(job)

    def checkpoints(request: Request) -> Any:
        return views.checkpoints_json(job.executor.stats.snapshot())

    def checkpoint_config(request: Request) -> Any:
        return views.checkpoint_config_json(job)

    def checkpoint(request: Request) -> Any:
        cid = int(request.path_params["cid"])
        c = job.executor.stats.snapshot().find(cid)
        if c is None:
            return _error(404, f"Could not find checkpointing statistics for checkpoint {cid}.")
        return views.checkpoint_json(c, tasks=True)

    def subtasks(request: Request) -> Any:
        cid = int(request.path_params["cid"])
        vertex = request.path_params["vid"]
        c = job.executor.stats.snapshot().find(cid)
        by_uid = {v.uid: v for v in job.executor.graph.vertices}
        if c is None or vertex not in by_uid:
            return _error(404, f"No statistics of vertex {vertex} in checkpoint {cid}.")
        return views.subtasks_json(c, vertex, by_uid[vertex].parallelism)

    def exceptions(request: Request) -> Any:
        return views.exceptions_json(job)

    def operation(request: Request) -> Any:
        op = job.operation(request.path_params["tid"])
        if op is None:
            return _error(404, f"There is no savepoint operation {request.path_params['tid']}.")
        return views.operation_json(op)

    def resource_requirements(request: Request) -> Any:
        return {
            v.uid: {"parallelism": {"lowerBound": 1, "upperBound": v.parallelism}}
            for v in job.executor.graph.vertices
        }

    async def metrics(request: Request) -> Response:
        data = await run_in_threadpool(generate_latest, registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    async def dashboard(request: Request) -> Response:
        return Response(_static("index.html"), media_type="text/html; charset=utf-8")

    async def script(request: Request) -> Response:
        return Response(_static("dashboard.js"), media_type="text/javascript; charset=utf-8")

    async def config(request: Request) -> Response:
        return JSONResponse({"jid": job.job_id, "name": job.name, "flink-version": "spillover"})

    # -- mutations ------------------------------------------------------------------------

    async def savepoint(request: Request) -> Any:
        b = await body(request)
        if b.get("cancel-job"):
            raise ConfigError("cancel-job is not supported", hint="POST /jobs/:id/stop")
        target = b.get("target-directory")
        unaligned = bool(b.get("unaligned", False))
        tid = await run_in_threadpool(job.trigger_savepoint, target, unaligned)
        await run_in_threadpool(on_command)
        return JSONResponse({"request-id": tid}, status_code=202)

    async def stop(request: Request) -> Any:
        b = await body(request)
        target = b.get("targetDirectory")
        drain, unaligned = bool(b.get("drain", False)), bool(b.get("unaligned", False))
        tid = await run_in_threadpool(job.trigger_stop, target, drain, unaligned)
        await run_in_threadpool(on_command)
        return JSONResponse({"request-id": tid}, status_code=202)

    async def patch(request: Request) -> Any:
        mode = request.query_params.get("mode", "cancel")
        if mode != "cancel":
            raise ConfigError(f"unknown mode {mode!r}", hint="mode=cancel")
        await run_in_threadpool(job.cancel)
        await run_in_threadpool(on_command)
        return JSONResponse({}, status_code=202)

    async def rescale(request: Request) -> Any:
        wanted = views.parse_resource_requirements(await body(request))
        rid = await run_in_threadpool(job.rescale, wanted)
        await run_in_threadpool(on_command)
        return JSONResponse({"request-id": rid})

    r = Route
    routes = [
        r("/", dashboard),
        r("/dashboard.js", script),
        r("/config", config),
        r("/metrics", metrics),
        r("/jobs", jobs),
        r("/jobs/overview", overview),
        r("/jobs/{jid}", for_job(details)),
        r("/jobs/{jid}", for_job(patch, mutating=True), methods=["PATCH"]),
        r("/jobs/{jid}/checkpoints", for_job(checkpoints)),
        r("/jobs/{jid}/checkpoints/config", for_job(checkpoint_config)),
        r("/jobs/{jid}/checkpoints/details/{cid:int}", for_job(checkpoint)),
        r("/jobs/{jid}/checkpoints/details/{cid:int}/subtasks/{vid}", for_job(subtasks)),
        r("/jobs/{jid}/exceptions", for_job(exceptions)),
        r("/jobs/{jid}/savepoints", for_job(savepoint, mutating=True), methods=["POST"]),
        r("/jobs/{jid}/savepoints/{tid}", for_job(operation)),
        r("/jobs/{jid}/stop", for_job(stop, mutating=True), methods=["POST"]),
        r("/jobs/{jid}/resource-requirements", for_job(resource_requirements)),
        r("/jobs/{jid}/resource-requirements", for_job(rescale, mutating=True), methods=["PUT"]),
    ]
    return Starlette(routes=routes)
