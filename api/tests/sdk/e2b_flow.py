"""The unmodified e2b SDK against twig-api: every control-plane call the
Rust test (api/tests/sdk.rs) drives, checked here and reported as JSON on
the last line of stdout for the Rust side's own checks.

Environment: E2B_API_URL, E2B_SANDBOX_URL, KEY_A, KEY_B (tenants A and B).
"""

import json
import os
import sys

import e2b
import requests
from e2b import Sandbox
from e2b.exceptions import AuthenticationException, NotFoundException, SandboxException

KEY_A = os.environ["KEY_A"]
KEY_B = os.environ["KEY_B"]
out = {}


def expect_raises(kind, fn, what):
    try:
        fn()
    except kind as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - the wrong kind is the failure
        sys.exit(f"{what}: raised {type(e).__name__}: {e}, not {kind.__name__}")
    sys.exit(f"{what}: did not raise {kind.__name__}")


# Create from a SandboxTemplate, with metadata and a timeout.
sbx = Sandbox.create("base", metadata={"user": "a1"}, timeout=120, api_key=KEY_A)
out["id"] = sbx.sandbox_id
out["envd_token"] = sbx._envd_access_token
info = sbx.get_info()
assert info.state.value == "running", info.state
assert info.metadata == {"user": "a1"}, info.metadata
assert info.template_id == "base", info.template_id
assert info.cpu_count == 1 and info.memory_mb == 256, (info.cpu_count, info.memory_mb)

listed = [s.sandbox_id for s in Sandbox.list(api_key=KEY_A).next_items()]
assert sbx.sandbox_id in listed, listed
by_meta = Sandbox.list(query=e2b.SandboxQuery(metadata={"user": "nobody"}), api_key=KEY_A)
assert by_meta.next_items() == [], "metadata filter"
sbx.set_timeout(600)

# Tenant B neither sees nor reaches tenant A's sandbox.
assert Sandbox.list(api_key=KEY_B).next_items() == [], "B lists A's sandbox"
out["b_get"] = expect_raises(
    NotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id, api_key=KEY_B), "B get_info"
)
expect_raises(NotFoundException, lambda: Sandbox.kill(sbx.sandbox_id, api_key=KEY_B) or
              (_ for _ in ()).throw(NotFoundException("kill returned False")), "B kill")

# A snapshot, listed, and a sandbox created from it.
snap = sbx.create_snapshot(name="warm")
out["snapshot"] = snap.snapshot_id
snaps = [s.snapshot_id for s in sbx.list_snapshots().next_items()]
assert snap.snapshot_id in snaps, snaps
from_snap = Sandbox.create(snap.snapshot_id, api_key=KEY_A)
out["from_snapshot"] = from_snap.sandbox_id
assert from_snap.get_info().template_id == snap.snapshot_id

# Fork: two new sandboxes.
forks = sbx.fork(count=2, timeout=60)
assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
out["forks"] = [f.sandbox_id for f in forks]
assert len(set(out["forks"]) | {sbx.sandbox_id}) == 3

# Pause then connect (resume): same ID, running again.
assert sbx.pause() is True
assert Sandbox.get_info(sbx.sandbox_id, api_key=KEY_A).state.value == "paused"
assert sbx.pause() is False, "a second pause says already paused"
states = {s.sandbox_id: s.state.value for s in
          Sandbox.list(query=e2b.SandboxQuery(state=[e2b.SandboxState.PAUSED]), api_key=KEY_A).next_items()}
assert states.get(sbx.sandbox_id) == "paused", states
resumed = Sandbox.connect(sbx.sandbox_id, api_key=KEY_A)
assert resumed.sandbox_id == sbx.sandbox_id
assert resumed.get_info().state.value == "running"
assert resumed.get_info().metadata == {"user": "a1"}

# Bad input: unknown template, missing and wrong keys.
out["unknown_template"] = expect_raises(
    SandboxException, lambda: Sandbox.create("no-such-template", api_key=KEY_A), "unknown template")
out["wrong_key"] = expect_raises(
    AuthenticationException, lambda: Sandbox.list(api_key="wrong").next_items(), "wrong key")

# The proxy: envd's port with the sandbox's token reaches it; a wrong token,
# or an unknown sandbox, does not.
proxy = os.environ["E2B_SANDBOX_URL"]
envd_port = os.environ["ENVD_PORT"]
route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": envd_port}
ok = requests.get(f"{proxy}/health", headers={**route, "X-Access-Token": resumed._envd_access_token})
assert ok.status_code == 204, (ok.status_code, ok.text)
wrong = requests.get(f"{proxy}/health", headers={**route, "X-Access-Token": "x"})
assert wrong.status_code == 401, (wrong.status_code, wrong.text)
unknown = requests.get(f"{proxy}/health", headers={**route, "E2b-Sandbox-Id": "inosuchsandbox"})
assert unknown.status_code == 502, (unknown.status_code, unknown.text)

# Kill: gone for good.
for s in [resumed, from_snap, *forks]:
    assert s.kill() is True
assert Sandbox.kill(sbx.sandbox_id, api_key=KEY_A) is False
expect_raises(NotFoundException, lambda: Sandbox.get_info(sbx.sandbox_id, api_key=KEY_A), "get killed")
assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=KEY_A) is True
assert Sandbox.delete_snapshot(snap.snapshot_id, api_key=KEY_A) is False
print(json.dumps(out))
