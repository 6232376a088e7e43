"""envd of a pod without an app container: commands fail with
failed_precondition naming the problem (the e2b SDK, debug mode)."""

from e2b import Sandbox

sbx = Sandbox.create(debug=True)
assert sbx.is_running()
try:
    sbx.commands.run("true")
    raise AssertionError("a command ran without a container")
except Exception as e:
    assert "no running container" in str(e), repr(e)
try:
    sbx.files.list("/")
    raise AssertionError("files were listed without a container")
except Exception as e:
    assert "no running container" in str(e), repr(e)
print("ok failed_precondition", flush=True)
