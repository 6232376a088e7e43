//! Test harness: real loop-mounted XFS, a real `twig-snapshotter` process,
//! real containerd; everything is torn down on drop, also when a test fails.
#![allow(dead_code)] // each test binary uses a different part of the harness

pub mod fstest;

use std::fs;
use std::io::Read;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tempfile::TempDir;
use twig_snapshotter::api::snapshots::snapshots_client::SnapshotsClient;
use twig_snapshotter::api::types::Mount;

pub type Client = SnapshotsClient<tonic::transport::Channel>;

/// Every snapshot the snapshotter `twig` reports, unfiltered.
pub async fn list_all(c: &mut Client) -> Vec<twig_snapshotter::api::snapshots::Info> {
    let mut stream = c
        .list(twig_snapshotter::api::snapshots::ListSnapshotsRequest {
            snapshotter: "twig".into(),
            filters: vec![],
        })
        .await
        .expect("list")
        .into_inner();
    let mut out = Vec::new();
    while let Some(batch) = stream.message().await.expect("list stream") {
        out.extend(batch.info);
    }
    out
}

/// Fails the test (never skips) unless running as root with `tools` on PATH.
pub fn require(tools: &[&str]) {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test needs root (loop devices, mounts, containerd); run `cargo test` as root"
    );
    let missing: Vec<&str> = tools
        .iter()
        .copied()
        .filter(|t| {
            !Command::new("sh")
                .args(["-c", &format!("command -v {t}")])
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .collect();
    assert!(
        missing.is_empty(),
        "this test needs {missing:?} on PATH; install them with scripts/install-deps.sh"
    );
}

/// Runs a command, panicking with its output when it fails.
pub fn sh(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed with {}:\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A loop-mounted filesystem in its own temp dir and loop device.
pub struct LoopFs {
    pub dir: TempDir,
    pub mnt: PathBuf,
    loopdev: String,
}

impl LoopFs {
    /// XFS with reflink, like the store's production filesystem.
    pub fn xfs(size_mib: u64) -> LoopFs {
        LoopFs::new(size_mib, "xfs", &["mkfs.xfs", "-q", "-m", "reflink=1"])
    }

    /// btrfs: reflinks too.
    pub fn btrfs(size_mib: u64) -> LoopFs {
        LoopFs::new(size_mib, "btrfs", &["mkfs.btrfs", "-q"])
    }

    /// ext4: no FICLONE.
    pub fn ext4(size_mib: u64) -> LoopFs {
        LoopFs::new(size_mib, "ext4", &["mkfs.ext4", "-q"])
    }

    fn new(size_mib: u64, fstype: &str, mkfs: &[&str]) -> LoopFs {
        require(&[mkfs[0], "losetup", "mount", "umount"]);
        let dir = tempfile::Builder::new()
            .prefix("twig-snap-test-")
            .tempdir()
            .expect("temp dir");
        let img = dir.path().join("xfs.img");
        fs::File::create(&img)
            .and_then(|f| f.set_len(size_mib << 20))
            .expect("sizing the XFS image");
        sh(Command::new(mkfs[0]).args(&mkfs[1..]).arg(&img));
        let loopdev = sh(Command::new("losetup").args(["--find", "--show"]).arg(&img))
            .trim()
            .to_string();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).expect("mount point");
        let fs = LoopFs { dir, mnt, loopdev };
        sh(Command::new("mount")
            .args(["-t", fstype, &fs.loopdev])
            .arg(&fs.mnt));
        fs
    }

    pub fn path(&self) -> &Path {
        &self.mnt
    }

    /// Bytes in use on the filesystem (statfs).
    pub fn used_bytes(&self) -> u64 {
        let out = sh(Command::new("stat")
            .args(["-f", "-c", "%S %b %f"])
            .arg(&self.mnt));
        let v: Vec<u64> = out
            .split_whitespace()
            .map(|x| x.parse().expect("stat output"))
            .collect();
        v[0] * (v[1] - v[2])
    }

    /// Fills the filesystem until writes fail with ENOSPC; returns the
    /// directory of filler files (remove it to free the space).
    pub fn fill_up(&self) -> PathBuf {
        let dir = self.mnt.join("filler");
        fs::create_dir_all(&dir).expect("filler dir");
        let out = sh(Command::new("stat")
            .args(["-f", "-c", "%S %a"])
            .arg(&self.mnt));
        let v: Vec<u64> = out
            .split_whitespace()
            .map(|x| x.parse().expect("stat output"))
            .collect();
        let avail = v[0] * v[1];
        if avail > 1 << 20 {
            let _ = Command::new("fallocate")
                .args(["-l", &(avail - (1 << 20)).to_string()])
                .arg(dir.join("big"))
                .status();
        }
        for i in 0.. {
            if fs::write(dir.join(format!("small-{i}")), [0u8; 4096]).is_err() {
                break;
            }
        }
        dir
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.mnt)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = Command::new("losetup").args(["-d", &self.loopdev]).status();
    }
}

/// A child process that is killed and reaped on drop.
pub struct Daemon {
    child: Option<Child>,
    pub log: PathBuf,
}

impl Daemon {
    pub fn spawn(cmd: &mut Command, log: PathBuf) -> Daemon {
        let out = fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
        Daemon {
            child: Some(child),
            log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        let _ = fs::File::open(&self.log).and_then(|mut f| f.read_to_string(&mut s));
        s
    }

    /// Waits until `socket` accepts connections; Err(log) if the process
    /// exits first or the deadline passes.
    pub fn wait_for_socket(&mut self, socket: &Path, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            if UnixStream::connect(socket).is_ok() {
                return Ok(());
            }
            if let Some(child) = self.child.as_mut() {
                if let Ok(Some(status)) = child.try_wait() {
                    self.child = None;
                    return Err(format!("exited with {status}: {}", self.log_text()));
                }
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "{} not accepting after {within:?}: {}",
                    socket.display(),
                    self.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the process to exit on its own; returns its exit code.
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return status.code();
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, wait up to 10 s, then SIGKILL.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: signalling our own child by pid.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A running `twig-snapshotter`.
pub struct Snapshotter {
    pub daemon: Daemon,
    pub socket: PathBuf,
    pub root: PathBuf,
}

impl Snapshotter {
    /// Starts the binary on `root`; Err(log) if it does not come up.
    pub fn try_start(root: &Path, socket: &Path, extra: &[&str]) -> Result<Snapshotter, String> {
        let log = socket.with_extension("log");
        let mut daemon = Daemon::spawn(
            Command::new(env!("CARGO_BIN_EXE_twig-snapshotter"))
                .arg("--root")
                .arg(root)
                .arg("--address")
                .arg(socket)
                .args(["--image-size-mib", "64"])
                .args(extra)
                .env("RUST_LOG", "info"),
            log,
        );
        daemon.wait_for_socket(socket, Duration::from_secs(30))?;
        Ok(Snapshotter {
            daemon,
            socket: socket.to_path_buf(),
            root: root.to_path_buf(),
        })
    }

    pub fn start(root: &Path, socket: &Path) -> Snapshotter {
        Snapshotter::try_start(root, socket, &[])
            .unwrap_or_else(|log| panic!("twig-snapshotter did not start: {log}"))
    }

    pub async fn client(&self) -> Client {
        connect(&self.socket).await
    }
}

/// A gRPC client on a Unix socket.
pub async fn connect(socket: &Path) -> Client {
    let path = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://[::1]:50051")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .unwrap_or_else(|e| panic!("connecting to {}: {e}", socket.display()));
    SnapshotsClient::new(channel)
}

/// An XFS with a snapshotter on it and a work dir for mount points.
pub struct Rig {
    pub snap: Snapshotter,
    pub work: PathBuf,
    pub xfs: LoopFs,
}

impl Rig {
    pub fn new() -> Rig {
        let xfs = LoopFs::xfs(320);
        let work = xfs.dir.path().join("work");
        fs::create_dir(&work).expect("work dir");
        let snap = Snapshotter::start(&xfs.mnt.join("store"), &xfs.dir.path().join("snap.sock"));
        Rig { snap, work, xfs }
    }

    /// Restarts the snapshotter process after SIGKILL.
    pub fn restart_after_kill9(&mut self) {
        self.snap.daemon.kill9();
        self.snap = Snapshotter::start(&self.snap.root, &self.snap.socket);
    }
}

/// Mounts containerd-style mounts (as `mount(8)` does, loop included) on a
/// fresh directory under `work`; unmounts on drop.
pub struct Mounted {
    pub path: PathBuf,
}

impl Mounted {
    pub fn new(mounts: &[Mount], work: &Path, name: &str) -> Mounted {
        assert_eq!(
            mounts.len(),
            1,
            "twig returns exactly one mount: {mounts:?}"
        );
        let m = &mounts[0];
        let path = work.join(name);
        fs::create_dir_all(&path).expect("mount point");
        sh(Command::new("mount")
            .args(["-t", &m.r#type, "-o", &m.options.join(",")])
            .arg(&m.source)
            .arg(&path));
        Mounted { path }
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.path)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}
