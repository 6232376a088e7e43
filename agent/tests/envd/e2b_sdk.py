"""Drives twig-agent's envd with the unmodified e2b SDK in debug mode (no
control plane: the SDK talks to http://localhost:49983). Run inside the
sandbox's network namespace by tests/envd.rs; prints "ok <check>" per check
and exits non-zero on the first failure."""

import asyncio
import base64
import io
import json
import os
import time
import urllib.error
import urllib.request

from e2b import AsyncSandbox, CommandExitException, ConnectionConfig, PtySize, Sandbox

ENVD = "http://localhost:49983"


def ok(name):
    print(f"ok {name}", flush=True)


def until(what, check, seconds=30):
    """Polls `check` until it returns something truthy (a deadline, no sleeps
    as synchronisation: each retry asks again)."""
    deadline = time.monotonic() + seconds
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


sbx = Sandbox.create(debug=True)
assert sbx.is_running(), "GET /health"
ok("health")

# A foreground command: exit code, stdout and stderr.
try:
    sbx.commands.run("echo hi; echo err >&2; exit 3")
    raise AssertionError("exit 3 did not raise")
except CommandExitException as e:
    assert e.exit_code == 3, e.exit_code
    assert e.stdout == "hi\n", repr(e.stdout)
    assert e.stderr == "err\n", repr(e.stderr)
ok("run_exit_code")

r = sbx.commands.run("echo $FOO $HOME $(id -u); pwd", envs={"FOO": "bar"})
assert r.exit_code == 0 and r.stdout == "bar /root 0\n/root\n", repr(r.stdout)
r = sbx.commands.run("pwd; id -u; touch mine; stat -c %u mine", user="user", cwd="/tmp")
assert r.stdout == "/tmp\n1000\n1000\n", repr(r.stdout)
ok("run_env_user_cwd")

# A background command, listed, then killed.
bg = sbx.commands.run("sleep 1000", background=True)
assert any(p.pid == bg.pid for p in sbx.commands.list()), "listed"
assert sbx.commands.kill(bg.pid)
try:
    bg.wait()
    raise AssertionError("a killed command did not raise")
except CommandExitException as e:
    assert e.exit_code != 0
assert not sbx.commands.kill(bg.pid), "killing it again finds nothing"
ok("background_kill")

# stdin: send, then close.
h = sbx.commands.run("read line; echo got:$line; cat", background=True, stdin=True)
sbx.commands.send_stdin(h.pid, "hello\n")
sbx.commands.send_stdin(h.pid, "more\n")
sbx.commands.close_stdin(h.pid)
r = h.wait()
assert r.stdout == "got:hello\nmore\n", repr(r.stdout)
ok("stdin")


# StreamInput (client streaming, as E2B's JS SDK sends stdin): the messages
# go as a chunked body, each written to the process as it arrives.
def envelope(msg):
    b = json.dumps(msg).encode()
    return bytes([0]) + len(b).to_bytes(4, "big") + b


def stdin_of(text):
    return {"data": {"input": {"stdin": base64.b64encode(text).decode()}}}


h = sbx.commands.run("read a; read b; echo got:$a:$b", background=True, stdin=True)
messages = iter([
    envelope({"start": {"process": {"pid": h.pid}}}),
    envelope(stdin_of(b"one\n")),
    envelope({"keepalive": {}}),
    envelope(stdin_of(b"two\n")),
])
req = urllib.request.Request(ENVD + "/process.Process/StreamInput", data=messages,
                             headers={"Content-Type": "application/connect+json"}, method="POST")
with urllib.request.urlopen(req) as resp:
    assert resp.status == 200, resp.status
    body = resp.read()
assert b"error" not in body, body
r = h.wait()
assert r.stdout == "got:one:two\n", repr(r.stdout)
ok("stream_input")

# Connect to a running command by pid and see its later output.
h = sbx.commands.run("read x; echo after:$x", background=True, stdin=True)
h2 = sbx.commands.connect(h.pid)
sbx.commands.send_stdin(h.pid, "1\n")
r = h2.wait()
assert r.stdout == "after:1\n", repr(r.stdout)
ok("connect")

# Files.
info = sbx.files.write("/tmp/dir/a.txt", "alpha")
assert info.path == "/tmp/dir/a.txt", info
assert sbx.files.read("/tmp/dir/a.txt") == "alpha"
assert sbx.files.read("/tmp/dir/a.txt", format="bytes") == b"alpha"
blob = bytes(range(256)) * 4096
sbx.files.write("/tmp/dir/blob.bin", blob)
assert sbx.files.read("/tmp/dir/blob.bin", format="bytes") == blob
# A file-like object goes up as application/octet-stream.
sbx.files.write("/tmp/dir/stream.bin", io.BytesIO(blob))
assert sbx.files.read("/tmp/dir/stream.bin", format="bytes") == blob
sbx.files.remove("/tmp/dir/stream.bin")
names = sorted(e.name for e in sbx.files.list("/tmp/dir"))
assert names == ["a.txt", "blob.bin"], names
st = sbx.files.get_info("/tmp/dir/a.txt")
assert st.size == 5 and st.type.value == "file", st
assert sbx.files.exists("/tmp/dir/a.txt")
assert not sbx.files.exists("/tmp/nope")
assert sbx.files.make_dir("/tmp/dir/sub")
assert not sbx.files.make_dir("/tmp/dir/sub"), "already exists"
sbx.files.rename("/tmp/dir/a.txt", "/tmp/dir/sub/b.txt")
assert sbx.files.read("/tmp/dir/sub/b.txt") == "alpha"
assert not sbx.files.exists("/tmp/dir/a.txt")
deep = sorted(e.path for e in sbx.files.list("/tmp/dir", depth=2))
assert deep == ["/tmp/dir/blob.bin", "/tmp/dir/sub", "/tmp/dir/sub/b.txt"], deep
sbx.files.remove("/tmp/dir/sub")
assert not sbx.files.exists("/tmp/dir/sub/b.txt")
# A relative path is the user's home's; the user owns what it writes.
sbx.files.write("rel.txt", "r", user="user")
r = sbx.commands.run("cat /home/user/rel.txt; stat -c %U /home/user/rel.txt")
assert r.stdout == "ruser\n", repr(r.stdout)
try:
    sbx.files.read("/tmp/nope")
    raise AssertionError("reading a missing file did not raise")
except Exception as e:  # NotFoundException
    assert "not" in type(e).__name__.lower() or "404" in str(e), repr(e)
# Symlinks resolve inside the container: /etc/twig-marker is the image's.
sbx.commands.run("ln -s /etc /tmp/etc-link")
assert sbx.files.read("/tmp/etc-link/twig-marker") == "twig-image\n"
ok("files")

# watch_dir sees a file written.
sbx.files.make_dir("/tmp/watched")
w = sbx.files.watch_dir("/tmp/watched")
sbx.files.write("/tmp/watched/new.txt", "x")
events = until(
    "a watch event",
    lambda: [e for e in w.get_new_events() if e.name == "new.txt"],
)
assert any(e.type.value == "create" for e in events) or events, events
w.stop()
ok("watch_dir")

# The async SDK watches with the WatchDir stream (keepalive pings asked).
async def watch_stream():
    asbx = await AsyncSandbox.create(debug=True)
    seen = asyncio.Event()

    def on_event(e):
        if e.name == "async.txt":
            seen.set()

    h = await asbx.files.watch_dir("/tmp/watched", on_event=on_event)
    await asbx.files.write("/tmp/watched/async.txt", "y")
    await asyncio.wait_for(seen.wait(), 30)
    await h.stop()


asyncio.run(watch_stream())
ok("watch_dir_stream")

# A PTY: resized, fed input, its output read.
h = sbx.pty.create(PtySize(rows=24, cols=80))
sbx.pty.resize(h.pid, PtySize(rows=30, cols=100))
sbx.pty.send_stdin(h.pid, b"stty size; echo pty-$((1+1)); exit\n")
chunks = []
h.wait(on_pty=lambda d: chunks.append(bytes(d)))
text = b"".join(chunks)
assert b"pty-2" in text and b"30 100" in text, text
ok("pty")

# /init sets a token: without it (the debug SDK sends none) or with a wrong
# one nothing is served; with it, it is.
def post(path, body, token=None):
    req = urllib.request.Request(
        ENVD + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **({"X-Access-Token": token} if token else {})},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


status, _ = post("/init", {"accessToken": "s3cret", "envVars": {"FROM_INIT": "yes"}})
assert status == 204, status
try:
    sbx.commands.run("true")
    raise AssertionError("a call without the token was served")
except Exception as e:
    assert "401" in str(e) or "auth" in str(e).lower() or "token" in str(e).lower(), repr(e)
status, body = post("/process.Process/List", {}, token="wrong")
assert status == 401, (status, body)
status, body = post("/process.Process/List", {}, token="s3cret")
assert status == 200, (status, body)
assert sbx.is_running(), "/health needs no token"
# A sandbox as Sandbox.create makes it from a create response that carries
# envdAccessToken (the headers the SDK then sends envd).
good = Sandbox(
    sandbox_id="debug_sandbox_id",
    sandbox_domain=None,
    envd_version=sbx._envd_version,
    envd_access_token="s3cret",
    traffic_access_token=None,
    connection_config=ConnectionConfig(
        debug=True,
        extra_sandbox_headers={"X-Access-Token": "s3cret", "E2b-Sandbox-Id": "debug_sandbox_id"},
    ),
)
r = good.commands.run("echo $FROM_INIT")
assert r.stdout == "yes\n", repr(r.stdout)
ok("access_token")

# Left running with no stream attached: the test then checks that an idle
# envd (and this process's output threads) wakes nothing.
idle = good.commands.run("sleep 100000", background=True)
assert any(p.pid == idle.pid for p in good.commands.list())
ok("idle_process")
