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

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{Error, Result};

/// The gate's directory under the shims' state root: a dot name, which no
/// pod's state directory has (those are named after the shim's socket).
const GATE_DIR: &str = ".starts";
/// How often a waiting start looks for a free slot.
const POLL: Duration = Duration::from_millis(25);

/// A node's sandbox-start gate of `slots` slots in `dir`.
pub struct StartGate {
    dir: PathBuf,
    slots: usize,
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
            if started.elapsed() >= within {
                return Err(Error::Deadline(format!(
                    "no sandbox start slot of {} ({}) was free within {within:?}: \
                     other pods of this node are starting",
                    self.slots,
                    self.dir.display()
                )));
            }
            std::thread::sleep(POLL);
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
    fn zero_slots_means_four_per_cpu_and_at_least_eight() {
        let dir = tempfile::tempdir().unwrap();
        let cpus = std::thread::available_parallelism().unwrap().get();
        assert_eq!(StartGate::new(dir.path(), 0).slots(), (cpus * 4).max(8));
    }
}
