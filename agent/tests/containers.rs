//! Host tests that run real containers through the agent binary (as root).

mod common;

use std::time::Duration;

use common::{Agent, Image, T};
use serde_json::json;
use twig_agent::client::{AgentClient, ContainerDisks, ProcessExit, Stream};
use twig_agent::proto::agent::BlockVolume;
use twig_agent::testkit::{process, spec};

fn run_container(
    c: &AgentClient,
    image: &Image,
    id: &str,
    args: &[&str],
) -> (i32, Vec<u8>, Vec<u8>) {
    c.create_container(id, &image.device, false, &spec(args, json!({})), T)
        .unwrap();
    c.start_container(id, T).unwrap();
    let out = c.read_to_end(id, "", Stream::Stdout, T).unwrap();
    let err = c.read_to_end(id, "", Stream::Stderr, T).unwrap();
    let exit = c.wait_exit(id, "", T).unwrap();
    c.remove_container(id, T).unwrap();
    (exit.status, out, err)
}

#[test]
fn ping_echo_and_exit_codes() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let pong = c.ping(T).unwrap();
    assert_eq!(pong.version, env!("CARGO_PKG_VERSION"));
    assert!(pong.uptime_s > 0.0);

    let (status, out, err) = run_container(&c, &image, "echo", &["echo", "hello"]);
    assert_eq!(
        (status, out.as_slice(), err.as_slice()),
        (0, &b"hello\n"[..], &b""[..])
    );

    let (status, _, _) = run_container(&c, &image, "exit3", &["sh", "-c", "exit 3"]);
    assert_eq!(status, 3);

    let (status, out, err) = run_container(
        &c,
        &image,
        "both",
        &["sh", "-c", "echo out; echo err >&2; exit 7"],
    );
    assert_eq!(
        (status, out.as_slice(), err.as_slice()),
        (7, &b"out\n"[..], &b"err\n"[..])
    );
}

#[test]
fn exec_signals_hostname_rootfs_stats_and_remove() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let id = "sleeper";
    c.create_container(
        id,
        &image.device,
        false,
        &spec(&["sleep", "1000"], json!({})),
        T,
    )
    .unwrap();
    let rootfs = common::path_str(&agent.rootfs_path(id));
    assert!(agent.mountinfo().contains(&rootfs), "rootfs not mounted");
    let pid = c.start_container(id, T).unwrap();
    assert!(pid > 1);

    // The container has its own pid namespace: sleep is pid 1 there.
    let (status, out, _) = c
        .run(id, "cmdline", &["cat", "/proc/1/cmdline"], T)
        .unwrap();
    assert_eq!((status, out.as_slice()), (0, &b"sleep\x001000\x00"[..]));

    let (status, out, _) = c.run(id, "hostname", &["hostname"], T).unwrap();
    assert_eq!((status, out.as_slice()), (0, &b"twig-test\n"[..]));

    // The image is the root: its marker is there, the host's /work is not.
    let (_, out, _) = c
        .run(id, "marker", &["cat", "/etc/twig-marker"], T)
        .unwrap();
    assert_eq!(out, b"twig-image\n");
    let (_, out, _) = c.run(id, "ls", &["ls", "/"], T).unwrap();
    let listing = String::from_utf8(out).unwrap();
    assert!(listing.split_whitespace().any(|n| n == "etc"), "{listing}");
    assert!(
        !listing.split_whitespace().any(|n| n == "work"),
        "{listing}"
    );

    // Env and cwd of an exec.
    let p = process(
        &["sh", "-c", "echo $FOO; pwd"],
        json!({"env": ["PATH=/bin", "FOO=bar"], "cwd": "/etc"}),
    );
    c.exec_process(id, "env", &p, T).unwrap();
    assert_eq!(
        c.read_to_end(id, "env", Stream::Stdout, T).unwrap(),
        b"bar\n/etc\n"
    );
    assert_eq!(c.wait_exit(id, "env", T).unwrap().status, 0);

    // Rlimits and no_new_privs of the spec reach init; it ignores no signal.
    let (_, out, _) = c
        .run(
            id,
            "limits",
            &["cat", "/proc/1/limits", "/proc/1/status"],
            T,
        )
        .unwrap();
    let text = String::from_utf8(out).unwrap();
    let nofile = text
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap_or_default();
    assert_eq!(
        nofile
            .split_whitespace()
            .skip(3)
            .take(2)
            .collect::<Vec<_>>(),
        ["1024", "1024"],
        "{text}"
    );
    assert!(text.contains("NoNewPrivs:\t1"), "{text}");
    assert!(text.contains("SigIgn:\t0000000000000000"), "{text}");

    // A long poll does not hold up other calls.
    std::thread::scope(|s| {
        let poll = s.spawn(|| {
            c.read_stream(id, "", Stream::Stdout, 0, Duration::from_secs(2))
                .unwrap()
        });
        let t0 = std::time::Instant::now();
        c.ping(T).unwrap();
        assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
        let chunk = poll.join().unwrap();
        assert!(chunk.data.is_empty() && !chunk.eof);
    });

    let stats = c.stats(id, T).unwrap();
    assert!(stats.memory_rss_bytes > 0, "{stats:?}");
    assert!(stats.process_count >= 1, "{stats:?}");

    // SIGTERM to an exec'd sleep.
    c.exec_process(id, "victim", &process(&["sleep", "1000"], json!({})), T)
        .unwrap();
    assert_eq!(c.wait_process(id, "victim", Duration::ZERO).unwrap(), None);
    c.signal_process(id, "victim", 15, T).unwrap();
    assert_eq!(
        c.wait_exit(id, "victim", T).unwrap(),
        ProcessExit {
            status: 143,
            signal: 15,
            oom_killed: false,
        }
    );
    // A dead process cannot be signalled: not found, as runc answers.
    let e = c.signal_process(id, "victim", 15, T).unwrap_err();
    assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
    assert!(e.to_string().contains("already finished"), "{e}");

    // An exited exec is forgotten on request, and its id is free again; a
    // running one, the init and an unknown one are refused.
    c.exec_process(id, "sleeper", &process(&["sleep", "1000"], json!({})), T)
        .unwrap();
    let e = c.remove_process(id, "sleeper", T).unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");
    let e = c.remove_process(id, "", T).unwrap_err();
    assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
    c.remove_process(id, "victim", T).unwrap();
    let e = c.wait_process(id, "victim", Duration::ZERO).unwrap_err();
    assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
    let e = c.remove_process(id, "victim", T).unwrap_err();
    assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
    let (status, out, _) = c.run(id, "victim", &["echo", "again"], T).unwrap();
    assert_eq!((status, out.as_slice()), (0, b"again\n".as_slice()));
    c.signal_process(id, "sleeper", 9, T).unwrap();
    c.wait_exit(id, "sleeper", T).unwrap();
    c.remove_process(id, "sleeper", T).unwrap();

    // SIGKILL to init.
    c.signal_process(id, "", 9, T).unwrap();
    assert_eq!(
        c.wait_exit(id, "", T).unwrap(),
        ProcessExit {
            status: 137,
            signal: 9,
            oom_killed: false,
        }
    );
    let e = c.run(id, "late", &["true"], T).unwrap_err();
    assert!(e.to_string().contains("init process has exited"), "{e}");

    c.remove_container(id, T).unwrap();
    assert!(!agent.mountinfo().contains(&rootfs), "rootfs still mounted");
    let e = c.stats(id, T).unwrap_err();
    assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
}

#[test]
fn stdin_round_trip_and_tty() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let id = "cat";
    c.create_container(id, &image.device, false, &spec(&["cat"], json!({})), T)
        .unwrap();
    c.start_container(id, T).unwrap();
    assert_eq!(c.write_stdin(id, "", b"ping\n", T).unwrap(), 5);
    let mut got = Vec::new();
    while got.len() < 5 {
        let chunk = c.read_stream(id, "", Stream::Stdout, 0, T).unwrap();
        assert!(!chunk.eof, "eof before the echo");
        got.extend(chunk.data);
    }
    assert_eq!(got, b"ping\n");
    c.close_stdin(id, "", T).unwrap();
    assert_eq!(c.wait_exit(id, "", T).unwrap().status, 0);
    let e = c.write_stdin(id, "", b"x", T).unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");
    c.remove_container(id, T).unwrap();

    // A TTY init with a console size from the spec.
    let id = "tty";
    let s = spec(
        &[
            "sh",
            "-c",
            "test -t 0 && test -t 1 && echo is-a-tty; tty; stty size; read x; stty size",
        ],
        json!({"process": {"terminal": true, "consoleSize": {"height": 30, "width": 90}}}),
    );
    c.create_container(id, &image.device, false, &s, T).unwrap();
    c.start_container(id, T).unwrap();
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + T;
    while !String::from_utf8_lossy(&out).contains("30 90") {
        assert!(std::time::Instant::now() < deadline, "{out:?}");
        out.extend(c.read_stream(id, "", Stream::Stdout, 0, T).unwrap().data);
    }
    c.resize_tty(id, "", 50, 120, T).unwrap();
    c.write_stdin(id, "", b"go\n", T).unwrap();
    let rest = c.read_to_end(id, "", Stream::Stdout, T).unwrap();
    out.extend(rest);
    let text = String::from_utf8_lossy(&out);
    assert!(text.contains("is-a-tty\r\n"), "{text:?}");
    // The pty is the container's own (its devpts instance), so `tty` names
    // a device that exists there.
    assert!(text.contains("/dev/pts/0\r\n"), "{text:?}");
    assert!(text.contains("50 120"), "{text:?}");
    assert!(c.read_to_end(id, "", Stream::Stderr, T).unwrap().is_empty());
    assert_eq!(c.wait_exit(id, "", T).unwrap().status, 0);
    // ResizeTty on a process without a terminal is refused.
    c.remove_container(id, T).unwrap();
}

#[test]
fn bad_input_gets_error_replies() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let good = spec(&["sleep", "1000"], json!({}));
    let code = |r: Result<(), twig_agent::client::Error>| {
        let e = r.unwrap_err();
        (e.status_code().unwrap_or("none").to_string(), e.to_string())
    };

    let (k, m) = code(c.create_container("a", &image.device, false, b"{not json", T));
    assert_eq!(k, "INVALID_ARGUMENT", "{m}");
    assert!(m.contains("invalid OCI spec"), "{m}");

    let (k, m) =
        code(c.create_container("a", &image.device, false, br#"{"ociVersion":"1.0.2"}"#, T));
    assert_eq!(k, "INVALID_ARGUMENT", "{m}");
    assert!(m.contains("no \"process\""), "{m}");

    let (k, m) = code(c.create_container("a", "/dev/does-not-exist", false, &good, T));
    assert_eq!(k, "INVALID_ARGUMENT", "{m}");
    assert!(m.contains("/dev/does-not-exist"), "{m}");

    let (k, m) = code(c.create_container("../x", &image.device, false, &good, T));
    assert_eq!(k, "INVALID_ARGUMENT", "{m}");
    assert!(m.contains("invalid container id"), "{m}");

    // An executable that does not exist: the start fails with the reason.
    let missing = spec(&["/bin/nope"], json!({}));
    c.create_container("nope", &image.device, false, &missing, T)
        .unwrap();
    let e = c.start_container("nope", T).unwrap_err();
    assert!(e.to_string().contains("/bin/nope"), "{e}");
    c.remove_container("nope", T).unwrap();

    // A terminal without a devpts in the container: a clear error, and the
    // container can be removed.
    let no_pts = spec(
        &["sh"],
        json!({"process": {"terminal": true}, "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]}
        ]}),
    );
    c.create_container("nopts", &image.device, false, &no_pts, T)
        .unwrap();
    let e = c.start_container("nopts", T).unwrap_err();
    assert!(e.to_string().contains("devpts mount at /dev/pts"), "{e}");
    c.remove_container("nopts", T).unwrap();

    c.create_container("a", &image.device, false, &good, T)
        .unwrap();
    let (k, m) = code(c.create_container("a", &image.device, false, &good, T));
    assert_eq!(k, "ALREADY_EXISTS", "{m}");

    // Not started yet.
    let e = c.run("a", "x", &["true"], T).unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");
    let e = c.wait_process("a", "", Duration::ZERO).unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");

    // Unknown ids.
    for e in [
        c.start_container("ghost", T).map(|_| ()).unwrap_err(),
        c.remove_container("ghost", T).unwrap_err(),
        c.signal_process("ghost", "", 9, T).unwrap_err(),
        c.wait_process("ghost", "", Duration::ZERO)
            .map(|_| ())
            .unwrap_err(),
        c.read_stream("ghost", "", Stream::Stdout, 0, Duration::ZERO)
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
    }

    c.start_container("a", T).unwrap();
    let e = c.start_container("a", T).unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");
    let e = c.wait_process("a", "ghost", Duration::ZERO).unwrap_err();
    assert_eq!(e.status_code(), Some("NOT_FOUND"), "{e}");
    let e = c
        .exec_process("a", "../e", &process(&["true"], json!({})), T)
        .unwrap_err();
    assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
    let e = c.exec_process("a", "e", b"[1,2", T).unwrap_err();
    assert!(e.to_string().contains("invalid OCI process"), "{e}");
    let e = c
        .exec_process("a", "e", &process(&[], json!({})), T)
        .unwrap_err();
    assert!(e.to_string().contains("args"), "{e}");
    let e = c.signal_process("a", "", 99999, T).unwrap_err();
    assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
    let e = c.resize_tty("a", "", 10, 10, T).unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");
    c.run("a", "dup", &["true"], T).unwrap();
    let e = c.run("a", "dup", &["true"], T).unwrap_err();
    assert_eq!(e.status_code(), Some("ALREADY_EXISTS"), "{e}");

    // A waiting call honours its timeout.
    let t0 = std::time::Instant::now();
    assert_eq!(
        c.wait_process("a", "", Duration::from_millis(300)).unwrap(),
        None
    );
    assert!(t0.elapsed() >= Duration::from_millis(300));
    let chunk = c
        .read_stream("a", "", Stream::Stdout, 0, Duration::from_millis(100))
        .unwrap();
    assert!(chunk.data.is_empty() && !chunk.eof);

    // Garbage on the socket: the agent drops that connection and lives on.
    {
        use std::io::Write;
        let mut raw = std::os::unix::net::UnixStream::connect(&agent.socket).unwrap();
        raw.write_all(&[0xff; 64]).unwrap();
        raw.write_all(b"\x00\x00\x00\x05\x00\x00\x00\x01\x01\x00hello")
            .unwrap();
    }
    {
        use std::io::Write;
        // A frame header that announces a huge message, then hangs up.
        let mut raw = std::os::unix::net::UnixStream::connect(&agent.socket).unwrap();
        raw.write_all(b"\x7f\xff\xff\xff\x00\x00\x00\x01\x01\x00")
            .unwrap();
    }
    c.ping(T).unwrap();
    agent.client().ping(T).unwrap();
    c.remove_container("a", T).unwrap();
    c.ping(T).unwrap();
}

#[test]
fn read_only_rootfs_and_chroot_fallback() {
    let image = Image::new();
    let agent = Agent::start_with(&[], "", &["--no-pivot-root"]);
    let c = agent.client();
    let id = "ro";
    let s = spec(
        &["sh", "-c", "cat /etc/twig-marker; touch /etc/x"],
        json!({}),
    );
    c.create_container(id, &image.device, true, &s, T).unwrap();
    c.start_container(id, T).unwrap();
    let out = c.read_to_end(id, "", Stream::Stdout, T).unwrap();
    let err = c.read_to_end(id, "", Stream::Stderr, T).unwrap();
    let exit = c.wait_exit(id, "", T).unwrap();
    assert_eq!(out, b"twig-image\n");
    assert_ne!(exit.status, 0, "touch on a read-only rootfs succeeded");
    assert!(
        String::from_utf8_lossy(&err).contains("Read-only"),
        "{err:?}"
    );
    c.remove_container(id, T).unwrap();

    // Only a mount namespace: the VM's pids, hostname and network.
    let id = "shared";
    let s = spec(
        &["sleep", "1000"],
        json!({"hostname": "", "linux": {"namespaces": [{"type": "mount"}]}}),
    );
    c.create_container(id, &image.device, true, &s, T).unwrap();
    let init = c.start_container(id, T).unwrap();
    c.exec_process(id, "second", &process(&["sleep", "1000"], json!({})), T)
        .unwrap();
    let (status, out, _) = c
        .run(
            id,
            "ps",
            &["sh", "-c", "cat /proc/1/cmdline; echo; echo $$"],
            T,
        )
        .unwrap();
    assert_eq!(status, 0);
    let text = String::from_utf8(out).unwrap();
    assert!(
        !text.starts_with("sleep"),
        "init of the VM expected: {text}"
    );
    let stats = c.stats(id, T).unwrap();
    assert_eq!(stats.process_count, 2, "{stats:?}");
    assert!(init > 1);
    c.remove_container(id, T).unwrap();
    assert!(!agent
        .mountinfo()
        .contains(&common::path_str(&agent.rootfs_path(id))));
}

#[test]
fn reidentify_in_private_namespaces() {
    let agent = Agent::start_with(
        &["--uts", "--net"],
        "ip link add twig0 type veth peer name twig1; ip link set twig1 up",
        &[],
    );
    let c = agent.client();
    let host_name = common::run_cmd(&mut std::process::Command::new("hostname"));
    let mut req = twig_agent::proto::agent::ReidentifyRequest {
        hostname: "clone-7".into(),
        interface: "twig0".into(),
        mac: "02:00:00:00:00:07".into(),
        ipv4_cidr: "10.77.0.7/24".into(),
        ipv4_gateway: "10.77.0.1".into(),
        entropy: (0..64u8).collect(),
        ..Default::default()
    };
    let before = c.reidentify(&req, T).unwrap();
    assert!(before > 1_600_000_000_000_000_000, "{before}");
    let pid = agent.pid().to_string();
    let ns = |args: &[&str]| {
        common::run_cmd(
            std::process::Command::new("nsenter")
                .args(["-t", &pid, "-u", "-n", "--"])
                .args(args),
        )
    };
    assert_eq!(ns(&["hostname"]).trim(), "clone-7");
    let link = ns(&["ip", "-o", "link", "show", "twig0"]);
    assert!(
        link.contains("02:00:00:00:00:07") && link.contains("UP"),
        "{link}"
    );
    let addr = ns(&["ip", "-o", "-4", "addr", "show", "twig0"]);
    assert!(addr.contains("10.77.0.7/24"), "{addr}");
    let route = ns(&["ip", "route"]);
    assert!(route.contains("default via 10.77.0.1 dev twig0"), "{route}");
    // The host kept its name.
    assert_eq!(
        common::run_cmd(&mut std::process::Command::new("hostname")),
        host_name
    );

    // Bad values and missing interfaces are errors, and nothing panics.
    req.interface = "nosuch0".into();
    let e = c.reidentify(&req, T).unwrap_err();
    assert!(e.to_string().contains("nosuch0"), "{e}");
    let bad = twig_agent::proto::agent::ReidentifyRequest {
        interface: "twig0".into(),
        mac: "not-a-mac".into(),
        ..Default::default()
    };
    let e = c.reidentify(&bad, T).unwrap_err();
    assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
    c.ping(T).unwrap();
}

/// runc's rule: when the init of a container without a pid namespace of
/// its own exits (CRI's default shares the pod's), the container's other
/// processes are killed — else an orphan keeps its output open and runs
/// on unseen. With its own pid namespace the kernel does the same.
#[test]
fn an_inits_exit_ends_the_rest_of_its_container() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let script = "sleep 1000 & echo $! > /dev/shm/orphan 2>/dev/null; echo started; exit 0";
    let shared =
        json!({"linux": {"namespaces": [{"type": "uts"}, {"type": "ipc"}, {"type": "mount"}]}});
    for (id, extra) in [("shared-pidns", shared), ("own-pidns", json!({}))] {
        c.create_container(
            id,
            &image.device,
            false,
            &spec(&["sh", "-c", script], extra),
            T,
        )
        .unwrap();
        c.start_container(id, T).unwrap();
        assert_eq!(c.wait_exit(id, "", T).unwrap().status, 0, "{id}");
        // Closed at once: the orphaned sleep held the output before.
        let started = std::time::Instant::now();
        let out = c
            .read_to_end(id, "", Stream::Stdout, Duration::from_secs(10))
            .unwrap_or_else(|e| panic!("{id}: {e}\n{}", agent.log()));
        assert_eq!(out, b"started\n", "{id}");
        assert!(started.elapsed() < Duration::from_secs(5), "{id}");
        let stats = c.stats(id, T).unwrap();
        assert_eq!(stats.process_count, 0, "{id}: {stats:?}");
        c.remove_container(id, T).unwrap();
    }
}

#[test]
fn the_builtin_pause_holds_the_pods_namespaces_without_a_disk() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    // A CRI sandbox container: the pause image's process, which is not run.
    c.create_pause("sb", &spec(&["/pause"], json!({"hostname": "pod-host"})), T)
        .unwrap();
    assert!(
        !agent
            .mountinfo()
            .contains(&common::path_str(&agent.rootfs_path("sb"))),
        "the pause container has no rootfs mount"
    );
    let pid = c.start_container("sb", T).unwrap();
    // An app container joins its UTS namespace and sees the pod's hostname.
    let join = |n: &str| json!({"type": n, "path": format!("/proc/{pid}/ns/{n}")});
    let app = spec(
        &["hostname"],
        json!({"hostname": "", "linux": {"namespaces": [
            {"type": "pid"}, join("ipc"), join("uts"), {"type": "mount"}
        ]}}),
    );
    c.create_container("app", &image.device, false, &app, T)
        .unwrap();
    c.start_container("app", T).unwrap();
    assert_eq!(
        c.read_to_end("app", "", Stream::Stdout, T).unwrap(),
        b"pod-host\n"
    );
    assert_ne!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap(),
        "pod-host\n",
        "the pause process named its own UTS namespace, not the agent's"
    );
    assert_eq!(c.wait_exit("app", "", T).unwrap().status, 0);
    c.remove_container("app", T).unwrap();

    // Nothing runs inside the pause container.
    let e = c
        .exec_process("sb", "sh", &process(&["true"], json!({})), T)
        .unwrap_err();
    assert_eq!(e.status_code(), Some("FAILED_PRECONDITION"), "{e}");
    assert!(e.to_string().contains("built-in pause"), "{e}");

    // SIGTERM ends it with 0, as Kubernetes' pause.
    const SIGTERM: u32 = 15;
    c.signal_process("sb", "", SIGTERM, T).unwrap();
    assert_eq!(c.wait_exit("sb", "", T).unwrap().status, 0);
    c.remove_container("sb", T).unwrap();
}

#[test]
fn a_new_disk_is_mounted_once_it_has_its_size() {
    let image = Image::new();
    let agent = Agent::start();
    let c = agent.client();
    let s = spec(&["true"], json!({}));
    // The test image is 16 MiB; a disk that never reaches the size the
    // shim expects is refused after the wait, naming both sizes.
    let started = std::time::Instant::now();
    let disks = |bytes| ContainerDisks {
        rootfs_device: image.device.clone(),
        rootfs_bytes: bytes,
        ..Default::default()
    };
    let e = c
        .create_container_on_disks("big", disks(32 << 20), &s, T)
        .unwrap_err();
    assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{e}");
    assert!(
        e.to_string().contains(&format!("{}", 16u64 << 20))
            && e.to_string().contains(&format!("{}", 32u64 << 20)),
        "{e}"
    );
    assert!(started.elapsed() >= Duration::from_secs(2), "it waited");
    // At its size it is mounted at once.
    c.create_container_on_disks("ok", disks(16 << 20), &s, T)
        .unwrap();
    c.start_container("ok", T).unwrap();
    assert_eq!(c.wait_exit("ok", "", T).unwrap().status, 0);
    c.remove_container("ok", T).unwrap();
}

#[test]
fn a_raw_block_volume_is_a_block_node_the_container_reads_and_writes() {
    let image = Image::new();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("volume.img");
    let mut data = vec![0u8; 1 << 20];
    data[5 * 512..6 * 512].fill(b'v');
    std::fs::write(&img, &data).unwrap();
    let volume = twig_agent::testkit::LoopDevice::new(&img).unwrap();
    let agent = Agent::start();
    let c = agent.client();
    let block = |path: &str, bytes| BlockVolume {
        device: volume.0.display().to_string(),
        path: path.to_string(),
        bytes,
        mode: 0o660,
        uid: 0,
        gid: 6,
        ..Default::default()
    };
    let disks = |volumes| ContainerDisks {
        rootfs_device: image.device.clone(),
        block_volumes: volumes,
        ..Default::default()
    };
    let s = spec(
        &[
            "sh",
            "-c",
            "stat -c '%F %a %u:%g' /dev/xvdb && echo written | dd of=/dev/xvdb bs=512 seek=2 \
             conv=notrunc 2>/dev/null && dd if=/dev/xvdb bs=512 skip=5 count=1 2>/dev/null | head -c 3",
        ],
        json!({}),
    );
    c.create_container_on_disks("blk", disks(vec![block("/dev/xvdb", 1 << 20)]), &s, T)
        .unwrap();
    c.start_container("blk", T).unwrap();
    let out = c.read_to_end("blk", "", Stream::Stdout, T).unwrap();
    let err = c.read_to_end("blk", "", Stream::Stderr, T).unwrap();
    assert_eq!(
        c.wait_exit("blk", "", T).unwrap().status,
        0,
        "{}",
        String::from_utf8_lossy(&err)
    );
    c.remove_container("blk", T).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out),
        "block special file 660 0:6\nvvv"
    );
    let on_disk = std::fs::read(&img).unwrap();
    assert_eq!(
        &on_disk[2 * 512..2 * 512 + 8],
        b"written\n",
        "written through"
    );

    // Hostile or wrong requests are refused before anything is made.
    for (path, bytes, want) in [
        ("dev/xvdb", 0, "absolute"),
        ("/dev/../etc/passwd", 0, "absolute"),
        ("/", 0, "absolute"),
        ("/dev/xvdb", 2 << 20, "did not see the disk"),
    ] {
        let e = c
            .create_container_on_disks("bad", disks(vec![block(path, bytes)]), &s, T)
            .unwrap_err();
        assert_eq!(e.status_code(), Some("INVALID_ARGUMENT"), "{path}: {e}");
        assert!(e.to_string().contains(want), "{path}: {e}");
    }
    let mut wide = block("/dev/xvdb", 0);
    wide.mode = 0o4777;
    let e = c
        .create_container_on_disks("bad", disks(vec![wide]), &s, T)
        .unwrap_err();
    assert!(e.to_string().contains("0o777"), "{e}");
}
