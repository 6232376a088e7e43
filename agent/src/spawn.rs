//! The agent's side of starting a container process.
//!
//! A raw `clone(2)` (fork semantics plus the new namespaces) creates the
//! child, which only moves its fds into place and execs the agent binary as
//! `twig-agent __twig-init` (async-signal-safe work only: the agent is
//! multi-threaded). The helper then does the real setup (see `helper.rs`).
//! Joining an existing pid namespace happens in a short-lived thread that
//! `setns`es itself first, so the new process is still the agent's child
//! and the reaper records its exit.
//!
//! Why a runtime of its own rather than youki's libcontainer: that brings
//! cgroup managers (v1/v2/systemd), libseccomp, D-Bus, a state-directory
//! protocol and its own process model — far more than a VM-per-pod guest
//! needs, and binary size and build time for a static PID 1. The VM is the
//! isolation boundary; inside it the agent needs namespaces, mounts,
//! `pivot_root`, credentials, rlimits and stdio, which `nix` gives in code
//! small enough to read, test here and keep static.

use std::ffi::CString;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sched::CloneFlags;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::cgroup::Cgroup;
use crate::error::{AgentError, Result};
use crate::helper::{HelperTask, STATUS_FD};
use crate::reaper::{ExitCell, Reaper};

/// How long a helper may take to set a container up and exec.
pub const SETUP_TIMEOUT: Duration = Duration::from_secs(30);

/// The child's ends of its stdio.
pub struct ChildStdio {
    /// fd 0.
    pub stdin: OwnedFd,
    /// fd 1.
    pub stdout: OwnedFd,
    /// fd 2.
    pub stderr: OwnedFd,
}

/// A started process.
pub struct Spawned {
    /// Its pid in the agent's pid namespace.
    pub pid: i32,
    /// Where its exit is recorded.
    pub exit: Arc<ExitCell>,
}

struct ExecArgs {
    path: CString,
    argv: Vec<CString>,
}

/// Runs `task` in a new child created with `clone_flags` (and inside the
/// pid namespace `join_pid_ns`, if given). Returns once the helper has
/// exec'd the process, or with the helper's error.
pub fn spawn(
    reaper: &Reaper,
    task: &HelperTask,
    clone_flags: CloneFlags,
    join_pid_ns: Option<&Path>,
    stdio: ChildStdio,
    cgroup: Option<&Cgroup>,
) -> Result<Spawned> {
    let json = serde_json::to_vec(task).map_err(|e| AgentError::sys("encoding the task", e))?;
    let (task_r, task_w) = crate::stdio::pipe()?;
    let (status_r, status_w) = crate::stdio::pipe()?;
    let args = ExecArgs {
        path: c"/proc/self/exe".to_owned(),
        argv: vec![c"twig-agent".to_owned(), c"__twig-init".to_owned()],
    };
    let fds = [
        stdio.stdin.as_raw_fd(),
        stdio.stdout.as_raw_fd(),
        stdio.stderr.as_raw_fd(),
        task_r.as_raw_fd(),
        status_w.as_raw_fd(),
    ];
    let spawned = match join_pid_ns {
        None => clone_child(reaper, clone_flags, &fds, &args)?,
        Some(path) => {
            let ns = File::open(path)
                .map_err(|e| AgentError::sys(format!("opening {}", path.display()), e))?;
            std::thread::scope(|s| {
                s.spawn(|| {
                    nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWPID).map_err(|e| {
                        AgentError::sys(format!("joining pid namespace {}", path.display()), e)
                    })?;
                    clone_child(reaper, clone_flags, &fds, &args)
                })
                .join()
                .unwrap_or_else(|_| {
                    Err(AgentError::Internal("the spawning thread panicked".into()))
                })
            })?
        }
    };
    drop((stdio, task_r, status_w));
    // The helper waits for its task, so it joins the cgroup before it runs
    // anything of the container's.
    let outcome = match cgroup.map(|c| c.add(spawned.pid)) {
        Some(Err(e)) => Err(e),
        _ => feed_and_collect(task_w, status_r, &json),
    };
    let failure = match outcome {
        Ok(report) => {
            for w in &report.warnings {
                tracing::warn!(pid = spawned.pid, "container setup: {w}");
            }
            match report.error {
                None => return Ok(spawned),
                Some(e) => AgentError::InvalidArgument(format!("container setup failed: {e}")),
            }
        }
        Err(e) => e,
    };
    let _ = kill(Pid::from_raw(spawned.pid), Signal::SIGKILL);
    if spawned.exit.wait(Duration::from_secs(10)).is_none() {
        tracing::warn!(pid = spawned.pid, "a failed helper did not exit");
    }
    Err(failure)
}

fn clone_child(
    reaper: &Reaper,
    flags: CloneFlags,
    fds: &[RawFd; 5],
    args: &ExecArgs,
) -> Result<Spawned> {
    let argv: Vec<*const libc::c_char> = args
        .argv
        .iter()
        .map(|a| a.as_ptr())
        .chain([std::ptr::null()])
        .collect();
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    let mut registration = reaper.registration();
    let raw_flags = flags.bits() as libc::c_ulong | libc::SIGCHLD as libc::c_ulong;
    // SAFETY: clone with a null stack behaves like fork; the child only runs
    // `child_exec`, which makes async-signal-safe calls and never returns.
    let pid = unsafe { libc::syscall(libc::SYS_clone, raw_flags, 0usize, 0usize, 0usize, 0usize) };
    if pid < 0 {
        return Err(AgentError::sys(
            format!("clone with {flags:?}"),
            std::io::Error::last_os_error(),
        ));
    }
    if pid == 0 {
        // SAFETY: in the freshly cloned child.
        unsafe { child_exec(fds, args.path.as_ptr(), argv.as_ptr(), envp.as_ptr()) }
    }
    let pid = i32::try_from(pid).map_err(|e| AgentError::sys("clone returned", e))?;
    let exit = registration.register(pid);
    Ok(Spawned { pid, exit })
}

/// In the child: put `fds` on 0..=4 and exec the helper.
///
/// # Safety
/// Only to be called in a child right after clone; async-signal-safe.
unsafe fn child_exec(
    fds: &[RawFd; 5],
    path: *const libc::c_char,
    argv: *const *const libc::c_char,
    envp: *const *const libc::c_char,
) -> ! {
    // SAFETY: the caller guarantees we are the child right after clone;
    // every call below is async-signal-safe and takes only the fds and
    // pointers the caller prepared before the clone.
    unsafe {
        let mut high = [0 as RawFd; 5];
        for (i, fd) in fds.iter().enumerate() {
            high[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 10);
            if high[i] < 0 {
                libc::_exit(126);
            }
        }
        for (i, fd) in high.iter().enumerate() {
            // dup2 to a different number clears close-on-exec on the target.
            if libc::dup2(*fd, i as RawFd) < 0 {
                libc::_exit(126);
            }
        }
        libc::execve(path, argv, envp);
        let msg = b"E cannot exec /proc/self/exe (the agent helper)\n";
        libc::write(STATUS_FD, msg.as_ptr().cast(), msg.len());
        libc::_exit(127);
    }
}

#[derive(Debug, Default)]
struct Report {
    warnings: Vec<String>,
    error: Option<String>,
}

/// Sends the task and reads the helper's report until it closes the status
/// pipe (exec succeeded, or it exited).
fn feed_and_collect(task_w: OwnedFd, status_r: OwnedFd, json: &[u8]) -> Result<Report> {
    let deadline = Instant::now() + SETUP_TIMEOUT;
    crate::stdio::set_nonblocking(task_w.as_fd())?;
    let written = crate::stdio::write_with_deadline(task_w.as_fd(), json, SETUP_TIMEOUT);
    drop(task_w);
    let mut status = File::from(status_r);
    let mut out = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(AgentError::Internal(format!(
                "container setup did not finish within {SETUP_TIMEOUT:?}"
            )));
        }
        let mut pfd = [PollFd::new(status.as_fd(), PollFlags::POLLIN)];
        let ms = u16::try_from(left.as_millis()).unwrap_or(u16::MAX);
        match poll(&mut pfd, PollTimeout::from(ms)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(AgentError::sys("poll on the helper's status", e)),
        }
        match status.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => out.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(AgentError::sys("reading the helper's status", e)),
        }
    }
    let mut report = Report::default();
    for line in String::from_utf8_lossy(&out).lines() {
        match line.split_at_checked(2) {
            Some(("W ", w)) => report.warnings.push(w.to_string()),
            Some(("E ", e)) => report.error = Some(e.to_string()),
            _ => report.warnings.push(line.to_string()),
        }
    }
    if report.error.is_none() {
        if let Err(e) = written {
            report.error = Some(format!("sending the task: {e}"));
        }
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_all(fd: OwnedFd, data: &[u8]) {
        File::from(fd).write_all(data).unwrap();
    }

    #[test]
    fn report_parsing() {
        let (task_r, task_w) = crate::stdio::pipe().unwrap();
        let (status_r, status_w) = crate::stdio::pipe().unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = Vec::new();
            File::from(task_r).read_to_end(&mut buf).unwrap();
            write_all(status_w, b"W cgroup skipped\nE mount failed: EPERM\n");
            buf
        });
        let report = feed_and_collect(task_w, status_r, b"{\"x\":1}").unwrap();
        assert_eq!(t.join().unwrap(), b"{\"x\":1}");
        assert_eq!(report.warnings, vec!["cgroup skipped"]);
        assert_eq!(report.error.as_deref(), Some("mount failed: EPERM"));
    }
}
