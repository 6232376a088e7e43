//! The Task service against a real twig-agent running on the host
//! (`twig-agent --listen unix://…`, in its own pid and mount namespaces),
//! through the [`HostSandbox`] seam: containerd's calls arrive over ttrpc,
//! stdio goes through FIFOs made here, rootfs images are ext4 files
//! attached as loop devices. Needs root (loop devices, namespaces, mounts)
//! and the static busybox; it fails, never skips, without them.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use containerd_shim::asynchronous::ExitSignal;
use containerd_shim_protos::api;
use containerd_shim_protos::cgroups::metrics::Metrics;
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::protobuf::{Message, MessageField};
use containerd_shim_protos::shim_async::TaskClient;
use containerd_shim_protos::ttrpc::r#async::{transport::Listener, Client, Server};
use containerd_shim_protos::ttrpc::Code;
use containerd_shim_protos::types::task::Status;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::mpsc;
use twig_shim::pod::Event;
use twig_shim::sandbox::{Fixed, HostSandbox};
use twig_shim::server::task_services;
use twig_shim::service::TaskService;

mod common;
use common::{bundle, code, ctx, twig_mount, Agent, T};

fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(rc, 0, "mkfifo: {}", std::io::Error::last_os_error());
}

struct Fixture {
    client: TaskClient,
    events: mpsc::UnboundedReceiver<Event>,
    dir: tempfile::TempDir,
    exit: Arc<ExitSignal>,
    _server: Server,
    _agent: Agent,
}

async fn fixture() -> Fixture {
    let agent = Agent::start();
    let sandbox = tokio::task::spawn_blocking({
        let s = agent.socket.clone();
        move || HostSandbox::connect(&s, T)
    })
    .await
    .unwrap()
    .expect("connecting to the host agent");
    let (tx, events) = mpsc::unbounded_channel();
    let exit = Arc::new(ExitSignal::default());
    let service = TaskService::new(Arc::new(Fixed(Arc::new(sandbox))), tx, exit.clone(), T);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("shim.sock");
    let listener =
        Listener::try_from(std::os::unix::net::UnixListener::bind(&sock).unwrap()).unwrap();
    let mut server = Server::new()
        .add_listener(listener)
        .register_service(task_services(service));
    server.start().await.unwrap();
    let client = TaskClient::new(
        Client::connect(&format!("unix://{}", sock.display()))
            .await
            .unwrap(),
    );
    Fixture {
        client,
        events,
        dir,
        exit,
        _server: server,
        _agent: agent,
    }
}

/// Test-side ends of a process's FIFOs.
struct Fifos {
    paths: [String; 3],
    stdin: pipe::Sender,
    stdout: pipe::Receiver,
    stderr: pipe::Receiver,
}

fn fifos(dir: &Path, name: &str) -> Fifos {
    let p: Vec<PathBuf> = ["in", "out", "err"]
        .iter()
        .map(|s| dir.join(format!("{name}.{s}")))
        .collect();
    p.iter().for_each(|f| mkfifo(f));
    Fifos {
        stdin: pipe::OpenOptions::new()
            .read_write(true)
            .open_sender(&p[0])
            .unwrap(),
        stdout: pipe::OpenOptions::new().open_receiver(&p[1]).unwrap(),
        stderr: pipe::OpenOptions::new().open_receiver(&p[2]).unwrap(),
        paths: [0, 1, 2].map(|i| p[i].display().to_string()),
    }
}

async fn read_all(r: &mut pipe::Receiver) -> String {
    let mut s = Vec::new();
    tokio::time::timeout(T, r.read_to_end(&mut s))
        .await
        .expect("EOF within the deadline")
        .unwrap();
    String::from_utf8_lossy(&s).into_owned()
}

async fn read_until(r: &mut pipe::Receiver, needle: &str) -> String {
    let deadline = Instant::now() + T;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&got).contains(needle) {
        let left = deadline.saturating_duration_since(Instant::now());
        let n = tokio::time::timeout(left, r.read(&mut buf))
            .await
            .unwrap_or_else(|_| {
                panic!(
                    "{needle:?} not seen; got {:?}",
                    String::from_utf8_lossy(&got)
                )
            })
            .unwrap();
        assert!(
            n > 0,
            "EOF before {needle:?}; got {:?}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&got).into_owned()
}

fn topics(rx: &mut mpsc::UnboundedReceiver<Event>) -> Vec<&'static str> {
    let mut t = Vec::new();
    while let Ok(e) = rx.try_recv() {
        t.push(e.topic);
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn containers_run_through_the_task_api_against_a_real_agent() {
    let mut f = fixture().await;
    let c = &f.client;
    let connect = c
        .connect(ctx(), &api::ConnectRequest::default())
        .await
        .unwrap();
    assert_eq!(connect.shim_pid, std::process::id());

    // The init: stdout, stderr, stdin, then it lives until killed.
    let (b, img) = bundle(
        f.dir.path(),
        "c1",
        &[
            "sh",
            "-c",
            "echo out; echo err >&2; read l; echo got $l; exec sleep 1000",
        ],
        json!({}),
    );
    let mut io = fifos(f.dir.path(), "c1");
    let create = api::CreateTaskRequest {
        id: "c1".into(),
        bundle: b.display().to_string(),
        rootfs: vec![twig_mount(&img)],
        stdin: io.paths[0].clone(),
        stdout: io.paths[1].clone(),
        stderr: io.paths[2].clone(),
        ..Default::default()
    };
    c.create(ctx(), &create).await.expect("create");
    assert_eq!(
        code(c.create(ctx(), &create).await.unwrap_err()),
        Code::ALREADY_EXISTS
    );
    let state = c
        .state(
            ctx(),
            &api::StateRequest {
                id: "c1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(state.status.enum_value(), Ok(Status::CREATED));
    c.start(
        ctx(),
        &api::StartRequest {
            id: "c1".into(),
            ..Default::default()
        },
    )
    .await
    .expect("start");
    assert_eq!(
        code(
            c.start(
                ctx(),
                &api::StartRequest {
                    id: "c1".into(),
                    ..Default::default()
                }
            )
            .await
            .unwrap_err()
        ),
        Code::FAILED_PRECONDITION
    );
    io.stdin.write_all(b"hello\n").await.unwrap();
    c.close_io(
        ctx(),
        &api::CloseIORequest {
            id: "c1".into(),
            stdin: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let out = read_until(&mut io.stdout, "got hello").await;
    assert_eq!(out, "out\ngot hello\n");
    assert_eq!(read_until(&mut io.stderr, "err").await, "err\n");
    let state = c
        .state(
            ctx(),
            &api::StateRequest {
                id: "c1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(state.status.enum_value(), Ok(Status::RUNNING));

    // Stats: cgroups v1 metrics, as containerd decodes them. The shell
    // may be in its `exec sleep` (a process between two address spaces
    // has no resident pages yet): poll until the memory shows.
    let deadline = std::time::Instant::now() + T;
    loop {
        let stats = c
            .stats(
                ctx(),
                &api::StatsRequest {
                    id: "c1".into(),
                    ..Default::default()
                },
            )
            .await
            .unwrap();
        let any = stats.stats.as_ref().unwrap();
        assert_eq!(any.type_url, "io.containerd.cgroups.v1.Metrics");
        let m = Metrics::parse_from_bytes(&any.value).unwrap();
        assert!(m.pids.current >= 1, "{m:?}");
        if m.memory.usage.usage > 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no memory within {T:?}: {m:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }

    // An exec with its exit code, and one with a terminal.
    let ex = |exec_id: &str, args: &[&str], terminal: bool, out: &str| api::ExecProcessRequest {
        id: "c1".into(),
        exec_id: exec_id.into(),
        terminal,
        stdout: out.into(),
        spec: MessageField::some(Any {
            type_url: "types.containerd.io/opencontainers/runtime-spec/1/Process".into(),
            value: twig_agent::testkit::process(args, json!({"terminal": terminal})),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut e1 = fifos(f.dir.path(), "e1");
    c.exec(
        ctx(),
        &ex(
            "e1",
            &["sh", "-c", "echo exec-out; exit 7"],
            false,
            &e1.paths[1],
        ),
    )
    .await
    .expect("exec");
    assert_eq!(
        code(
            c.exec(ctx(), &ex("e1", &["true"], false, ""))
                .await
                .unwrap_err()
        ),
        Code::ALREADY_EXISTS
    );
    c.start(
        ctx(),
        &api::StartRequest {
            id: "c1".into(),
            exec_id: "e1".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let w = c
        .wait(
            ctx(),
            &api::WaitRequest {
                id: "c1".into(),
                exec_id: "e1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(w.exit_status, 7);
    assert_eq!(read_all(&mut e1.stdout).await, "exec-out\n");
    let d = c
        .delete(
            ctx(),
            &api::DeleteRequest {
                id: "c1".into(),
                exec_id: "e1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(d.exit_status, 7);
    // Deleted in the guest too: the exec id can be used again (the agent
    // would refuse a second "e1" it still held).
    let mut again = fifos(f.dir.path(), "e1-again");
    c.exec(ctx(), &ex("e1", &["echo", "again"], false, &again.paths[1]))
        .await
        .expect("an exec id reused after its delete");
    let start = api::StartRequest {
        id: "c1".into(),
        exec_id: "e1".into(),
        ..Default::default()
    };
    c.start(ctx(), &start).await.unwrap();
    assert_eq!(read_all(&mut again.stdout).await, "again\n");
    let d = api::DeleteRequest {
        id: "c1".into(),
        exec_id: "e1".into(),
        ..Default::default()
    };
    let w = api::WaitRequest {
        id: "c1".into(),
        exec_id: "e1".into(),
        ..Default::default()
    };
    c.wait(ctx(), &w).await.unwrap();
    c.delete(ctx(), &d).await.unwrap();

    let mut e2 = fifos(f.dir.path(), "e2");
    c.exec(
        ctx(),
        &ex(
            "e2",
            &["sh", "-c", "test -t 1 && echo tty-ok && tty"],
            true,
            &e2.paths[1],
        ),
    )
    .await
    .unwrap();
    c.start(
        ctx(),
        &api::StartRequest {
            id: "c1".into(),
            exec_id: "e2".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    c.resize_pty(
        ctx(),
        &api::ResizePtyRequest {
            id: "c1".into(),
            exec_id: "e2".into(),
            width: 100,
            height: 40,
            ..Default::default()
        },
    )
    .await
    .ok();
    let w = c
        .wait(
            ctx(),
            &api::WaitRequest {
                id: "c1".into(),
                exec_id: "e2".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(w.exit_status, 0);
    let tty = read_all(&mut e2.stdout).await;
    // A terminal's output: onlcr turns the newline into CR LF.
    assert_eq!(tty, "tty-ok\r\n/dev/pts/0\r\n");

    // Kill: 128 + signal, as runc's shim reports; a second kill finds nothing.
    c.kill(
        ctx(),
        &api::KillRequest {
            id: "c1".into(),
            signal: 9,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let w = c
        .wait(
            ctx(),
            &api::WaitRequest {
                id: "c1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(w.exit_status, 137);
    assert_eq!(read_all(&mut io.stdout).await, "");
    assert_eq!(
        code(
            c.kill(
                ctx(),
                &api::KillRequest {
                    id: "c1".into(),
                    signal: 9,
                    ..Default::default()
                }
            )
            .await
            .unwrap_err()
        ),
        Code::NOT_FOUND
    );
    let state = c
        .state(
            ctx(),
            &api::StateRequest {
                id: "c1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(
        (state.status.enum_value(), state.exit_status),
        (Ok(Status::STOPPED), 137)
    );
    let d = c
        .delete(
            ctx(),
            &api::DeleteRequest {
                id: "c1".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(d.exit_status, 137);
    assert_eq!(
        code(
            c.state(
                ctx(),
                &api::StateRequest {
                    id: "c1".into(),
                    ..Default::default()
                }
            )
            .await
            .unwrap_err()
        ),
        Code::NOT_FOUND
    );

    let t = topics(&mut f.events);
    assert_eq!(
        t,
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exec-added",
            "/tasks/exec-started",
            "/tasks/exit",
            "/tasks/exec-added",
            "/tasks/exec-started",
            "/tasks/exit",
            "/tasks/exec-added",
            "/tasks/exec-started",
            "/tasks/exit",
            "/tasks/exit",
            "/tasks/delete",
        ]
    );

    // Shutdown with nothing left ends the shim.
    c.shutdown(ctx(), &api::ShutdownRequest::default())
        .await
        .unwrap();
    tokio::time::timeout(T, f.exit.wait())
        .await
        .expect("shutdown signals exit");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_get_errdefs_codes_and_change_nothing() {
    let mut f = fixture().await;
    let c = &f.client;
    let (b, img) = bundle(f.dir.path(), "c2", &["sh", "-c", "exit 3"], json!({}));
    let overlay = api::Mount {
        type_: "overlay".into(),
        source: "overlay".into(),
        options: vec!["lowerdir=/x".into()],
        ..Default::default()
    };
    let mut req = api::CreateTaskRequest {
        id: "c2".into(),
        bundle: b.display().to_string(),
        rootfs: vec![overlay],
        ..Default::default()
    };
    let e = c.create(ctx(), &req).await.unwrap_err();
    let msg = format!("{e:?}");
    assert_eq!(code(e), Code::INVALID_ARGUMENT);
    assert!(msg.contains("--snapshotter twig"), "{msg}");
    // Nothing was created: the same id is free, and the exit code comes through.
    req.rootfs = vec![twig_mount(&img)];
    c.create(ctx(), &req)
        .await
        .expect("create after a refused create");
    assert_eq!(
        code(
            c.start(
                ctx(),
                &api::StartRequest {
                    id: "nope".into(),
                    ..Default::default()
                }
            )
            .await
            .unwrap_err()
        ),
        Code::NOT_FOUND
    );
    assert_eq!(
        code(
            c.pause(ctx(), &api::PauseRequest::default())
                .await
                .unwrap_err()
        ),
        Code::UNIMPLEMENTED
    );
    c.start(
        ctx(),
        &api::StartRequest {
            id: "c2".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let w = c
        .wait(
            ctx(),
            &api::WaitRequest {
                id: "c2".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(w.exit_status, 3);
    // Shutdown while a container exists keeps serving.
    c.shutdown(ctx(), &api::ShutdownRequest::default())
        .await
        .unwrap();
    assert!(
        tokio::time::timeout(Duration::from_millis(100), f.exit.wait())
            .await
            .is_err()
    );
    c.delete(
        ctx(),
        &api::DeleteRequest {
            id: "c2".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    // A kill of a created, unstarted container ends it, as runc's shim does
    // (containerd kills, waits, then deletes a task whose start failed):
    // 128 + SIGKILL, and it cannot be started any more.
    req.id = "c3".into();
    c.create(ctx(), &req).await.expect("create c3");
    c.kill(
        ctx(),
        &api::KillRequest {
            id: "c3".into(),
            signal: 9,
            ..Default::default()
        },
    )
    .await
    .expect("kill of a created container");
    let w = c
        .wait(
            ctx(),
            &api::WaitRequest {
                id: "c3".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(w.exit_status, 137);
    assert_eq!(
        code(
            c.start(
                ctx(),
                &api::StartRequest {
                    id: "c3".into(),
                    ..Default::default()
                }
            )
            .await
            .unwrap_err()
        ),
        Code::FAILED_PRECONDITION
    );
    c.delete(
        ctx(),
        &api::DeleteRequest {
            id: "c3".into(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let t = topics(&mut f.events);
    assert_eq!(
        t,
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exit",
            "/tasks/delete",
            "/tasks/create",
            "/tasks/exit",
            "/tasks/delete"
        ]
    );
}

/// A CRI pod's sandbox container (containerd's pause image) becomes the
/// agent's built-in pause: no disk is attached for it, the image's process
/// never runs (`/pause` is not in this image), and it ends with 0 on
/// SIGTERM, as Kubernetes' pause does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cri_sandbox_container_is_the_agents_pause_on_no_disk() {
    let f = fixture().await;
    let c = &f.client;
    let (b, img) = bundle(
        f.dir.path(),
        "sb",
        &["/pause"],
        json!({"annotations": {
            "io.kubernetes.cri.container-type": "sandbox",
            "io.kubernetes.cri.sandbox-id": "sb",
        }}),
    );
    let id = |id: &str| id.to_string();
    c.create(
        ctx(),
        &api::CreateTaskRequest {
            id: id("sb"),
            bundle: b.display().to_string(),
            rootfs: vec![twig_mount(&img)],
            ..Default::default()
        },
    )
    .await
    .expect("create");
    c.start(
        ctx(),
        &api::StartRequest {
            id: id("sb"),
            ..Default::default()
        },
    )
    .await
    .expect("start");
    let state = c
        .state(
            ctx(),
            &api::StateRequest {
                id: id("sb"),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(state.status.enum_value(), Ok(Status::RUNNING));
    let loops = std::process::Command::new("losetup")
        .arg("-j")
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        loops.status.success() && loops.stdout.is_empty(),
        "no loop device for the pause image: {}",
        String::from_utf8_lossy(&loops.stdout)
    );
    c.kill(
        ctx(),
        &api::KillRequest {
            id: id("sb"),
            signal: 15,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let w = c
        .wait(
            ctx(),
            &api::WaitRequest {
                id: id("sb"),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(w.exit_status, 0);
    c.delete(
        ctx(),
        &api::DeleteRequest {
            id: id("sb"),
            ..Default::default()
        },
    )
    .await
    .expect("delete");
}

/// A pod's guest volumes go to the agent in `PrepareVolumes` calls, each
/// under ttrpc's 4 MiB message: three 2 MiB mirrors and a small one (8
/// MiB in all) arrive whole, each with its own content.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pods_volumes_go_in_batches_under_the_message_limit() {
    use twig_shim::resources::volumes::{self, Mirror, Volume};
    let agent = Agent::start();
    let dir = tempfile::tempdir().unwrap();
    let mut mirrors = Vec::new();
    for (i, len) in [(0u8, 16usize), (1, 2 << 20), (2, 2 << 20), (3, 2 << 20)] {
        let host = dir.path().join(format!("vol{i}"));
        std::fs::create_dir(&host).unwrap();
        std::fs::write(host.join("data"), vec![b'a' + i; len]).unwrap();
        mirrors.push(Volume::Mirror(Mirror {
            name: format!("vol{i}"),
            host,
            file: false,
            live: false,
        }));
    }
    let socket = agent.socket.clone();
    tokio::task::spawn_blocking(move || {
        let sandbox = HostSandbox::connect(&socket, T).expect("connecting to the host agent");
        volumes::prepare(&sandbox, &mirrors, None, T).expect("the volumes");
        for i in 0..4u8 {
            let read = twig_shim::sandbox::Sandbox::agent(&sandbox)
                .read_volume_file(&format!("vol{i}"), "data", 16, T)
                .expect("reading a volume's file");
            assert_eq!(read.data, vec![b'a' + i; 16], "vol{i}");
        }
    })
    .await
    .unwrap();
}

/// kubelet starts a restarted container (the same name, so the same guest
/// volumes) before it removes the exited attempt: deleting the exited one
/// leaves the running one's volumes in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_an_exited_attempt_keeps_the_restarted_ones_volumes() {
    let f = fixture().await;
    let c = &f.client;
    let cm = f
        .dir
        .path()
        .join("pods/uid-1/volumes/kubernetes.io~configmap/cfg");
    std::fs::create_dir_all(&cm).unwrap();
    std::fs::write(cm.join("key"), "v1\n").unwrap();
    let extra = json!({
        "annotations": {"io.kubernetes.cri.container-name": "app"},
        "mounts": [{"destination": "/etc/cfg", "type": "bind", "source": cm,
                    "options": ["rbind", "ro"]}]});
    let run = |id: &'static str, args: &'static [&'static str]| {
        let (b, img) = bundle(f.dir.path(), id, args, extra.clone());
        let io = fifos(f.dir.path(), id);
        let create = api::CreateTaskRequest {
            id: id.into(),
            bundle: b.display().to_string(),
            rootfs: vec![twig_mount(&img)],
            stdin: io.paths[0].clone(),
            stdout: io.paths[1].clone(),
            stderr: io.paths[2].clone(),
            ..Default::default()
        };
        async move {
            c.create(ctx(), &create).await.expect("create");
            let start = api::StartRequest {
                id: id.into(),
                ..Default::default()
            };
            c.start(ctx(), &start).await.expect("start");
            io
        }
    };
    // Attempt 0 exits; attempt 1 runs, then reads its ConfigMap on a line
    // of stdin.
    let mut first = run("attempt-0", &["cat", "/etc/cfg/key"]).await;
    assert_eq!(read_all(&mut first.stdout).await, "v1\n");
    let wait = api::WaitRequest {
        id: "attempt-0".into(),
        ..Default::default()
    };
    assert_eq!(c.wait(ctx(), &wait).await.unwrap().exit_status, 0);
    let mut second = run(
        "attempt-1",
        &["sh", "-c", "read l; cat /etc/cfg/key; exec sleep 1000"],
    )
    .await;
    let delete = api::DeleteRequest {
        id: "attempt-0".into(),
        ..Default::default()
    };
    c.delete(ctx(), &delete)
        .await
        .expect("delete the exited attempt");
    second.stdin.write_all(b"go\n").await.unwrap();
    assert_eq!(read_until(&mut second.stdout, "\n").await, "v1\n");
    let kill = api::KillRequest {
        id: "attempt-1".into(),
        signal: 9,
        ..Default::default()
    };
    c.kill(ctx(), &kill).await.expect("kill");
}
