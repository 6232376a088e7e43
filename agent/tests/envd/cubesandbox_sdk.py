"""Drives twig-agent's envd with the unmodified cubesandbox SDK. It needs no
control plane for an existing sandbox: a Sandbox is made from the create
response's fields and the SDK's proxy settings send its data-plane requests
(Host: 49983-<id>.<domain>) to localhost:49983, as CubeProxy would."""

import time

from cubesandbox._config import Config
from cubesandbox.sandbox import Sandbox


def ok(name):
    print(f"ok {name}", flush=True)


config = Config(proxy_node_ip="127.0.0.1", proxy_port=49983, template_id="t")
sbx = Sandbox({"sandboxID": "twig", "templateID": "t"}, config)

r = sbx.commands.run("echo hi; echo err >&2; exit 3")
assert r.exit_code == 3, r
assert r.stdout == "hi\n" and r.stderr == "err\n", r
r = sbx.commands.run("id -u", user="user")
assert r.stdout == "1000\n", r
ok("run")

sbx.files.write("/tmp/cube/a.txt", "alpha")
assert sbx.files.read("/tmp/cube/a.txt") == "alpha"
assert sbx.files.exists("/tmp/cube/a.txt")
names = [e["name"] for e in sbx.files.list("/tmp/cube")]
assert names == ["a.txt"], names
sbx.files.make_dir("/tmp/cube/d")
sbx.files.rename("/tmp/cube/a.txt", "/tmp/cube/d/b.txt")
assert sbx.files.read("/tmp/cube/d/b.txt") == "alpha"
sbx.files.remove("/tmp/cube/d")
assert not sbx.files.exists("/tmp/cube/d")
ok("files")

# WatchDir (the streaming watcher): a write shows up as an event.
with sbx.files.watch_dir("/tmp/cube") as w:
    sbx.files.write("/tmp/cube/w.txt", "x")
    seen = next(ev for ev in w if ev.name == "w.txt")
    assert "CREATE" in seen.type or "WRITE" in seen.type, seen
ok("watch_dir")
