//! Zombie reaping that does not steal exit statuses.
//!
//! SIGCHLD is blocked in every thread; one reaper thread `sigwait`s for it
//! and reaps every child with `waitpid(-1, WNOHANG)`. Children the agent
//! spawned are registered (under the same lock, before the reaper can see
//! them exit) and get their status recorded in an [`ExitCell`]; anything
//! else (orphans re-parented to PID 1) is reaped and forgotten.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{SigSet, SigmaskHow, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit code, or 128 + signal.
    pub status: i32,
    /// The killing signal, 0 if it exited.
    pub signal: i32,
}

/// What runs once a child has exited.
type OnExit = Box<dyn FnOnce(Exit) + Send>;

/// Where the reaper records one child's exit.
#[derive(Default)]
pub struct ExitCell {
    exit: Mutex<Option<Exit>>,
    cv: Condvar,
    on_exit: Mutex<Option<OnExit>>,
}

impl std::fmt::Debug for ExitCell {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExitCell")
            .field("exit", &self.get())
            .finish_non_exhaustive()
    }
}

impl ExitCell {
    /// The exit status if the process has exited.
    pub fn get(&self) -> Option<Exit> {
        *lock(&self.exit)
    }

    /// Waits up to `timeout` for the exit.
    pub fn wait(&self, timeout: Duration) -> Option<Exit> {
        let deadline = Instant::now() + timeout;
        let mut guard = lock(&self.exit);
        loop {
            if let Some(exit) = *guard {
                return Some(exit);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            guard = self
                .cv
                .wait_timeout(guard, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|e| e.into_inner().0);
        }
    }

    /// Runs `f` once the process has exited (at once if it has), on the
    /// reaper's thread: it must be quick and must not wait for a child.
    pub fn on_exit(&self, f: impl FnOnce(Exit) + Send + 'static) {
        // Under the exit's lock, so `set` cannot slip in between.
        let exit = lock(&self.exit);
        match *exit {
            Some(e) => {
                drop(exit);
                f(e);
            }
            None => *lock(&self.on_exit) = Some(Box::new(f)),
        }
    }

    fn set(&self, exit: Exit) {
        let then = {
            let mut guard = lock(&self.exit);
            *guard = Some(exit);
            lock(&self.on_exit).take()
        };
        self.cv.notify_all();
        if let Some(f) = then {
            f(exit);
        }
    }
}

/// Locks a mutex, ignoring poisoning (the agent must keep serving).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The registry of children whose exit somebody waits for.
#[derive(Debug, Default)]
pub struct Reaper {
    known: Mutex<HashMap<i32, Arc<ExitCell>>>,
}

/// Held while a child is created and registered: the reaper cannot record
/// (and so lose) an exit in between.
pub struct Registration<'a> {
    known: MutexGuard<'a, HashMap<i32, Arc<ExitCell>>>,
}

impl Registration<'_> {
    /// Registers `pid`; its exit will be recorded in the returned cell.
    pub fn register(&mut self, pid: i32) -> Arc<ExitCell> {
        let cell = Arc::new(ExitCell::default());
        self.known.insert(pid, cell.clone());
        cell
    }
}

/// Blocks SIGCHLD in the calling thread (call before any thread starts).
pub fn block_sigchld() -> nix::Result<()> {
    let mut set = SigSet::empty();
    set.add(Signal::SIGCHLD);
    nix::sys::signal::pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), None)
}

impl Reaper {
    /// Starts the reaper thread.
    pub fn start() -> Arc<Reaper> {
        let reaper = Arc::new(Reaper::default());
        let r = reaper.clone();
        let spawned = std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || r.run());
        if let Err(e) = spawned {
            tracing::error!("starting the reaper thread: {e}");
        }
        reaper
    }

    /// Locks the registry so that a child can be created and registered.
    pub fn registration(&self) -> Registration<'_> {
        Registration {
            known: lock(&self.known),
        }
    }

    fn run(&self) {
        let mut set = SigSet::empty();
        set.add(Signal::SIGCHLD);
        loop {
            self.reap_all();
            if let Err(e) = set.wait() {
                tracing::error!("sigwait for SIGCHLD: {e}");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    fn reap_all(&self) {
        loop {
            let (pid, exit) = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (
                    pid,
                    Exit {
                        status: code,
                        signal: 0,
                    },
                ),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (
                    pid,
                    Exit {
                        status: 128 + sig as i32,
                        signal: sig as i32,
                    },
                ),
                Ok(WaitStatus::StillAlive) | Err(nix::errno::Errno::ECHILD) => return,
                Ok(_) => continue,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!("waitpid: {e}");
                    return;
                }
            };
            let cell = lock(&self.known).remove(&pid.as_raw());
            match cell {
                Some(cell) => {
                    tracing::debug!(pid = pid.as_raw(), ?exit, "child exited");
                    cell.set(exit);
                }
                None => tracing::debug!(pid = pid.as_raw(), "reaped an orphan"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_exit_runs_once_whether_set_before_or_after() {
        let ran = Arc::new(Mutex::new(Vec::new()));
        let exit = Exit {
            status: 3,
            signal: 0,
        };
        let before = ExitCell::default();
        let r = ran.clone();
        before.on_exit(move |e| lock(&r).push(("before", e)));
        assert!(lock(&ran).is_empty());
        before.set(exit);
        let after = ExitCell::default();
        after.set(exit);
        let r = ran.clone();
        after.on_exit(move |e| lock(&r).push(("after", e)));
        assert_eq!(*lock(&ran), [("before", exit), ("after", exit)]);
    }

    #[test]
    fn exit_cell_times_out_then_reports() {
        let cell = Arc::new(ExitCell::default());
        assert_eq!(cell.wait(Duration::from_millis(10)), None);
        let c = cell.clone();
        let t = std::thread::spawn(move || c.wait(Duration::from_secs(10)));
        cell.set(Exit {
            status: 137,
            signal: 9,
        });
        assert_eq!(
            t.join().unwrap(),
            Some(Exit {
                status: 137,
                signal: 9
            })
        );
        assert_eq!(cell.get().map(|e| e.status), Some(137));
    }
}
