//! The harness's part of the recovery tests: killing and restarting the
//! node's daemons (`kill -9`, then the same command again), and finding
//! the processes and files a pod leaves: its shim, its VMM (the pid the
//! shim records in its state directory), their `/proc` state.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::error::{Error, Result};
use crate::node::Node;
use crate::process::Daemon;

/// Deadline of a restarted daemon's socket.
const RESTART: Duration = Duration::from_secs(180);
/// Polling interval of the harness's waits.
const POLL: Duration = Duration::from_millis(50);

/// What `/proc` says about a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcState {
    /// It runs (or sleeps, or is stopped).
    Alive,
    /// It exited and nobody reaped it yet.
    Zombie,
    /// No such process.
    Gone,
}

/// The state of process `pid` from `/proc/<pid>/stat`.
pub fn proc_state(pid: i32) -> ProcState {
    match fs::read_to_string(format!("/proc/{pid}/stat")) {
        // `pid (comm) state ...`; comm may hold spaces and parentheses.
        Ok(stat) => match stat.rsplit_once(')').map(|(_, rest)| rest.trim_start()) {
            Some(rest) if rest.starts_with(['Z', 'X']) => ProcState::Zombie,
            _ => ProcState::Alive,
        },
        Err(_) => ProcState::Gone,
    }
}

/// Polls `check` every 50 ms until it holds or `within` passes; whether
/// it held.
pub fn poll_until(within: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if check() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// PIDs of the processes whose command line has an argument satisfying
/// `matches` (this process excluded).
pub fn pids_with_arg(matches: impl Fn(&str) -> bool) -> Vec<i32> {
    let me = i32::try_from(std::process::id()).unwrap_or_default();
    let Ok(entries) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                c.split(|b| *b == 0)
                    .any(|a| matches(&String::from_utf8_lossy(a)))
            })
        })
        .collect()
}

/// `pid` and every process below it (children of each of its threads,
/// recursively), parents first: a jailed VMM in its own PID namespace is a
/// parent outside waiting for the VMM inside.
pub fn process_tree(pid: i32) -> Vec<i32> {
    let mut tree = vec![pid];
    let mut i = 0;
    while let Some(&p) = tree.get(i) {
        let tasks = fs::read_dir(format!("/proc/{p}/task"))
            .into_iter()
            .flatten();
        for task in tasks.flatten() {
            let children = fs::read_to_string(task.path().join("children")).unwrap_or_default();
            tree.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
        i += 1;
    }
    tree
}

/// Sends SIGKILL to `pid` (gone already: nothing to do).
pub fn kill9(pid: i32) {
    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
}

/// Sends `signal` to `pid`.
pub fn signal(pid: i32, signal: Signal) -> Result<()> {
    kill(Pid::from_raw(pid), signal).map_err(|e| Error::Io {
        what: format!("sending {signal} to {pid}"),
        source: e.into(),
    })
}

impl Node {
    /// The node's directory for lookups: empty once torn down (finds
    /// nothing).
    fn lookup_dir(&self) -> PathBuf {
        self.dir().map(Path::to_path_buf).unwrap_or_default()
    }

    /// The twig shim's state directories (one per pod whose VM runs); not
    /// the node's start gate (`.starts`, kept for the node's life).
    pub fn shim_state_dirs(&self) -> Vec<PathBuf> {
        fs::read_dir(self.lookup_dir().join("shim"))
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
            .map(|e| e.path())
            .collect()
    }

    /// The pids of the twig VMMs the shims own: what each shim recorded in
    /// its state directory (`vmm.pid`, first line).
    pub fn handed_vmms(&self) -> Vec<i32> {
        self.shim_state_dirs()
            .iter()
            .filter_map(|d| fs::read_to_string(d.join("vmm.pid")).ok())
            .filter_map(|s| s.lines().next()?.trim().parse().ok())
            .collect()
    }

    /// The pids of the shims of `shim` (the binary's name) serving this
    /// node's containerd (they name its socket in `-address`).
    pub fn shim_pids(&self, shim: &str) -> Vec<i32> {
        let socket = self.socket().to_string_lossy().into_owned();
        pids_with_arg(|a| a == socket)
            .into_iter()
            .filter(|pid| {
                fs::read(format!("/proc/{pid}/cmdline"))
                    .is_ok_and(|c| String::from_utf8_lossy(&c).contains(shim))
            })
            .collect()
    }

    /// twig-node's log so far (every run of it).
    pub fn node_daemon_log(&self) -> String {
        self.logs_named("twig-node")
    }

    /// containerd's log so far (every run of it), the shims' logs included
    /// (containerd copies them from each bundle's `log` FIFO).
    pub fn containerd_log(&self) -> String {
        self.logs_named("containerd/containerd")
    }

    fn logs_named(&self, stem: &str) -> String {
        let mut text = String::new();
        for run in 0.. {
            let suffix = if run == 0 {
                String::new()
            } else {
                format!("-{run}")
            };
            match fs::read_to_string(self.lookup_dir().join(format!("{stem}{suffix}.log"))) {
                Ok(t) => text.push_str(&t),
                Err(_) => break,
            }
        }
        text
    }

    /// `kill -9` of containerd, then containerd again with the same
    /// configuration (its log continues in `containerd-<n>.log`); returns
    /// when its socket answers. Its shims run on and are found again from
    /// their bundles.
    pub fn restart_containerd(&mut self, run: usize) -> Result<()> {
        let dir = self.dir()?.to_path_buf();
        let cdir = dir.join("containerd");
        restart(
            &mut self.containerd,
            "containerd",
            Command::new("containerd")
                .arg("--config")
                .arg(cdir.join("config.toml"))
                .env("TWIG_SHIM_CONFIG", dir.join("shim.json")),
            cdir.join(format!("containerd-{run}.log")),
            &cdir.join("containerd.sock"),
        )
    }

    /// `kill -9` of twig-node, then twig-node again with the same
    /// configuration (log `twig-node-<n>.log`); returns when its socket
    /// answers. The VMMs it handed over run on (their shims own them).
    pub fn restart_node_daemon(&mut self, run: usize) -> Result<()> {
        let dir = self.dir()?.to_path_buf();
        restart(
            &mut self.node_daemon,
            "twig-node",
            Command::new("twig-node")
                .arg("--config")
                .arg(dir.join("node.json"))
                .env("RUST_LOG", "info"),
            dir.join(format!("twig-node-{run}.log")),
            &dir.join("node.sock"),
        )
    }
}

/// SIGKILLs `daemon`, reaps it, and starts `cmd` in its place.
fn restart(
    daemon: &mut Daemon,
    name: &str,
    cmd: &mut Command,
    log: PathBuf,
    socket: &Path,
) -> Result<()> {
    if let Some(pid) = daemon.pid().and_then(|p| i32::try_from(p).ok()) {
        kill9(pid);
    }
    // Reaps the killed process (its SIGTERM finds a zombie).
    daemon.stop();
    let mut new = Daemon::spawn(name, cmd, log)?;
    new.wait_for_socket(socket, RESTART)?;
    *daemon = new;
    Ok(())
}
