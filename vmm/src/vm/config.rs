//! The public types of a VM: its shape, its devices, its run state and what
//! its operations report.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::arch;
use crate::error::{Error, Result};
use crate::snapshot::Kind;

/// Most vCPUs a VM may have.
pub const MAX_VCPUS: usize = 64;
/// Smallest guest RAM.
pub const MIN_MEM: usize = 16 << 20;

/// A VM's size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Shape {
    /// Guest RAM in bytes (a multiple of 2 MiB, at least 16 MiB, below the
    /// 3 GiB MMIO gap).
    pub mem_size: usize,
    /// Number of vCPUs.
    pub vcpus: usize,
}

impl Shape {
    /// A shape of `mem_mib` MiB and `vcpus` vCPUs.
    pub fn new(mem_mib: usize, vcpus: usize) -> Shape {
        Shape {
            mem_size: mem_mib << 20,
            vcpus,
        }
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.vcpus == 0 || self.vcpus > MAX_VCPUS {
            return Err(Error::Config(format!(
                "{} vCPUs; a VM has 1 to {MAX_VCPUS}",
                self.vcpus
            )));
        }
        if self.mem_size < MIN_MEM
            || self.mem_size % (2 << 20) != 0
            || self.mem_size as u64 > arch::layout::MMIO_GAP
        {
            return Err(Error::Config(format!(
                "{} bytes of RAM; guest RAM is a multiple of 2 MiB from 16 MiB to 3 GiB",
                self.mem_size
            )));
        }
        Ok(())
    }
}

/// A disk slot's image that the caller opened and sent for a restore
/// ([`super::Vm::restore_image_with`]): how a jailed VMM, which cannot open
/// the caller's files, gets the disks of a snapshot's attached slots. The
/// file is attached to the slot as it is: it must already hold the
/// snapshot's copy of that disk (the caller reflinks the snapshot's
/// `disk<i>` into it), be the size the snapshot recorded, and be open for
/// writing if the slot was attached read-write.
#[derive(Debug)]
pub struct SlotImage {
    /// A name for the image (logs, the device id); never opened.
    pub name: PathBuf,
    /// The open image.
    pub file: File,
}

/// The devices a VM has besides the entropy device every VM gets. Their
/// MMIO order is fixed (rng, the disks in order, the disk slots, net,
/// vsock, balloon), so that snapshots line up with VMs built from the same
/// configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// virtio-blk disks.
    pub disks: Vec<DiskConfig>,
    /// Empty virtio-blk disk slots after the disks: files are attached to
    /// them while the VM runs ([`super::Vm::attach_disk`]).
    pub disk_slots: usize,
    /// For a VM that restores a snapshot with files attached to its slots:
    /// slot → the file that slot's disk goes to. A read-write slot's file
    /// gets the snapshot's copy (created, or replaced if it exists); a
    /// read-only slot's file must be the image that was attached (same
    /// size), opened read-only. Names for slots empty in the snapshot are
    /// not used.
    pub slot_files: BTreeMap<usize, PathBuf>,
    /// A virtio-net device, on a tap or detached until one is attached
    /// ([`super::Vm::attach_net`]).
    pub net: Option<NetConfig>,
    /// A virtio-vsock device.
    pub vsock: Option<VsockConfig>,
    /// A virtio-balloon device taking free page reports: memory the guest
    /// frees goes back to the host. Snapshots restore only into VMs that
    /// agree on it (it is a device like the others).
    pub balloon: bool,
}

/// A raw disk image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// The image file (its size a multiple of 512 bytes). A read-write
    /// disk's file is copied into every snapshot and replaced by the
    /// snapshot's copy on restore and rollback.
    pub path: PathBuf,
    /// Whether the guest may only read it.
    pub read_only: bool,
}

/// A network device on a host tap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// The tap's name (opened, created if missing, when the VM is
    /// created), or `None` for a device detached until a tap is attached
    /// as a descriptor ([`super::Vm::attach_net`]).
    pub tap: Option<String>,
    /// The guest's MAC address.
    pub mac: [u8; 6],
}

/// A vsock device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's context id.
    pub cid: u64,
    /// The host side's Unix socket.
    pub uds_path: PathBuf,
}

/// Where a VM is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    /// Created, neither booted nor restored yet.
    Created,
    /// vCPUs running.
    Running,
    /// vCPUs parked.
    Paused,
    /// The guest shut down or crashed.
    Stopped,
}

impl RunState {
    pub(super) fn name(self) -> &'static str {
        match self {
            RunState::Created => "created",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Stopped => "stopped",
        }
    }
}

/// What a snapshot call did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SnapshotInfo {
    /// The new snapshot's id.
    pub id: String,
    /// Full or incremental.
    pub kind: Kind,
    /// Its parent's id.
    pub parent: Option<String>,
    /// Guest pages written to its memory file.
    pub pages_written: usize,
    /// How long the guest was paused.
    pub pause_ms: f64,
    /// Wall time of the whole call, until the snapshot was durable and
    /// published.
    pub duration_ms: f64,
    /// A full snapshot's pre-copy rounds (the first pass over all of RAM
    /// included) before the pause; 0 for an incremental snapshot.
    #[serde(default)]
    pub precopy_rounds: usize,
    /// Pages copied by the pre-copy rounds, before the pause.
    #[serde(default)]
    pub pages_precopied: usize,
    /// Pages copied while the guest was paused.
    #[serde(default)]
    pub pages_paused: usize,
}

/// What a rollback call did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RollbackInfo {
    /// The snapshot rolled back to.
    pub id: String,
    /// Guest pages put back.
    pub pages_restored: usize,
    /// Whether all of RAM was remapped (the snapshot is from another
    /// lineage, or RAM did not map its root memory file and more than 1,024
    /// pages changed: after a full snapshot of a running VM).
    pub remapped: bool,
    /// Wall time of the whole call.
    pub duration_ms: f64,
}

/// A VM's counters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stats {
    /// Where the VM is in its life.
    pub state: RunState,
    /// vCPUs.
    pub vcpus: usize,
    /// Guest RAM, MiB.
    pub mem_mib: usize,
    /// The snapshot the VM's memory is tracked against.
    pub baseline: Option<String>,
    /// Pages changed since that snapshot.
    pub dirty_pages: usize,
    /// VM exits handled in user space.
    pub exits: u64,
    /// Guest RAM mapped in this process, KiB (includes pages shared with
    /// other VMs through the snapshot's page cache).
    pub guest_resident_kib: usize,
    /// Guest RAM private to this VM, KiB: pages it changed or got from an
    /// incremental layer.
    pub guest_private_kib: usize,
    /// Why the guest stopped, if it did.
    pub guest_exit: Option<String>,
    /// The network device, if the VM has one.
    #[serde(default)]
    pub net: Option<NetStats>,
}

/// A network device's link to the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetStats {
    /// The attached tap's interface, `None` while the device is detached.
    pub tap: Option<String>,
    /// Frames the guest sent while the device had no tap (dropped).
    pub tx_dropped: u64,
}
