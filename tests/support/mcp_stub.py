#!/usr/bin/env python3
"""A tiny stdio MCP server for the broker tests (no dependencies).

Directory $STUB_DIR: it writes its pid to `pid`, appends every method it receives to
`log`, and reads the description of its `echo` tool from `description` at each
tools/list (so a test can change it: a tool rug-pull), and the input schemas the JSON object
in `schemas` names (tool name -> schema, of any shape) in place of its own.

With an argument TAG (a channel-scoped session passes `{channel}`), it also writes its pid
to `pid-TAG`, and reads the description from `description-TAG` first (so a test can make
one channel's session present a different tool).

Tools: echo {text} -> text; sleep {seconds} (answered from a thread, so a
notifications/cancelled is still read and logged); crash (exits mid-call);
fail (answers isError); meta -> the call's `_meta` as JSON; secret (never allow-listed);
hold {tag} (appends the tag to `calls` when the call starts, then answers the tag once the
file `open` exists in $STUB_DIR: a test sees the order calls reach the server in, and holds
one as long as it likes).

Hostile answers (issue 43), each sized by its `mb` argument (megabytes, default 15):
bigmeta (a result whose `_meta` is `mb` of `{"":0}` objects, its text "ok"); structured
(a result with no text whose `structuredContent` is `mb` of `{}`); notify (`count`
unsolicited notifications/message of `mb` each, then the result "ok"); endless (writes a
message that never ends, without a newline, until killed); dribble (100 kB of a 15 MB
message, the rest once the file `gate` exists in $STUB_DIR); badshape (a result whose
`isError` is its `value` argument, of any type).
"""
import json
import os
import sys
import threading
import time

DIR = os.environ["STUB_DIR"]
TAG = sys.argv[1] if len(sys.argv) > 1 else None
for name in ["pid"] + ([f"pid-{TAG}"] if TAG else []):
    with open(os.path.join(DIR, name), "w") as f:
        f.write(str(os.getpid()))
LOG = open(os.path.join(DIR, "log"), "a")
OUT = threading.Lock()


def description():
    for name in ([f"description-{TAG}"] if TAG else []) + ["description"]:
        try:
            with open(os.path.join(DIR, name)) as f:
                return f.read()
        except FileNotFoundError:
            pass
    return "Echo the text"


def tools():
    obj = {"type": "object"}
    return [
        {
            "name": "echo",
            "description": description(),
            "inputSchema": {
                "type": "object",
                "properties": {"text": {"type": "string"}},
                "required": ["text"],
            },
        },
        {
            "name": "sleep",
            "description": "Sleep",
            "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
        },
        {"name": "crash", "description": "Exit mid-call", "inputSchema": obj},
        {"name": "fail", "description": "Fail", "inputSchema": obj},
        {"name": "meta", "description": "The call's _meta", "inputSchema": obj},
        {"name": "secret", "description": "Not allow-listed", "inputSchema": obj},
        {
            "name": "hold",
            "description": "Hold until the file open exists",
            "inputSchema": {
                "type": "object",
                "properties": {"tag": {"type": "string"}},
                "required": ["tag"],
            },
        },
        {"name": "bigmeta", "description": "A huge _meta", "inputSchema": obj},
        {"name": "structured", "description": "Huge structured content", "inputSchema": obj},
        {"name": "notify", "description": "Unsolicited notifications", "inputSchema": obj},
        {"name": "endless", "description": "A message that never ends", "inputSchema": obj},
        {"name": "dribble", "description": "A huge message, slowly", "inputSchema": obj},
        {"name": "badshape", "description": "isError of another type", "inputSchema": obj},
    ]


def listed():
    """tools(), with the input schemas the file `schemas` in $STUB_DIR replaces (a JSON
    object: tool name -> its inputSchema, of any shape)."""
    out = tools()
    try:
        with open(os.path.join(DIR, "schemas")) as f:
            schemas = json.load(f)
    except FileNotFoundError:
        return out
    for tool in out:
        if tool["name"] in schemas:
            tool["inputSchema"] = schemas[tool["name"]]
    return out


def send(msg):
    with OUT:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()


def result(mid, res):
    send({"jsonrpc": "2.0", "id": mid, "result": res})


def text(t, error=False):
    return {"content": [{"type": "text", "text": t}], "isError": error}


def raw(line):
    with OUT:
        sys.stdout.write(line)
        sys.stdout.flush()


def objects(obj, mb):
    """A JSON list of `obj` repeated to about `mb` megabytes."""
    n = max(1, int(mb * 1_000_000) // (len(obj) + 1))
    return "[" + ",".join([obj] * n) + "]"


def endless():
    with OUT:
        sys.stdout.write('{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"')
        chunk = "x" * 65536
        while True:
            sys.stdout.write(chunk)
            sys.stdout.flush()


def holder(mid, tag):
    with open(os.path.join(DIR, "calls"), "a") as f:
        f.write(tag + "\n")
    while not os.path.exists(os.path.join(DIR, "open")):
        time.sleep(0.02)
    result(mid, text(tag))


def sleeper(mid, seconds):
    time.sleep(seconds)
    result(mid, text("slept"))


for line in sys.stdin:
    msg = json.loads(line)
    method = msg.get("method")
    LOG.write(f"{method}\n")
    LOG.flush()
    if "id" not in msg or method is None:
        continue
    mid = msg["id"]
    if method == "initialize":
        result(mid, {
            "protocolVersion": "2025-06-18",
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "stub", "version": "1"},
        })
    elif method == "tools/list":
        result(mid, {"tools": listed()})
    elif method == "tools/call":
        name = msg["params"]["name"]
        args = msg["params"].get("arguments") or {}
        if name == "echo":
            result(mid, text(args["text"]))
        elif name == "sleep":
            threading.Thread(target=sleeper, args=(mid, args.get("seconds", 30)), daemon=True).start()
        elif name == "hold":
            threading.Thread(target=holder, args=(mid, args["tag"]), daemon=True).start()
        elif name == "crash":
            os._exit(3)
        elif name == "fail":
            result(mid, text("it failed", error=True))
        elif name == "meta":
            result(mid, text(json.dumps(msg["params"].get("_meta"))))
        elif name == "bigmeta":
            meta = objects('{"":0}', args.get("mb", 15))
            raw('{"jsonrpc":"2.0","id":%s,"result":{"_meta":{"rows":%s},"content":[{"type":"text","text":"ok"}]}}\n' % (json.dumps(mid), meta))
        elif name == "structured":
            rows = objects("{}", args.get("mb", 15))
            raw('{"jsonrpc":"2.0","id":%s,"result":{"content":[],"structuredContent":{"rows":%s}}}\n' % (json.dumps(mid), rows))
        elif name == "notify":
            data = objects('{"":0}', args.get("mb", 15))
            for _ in range(int(args.get("count", 4))):
                raw('{"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info","data":%s}}\n' % data)
            result(mid, text("ok"))
        elif name == "badshape":
            result(mid, {"content": [], "isError": args.get("value")})
        elif name == "endless":
            endless()
        elif name == "dribble":
            # 100 kB of a 15 MB `_meta` now, the rest once the file `gate` exists.
            head = '{"jsonrpc":"2.0","id":%s,"result":{"_meta":{"rows":[' % json.dumps(mid)
            raw(head + ",".join(['{"":0}'] * 14_000) + ",")
            LOG.write("dribbling\n")
            LOG.flush()
            while not os.path.exists(os.path.join(DIR, "gate")):
                time.sleep(0.05)
            raw(",".join(['{"":0}'] * 2_000_000) + ']},"content":[{"type":"text","text":"ok"}]}}\n')
        else:
            result(mid, text("the secret tool ran"))
    elif method == "ping":
        result(mid, {})
    else:
        send({"jsonrpc": "2.0", "id": mid, "error": {"code": -32601, "message": "method not found"}})
