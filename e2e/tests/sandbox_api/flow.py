"""The unmodified e2b and cubesandbox SDKs against twig-api over real Twig
pods in the lab (e2e/tests/sandbox_api.rs): commands, files, pause and
connect with a process's memory intact, fork; snapshot, rollback and clone(n)
with the CubeSandbox SDK. Prints "ok <step>" as each step passes and a JSON
report on its last line.

Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, CUBE_API_URL,
CUBE_API_KEY, CUBE_PROXY_NODE_IP, CUBE_PROXY_PORT_HTTP, CUBE_SANDBOX_DOMAIN,
TEMPLATE, CLONES.
"""

import json
import os
import sys
import time

import requests
from e2b import CommandExitException, Sandbox

# The lab runs its guests under emulation: every call is slow.
T = 900
TEMPLATE = os.environ["TEMPLATE"]
CLONES = int(os.environ["CLONES"])
out = {}
# Seconds each operation took through the SDK, for the record
# (twig-api's BENCHMARKS.md), never asserted.
bench = {}
out["bench"] = bench
started = time.monotonic()


def ok(step):
    print(f"ok {step} {time.monotonic() - started:.1f}s", flush=True)


def count(sbx):
    """The counter's value (E2B's SDK; each call's deadline set)."""
    return int(sbx.files.read("/tmp/count", request_timeout=T).strip() or 0)


def cube_count(sbx):
    """The counter's value (CubeSandbox's SDK: its Config sets deadlines)."""
    return int(sbx.files.read("/tmp/count").strip() or 0)


# A counter whose state is in the shell's memory ($i) and on disk.
COUNTER = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done"


def until(what, fn, within=T):
    deadline = time.monotonic() + within
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            sys.exit(f"{what}: not within {within} s")
        time.sleep(0.5)


# --- E2B ---------------------------------------------------------------
t = time.monotonic()
sbx = Sandbox.create(TEMPLATE, timeout=3600, request_timeout=T)
r = sbx.commands.run("echo ready", timeout=T, request_timeout=T)
bench["create_to_first_output"] = time.monotonic() - t
assert r.stdout == "ready\n", r
out["id"] = sbx.sandbox_id
ok("create")
rounds = []
for _ in range(5):
    t = time.monotonic()
    sbx.commands.run("true", timeout=T, request_timeout=T)
    rounds.append(time.monotonic() - t)
bench["run_true_p50"] = sorted(rounds)[len(rounds) // 2]

try:
    sbx.commands.run("echo out; echo err >&2; exit 3", timeout=T, request_timeout=T)
    sys.exit("exit 3 did not raise")
except CommandExitException as e:
    assert (e.exit_code, e.stdout, e.stderr) == (3, "out\n", "err\n"), (e.exit_code, e.stdout, e.stderr)
lines = []
r = sbx.commands.run("for i in 1 2 3; do echo line$i; done", on_stdout=lines.append,
                     timeout=T, request_timeout=T)
assert r.exit_code == 0 and "".join(lines) == "line1\nline2\nline3\n", (r, lines)
ok("commands_run")

h = sbx.commands.run("read x; echo got-$x", background=True, stdin=True, timeout=T, request_timeout=T)
sbx.commands.send_stdin(h.pid, "abc\n", request_timeout=T)
r = h.wait()
assert r.stdout == "got-abc\n", r
sleeper = sbx.commands.run("sleep 100000", background=True, timeout=0, request_timeout=T)
assert sbx.commands.kill(sleeper.pid, request_timeout=T) is True
ok("stdin_kill")

t = time.monotonic()
sbx.files.write("/tmp/mib", b"x" * (1 << 20), request_timeout=T)
bench["write_1_mib"] = time.monotonic() - t
r = sbx.commands.run("wc -c < /tmp/mib", timeout=T, request_timeout=T)
assert r.stdout.strip() == str(1 << 20), r
sbx.files.write("/tmp/hello.txt", "from the sdk\n", request_timeout=T)
assert sbx.files.read("/tmp/hello.txt", request_timeout=T) == "from the sdk\n"
assert "hello.txt" in [e.name for e in sbx.files.list("/tmp", request_timeout=T)]
ok("files")

sbx.commands.run(COUNTER, background=True, timeout=0, request_timeout=T)
until("the counter to count", lambda: count(sbx) >= 2)
assert sbx.pause() is True
assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
ok("pause")
resumed = Sandbox.connect(sbx.sandbox_id, timeout=3600, request_timeout=T)
first = count(resumed)
assert first >= 2, first
# The same loop goes on from its own count: its memory came back with it.
until("the resumed counter to go on", lambda: count(resumed) > first)
out["resumed_from"] = first
ok("connect")

# The token: envd's port through the proxy needs it.
proxy = os.environ["E2B_SANDBOX_URL"]
route = {"E2b-Sandbox-Id": resumed.sandbox_id, "E2b-Sandbox-Port": "49983"}
no = requests.post(f"{proxy}/process.Process/List", json={}, headers=route, timeout=T)
assert no.status_code == 401, (no.status_code, no.text)
ok("token")

forks = resumed.fork(count=1, timeout=3600)
assert len(forks) == 1
fork = forks[0]
fork_count = count(fork)
assert fork_count >= first, (fork_count, first)
fork.files.write("/tmp/who", "fork\n", request_timeout=T)
assert resumed.files.read("/tmp/hello.txt", request_timeout=T) == "from the sdk\n"
assert not resumed.files.exists("/tmp/who", request_timeout=T), "the fork's file in its source"
out["fork"] = fork.sandbox_id
ok("fork")
for s in (fork, resumed):
    assert s.kill() is True
ok("kill")

# --- CubeSandbox -------------------------------------------------------
from cubesandbox import Sandbox as Cube  # noqa: E402
from cubesandbox._config import Config  # noqa: E402

config = Config(request_timeout=T)
cube = Cube.create(template=TEMPLATE, timeout=3600, config=config)
r = cube.commands.run(f"setsid sh -c '{COUNTER}' >/dev/null 2>&1 &", timeout=T)
assert r.exit_code == 0, r
until("the cube counter to count", lambda: cube_count(cube) >= 2)
cube.files.write("/tmp/state", "before\n")
t = time.monotonic()
snap = cube.create_snapshot(name="here")
bench["snapshot"] = time.monotonic() - t
at_snapshot = cube_count(cube)
ok("create_snapshot")

# Diverge: a file changed, the counter well past the snapshot; the
# rollback brings both back (the counter's memory: it counts on from the
# snapshot's value).
cube.files.write("/tmp/state", "after\n")
diverged = until("the cube counter to pass the snapshot",
                 lambda: (lambda n: n if n > at_snapshot + 8 else 0)(cube_count(cube)))
t = time.monotonic()
res = cube.rollback(snap.snapshot_id)
bench["rollback"] = time.monotonic() - t
assert res.get("status") == "success", res
assert cube.files.read("/tmp/state") == "before\n"
back = cube_count(cube)
assert back < diverged, (back, diverged, at_snapshot)
# The process goes on from the snapshot's count, not from where it was.
later = until("the rolled-back counter to go on",
              lambda: (lambda n: n if n > back else 0)(cube_count(cube)))
assert later < diverged, (later, diverged)
out["rolled_back"] = [at_snapshot, diverged, back]
ok("rollback")

t = time.monotonic()
clones = cube.clone(n=CLONES, concurrency=CLONES)
assert len({c.sandbox_id for c in clones} | {cube.sandbox_id}) == CLONES + 1
for c in clones:
    # Shared up to the clone point ...
    assert c.files.read("/tmp/state") == "before\n"
bench["clone_all_answering"] = time.monotonic() - t
for i, c in enumerate(clones):
    c.files.write("/tmp/state", f"clone {i}\n")
for i, c in enumerate(clones):
    # ... and their own after it.
    assert c.files.read("/tmp/state") == f"clone {i}\n"
assert cube.files.read("/tmp/state") == "before\n"
out["clones"] = [c.sandbox_id for c in clones]
ok("clone")
for c in [*clones, cube]:
    c.kill()
ok("cube_kill")
print(json.dumps(out))
