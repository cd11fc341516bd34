#!/usr/bin/env python3
"""A hostile streamable-HTTP MCP server for the broker tests (no dependencies).

Usage: mcp_hostile_http.py PORT. It speaks just enough MCP (initialize with a session id,
notifications answered 202, tools/list) and answers tools/call by the tool's name:
echo {text} (a plain answer, as JSON); bigbody (a 15 MiB JSON body of `{"":0}` objects in
`_meta`); bigevent (the same as one server-sent event); flood (an event stream of 1000
notifications/message before the answer); slowflood (an event stream that sends a
notification every 10 ms and never answers).
"""
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOOLS = ["echo", "bigbody", "bigevent", "flood", "slowflood"]


def objects(obj, mb):
    n = max(1, int(mb * 1_000_000) // (len(obj) + 1))
    return "[" + ",".join([obj] * n) + "]"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def json(self, obj, extra=None):
        body = obj.encode() if isinstance(obj, str) else json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def events(self, events, then_forever=False):
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("connection", "close")
        self.end_headers()
        for e in events:
            self.wfile.write(("event: message\ndata: " + e + "\n\n").encode())
        self.wfile.flush()
        while then_forever:
            note = '{"jsonrpc":"2.0","method":"notifications/progress","params":{"progress":1}}'
            self.wfile.write(("event: message\ndata: " + note + "\n\n").encode())
            self.wfile.flush()
            time.sleep(0.01)

    def do_DELETE(self):
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self):
        msg = json.loads(self.rfile.read(int(self.headers["content-length"])))
        method = msg.get("method")
        if "id" not in msg:
            self.send_response(202)
            self.send_header("content-length", "0")
            self.end_headers()
            return
        mid = msg["id"]
        if method == "initialize":
            self.json({"jsonrpc": "2.0", "id": mid, "result": {
                "protocolVersion": "2025-06-18", "capabilities": {"tools": {}},
                "serverInfo": {"name": "hostile", "version": "1"}}},
                {"mcp-session-id": "hostile-session"})
            return
        if method == "tools/list":
            tools = [{"name": t, "description": t, "inputSchema": {"type": "object"}} for t in TOOLS]
            self.json({"jsonrpc": "2.0", "id": mid, "result": {"tools": tools}})
            return
        name = msg["params"]["name"]
        args = msg["params"].get("arguments") or {}
        ok = {"jsonrpc": "2.0", "id": mid, "result": {"content": [{"type": "text", "text": "ok"}]}}
        big = '{"jsonrpc":"2.0","id":%s,"result":{"_meta":{"rows":%s},"content":[]}}' % (
            json.dumps(mid), objects('{"":0}', 15.7))
        note = '{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":"x"}}'
        if name == "echo":
            self.json({"jsonrpc": "2.0", "id": mid,
                       "result": {"content": [{"type": "text", "text": args.get("text", "")}]}})
        elif name == "bigbody":
            self.json(big)
        elif name == "bigevent":
            self.events([big])
        elif name == "flood":
            self.events([note] * 1000 + [json.dumps(ok)])
        elif name == "slowflood":
            self.events([], then_forever=True)


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
