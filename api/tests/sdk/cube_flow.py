"""The unmodified cubesandbox SDK against twig-api: snapshot, rollback,
clone(n), pause/resume and a timeout expiring. Reports JSON on the last line.

Environment: CUBE_API_URL, CUBE_API_KEY, CUBE_TEMPLATE_ID.
"""

import json
import sys
import time

from cubesandbox import Sandbox
from cubesandbox._exceptions import SandboxNotFoundError, TemplateNotFoundError

out = {}
sb = Sandbox.create(timeout=120)
out["id"] = sb.sandbox_id

snap = sb.create_snapshot(name="before")
out["snapshot"] = snap.snapshot_id
res = sb.rollback(snap.snapshot_id)
assert res.get("status") == "success", res
assert sb.get_info().get("state") == "running"

clones = sb.clone(n=3, concurrency=3)
ids = [c.sandbox_id for c in clones]
out["clones"] = ids
assert len(set(ids) | {sb.sandbox_id}) == 4, ids
for c in clones:
    assert c.get_info().get("state") == "running"
    c.kill()

sb.pause(wait=True, interval=0.1)
assert sb.get_info().get("state") == "paused"
sb.resume()
assert sb.get_info().get("state") == "running"

try:
    Sandbox.create(template="no-such-template")
    sys.exit("an unknown template was accepted")
except TemplateNotFoundError as e:
    out["unknown_template"] = str(e)

# A timeout expiring ends the sandbox.
sb.set_timeout(1)
deadline = time.monotonic() + 30
while True:
    try:
        sb.get_info()
    except SandboxNotFoundError:
        break
    if time.monotonic() > deadline:
        sys.exit("the sandbox outlived its timeout by 30 s")
    time.sleep(0.1)
out["timed_out"] = True
print(json.dumps(out))
