//! Processes with deadlines: one-shot commands whose output goes to files
//! (so a chatty command cannot block on a full pipe), and daemons stopped by
//! PID when dropped — also when a test panics.

use std::fmt;
use std::fs::File;
use std::io::{Read, Seek};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::error::{io, Error, Result};

/// How often the harness polls a process or a socket.
const POLL: Duration = Duration::from_millis(20);
/// How long a daemon gets between SIGTERM and SIGKILL.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// What a finished command printed, and how it ended.
#[derive(Debug)]
pub struct Output {
    /// Its exit status.
    pub status: ExitStatus,
    /// Its standard output.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
}

impl Output {
    /// The exit code, if the command exited rather than died of a signal.
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }
}

impl fmt::Display for Output {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}\nstdout: {}\nstderr: {}",
            self.status, self.stdout, self.stderr
        )
    }
}

fn read_back(mut file: File, what: &str) -> Result<String> {
    let mut text = String::new();
    file.rewind()
        .and_then(|()| file.read_to_string(&mut text))
        .map_err(io(format!("reading the output of {what}")))?;
    Ok(text)
}

/// Runs `cmd` to completion within `within`, whatever its exit status; a
/// command still running at the deadline is killed and reported as
/// [`Error::Timeout`] with what it printed.
pub fn run(cmd: &mut Command, within: Duration) -> Result<Output> {
    let what = format!("{cmd:?}");
    let out = tempfile::tempfile().map_err(io("creating an output file"))?;
    let err = tempfile::tempfile().map_err(io("creating an output file"))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(out.try_clone().map_err(io("duplicating an output file"))?)
        .stderr(err.try_clone().map_err(io("duplicating an output file"))?)
        .spawn()
        .map_err(io(format!("starting {what}")))?;
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .map_err(io(format!("waiting for {what}")))?
        {
            break status;
        }
        if Instant::now() >= deadline {
            // Already gone or not: either way it is reaped next.
            let _ = child.kill();
            let _ = child.wait();
            let output = format!(
                "stdout: {}\nstderr: {}",
                read_back(out, &what)?,
                read_back(err, &what)?
            );
            return Err(Error::Timeout {
                what,
                within,
                output,
            });
        }
        std::thread::sleep(POLL);
    };
    Ok(Output {
        status,
        stdout: read_back(out, &what)?,
        stderr: read_back(err, &what)?,
    })
}

/// Like [`run`], but a failure status is an [`Error::Failed`]; returns
/// standard output.
pub fn run_ok(cmd: &mut Command, within: Duration) -> Result<String> {
    let what = format!("{cmd:?}");
    let out = run(cmd, within)?;
    if out.status.success() {
        Ok(out.stdout)
    } else {
        Err(Error::Failed {
            what,
            status: out.status,
            output: format!("stdout: {}\nstderr: {}", out.stdout, out.stderr),
        })
    }
}

/// The last `lines` lines of a file (empty if it cannot be read).
pub fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// A long-running child process with its output in a log file; SIGTERM,
/// then SIGKILL after a grace period, when stopped or dropped.
#[derive(Debug)]
pub struct Daemon {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl Daemon {
    /// Starts `cmd` with stdout and stderr appended to `log`.
    pub fn spawn(name: &str, cmd: &mut Command, log: PathBuf) -> Result<Daemon> {
        let out = File::create(&log).map_err(io(format!("creating {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io(format!("duplicating {}", log.display())))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io(format!("starting {name} ({cmd:?})")))?;
        Ok(Daemon {
            name: name.to_string(),
            child: Some(child),
            log,
        })
    }

    /// The process's ID while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its log file.
    pub fn log(&self) -> &Path {
        &self.log
    }

    /// Waits until `socket` accepts connections; fails if the process exits
    /// first or `within` passes.
    pub fn wait_for_socket(&mut self, socket: &Path, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            if UnixStream::connect(socket).is_ok() {
                return Ok(());
            }
            let exited = match self.child.as_mut() {
                Some(child) => child
                    .try_wait()
                    .map_err(io(format!("waiting for {}", self.name)))?,
                None => None,
            };
            if let Some(status) = exited {
                self.child = None;
                return Err(self.start_error(format!("it exited with {status}")));
            }
            if Instant::now() >= deadline {
                return Err(self.start_error(format!(
                    "{} did not accept connections within {within:?}",
                    socket.display()
                )));
            }
            std::thread::sleep(POLL);
        }
    }

    fn start_error(&self, why: String) -> Error {
        Error::Start {
            what: self.name.clone(),
            why,
            log: self.log.clone(),
            tail: tail(&self.log, 40),
        }
    }

    /// Stops the process: SIGTERM, then SIGKILL if it is still there after
    /// a grace period; reaps it. Does nothing once it is stopped.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            // ESRCH only: it is a zombie or gone, which the wait reaps.
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + STOP_GRACE;
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(POLL);
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Kills (SIGKILL) every process whose command line has `arg` as one of its
/// arguments: how the harness finds the shims its containerd started (they
/// outlive containerd, and each names containerd's socket in `-address`).
pub fn kill_processes_with_arg(arg: &str) {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    let me = std::process::id();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        if u32::try_from(pid).is_ok_and(|p| p == me) {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if cmdline.split(|b| *b == 0).any(|a| a == arg.as_bytes()) {
            // The process may have exited since: nothing to do then.
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_reports_exit_code_and_both_streams() {
        let out = run(
            Command::new("sh").args(["-c", "echo out; echo err >&2; exit 3"]),
            Duration::from_secs(30),
        )
        .expect("sh runs");
        assert_eq!(out.code(), Some(3));
        assert_eq!(out.stdout, "out\n");
        assert_eq!(out.stderr, "err\n");
    }

    #[test]
    fn run_kills_at_the_deadline_and_keeps_the_output() {
        let started = Instant::now();
        let err = run(
            Command::new("sh").args(["-c", "echo before; exec sleep 30"]),
            Duration::from_millis(500),
        )
        .expect_err("sleep 30 outlives a 0.5 s deadline");
        assert!(started.elapsed() < Duration::from_secs(10));
        match err {
            Error::Timeout { output, .. } => assert!(output.contains("before"), "{output}"),
            other => panic!("expected a timeout, got {other}"),
        }
    }

    #[test]
    fn run_ok_turns_a_failure_status_into_an_error() {
        let err = run_ok(
            Command::new("sh").args(["-c", "echo why >&2; exit 1"]),
            Duration::from_secs(30),
        )
        .expect_err("exit 1 fails");
        assert!(err.to_string().contains("why"), "{err}");
    }

    #[test]
    fn a_daemon_that_exits_early_reports_its_log() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut d = Daemon::spawn(
            "short-lived",
            Command::new("sh").args(["-c", "echo cannot bind; exit 2"]),
            dir.path().join("d.log"),
        )
        .expect("sh starts");
        let err = d
            .wait_for_socket(&dir.path().join("none.sock"), Duration::from_secs(30))
            .expect_err("no socket ever appears");
        let text = err.to_string();
        assert!(text.contains("exit status: 2"), "{text}");
        assert!(text.contains("cannot bind"), "{text}");
    }

    #[test]
    fn stopping_a_daemon_ends_the_process() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut d = Daemon::spawn(
            "sleeper",
            Command::new("sleep").arg("300"),
            dir.path().join("d.log"),
        )
        .expect("sleep starts");
        let pid = d.pid().expect("running");
        d.stop();
        assert_eq!(d.pid(), None);
        assert!(!Path::new(&format!("/proc/{pid}")).exists());
    }
}
