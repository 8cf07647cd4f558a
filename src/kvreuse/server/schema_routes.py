"""``/v1/schemas``: register (precompute), list and delete PML schemas.

::

    POST   /v1/schemas          {"schema": "<schema name=...>...</schema>"} -> 200 schema info
    GET    /v1/schemas          -> {"object": "list", "data": [schema info, ...]}
    DELETE /v1/schemas/{name}   -> {"name": ..., "deleted": true}; 404 if unknown

A POST is compiled and priced in a worker thread; a schema over ``--schema-max-tokens`` /
``--schema-max-bytes`` (or larger than the pool) is a 400 naming the limit before any work.
Its modules are then precomputed on the engine thread in slices of at most
``--schema-slice-tokens`` tokens per engine step, between the steps of the requests in flight
(``AsyncEngine.register_schema``), so streaming clients keep getting tokens; the POST answers
once the schema serves. Until then prompts see the version registered before (or none);
``GET`` lists the registrations in progress under ``registering``. Bad markup is a 400 whose
message names the line and column, or the module / parameter.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from kvreuse.api.errors import APIError
from kvreuse.pml import PMLError
from kvreuse.pml.schema_cost import SchemaTooLarge
from kvreuse.server.context import context_of

router = APIRouter()


def _code(exc: PMLError) -> str | None:
    return "schema_too_large" if isinstance(exc, SchemaTooLarge) else None


class SchemaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_: StrictStr = Field(alias="schema", min_length=1)  # the PML text


@router.post("/v1/schemas")
async def create_schema(body: SchemaRequest, request: Request):
    """Raises 400 naming line/column or the module for bad PML, or the pool being too small."""
    engine = context_of(request).engine
    text = body.schema_
    try:
        info = await engine.register_schema(text)
    except PMLError as exc:
        raise APIError(str(exc), param="schema", code=_code(exc)) from None
    return {"object": "schema", **info.to_json()}


@router.get("/v1/schemas")
async def list_schemas(request: Request):
    engine = context_of(request).engine
    listing = await engine.list_schemas()
    return {
        "object": "list",
        "data": [{"object": "schema", **i.to_json()} for i in listing.schemas],
        "registering": [job.to_json() for job in listing.registering],
    }


@router.delete("/v1/schemas/{name}")
async def delete_schema(name: str, request: Request):
    engine = context_of(request).engine
    if not await engine.remove_schema(name):
        raise APIError(f"schema {name!r} is not registered", status=404, type="not_found_error", param="name")
    return {"object": "schema", "name": name, "deleted": True}
