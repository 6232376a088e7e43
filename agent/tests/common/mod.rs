//! Fixtures for the agent's host tests: a busybox ext4 image on a loop
//! device, and the agent binary serving on a Unix socket inside its own pid
//! and mount namespaces (so that killing it cleans up every container
//! process and mount, even when a test fails).

#![allow(dead_code)]

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use twig_agent::client::AgentClient;

pub const T: Duration = Duration::from_secs(30);

pub fn run_cmd(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An ext4 image holding busybox, attached to a loop device; detached on
/// drop.
pub struct Image {
    pub device: String,
    _dir: tempfile::TempDir,
}

impl Image {
    pub fn new() -> Image {
        Self::with_programs(&[])
    }

    /// The image with host files added as `/bin/<name>` (mode kept).
    pub fn with_programs(programs: &[(&Path, &str)]) -> Image {
        let dir = tempfile::tempdir().unwrap();
        let img = dir.path().join("rootfs.ext4");
        twig_agent::testkit::busybox_rootfs(&img, 16, &[("etc/twig-marker", "twig-image\n")])
            .unwrap();
        for (host, name) in programs {
            let cmd = format!("write {} /bin/{name}", host.display());
            run_cmd(Command::new("debugfs").args(["-w", "-R", &cmd]).arg(&img));
        }
        let device = run_cmd(Command::new("losetup").args(["--find", "--show"]).arg(&img))
            .trim()
            .to_string();
        assert!(device.starts_with("/dev/loop"), "{device}");
        Image { device, _dir: dir }
    }
}

impl Drop for Image {
    fn drop(&mut self) {
        let _ = Command::new("losetup").args(["-d", &self.device]).status();
    }
}

/// The agent, by PID, killed on drop.
pub struct Agent {
    pub child: Child,
    pub socket: PathBuf,
    pub state_dir: PathBuf,
    log: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Agent {
    /// Starts the agent in new pid + mount namespaces (plus `extra_unshare`
    /// flags), optionally after a shell `prelude` run in those namespaces.
    pub fn start_with(extra_unshare: &[&str], prelude: &str, agent_args: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let state_dir = dir.path().join("state");
        let log = dir.path().join("agent.log");
        // TWIG_AGENT_BIN runs the tests against another build (e.g. the
        // static release binary).
        let exe = std::env::var("TWIG_AGENT_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_twig-agent").to_string());
        let mut agent_cmd = format!(
            "exec {exe} --listen unix://{} --state-dir {}",
            socket.display(),
            state_dir.display()
        );
        for a in agent_args {
            agent_cmd.push(' ');
            agent_cmd.push_str(a);
        }
        let script = if prelude.is_empty() {
            agent_cmd
        } else {
            format!("set -e; {prelude}; {agent_cmd}")
        };
        let child = Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .args(extra_unshare)
            .args(["sh", "-c", &script])
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Agent {
            child,
            socket,
            state_dir,
            log,
            dir,
        }
    }

    pub fn start() -> Agent {
        Self::start_with(&[], "", &[])
    }

    pub fn client(&self) -> AgentClient {
        AgentClient::connect_unix(&self.socket, T)
            .unwrap_or_else(|e| panic!("connecting to the agent: {e}\nlog:\n{}", self.log()))
    }

    pub fn log(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    /// The agent's pid (the child of `unshare`).
    pub fn pid(&self) -> i32 {
        let unshare = self.child.id();
        let deadline = Instant::now() + T;
        loop {
            let children =
                std::fs::read_to_string(format!("/proc/{unshare}/task/{unshare}/children"))
                    .unwrap_or_default();
            if let Some(pid) = children.split_whitespace().next() {
                return pid.parse().unwrap();
            }
            assert!(Instant::now() < deadline, "unshare has no child");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The agent's mount table.
    pub fn mountinfo(&self) -> String {
        std::fs::read_to_string(format!("/proc/{}/mountinfo", self.pid())).unwrap()
    }

    pub fn rootfs_path(&self, id: &str) -> PathBuf {
        self.state_dir.join("containers").join(id).join("rootfs")
    }

    pub fn is_alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // unshare --kill-child takes the agent (pid 1 of its namespace) and
        // so every container process with it.
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() || std::env::var_os("TWIG_AGENT_TEST_LOG").is_some() {
            eprintln!("---- agent log ----\n{}", self.log());
        }
    }
}

pub fn path_str(p: &Path) -> String {
    p.display().to_string()
}
