//! twig-vmm: Twig's KVM microVM monitor.
//!
//! A [`Vm`] boots a kernel through the Linux 64-bit boot protocol, snapshots
//! itself (full, or incremental from KVM's dirty log), restores from a
//! snapshot by mapping its memory copy-on-write, clones N ways, and rolls
//! back in place at a cost that grows with the pages changed, not with RAM.
//! The `twig-vmm` binary serves one VM over a JSON API on a Unix socket;
//! [`api`] holds its types, server and client.
//!
//! The test guest ([`testguest`]) is behind the cargo feature `testguest`.

pub mod api;
mod arch;
pub mod console;
mod devices;
mod error;
pub mod jail;
pub mod logcap;
mod memory;
mod mptable;
mod precopy;
mod ratelimit;
pub mod snapshot;
#[cfg(feature = "testguest")]
pub mod testguest;
pub mod uffd;
mod vcpu;
mod virtio;
mod vm;

pub use devices::{Capture, GuestExit, SerialOut};
pub use error::{Error, ErrorKind, Result};
pub use snapshot::Kind;
pub use virtio::vsock::host_connect;
pub use vm::{
    open_kvm, DeviceConfig, DiskConfig, LazySource, NetConfig, NetStats, RollbackInfo, RunState,
    Shape, SlotImage, SlotInfo, SnapshotInfo, Stats, Vm, VsockConfig, MAX_VCPUS, MIN_MEM,
};
