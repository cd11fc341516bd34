#!/usr/bin/env python3
"""A streamable-HTTP MCP server for the broker tests (run with the MCP venv's python).

Usage: mcp_http.py PORT. It answers only requests that carry `x-mcp-token: $MCP_TOKEN`
(so a test can check that the configured headers reach it). Tools: echo {text}; hidden;
whoami -> JSON of the request's `channel` query parameter, `x-channel` header, MCP session
id and the call's `_meta` (so a test can check what a channel-scoped session sends).
"""
import json
import os
import sys

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse

TOKEN = os.environ["MCP_TOKEN"]
server = MCPServer("httpstub")


@server.tool()
def echo(text: str) -> str:
    """Echo the text"""
    return text


@server.tool()
def whoami(ctx: Context) -> str:
    """Who is calling"""
    request = ctx.request_context.request
    meta = ctx.request_context.meta
    return json.dumps({
        "query": request.query_params.get("channel"),
        "header": request.headers.get("x-channel"),
        "session": request.headers.get("mcp-session-id"),
        "meta": dict(meta) if meta is not None else None,
    }, default=str)


@server.tool()
def hidden() -> str:
    """Not allow-listed"""
    return "hidden"


class Auth(BaseHTTPMiddleware):
    async def dispatch(self, request, call_next):
        if request.headers.get("x-mcp-token") != TOKEN:
            return JSONResponse({"error": "unauthorized"}, status_code=401)
        return await call_next(request)


app = server.streamable_http_app()
app.add_middleware(Auth)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
