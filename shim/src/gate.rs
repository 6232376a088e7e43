//! How many sandboxes of a node start at once: every shim of the node is a
//! process of its own, so the gate is a set of slot files under the shims'
//! state root, each `flock`ed by the shim whose start holds it. A shim
//! that dies lets its slot go with its descriptors.
//!
//! Why: a Clone of 64 starts 64 sandboxes at the same moment. Started all
//! together, every restored guest shares the node's CPUs with the others
//! until its agent answers, so every start takes as long as all of them
//! together and each runs into its own call deadline. Gated, the starts
//! run a few at a time: the first pods are up at once, the last after the
//! others, and each start's deadline counts its own work.
//!
//! A waiting start sleeps until a slot file of the gate is closed (inotify's
//! `IN_CLOSE_WRITE`: a start that ends, or a shim that dies, closes its
//! slot), and looks at least every [`FALLBACK`] whatever it heard. With 56
//! starts waiting (a Clone of 64 on a gate of 8), polling every 25 ms woke
//! 2,240 processes a second, each trying eight locks: CPU taken from the
//! starts they wait for.

use std::fs::{File, OpenOptions};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use crate::{Error, Result};

/// The gate's directory under the shims' state root: a dot name, which no
/// pod's state directory has (those are named after the shim's socket).
const GATE_DIR: &str = ".starts";
/// The longest a waiting start goes without looking at the slots.
const FALLBACK: Duration = Duration::from_secs(1);

/// A node's sandbox-start gate of `slots` slots in `dir`.
pub struct StartGate {
    dir: PathBuf,
    slots: usize,
    fallback: Duration,
}

/// A start's slot, free again when dropped.
pub struct StartPermit {
    _slot: File,
    /// Which slot.
    pub slot: usize,
    /// How long the start waited for it.
    pub waited: Duration,
}

impl StartGate {
    /// The gate of the shims whose state is under `state_root`, `slots`
    /// wide (0: [`StartGate::default_slots`]).
    pub fn new(state_root: &Path, slots: usize) -> StartGate {
        let slots = match slots {
            0 => StartGate::default_slots(),
            n => n,
        };
        StartGate {
            dir: state_root.join(GATE_DIR),
            slots,
            fallback: FALLBACK,
        }
    }

    /// Four starts per CPU this process may run on, at least 8: a start
    /// mostly waits (for its VMM, for the guest's first answer), so a few
    /// per CPU keep the CPUs busy, and a small node still starts 8 at once.
    pub fn default_slots() -> usize {
        (std::thread::available_parallelism().map_or(1, |n| n.get()) * 4).max(8)
    }

    /// How many starts may run at once.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Waits until a slot is free (at most `within`) and takes it.
    pub fn enter(&self, within: Duration) -> Result<StartPermit> {
        std::fs::create_dir_all(&self.dir)
            .map_err(|e| Error::io(format!("creating {}", self.dir.display()), e))?;
        let mut files = (0..self.slots)
            .map(|i| {
                let path = self.dir.join(i.to_string());
                OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&path)
                    .map_err(|e| Error::io(format!("opening {}", path.display()), e))
            })
            .collect::<Result<Vec<File>>>()?;
        // Watching before the first look: a slot let go after it is heard.
        let closed = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .and_then(|i| {
                i.add_watch(&self.dir, AddWatchFlags::IN_CLOSE_WRITE)?;
                Ok(i)
            })
            .map_err(|e| Error::io(format!("watching {}", self.dir.display()), e.into()))?;
        let started = Instant::now();
        // Start looking at a slot of this process's own, so that waiters
        // spread over the slots rather than all trying slot 0 first.
        let first = std::process::id() as usize % self.slots;
        loop {
            for k in 0..self.slots {
                let slot = (first + k) % self.slots;
                let taken = twig_store::fsops::try_flock(&files[slot])
                    .map_err(|e| Error::io(format!("locking {}/{slot}", self.dir.display()), e))?;
                if taken {
                    return Ok(StartPermit {
                        _slot: files.swap_remove(slot),
                        slot,
                        waited: started.elapsed(),
                    });
                }
            }
            let Some(left) = within
                .checked_sub(started.elapsed())
                .filter(|l| !l.is_zero())
            else {
                return Err(Error::Deadline(format!(
                    "no sandbox start slot of {} ({}) was free within {within:?}: \
                     other pods of this node are starting",
                    self.slots,
                    self.dir.display()
                )));
            };
            wait_for_a_close(&closed, left.min(self.fallback))
                .map_err(|e| Error::io(format!("waiting on {}", self.dir.display()), e))?;
        }
    }
}

/// Sleeps until `closed` reports a slot file closed, or `at_most` passed;
/// drains what it reported.
fn wait_for_a_close(closed: &Inotify, at_most: Duration) -> std::io::Result<()> {
    let ms = u16::try_from(at_most.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(closed.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
        Err(e) => return Err(e.into()),
    }
    loop {
        match closed.read_events() {
            Ok(events) if !events.is_empty() => continue,
            Ok(_) | Err(nix::errno::Errno::EAGAIN) => return Ok(()),
            Err(e) => return Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_slots_starts_hold_the_gate_and_a_dropped_permit_frees_its_slot() {
        let dir = tempfile::tempdir().unwrap();
        let gate = StartGate::new(dir.path(), 2);
        assert_eq!(gate.slots(), 2);
        let a = gate.enter(Duration::from_secs(1)).unwrap();
        let b = gate.enter(Duration::from_secs(1)).unwrap();
        assert_ne!(a.slot, b.slot);
        let e = gate.enter(Duration::from_millis(100)).err().unwrap();
        assert!(
            matches!(e, Error::Deadline(_)) && e.to_string().contains("no sandbox start slot"),
            "{e}"
        );
        let freed = a.slot;
        drop(a);
        let c = gate.enter(Duration::from_secs(1)).unwrap();
        assert_eq!(c.slot, freed);
    }

    #[test]
    fn a_waiting_start_gets_the_slot_when_the_holder_lets_go() {
        let dir = tempfile::tempdir().unwrap();
        let gate = StartGate::new(dir.path(), 1);
        let held = gate.enter(Duration::from_secs(1)).unwrap();
        std::thread::scope(|s| {
            let waiter = s.spawn(|| gate.enter(Duration::from_secs(30)));
            drop(held);
            let got = waiter.join().unwrap().unwrap();
            assert_eq!(got.slot, 0);
        });
    }

    #[test]
    fn a_waiting_start_is_woken_by_the_release_not_by_its_fallback_look() {
        let dir = tempfile::tempdir().unwrap();
        let mut gate = StartGate::new(dir.path(), 1);
        // A fallback look far beyond the test's bound: only the close can
        // wake the waiter in time.
        gate.fallback = Duration::from_secs(120);
        let held = gate.enter(Duration::from_secs(1)).unwrap();
        std::thread::scope(|s| {
            let gate = &gate;
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let waiter = s.spawn(move || {
                let _ = tid_tx.send(nix::unistd::gettid());
                gate.enter(Duration::from_secs(300))
            });
            let tid = tid_rx.recv().unwrap();
            // Let the waiter find the slot taken and go to sleep on it.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !sleeps_in_poll(tid) {
                assert!(Instant::now() < deadline, "the waiter never slept");
                std::thread::sleep(Duration::from_millis(5));
            }
            let released = Instant::now();
            drop(held);
            let got = waiter.join().unwrap().unwrap();
            assert_eq!(got.slot, 0);
            // Woken by the close, long before its fallback look.
            assert!(
                released.elapsed() < Duration::from_secs(60),
                "the waiter took {:?} to see the slot free",
                released.elapsed()
            );
        });
    }

    /// Whether thread `tid` of this process sleeps in `poll` (the gate's wait).
    fn sleeps_in_poll(tid: nix::unistd::Pid) -> bool {
        std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall"))
            // poll(2) or ppoll(2), by their x86-64 numbers.
            .is_ok_and(|w| matches!(w.split_whitespace().next(), Some("7" | "271")))
    }

    #[test]
    fn zero_slots_means_four_per_cpu_and_at_least_eight() {
        let dir = tempfile::tempdir().unwrap();
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(StartGate::new(dir.path(), 0).slots(), (cpus * 4).max(8));
    }
}
