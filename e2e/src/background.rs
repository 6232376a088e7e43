//! Commands that run while the test does something else (a `ctr run` or
//! `ctr task exec` waiting for its process, whose output the test watches),
//! and commands run on a pseudo-terminal (`ctr run -t` wants a terminal on
//! its stdin). Every wait has a deadline; a command still running when its
//! handle is dropped is killed.

use std::fs::{self, File};
use std::io::{ErrorKind, Read};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};
use nix::pty::{openpty, Winsize};
use tempfile::NamedTempFile;

use crate::error::{io, Error, Result};
use crate::process::Output;

/// How often a background command or its output is polled.
const POLL: Duration = Duration::from_millis(20);
/// How long the pty's output may take to reach its reader once the command
/// has exited.
const PTY_DRAIN: Duration = Duration::from_secs(10);

/// A command running in the background, its stdout and stderr in files.
#[derive(Debug)]
pub struct Background {
    what: String,
    child: Option<Child>,
    stdout: NamedTempFile,
    stderr: NamedTempFile,
}

impl Background {
    /// Starts `cmd` with stdin from `/dev/null`.
    pub fn spawn(cmd: &mut Command) -> Result<Background> {
        let what = format!("{cmd:?}");
        let stdout = NamedTempFile::new().map_err(io("creating an output file"))?;
        let stderr = NamedTempFile::new().map_err(io("creating an output file"))?;
        let out = stdout
            .reopen()
            .map_err(io("opening an output file for the child"))?;
        let err = stderr
            .reopen()
            .map_err(io("opening an output file for the child"))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(io(format!("starting {what}")))?;
        Ok(Background {
            what,
            child: Some(child),
            stdout,
            stderr,
        })
    }

    /// What it has printed on stdout so far.
    pub fn stdout(&self) -> String {
        fs::read_to_string(self.stdout.path()).unwrap_or_default()
    }

    /// What it has printed on stderr so far.
    pub fn stderr(&self) -> String {
        fs::read_to_string(self.stderr.path()).unwrap_or_default()
    }

    /// Polls its stdout until `done` says yes, and returns that stdout;
    /// fails if the command exits first or `within` passes.
    pub fn wait_for_stdout(
        &mut self,
        within: Duration,
        done: impl Fn(&str) -> bool,
    ) -> Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let out = self.stdout();
            if done(&out) {
                return Ok(out);
            }
            if let Some(status) = self.try_status()? {
                return Err(Error::Failed {
                    what: format!("{} (waiting for its output)", self.what),
                    status,
                    output: format!("stdout: {out}\nstderr: {}", self.stderr()),
                });
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("{} (waiting for its output)", self.what),
                    within,
                    output: format!("stdout: {out}\nstderr: {}", self.stderr()),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    fn try_status(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => child
                .try_wait()
                .map_err(io(format!("waiting for {}", self.what))),
            None => Ok(None),
        }
    }

    /// Waits for it to exit within `within` (killing it at the deadline,
    /// reported as [`Error::Timeout`]) and returns how it ended.
    pub fn wait(mut self, within: Duration) -> Result<Output> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.try_status()? {
                self.child = None;
                return Ok(Output {
                    status,
                    stdout: self.stdout(),
                    stderr: self.stderr(),
                });
            }
            if Instant::now() >= deadline {
                self.kill();
                return Err(Error::Timeout {
                    what: self.what.clone(),
                    within,
                    output: format!("stdout: {}\nstderr: {}", self.stdout(), self.stderr()),
                });
            }
            std::thread::sleep(POLL);
        }
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Already exited is fine: the wait reaps it either way.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Mounts a devpts instance on `/dev/pts` unless one is there: the lab's
/// `/dev` is a bare devtmpfs, whose `/dev/ptmx` needs `pts` beside it.
fn ensure_devpts() -> Result<()> {
    if Path::new("/dev/pts/ptmx").exists() {
        return Ok(());
    }
    fs::create_dir_all("/dev/pts").map_err(io("creating /dev/pts"))?;
    mount(
        Some("devpts"),
        "/dev/pts",
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )
    .map_err(|e| Error::Io {
        what: "mounting devpts on /dev/pts".into(),
        source: e.into(),
    })
}

/// Runs `cmd` to completion within `within` with a new pseudo-terminal
/// (80×24) as its stdin, stdout and stderr; returns its exit status and
/// everything it wrote to the terminal (as stdout; stderr stays empty).
pub fn run_on_pty(cmd: &mut Command, within: Duration) -> Result<Output> {
    ensure_devpts()?;
    let what = format!("{cmd:?}");
    let size = Winsize {
        ws_row: 24,
        ws_col: 80,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    let pty = openpty(Some(&size), None).map_err(|e| Error::Io {
        what: "opening a pseudo-terminal".into(),
        source: e.into(),
    })?;
    let slave = File::from(pty.slave);
    let dup = |what: &str| {
        slave
            .try_clone()
            .map_err(io(format!("duplicating the pty for {what}")))
    };
    let child = cmd
        .stdin(dup("stdin")?)
        .stdout(dup("stdout")?)
        .stderr(dup("stderr")?)
        .spawn()
        .map_err(io(format!("starting {what}")));
    // Only the child keeps the terminal open from here (the command holds
    // its copies until told otherwise): its exit ends the reader's stream
    // (EIO on the master).
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    drop(slave);
    let mut child = child?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let reader = {
        let seen = Arc::clone(&seen);
        let mut master = File::from(pty.master);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            loop {
                match master.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => seen
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .extend_from_slice(&buf[..n]),
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    // EIO: every slave descriptor is closed.
                    Err(_) => break,
                }
            }
        })
    };
    let text = |seen: &Mutex<Vec<u8>>| {
        String::from_utf8_lossy(&seen.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
    };
    let deadline = Instant::now() + within;
    let status = loop {
        if let Some(status) = child
            .try_wait()
            .map_err(io(format!("waiting for {what}")))?
        {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(Error::Timeout {
                what,
                within,
                output: text(&seen),
            });
        }
        std::thread::sleep(POLL);
    };
    let drained = Instant::now() + PTY_DRAIN;
    while !reader.is_finished() && Instant::now() < drained {
        std::thread::sleep(POLL);
    }
    Ok(Output {
        status,
        stdout: text(&seen),
        stderr: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_background_command_is_watched_then_waited_for() {
        let mut bg = Background::spawn(Command::new("sh").args(["-c", "echo ready; exit 4"]))
            .expect("sh starts");
        let out = bg
            .wait_for_stdout(Duration::from_secs(30), |o| o.contains("ready"))
            .expect("sh prints ready");
        assert_eq!(out, "ready\n");
        let done = bg.wait(Duration::from_secs(30)).expect("sh exits");
        assert_eq!(done.code(), Some(4));
    }

    #[test]
    fn a_background_command_that_exits_early_is_an_error() {
        let mut bg = Background::spawn(Command::new("sh").args(["-c", "echo nope >&2; exit 2"]))
            .expect("sh starts");
        let err = bg
            .wait_for_stdout(Duration::from_secs(30), |o| o.contains("ready"))
            .expect_err("sh never prints ready");
        assert!(err.to_string().contains("nope"), "{err}");
    }

    #[test]
    fn a_pty_command_sees_a_terminal() {
        let started = Instant::now();
        let out = run_on_pty(
            Command::new("sh").args(["-c", "[ -t 0 ] && [ -t 1 ] && echo on a tty; exit 6"]),
            Duration::from_secs(30),
        )
        .expect("sh runs on a pty");
        assert_eq!(out.code(), Some(6));
        assert_eq!(out.stdout, "on a tty\r\n");
        assert!(
            started.elapsed() < PTY_DRAIN,
            "the terminal's end was not seen when sh exited"
        );
    }
}
