//! The agent's file-share listener (`--share-listen unix://…`) and
//! `PrepareVolume.share`: a connection's request names a share id, the
//! stream waits for the `PrepareVolume` naming it, which mounts it (9p over
//! the stream, `trans=fd`). The host has no 9p filesystem and the test's
//! end serves none, so every mount here fails: what is checked is that the
//! stream is taken by its id, a malformed id or request is refused, a
//! share that never arrives fails within its deadline, and a failed mount
//! leaves no volume behind. The mount itself is the lab's
//! (`e2e/tests/volumes.rs`, the shim's file server in a real guest).

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Agent, T};
use twig_agent::client::{AgentClient, Error};
use twig_agent::proto::agent::PrepareVolumeRequest;
use twig_agent::proto::file_share;

const ID: &str = "0123456789abcdef0123456789abcdef";

struct Shares {
    agent: Agent,
    socket: PathBuf,
    vols: PathBuf,
    _dir: tempfile::TempDir,
}

impl Shares {
    fn start() -> Shares {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("share.sock");
        let vols = dir.path().join("vols");
        let agent = Agent::start_with(
            &[],
            "",
            &[
                &format!("--share-listen unix://{}", socket.display()),
                "--volumes-dir",
                &common::path_str(&vols),
            ],
        );
        Shares {
            agent,
            socket,
            vols,
            _dir: dir,
        }
    }

    /// `path` as the agent's mount namespace sees it.
    fn agent_path(&self, path: &Path) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{}", self.agent.pid(), path.display()))
    }

    fn connect(&self) -> UnixStream {
        let deadline = Instant::now() + T;
        loop {
            match UnixStream::connect(&self.socket) {
                Ok(s) => return s,
                Err(_) if Instant::now() < deadline => std::thread::yield_now(),
                Err(e) => panic!("connecting: {e}\nlog:\n{}", self.agent.log()),
            }
        }
    }
}

fn share(c: &AgentClient, name: &str, id: &str) -> Result<(), Error> {
    let req = PrepareVolumeRequest {
        name: name.into(),
        share: id.into(),
        read_only: true,
        ..Default::default()
    };
    c.prepare_volume(&req, T)
}

fn code(r: Result<(), Error>) -> String {
    match r {
        Err(e) => e.status_code().unwrap_or("not a status").to_string(),
        Ok(()) => "ok".into(),
    }
}

fn no_volume(vols: &Path, name: &str) {
    assert!(
        !vols.join(name).exists(),
        "{name} was left in {}",
        vols.display()
    );
}

#[test]
fn a_share_is_taken_by_its_id_and_a_failed_mount_leaves_no_volume() {
    let s = Shares::start();
    let c = s.agent.client();
    // A malformed id, and a share with a tmpfs: refused at once.
    assert_eq!(code(share(&c, "v1", "not-an-id")), "INVALID_ARGUMENT");
    let both = PrepareVolumeRequest {
        name: "v1".into(),
        share: ID.into(),
        tmpfs_bytes: 1 << 20,
        ..Default::default()
    };
    assert_eq!(code(c.prepare_volume(&both, T)), "INVALID_ARGUMENT");

    // The stream arrives, then its PrepareVolume: the agent hands it to a
    // 9p mount, which fails here (no 9p, and the test's end is closed).
    let mut conn = s.connect();
    conn.write_all(&file_share::encode(ID).unwrap()).unwrap();
    drop(conn);
    let e = share(&c, "v1", ID).expect_err("no 9p server: the mount fails");
    assert_eq!(e.status_code(), Some("INTERNAL"), "{e}");
    assert!(e.to_string().contains("mounting the file share"), "{e}");
    no_volume(&s.vols, "v1");

    // A volume of that name exists (a restarted container's share): the
    // new share goes on it (here: the mount is tried, and fails).
    let mut conn = s.connect();
    conn.write_all(&file_share::encode(ID).unwrap()).unwrap();
    drop(conn);
    std::fs::create_dir_all(s.agent_path(&s.vols.join("v1"))).unwrap();
    let e = share(&c, "v1", ID).expect_err("no 9p server");
    assert!(e.to_string().contains("mounting the file share"), "{e}");

    // Taken once: the same id again has no stream, and fails within its
    // deadline (the agent's 10 s).
    let started = Instant::now();
    assert_eq!(code(share(&c, "v2", ID)), "FAILED_PRECONDITION");
    assert!(started.elapsed() < Duration::from_secs(20));
    no_volume(&s.vols, "v2");
}

#[test]
fn a_malformed_request_is_closed() {
    let s = Shares::start();
    let mut conn = s.connect();
    conn.write_all(b"TWPF0123456789abcdef0123456789abcdef")
        .unwrap();
    conn.set_read_timeout(Some(T)).unwrap();
    let mut buf = [0u8; 1];
    assert_eq!(conn.read(&mut buf).unwrap(), 0, "closed by the agent");
    // The listener goes on.
    let mut conn = s.connect();
    conn.write_all(&file_share::encode(ID).unwrap()).unwrap();
}
