#!/usr/bin/env python3
"""A streamable-HTTP MCP server for the broker tests (run with the MCP venv's python).

Usage: mcp_http.py PORT. It answers only requests that carry `x-mcp-token: $MCP_TOKEN`
(so a test can check that the configured headers reach it). Tools: echo {text}; hidden.
"""
import os
import sys

import uvicorn
from mcp.server.mcpserver import MCPServer
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse

TOKEN = os.environ["MCP_TOKEN"]
server = MCPServer("httpstub")


@server.tool()
def echo(text: str) -> str:
    """Echo the text"""
    return text


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
