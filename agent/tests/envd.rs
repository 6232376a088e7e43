//! The sandbox API (envd) driven by the unmodified E2B and CubeSandbox
//! Python SDKs (from `scripts/sdk-venv.sh`), run inside the pod's network
//! namespace against a real agent on the host (as root, as the other
//! container tests).

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{run_cmd, Agent, T};
use serde_json::json;
use sha2::{Digest, Sha256};
use twig_agent::proto::agent::{EnvdPolicy, ReidentifyRequest};
use twig_agent::testkit::{busybox_rootfs, spec, LoopDevice};

/// A pod's annotations turning envd on.
fn on() -> serde_json::Value {
    json!({"twig.dev/envd": "true"})
}

/// `/proc/net/tcp`'s local port of envd (49983) in hex.
const ENVD_PORT_HEX: &str = ":C33F";

/// A busybox image with a `bash` (busybox's sh: the SDKs run
/// `/bin/bash -l -c <cmd>`), root and a user `user` (1000, home
/// /home/user owned by it).
struct PodImage {
    device: LoopDevice,
    _dir: tempfile::TempDir,
}

impl PodImage {
    fn new() -> PodImage {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("rootfs.ext4");
        busybox_rootfs(
            &img,
            32,
            &[
                ("etc/twig-marker", "twig-image\n"),
                (
                    "etc/passwd",
                    "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
                ),
                ("etc/group", "root:x:0:\nuser:x:1000:\n"),
                ("bin/bash", "#!/bin/sh\nexec /bin/sh \"$@\"\n"),
                ("home/user/.keep", ""),
            ],
        )
        .unwrap();
        for cmd in [
            "set_inode_field /bin/bash mode 0100755",
            "set_inode_field /home/user uid 1000",
            "set_inode_field /home/user gid 1000",
        ] {
            run_cmd(Command::new("debugfs").args(["-w", "-R", cmd]).arg(&img));
        }
        let device = LoopDevice::new(&img).unwrap();
        PodImage { device, _dir: dir }
    }

    fn device(&self) -> String {
        self.device.0.display().to_string()
    }
}

/// The venv of the pinned SDKs; a missing python3/pip fails the test.
fn sdk_venv() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/sdk-venv.sh");
    let out = Command::new("bash")
        .arg(&script)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    assert!(
        out.status.success(),
        "{} failed: the envd tests need python3 with venv and pip (and PyPI or a cached venv): {}",
        script.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// The host pid of the agent's process `ns_pid` (a pid in its namespace).
fn host_pid(agent: &Agent, ns_pid: u32) -> u32 {
    let deadline = Instant::now() + T;
    loop {
        let tasks = std::fs::read_dir(format!("/proc/{}/task", agent.pid())).unwrap();
        for t in tasks.filter_map(|t| t.ok()) {
            let children = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            for c in children.split_whitespace() {
                let status =
                    std::fs::read_to_string(format!("/proc/{c}/status")).unwrap_or_default();
                // NSpid: the host's pid, the agent's namespace's, then the
                // process's own namespace's (if it has one).
                let in_agent_ns = status
                    .lines()
                    .find_map(|l| l.strip_prefix("NSpid:"))
                    .and_then(|l| l.split_whitespace().nth(1).map(String::from));
                if in_agent_ns.as_deref() == Some(&ns_pid.to_string()) {
                    return c.parse().unwrap();
                }
            }
        }
        assert!(Instant::now() < deadline, "no host pid for {ns_pid}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Whether something listens on envd's port in the network namespace of
/// host process `pid`.
fn envd_listening(pid: u32) -> bool {
    let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap();
    tcp.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.get(1).is_some_and(|a| a.ends_with(ENVD_PORT_HEX)) && f.get(3) == Some(&"0A")
    })
}

/// A pod: the built-in pause with its own network namespace (annotated
/// with `annotations`) and, if `app`, an app container joining it.
struct Pod {
    agent: Agent,
    pause_host_pid: u32,
    app_host_pid: Option<u32>,
    _image: PodImage,
}

fn pod(annotations: serde_json::Value, app: bool) -> Pod {
    let image = PodImage::new();
    let agent = Agent::start();
    let c = agent.client();
    let ns = json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]);
    let pause = spec(
        &["/pause"],
        json!({"annotations": annotations, "linux": {"namespaces": ns}}),
    );
    c.create_pause("sb", &pause, T).unwrap();
    let pid = c.start_container("sb", T).unwrap();
    let mut app_pid = None;
    if app {
        let join = |n: &str| json!({"type": n, "path": format!("/proc/{pid}/ns/{}", if n == "network" { "net" } else { n })});
        let app = spec(
            &["sleep", "100000"],
            json!({
                "hostname": "",
                "linux": {"namespaces": [{"type": "pid"}, join("ipc"), join("uts"), join("network"), {"type": "mount"}]}
            }),
        );
        c.create_container("app", &image.device(), false, &app, T)
            .unwrap();
        app_pid = Some(c.start_container("app", T).unwrap());
    }
    let pause_host_pid = host_pid(&agent, pid);
    let app_host_pid = app_pid.map(|p| host_pid(&agent, p));
    Pod {
        agent,
        pause_host_pid,
        app_host_pid,
        _image: image,
    }
}

/// Runs `script` (in tests/envd/) with the venv's python inside the pod's
/// network namespace; returns its stdout, failing with everything it said.
fn run_sdk(p: &Pod, script: &str) -> String {
    let venv = sdk_venv();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/envd")
        .join(script);
    let out = Command::new("timeout")
        .arg("120")
        .arg("nsenter")
        .arg(format!("--net=/proc/{}/ns/net", p.pause_host_pid))
        .arg(venv.join("bin/python"))
        .arg(&path)
        .env("E2B_DEBUG", "true")
        .env("PYTHONUNBUFFERED", "1")
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .env_remove("ALL_PROXY")
        .env_remove("all_proxy")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{script} failed ({}):\n{stdout}\n{}\nagent log:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr),
        p.agent.log()
    );
    stdout
}

#[test]
fn the_e2b_sdk_runs_commands_and_uses_files() {
    let p = pod(on(), true);
    assert!(envd_listening(p.pause_host_pid));
    let out = run_sdk(&p, "e2b_sdk.py");
    for check in [
        "health",
        "run_exit_code",
        "run_env_user_cwd",
        "background_kill",
        "stdin",
        "stream_input",
        "connect",
        "files",
        "watch_dir",
        "watch_dir_stream",
        "pty",
        "access_token",
        "idle_process",
    ] {
        assert!(
            out.contains(&format!("ok {check}\n")),
            "{check} missing:\n{out}"
        );
    }
    // Idle (the SDK gone, a process running with no stream attached),
    // envd's threads sleep: a measurement window, nothing asked meanwhile.
    let before = envd_switches(&p.agent);
    std::thread::sleep(IDLE_WINDOW);
    let after = envd_switches(&p.agent);
    // Threads of both looks (a connection's may end meanwhile).
    let woke: u64 = after
        .iter()
        .filter_map(|(tid, n)| Some(n - before.get(tid)?))
        .sum();
    assert!(
        woke <= MAX_IDLE_WAKEUPS,
        "idle envd threads woke {woke} times in {IDLE_WINDOW:?}"
    );
}

/// How long an idle envd is watched.
const IDLE_WINDOW: Duration = Duration::from_secs(2);
/// Wake-ups of envd's threads allowed in the window (a stray one).
const MAX_IDLE_WAKEUPS: u64 = 4;

/// Context switches of each of the agent's envd threads so far.
fn envd_switches(agent: &Agent) -> std::collections::HashMap<String, u64> {
    let tasks = std::fs::read_dir(format!("/proc/{}/task", agent.pid())).unwrap();
    let counts: std::collections::HashMap<String, u64> = tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.starts_with("envd"))
        })
        .filter_map(|t| {
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let n = status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum();
            Some((t.file_name().to_string_lossy().into_owned(), n))
        })
        .collect();
    // The accepting thread and the idle process's two output threads.
    assert!(counts.len() >= 3, "{} envd threads", counts.len());
    counts
}

#[test]
fn the_cubesandbox_sdk_runs_commands_and_uses_files() {
    let p = pod(on(), true);
    let out = run_sdk(&p, "cubesandbox_sdk.py");
    for check in ["run", "files", "watch_dir"] {
        assert!(
            out.contains(&format!("ok {check}\n")),
            "{check} missing:\n{out}"
        );
    }
}

#[test]
fn without_an_app_container_commands_fail_with_a_clear_error() {
    let p = pod(on(), false);
    let out = run_sdk(&p, "no_container.py");
    assert!(out.contains("ok failed_precondition\n"), "{out}");
}

#[test]
fn envd_is_opt_in_and_removal_stops_it() {
    for off in [json!({}), json!({"twig.dev/envd": "false"})] {
        let off = pod(off, false);
        assert!(!envd_listening(off.pause_host_pid));
    }
    // A value that is neither "true" nor "false" is refused, naming it.
    let agent = Agent::start();
    let c = agent.client();
    let ns = json!([{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}]);
    let bad = spec(
        &["/pause"],
        json!({"annotations": {"twig.dev/envd": "yes"}, "linux": {"namespaces": ns}}),
    );
    c.create_pause("sb", &bad, T).unwrap();
    let e = c.start_container("sb", T).unwrap_err().to_string();
    assert!(e.contains("twig.dev/envd") && e.contains("\"yes\""), "{e}");
    drop(agent);

    let on = pod(on(), true);
    assert!(envd_listening(on.pause_host_pid));
    // The app keeps the network namespace; removing the sandbox container
    // closes the listener.
    let app = on.app_host_pid.unwrap();
    on.agent.client().remove_container("sb", T).unwrap();
    let deadline = Instant::now() + T;
    while envd_listening(app) {
        assert!(
            Instant::now() < deadline,
            "envd still listens after its sandbox went"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A VM restored from a snapshot runs its snapshotted pod's sandbox
/// container already: `Reidentify` makes its envd the new pod's — started
/// with the token the pod names, kept (its token too) when it runs, and
/// stopped when the pod has none.
#[test]
fn reidentify_gives_a_running_sandbox_its_pods_envd() {
    let p = pod(json!({}), true);
    assert!(!envd_listening(p.pause_host_pid));
    let c = p.agent.client();
    let policy = |on: bool, token: &str| ReidentifyRequest {
        envd: Some(EnvdPolicy {
            on,
            token_sha256: if token.is_empty() {
                Vec::new()
            } else {
                Sha256::digest(token.as_bytes()).to_vec()
            },
            ..Default::default()
        })
        .into(),
        ..Default::default()
    };
    c.reidentify(&policy(true, "first"), T).unwrap();
    assert!(envd_listening(p.pause_host_pid));
    let list = |token: &str| envd_status(p.pause_host_pid, "/process.Process/List", token);
    assert_eq!(list(""), 401, "a token was named: none is refused");
    assert_eq!(list("first"), 200);
    // Running with a token: a later pod's token does not replace it.
    c.reidentify(&policy(true, "second"), T).unwrap();
    assert_eq!(list("second"), 401);
    assert_eq!(list("first"), 200);
    // A malformed digest is refused before anything changes.
    let mut bad = policy(true, "");
    bad.envd.mut_or_insert_default().token_sha256 = vec![0; 7];
    let e = c.reidentify(&bad, T).unwrap_err().to_string();
    assert!(e.contains("token_sha256"), "{e}");
    assert_eq!(list("first"), 200);
    c.reidentify(&policy(false, ""), T).unwrap();
    assert!(!envd_listening(p.pause_host_pid));
}

/// The status of a POST of `{}` to envd's `path` in the network namespace
/// of host process `pid`, with `token` as `X-Access-Token` (none if empty).
fn envd_status(pid: u32, path: &str, token: &str) -> u16 {
    let netns = std::fs::File::open(format!("/proc/{pid}/ns/net")).unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nContent-Type: application/json\r\nConnection: close\r\n{}Content-Length: 2\r\n\r\n{{}}",
        if token.is_empty() {
            String::new()
        } else {
            format!("X-Access-Token: {token}\r\n")
        }
    );
    let answer = std::thread::spawn(move || {
        nix::sched::setns(netns, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let mut s = std::net::TcpStream::connect(("127.0.0.1", 49983)).unwrap();
        s.write_all(request.as_bytes()).unwrap();
        let mut answer = String::new();
        let _ = s.read_to_string(&mut answer);
        answer
    })
    .join()
    .unwrap();
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {answer:?}"))
}
