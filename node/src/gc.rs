//! What the node store keeps, and the garbage collector of what nothing
//! refers to.
//!
//! - [`Claims`]: snapshots an `AcquireVm` is about to hand to a VM (read,
//!   checked, a VMM being taken), and snapshots being deleted. A deletion's
//!   in-use check and a restore taking the snapshot are atomic: whichever
//!   registers first under the one lock wins; the other is refused.
//! - [`garbage`]: which published snapshots are garbage, children first,
//!   given what is kept (the roots) — every parent of a kept snapshot is
//!   kept too.
//!
//! The roots (see the README's *Garbage collection*): what the controller's
//! objects name (Snapshot UIDs and `status.snapshotID`, SandboxTemplates'
//! template ids), base templates, snapshots marked retained (a Snapshot
//! deleted with `deletionPolicy: Retain`), snapshots a running VM was
//! restored from or an `AcquireVm` is taking, templates being built, and
//! snapshots younger than the grace period.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use twig_store::VmSnapshot;

use crate::error::{Error, Result};

/// The label of a snapshot whose object was deleted with
/// `deletionPolicy: Retain`: the collector keeps it.
pub const RETAINED_LABEL: &str = "twig.dev/retained";

/// Snapshots being taken by `AcquireVm` and snapshots being deleted.
#[derive(Default)]
pub struct Claims {
    state: Mutex<ClaimState>,
}

#[derive(Default)]
struct ClaimState {
    /// Snapshot id → how many acquisitions hold it.
    taking: HashMap<String, usize>,
    /// Snapshots being deleted.
    deleting: HashSet<String>,
}

/// Holds snapshots for an acquisition until dropped (by then the VM's
/// lease, the pool's `handed` record, holds them).
pub struct Claim<'a> {
    claims: &'a Claims,
    ids: Vec<String>,
}

/// Holds a snapshot's deletion until dropped: no acquisition takes it.
pub struct Deletion<'a> {
    claims: &'a Claims,
    id: String,
}

impl Claims {
    fn state(&self) -> MutexGuard<'_, ClaimState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claims `ids` for an acquisition; refused (`NOT_FOUND`) for one
    /// being deleted.
    pub fn claim(&self, ids: &[String]) -> Result<Claim<'_>> {
        let mut s = self.state();
        if let Some(id) = ids.iter().find(|id| s.deleting.contains(*id)) {
            return Err(Error::NotFound(format!(
                "snapshot {id:?} is being deleted from this node's store"
            )));
        }
        for id in ids {
            *s.taking.entry(id.clone()).or_default() += 1;
        }
        Ok(Claim {
            claims: self,
            ids: ids.to_vec(),
        })
    }

    /// Starts deleting `id` unless an acquisition claims it or `users`
    /// (asked under the same lock: the running VMs restored from it) names
    /// any (`FAILED_PRECONDITION`).
    pub fn delete(&self, id: &str, users: impl FnOnce() -> Vec<u32>) -> Result<Deletion<'_>> {
        let mut s = self.state();
        if s.taking.get(id).is_some_and(|n| *n > 0) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id:?} is in use: a VM is being restored from it"
            )));
        }
        let users = users();
        if !users.is_empty() {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id:?} is in use: the running VMs of pids {users:?} were restored from it"
            )));
        }
        if !s.deleting.insert(id.to_string()) {
            return Err(Error::FailedPrecondition(format!(
                "snapshot {id:?} is being deleted already"
            )));
        }
        Ok(Deletion {
            claims: self,
            id: id.to_string(),
        })
    }

    /// Whether an acquisition holds `id` now.
    pub fn taking(&self, id: &str) -> bool {
        self.state().taking.get(id).is_some_and(|n| *n > 0)
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        let mut s = self.claims.state();
        for id in &self.ids {
            if let Some(n) = s.taking.get_mut(id) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    s.taking.remove(id);
                }
            }
        }
    }
}

impl Drop for Deletion<'_> {
    fn drop(&mut self) {
        self.claims.state().deleting.remove(&self.id);
    }
}

/// The published snapshots of `all` that are garbage — neither kept by
/// `root` nor a parent (at any depth) of a kept one — children before
/// their parents (the order the store can delete them in).
pub fn garbage(all: &[VmSnapshot], root: impl Fn(&VmSnapshot) -> bool) -> Vec<String> {
    let parents: BTreeMap<&str, Option<&str>> = all
        .iter()
        .map(|s| (s.id.as_str(), s.parent.as_deref()))
        .collect();
    let mut kept: HashSet<&str> = HashSet::new();
    for s in all.iter().filter(|s| root(s)) {
        let mut at = Some(s.id.as_str());
        while let Some(id) = at {
            if !kept.insert(id) {
                break;
            }
            at = parents.get(id).copied().flatten();
        }
    }
    // Depth in the store's chains: a child is deeper than its parent.
    let depth = |id: &str| {
        let mut n = 0usize;
        let mut at = parents.get(id).copied().flatten();
        while let Some(p) = at {
            n += 1;
            if n > all.len() {
                break;
            }
            at = parents.get(p).copied().flatten();
        }
        n
    };
    let mut out: Vec<(usize, &str)> = all
        .iter()
        .map(|s| s.id.as_str())
        .filter(|id| !kept.contains(id))
        .map(|id| (depth(id), id))
        .collect();
    out.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
    out.into_iter().map(|(_, id)| id.to_string()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use twig_store::{Artefact, NodeStore};

    fn publish(store: &NodeStore, id: &str, parent: Option<&str>) {
        let mut s = store.stage(id).unwrap();
        if let Some(p) = parent {
            s.set_parent(p).unwrap();
        }
        s.put_bytes(Artefact::State, b"state").unwrap();
        s.publish().unwrap();
    }

    #[test]
    fn garbage_is_what_no_root_reaches_children_first() {
        let dir = tempfile::tempdir().unwrap();
        let store = NodeStore::open(dir.path(), true).unwrap();
        // base ← a ← b ← c, a ← d; orphan ← orphan.child; lone.
        publish(&store, "base", None);
        publish(&store, "a", Some("base"));
        publish(&store, "b", Some("a"));
        publish(&store, "c", Some("b"));
        publish(&store, "d", Some("a"));
        publish(&store, "orphan", None);
        publish(&store, "orphan.child", Some("orphan"));
        publish(&store, "lone", None);
        let all = store.list().unwrap();
        // c kept: b, a and base with it; d is not a parent of a kept one.
        let g = garbage(&all, |s| s.id == "c");
        assert_eq!(g, ["d", "orphan.child", "lone", "orphan"]);
        // Nothing kept: everything, every child before its parent.
        let g = garbage(&all, |_| false);
        let at = |id: &str| g.iter().position(|x| x == id).unwrap();
        assert_eq!(g.len(), all.len());
        for (child, parent) in [("c", "b"), ("b", "a"), ("d", "a"), ("a", "base")] {
            assert!(at(child) < at(parent), "{g:?}");
        }
        assert!(at("orphan.child") < at("orphan"), "{g:?}");
        // Everything kept: nothing.
        assert!(garbage(&all, |_| true).is_empty());
        // The order deletes cleanly.
        for id in garbage(&all, |s| s.id == "c") {
            store.delete(&id).unwrap();
        }
        let left: Vec<String> = store.list().unwrap().into_iter().map(|s| s.id).collect();
        assert_eq!(left, ["a", "b", "base", "c"]);
    }

    #[test]
    fn a_deletion_and_an_acquisition_exclude_each_other() {
        let claims = Claims::default();
        let ids = vec!["s".to_string()];
        let claim = claims.claim(&ids).unwrap();
        assert!(claims.taking("s"));
        let e = claims.delete("s", Vec::new).err().unwrap();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
        drop(claim);
        assert!(!claims.taking("s"));
        let e = claims.delete("s", || vec![42]).err().unwrap();
        assert!(e.to_string().contains("42"), "{e}");
        let deletion = claims.delete("s", Vec::new).unwrap();
        let e = claims.claim(&ids).err().unwrap();
        assert!(matches!(e, Error::NotFound(_)), "{e}");
        drop(deletion);
        assert!(claims.claim(&ids).is_ok());
    }
}
