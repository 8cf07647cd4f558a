"""``/v1/schemas``: register (precompute), list and delete PML schemas.

::

    POST   /v1/schemas          {"schema": "<schema name=...>...</schema>"} -> 200 schema info
    GET    /v1/schemas          -> {"object": "list", "data": [schema info, ...]}
    DELETE /v1/schemas/{name}   -> {"name": ..., "deleted": true}; 404 if unknown

Precompute runs on the engine thread (``AsyncEngine.call``), between steps: requests wait
while a schema's modules are encoded. Bad markup is a 400 whose message names the line and
column, or the module / parameter.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from kvreuse.pml import PMLError
from kvreuse.api.errors import APIError
from kvreuse.server.context import context_of

router = APIRouter()


class SchemaRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_: StrictStr = Field(alias="schema", min_length=1)  # the PML text


@router.post("/v1/schemas")
async def create_schema(body: SchemaRequest, request: Request):
    """Raises 400 naming line/column or the module for bad PML, or the pool being too small."""
    engine = context_of(request).engine
    text = body.schema_
    try:
        info = await engine.call(lambda e: e.modules.register(text))
    except PMLError as exc:
        raise APIError(str(exc), param="schema") from None
    return {"object": "schema", **info.to_json()}


@router.get("/v1/schemas")
async def list_schemas(request: Request):
    engine = context_of(request).engine
    infos = await engine.call(lambda e: [e.modules.info(name) for name in sorted(e.modules.schemas)])
    return {"object": "list", "data": [{"object": "schema", **i.to_json()} for i in infos]}


@router.delete("/v1/schemas/{name}")
async def delete_schema(name: str, request: Request):
    engine = context_of(request).engine
    if not await engine.call(lambda e: e.modules.remove(name)):
        raise APIError(f"schema {name!r} is not registered", status=404, type="not_found_error", param="name")
    return {"object": "schema", "name": name, "deleted": True}
