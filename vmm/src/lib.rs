//! twig-vmm: Twig's KVM microVM monitor.
//!
//! A [`Vm`] boots a kernel through the Linux 64-bit boot protocol, snapshots
//! itself (full, or incremental from KVM's dirty log), restores from a
//! snapshot by mapping its memory copy-on-write, clones N ways, and rolls
//! back in place at a cost that grows with the pages changed, not with RAM.
//! The `twig-vmm` binary serves one VM over a JSON API on a Unix socket
//! ([`api`]).

pub mod api;
pub mod arch;
pub mod devices;
pub mod error;
pub mod memory;
pub mod snapshot;
pub mod testguest;
pub mod vcpu;
pub mod virtio;
pub mod vm;

pub use devices::{Capture, GuestExit, SerialOut};
pub use error::{Error, Result};
pub use snapshot::Kind;
pub use vm::{
    DeviceConfig, DiskConfig, NetConfig, RollbackInfo, RunState, Shape, SnapshotInfo, Stats, Vm,
    VsockConfig,
};
