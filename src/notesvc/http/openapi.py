"""The OpenAPI 3.1 document of the route table (GET /api/v1/openapi.json)."""

from __future__ import annotations

import re

from notesvc.boot import KEY_HEADER, __version__, bottle
from notesvc.errors import ERROR_CODES, JSON_TYPE, to_json
from notesvc.oauth import OAUTH_SCOPES
from notesvc.service import Service


def get_openapi(svc: Service):
    bottle.response.content_type = JSON_TYPE
    return to_json(openapi_document(svc, svc.base_url(bottle.request.environ)))


def openapi_path(rule: str) -> str:
    """Return a Bottle rule as an OpenAPI path: <name> and <name:path> become {name}."""
    return re.sub(r"<(\w+)(?::[^>]*)?>", r"{\1}", rule)


_SEGMENT = {"type": "string", "minLength": 1}  # a path parameter without its own schema


def openapi_document(svc: Service, server_url: str) -> dict:
    """Return the OpenAPI 3.1 document of every /api/v1 route in the table."""
    envelope_ok = {
        "type": "object",
        "required": ["success", "data"],
        "properties": {"success": {"const": True}, "data": {"type": "object"}},
    }
    error = {
        "type": "object",
        "required": ["code", "message"],
        "properties": {"code": {"enum": list(ERROR_CODES)}, "message": {"type": "string"}},
    }
    envelope_err = {
        "type": "object",
        "required": ["success", "error"],
        "properties": {"success": {"const": False}, "error": error},
    }
    paths: dict = {}
    for r in svc.routes:
        if not r.api:
            continue
        success = (
            _json_content("Success")
            if r.enveloped
            else {r.media: {"schema": {"type": "object" if "json" in r.media else "string"}}}
        )
        op: dict = {
            "operationId": r.handler.__name__,
            "summary": r.summary or r.handler.__name__.replace("_", " "),
            "tags": [r.tag],
            "responses": {
                **{
                    str(code): {"description": "success", "content": success}
                    for code in sorted({200, r.status})
                },
                "default": {
                    "description": "the error envelope: 400, 401, 403, 404, 405, 409, 410, "
                    "412, 413, 415, 429, 500, 502, 503, 504 or 507",
                    "content": _json_content("Error"),
                },
            },
        }
        if r.jsonrpc:
            answer = {"application/json": {"schema": {"type": "object"}}}
            op["responses"] = {
                "200": {"description": "the JSON-RPC answer", "content": answer},
                "202": {"description": "a notification (or response), accepted"},
                "default": {"description": "a JSON-RPC error object", "content": answer},
            }
            op["security"] = [{"apiKey": []}, {"bearerKey": []}, {"xApiKey": []}, {"bearerJwt": []}]
            op["security"].append({"mcpOAuth": [OAUTH_SCOPES[0]]})  # docs/api.md: Let others in
        if r.public:
            op["security"] = []
        elif r.key_only:
            op["security"] = [{"apiKey": []}]
        if not r.public:
            op["x-scope"] = r.scope
        schemas = r.params or {}  # a name of the rule's is a path parameter, others query
        in_path = re.findall(r"<(\w+)(?::[^>]*)?>", r.path)
        params = [
            {"name": p, "in": "path", "required": True, "schema": schemas.get(p, _SEGMENT)}
            for p in in_path
        ]
        params += [
            {"name": n, "in": "query", "required": n == "q", "schema": schema}
            for n, schema in schemas.items()
            if n not in in_path
        ]
        if params:
            op["parameters"] = params
        body = r.body(svc) if callable(r.body) else r.body  # built per app and document
        if body is not None:
            op["requestBody"] = {
                "required": bool(
                    body.get("required") or body.get("oneOf") or body.get("minProperties")
                ),
                "content": {r.body_media: {"schema": body}},
            }
        paths.setdefault(openapi_path(r.rule), {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "notesvc",
            "version": __version__,
            "description": "A self-hosted notes server. Every answer is the envelope "
            '{"success": true, "data": {...}} or {"success": false, "error": {code, message}}; '
            "note paths in URLs are percent-encoded with / as %2F.",
        },
        "servers": [{"url": server_url}],
        "paths": paths,
        "components": {
            "schemas": {"Success": envelope_ok, "Error": envelope_err},
            "securitySchemes": {
                "apiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": KEY_HEADER,
                    "description": "the API key (admin), or a scoped key (nsg_...) holding "
                    "the scope an operation's x-scope names (also as Authorization: Bearer)",
                },
                "mcpOAuth": {
                    "type": "oauth2",
                    "description": "OAuth 2.1 for MCP clients (PKCE S256, RFC 8707 resource); "
                    "tokens are good for /api/v1/mcp only",
                    "flows": {
                        "authorizationCode": {
                            "authorizationUrl": f"{server_url}/oauth/authorize",
                            "tokenUrl": f"{server_url}/oauth/token",
                            "refreshUrl": f"{server_url}/oauth/token",
                            "scopes": {
                                "notes:read": "read and search notes",
                                "notes:write": "create and change notes (SERVICE_MCP_WRITE)",
                            },
                        }
                    },
                },
                "bearerJwt": {"type": "http", "scheme": "bearer", "bearerFormat": "JWT"},
                "bearerKey": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the API key as a bearer token (/mcp only)",
                },
                "xApiKey": {
                    "type": "apiKey",
                    "in": "header",
                    "name": "X-API-Key",
                    "description": "the API key (/mcp only)",
                },
            },
        },
        "security": [{"apiKey": []}, {"bearerJwt": []}],
    }


def _json_content(schema: str) -> dict:
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
