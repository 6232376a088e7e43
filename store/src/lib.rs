//! `twig-store`: where Twig keeps VM snapshots on a node, and how.
//!
//! * [`layout`] is the one snapshot directory layout: `<store>/snapshots/<id>/`
//!   with `manifest.json`, `state`, `memory` and `disk<i>`, parents named by
//!   id (a sibling directory), so a store can be moved without breaking
//!   chains.
//! * [`NodeStore`] stages snapshots in private directories it hands to
//!   writers (twig-vmm), publishes them (manifest, fsync, atomic no-replace
//!   rename), lists, accounts, reflinks out and deletes them.
//! * [`fsops`] holds the filesystem primitives every Twig crate uses:
//!   FICLONE reflinks and their copy fallbacks, durable writes, no-replace
//!   renames, `flock`, FIEMAP extents and space accounting.
//! * [`grants`] lets a jailed VMM's user read the published snapshots it
//!   restores or wrote (POSIX ACL entries), and takes them back by a ledger
//!   per user.
//! * [`sizes`] computes a snapshot's memory, disk and restore sizes and the
//!   store's footprint and room (`st_blocks`, `statvfs`).
//!
//! Lean on purpose (no async runtime, no RPC): twig-vmm links it.

pub mod error;
pub mod fsops;
pub mod grants;
pub mod layout;
pub mod nodestore;
pub mod sizes;
#[cfg(feature = "testkit")]
pub mod testkit;

pub use error::{Error, Result};
pub use fsops::{CloneMode, Usage};
pub use layout::{Artefact, Kind, Manifest};
pub use nodestore::{NodeStore, Staging, VmSnapshot};
pub use sizes::{snapshot_sizes, SnapshotSizes, StoreStats};
