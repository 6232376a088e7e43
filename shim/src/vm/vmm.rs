//! The `twig-vmm` process the node daemon handed over: not the shim's
//! child (twig-node reaps it), so it is watched and killed through a pidfd;
//! a thread reports its death at once, quoting the ends of its log and of
//! the guest's console; a start that fails half-way kills it.

use std::fs::File;
use std::io::{Read, Seek};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sandbox::Death;

/// A VMM the node daemon handed over: not this process's child (the daemon
/// reaps it), so it is watched and signalled through a pidfd.
pub(super) struct Process {
    pub(super) pid: u32,
    pidfd: OwnedFd,
}

impl Process {
    /// A pidfd for `pid`, once `/proc/<pid>/cmdline` shows it serves
    /// `api_socket` (so a recycled pid is never signalled).
    pub(super) fn open(pid: u32, api_socket: &str) -> Result<Process> {
        let raw = libc::pid_t::try_from(pid)
            .map_err(|_| Error::Internal(format!("the node daemon handed over pid {pid}")))?;
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new
        // descriptor or -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, raw, 0) };
        if fd < 0 {
            return Err(Error::io(
                format!("pidfd_open of the handed-over twig-vmm {pid}"),
                std::io::Error::last_os_error(),
            ));
        }
        let fd =
            i32::try_from(fd).map_err(|_| Error::Internal(format!("pidfd_open returned {fd}")))?;
        // SAFETY: `fd` is a descriptor pidfd_open just returned, owned by
        // nothing else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if !String::from_utf8_lossy(&cmdline).contains(api_socket) {
            return Err(Error::Internal(format!(
                "pid {pid} handed over by the node daemon is not the twig-vmm serving {api_socket}"
            )));
        }
        Ok(Process { pid, pidfd })
    }

    pub(super) fn kill(&self) {
        // SAFETY: pidfd_send_signal(2) on our pidfd, no siginfo; no memory
        // is passed.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if rc != 0 {
            tracing::debug!(
                pid = self.pid,
                "pidfd_send_signal: {}",
                std::io::Error::last_os_error()
            );
        }
    }

    /// Whether the process exited within `timeout`.
    pub(super) fn wait(&self, timeout: Duration) -> bool {
        wait_exit(&self.pidfd, Some(timeout))
    }
}

/// Whether the process of `pidfd` exited within `timeout` (`None`: waits
/// as long as it takes). A pidfd polls readable once its process exited.
fn wait_exit(pidfd: &OwnedFd, timeout: Option<Duration>) -> bool {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = match deadline {
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                i32::try_from(left.as_millis()).unwrap_or(i32::MAX)
            }
            None => -1,
        };
        // SAFETY: one pollfd we own, for the duration of the call.
        let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
        if rc > 0 {
            return true;
        }
        if rc == 0 || deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        // EINTR: poll again until the deadline.
    }
}

/// The file in the shim's state directory naming the pod's VMM: its pid on
/// the first line, its API socket on the second.
pub const PID_FILE: &str = "vmm.pid";

/// The VMM's log and guest console, opened while they exist: read after a
/// death, when twig-node may have removed them already.
pub(super) struct VmLogs {
    vmm: Option<File>,
    console: Option<File>,
}

impl VmLogs {
    pub(super) fn open(vm_dir: &Path) -> VmLogs {
        VmLogs {
            vmm: File::open(vm_dir.join("vmm.log")).ok(),
            console: File::open(vm_dir.join("serial.log")).ok(),
        }
    }

    /// `[twig-vmm log: …] [guest console: …]`, the last lines of each.
    fn tails(&mut self) -> String {
        let tail = |f: &mut Option<File>| {
            let mut text = Vec::new();
            if let Some(f) = f {
                if f.rewind().and_then(|()| f.read_to_end(&mut text)).is_err() {
                    return "(unreadable)".to_string();
                }
            }
            tail_lines(&String::from_utf8_lossy(&text))
        };
        format!(
            "[twig-vmm log: {}] [guest console: {}]",
            tail(&mut self.vmm),
            tail(&mut self.console)
        )
    }
}

/// The last [`LOG_TAIL_LINES`] lines of `text`, joined with ` | `.
fn tail_lines(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join(" | ")
}

/// A thread waiting on (a duplicate of) the VMM's pidfd: when the process
/// ends while `stopping` is unset, the receiver gets why, at once (the
/// shim does not wait for its next call to the VM to notice).
pub(super) fn watch_death(
    process: &Process,
    stopping: Arc<AtomicBool>,
    mut logs: VmLogs,
) -> Result<Death> {
    let pidfd = process
        .pidfd
        .try_clone()
        .map_err(|e| Error::io("duplicating the VMM's pidfd", e))?;
    let pid = process.pid;
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("vmm-watch".into())
        .spawn(move || {
            wait_exit(&pidfd, None);
            if stopping.load(Ordering::SeqCst) {
                return;
            }
            // The VMM is twig-node's child: its exit status is the
            // daemon's to read (and log), not the shim's.
            let why = format!(
                "twig-vmm (pid {pid}) exited without being stopped (its exit status is in \
                 twig-node's log, which reaped it) {}",
                logs.tails()
            );
            if tx.send(why).is_err() {
                tracing::warn!(pid, "the pod's VMM died and nobody watches the sandbox");
            }
        })
        .map_err(|e| Error::io("starting the VMM watch thread", e))?;
    Ok(rx)
}

/// Kills the VMM, and removes the state directory naming it, if the start
/// fails half-way.
pub(super) struct KillOnDrop(pub(super) Option<Process>, pub(super) PathBuf);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            p.kill();
            if !p.wait(Duration::from_secs(5)) {
                tracing::warn!(pid = p.pid, "the killed twig-vmm did not exit within 5 s");
            }
            if let Err(e) = std::fs::remove_dir_all(&self.1) {
                tracing::warn!("removing {}: {e}", self.1.display());
            }
        }
    }
}

/// Lines of each log a failed VM start quotes.
const LOG_TAIL_LINES: usize = 12;

/// `e` with the end of the VMM's log and of the guest's console appended,
/// so the error containerd shows says why the VM did not come up (the state
/// directory holding the logs goes with the failed task).
pub(super) fn with_vm_logs(e: Error, state_dir: &Path) -> Error {
    let tail = |name: &str| {
        let text = std::fs::read(state_dir.join(name)).unwrap_or_default();
        tail_lines(&String::from_utf8_lossy(&text))
    };
    let logs = format!(
        " [twig-vmm log: {}] [guest console: {}]",
        tail("vmm.log"),
        tail("serial.log")
    );
    match e {
        Error::Agent { what, source } => Error::Agent {
            what: what + &logs,
            source,
        },
        Error::Vmm { what, source } => Error::Vmm {
            what: what + &logs,
            source,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handed_over_process_is_watched_and_killed_through_its_pidfd() {
        let mut child = sleep("1000");
        let e = Process::open(child.id(), "/not/its/api.sock")
            .err()
            .unwrap();
        assert!(e.to_string().contains("is not the twig-vmm serving"), "{e}");
        let p = Process::open(child.id(), "1000").unwrap();
        assert!(!p.wait(Duration::from_millis(20)), "sleep runs");
        p.kill();
        assert!(p.wait(Duration::from_secs(5)), "killed");
        let status = child.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(libc::SIGKILL)
        );
    }

    /// `sleep arg`, once its command line shows `arg` (exec'd).
    fn sleep(arg: &str) -> std::process::Child {
        let child = std::process::Command::new("sleep")
            .arg(arg)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !std::fs::read(format!("/proc/{}/cmdline", child.id()))
            .is_ok_and(|c| String::from_utf8_lossy(&c).contains(arg))
        {
            assert!(Instant::now() < deadline, "sleep {arg} did not start");
            std::thread::sleep(Duration::from_millis(1));
        }
        child
    }

    #[test]
    fn a_vmm_that_dies_unasked_is_reported_at_once_with_its_logs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("vmm.log"), "line 1\nvmm: last words\n").unwrap();
        let mut child = sleep("1001");
        let p = Process::open(child.id(), "1001").unwrap();
        let logs = VmLogs::open(dir.path());
        // twig-node removes the VMM's directory once it reaped it.
        drop(dir);
        let mut death = watch_death(&p, Arc::new(AtomicBool::new(false)), logs).unwrap();
        assert!(death.try_recv().is_err(), "reported while it runs");
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap()),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
        child.wait().unwrap();
        let why = death.blocking_recv().expect("the death is reported");
        assert!(
            why.contains(&format!("pid {}", child.id())) && why.contains("vmm: last words"),
            "{why}"
        );
    }

    #[test]
    fn a_vmm_stopped_on_purpose_is_no_death() {
        let mut child = sleep("1002");
        let p = Process::open(child.id(), "1002").unwrap();
        let stopping = Arc::new(AtomicBool::new(false));
        let death = watch_death(
            &p,
            stopping.clone(),
            VmLogs {
                vmm: None,
                console: None,
            },
        )
        .unwrap();
        stopping.store(true, Ordering::SeqCst);
        p.kill();
        child.wait().unwrap();
        assert!(death.blocking_recv().is_err(), "a shutdown is not a death");
    }
}
