//! A container's device nodes (as root, through the agent binary): a
//! privileged container (CRI's shape: an allow-all device rule and the
//! host's devices listed) starts with the guest's devices; another gets the
//! listed devices the kernel has and the others are left out. "The guest"
//! is this host here.

mod common;

use common::{Agent, Image, T};
use serde_json::{json, Value};
use twig_agent::client::{AgentClient, Stream};
use twig_agent::testkit::spec;

/// Runs `script` in a container to its end; (exit status, stdout + stderr).
fn run(c: &AgentClient, image: &Image, id: &str, script: &str, extra: Value) -> (i32, String) {
    c.create_container(
        id,
        &image.device,
        false,
        &spec(&["sh", "-c", script], extra),
        T,
    )
    .unwrap();
    c.start_container(id, T).unwrap();
    let out = c.read_to_end(id, "", Stream::Stdout, T).unwrap();
    let err = c.read_to_end(id, "", Stream::Stderr, T).unwrap();
    let status = c.wait_exit(id, "", T).unwrap().status;
    c.remove_container(id, T).unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out),
        String::from_utf8_lossy(&err)
    );
    (status, text)
}

/// What CRI lists for a privileged container: the host's devices, among
/// them the defaults the helper binds anyway, and ones this kernel lacks.
fn host_devices() -> Value {
    json!([
        {"path": "/dev/full", "type": "c", "major": 1, "minor": 7, "fileMode": 0o666, "uid": 0, "gid": 0},
        {"path": "/dev/null", "type": "c", "major": 1, "minor": 3, "fileMode": 0o666, "uid": 0, "gid": 0},
        {"path": "/dev/my-null", "type": "c", "major": 1, "minor": 3, "fileMode": 0o600, "uid": 0, "gid": 0},
        {"path": "/dev/host-only", "type": "b", "major": 4095, "minor": 4095, "fileMode": 0o660, "uid": 0, "gid": 6}
    ])
}

#[test]
fn a_privileged_container_gets_the_guest_devices_not_the_host_list() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    // A device of this kernel that the spec does not list.
    let guest_only = ["loop-control", "fuse", "net/tun", "kmsg", "zero"]
        .into_iter()
        .find(|d| std::path::Path::new("/dev").join(d).exists())
        .unwrap();
    let extra = json!({
        "linux": {
            "devices": host_devices(),
            "resources": {"devices": [{"allow": true, "access": "rwm"}]},
        },
    });
    let script = format!(
        "echo hi > /dev/full; echo full=$?; test -c /dev/{guest_only} && echo guest=yes; \
         test -e /dev/my-null || echo listed=absent; test -e /dev/host-only || echo host=absent"
    );
    let (status, text) = run(&c, &image, "priv", &script, extra);
    assert_eq!(status, 0, "{text}\n{}", agent.log());
    assert!(text.contains("No space left on device"), "{text}");
    assert!(text.contains("full=1"), "{text}");
    assert!(text.contains("guest=yes"), "{text}");
    // The host's list is ignored for a privileged container.
    assert!(text.contains("listed=absent"), "{text}");
    assert!(text.contains("host=absent"), "{text}");
}

#[test]
fn listed_devices_the_kernel_lacks_are_left_out_with_a_warning() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    // containerd's default: deny every device but what is listed.
    let extra = json!({
        "linux": {
            "devices": host_devices(),
            "resources": {"devices": [{"allow": false, "access": "rwm"}]},
        },
    });
    let script = "echo hi > /dev/full; echo full=$?; stat -c 'my-null=%t:%T %a' /dev/my-null; \
        test -e /dev/host-only || echo host=absent";
    let (status, text) = run(&c, &image, "listed", script, extra);
    assert_eq!(status, 0, "{text}\n{}", agent.log());
    assert!(text.contains("full=1"), "{text}");
    assert!(text.contains("my-null=1:3 600"), "{text}");
    assert!(text.contains("host=absent"), "{text}");
    assert!(
        agent.log().contains("/dev/host-only"),
        "no warning in the log:\n{}",
        agent.log()
    );
}
