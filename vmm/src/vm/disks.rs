//! A VM's disks: files attached to and detached from its disk slots while
//! it runs, and the disks' part of snapshot, restore and rollback (what a
//! snapshot records and copies, whether a snapshot's disks fit this VM, and
//! the replacements restore and rollback make).
//!
//! A disk slot is a virtio-blk device of capacity 0 with no file behind it,
//! created with the VM (virtio-mmio has no hotplug, and a restored VM never
//! boots, so every device must exist when the guest probes). Attaching a
//! file swaps it in and raises the configuration-change interrupt, so the
//! guest's virtio_blk re-reads the capacity; detaching sets the capacity
//! back to 0 the same way. The guest must have let go before a detach (the
//! agent unmounts); the file is closed and left as it is.
//!
//! What Linux 6.1 does with it: a capacity-0 disk probes fine without a
//! partition scan; I/O to it fails in the block layer (`bio_check_eod`); a
//! change from or to 0 sends no uevent, so the agent mounts the whole
//! device once `/sys/block/vdX/size` is non-zero; the block device's page
//! cache is dropped on its last close, so a later file in the same slot is
//! not read through stale cache.
//!
//! Snapshots record each slot (`DiskMeta { slot, attached, read_only, size
//! }`, never a path); an attached read-write slot is copied like a fixed
//! disk. A restore needs a file for every slot attached in the snapshot
//! (`DeviceConfig::slot_files`, or an image sent with the request), or is
//! refused before anything changes. A rollback puts every slot back as it
//! was: a slot empty then is emptied; one attached read-write then gets the
//! snapshot's copy into the file attached now; one attached read-only keeps
//! its image (same size). A slot attached then but empty now (or in the
//! other mode) refuses the rollback: the caller attaches the file the
//! content should go back to first. Paths are not recorded on purpose: a
//! rollback may target another VM's snapshot, whose files this VM must
//! never write. The configuration generation lives in the device; after
//! restore and rollback the transport raises the interrupt whenever it
//! differs from the one last announced.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::snapshot::{DiskMeta, Image};
use crate::virtio::blk::{scratch_dir, DiskFile, Replacement};

use super::{DiskConfig, RunState, SlotImage, Vm};

/// What a disk slot holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlotInfo {
    /// The slot's number (0 is the first slot, after the fixed disks).
    pub slot: usize,
    /// The attached image; `None` for an empty slot.
    pub path: Option<PathBuf>,
    /// Whether the attached image is read-only to the guest.
    pub read_only: bool,
    /// The capacity the guest sees, in bytes (0 when empty).
    pub size: u64,
}

fn kind(read_only: bool) -> &'static str {
    if read_only {
        "read-only"
    } else {
        "read-write"
    }
}

impl Vm {
    /// Index of the first disk slot among all disks (the number of fixed
    /// disks).
    fn first_slot(&self) -> usize {
        self.disks.iter().take_while(|d| !d.is_slot()).count()
    }

    /// Slot `slot`'s disk and its index among all disks.
    fn slot_disk(&self, slot: usize) -> Result<(usize, Arc<DiskFile>)> {
        let first = self.first_slot();
        let count = self.disks.len() - first;
        match self.disks.get(first + slot) {
            Some(d) if slot < count => Ok((first + slot, d.clone())),
            _ => Err(Error::Slot {
                slot,
                reason: format!("no such slot: this VM has {count} disk slots"),
            }),
        }
    }

    /// What each disk slot holds, in slot order.
    pub fn disk_slots(&self) -> Vec<SlotInfo> {
        let first = self.first_slot();
        self.disks[first..]
            .iter()
            .enumerate()
            .map(|(slot, d)| SlotInfo {
                slot,
                path: d.path(),
                read_only: d.read_only(),
                size: d.size(),
            })
            .collect()
    }

    /// Attaches the raw image `disk.path` (its size a multiple of 512) to
    /// the empty slot `slot` of this running or paused VM: the guest sees a
    /// disk of that size, announced through the configuration-change
    /// interrupt. A read-only attachment refuses the guest's writes with an
    /// I/O error (the slot's feature bits were fixed at boot, so the guest
    /// should also mount it read-only).
    pub fn attach_disk(&mut self, slot: usize, disk: &DiskConfig) -> Result<()> {
        self.need(
            "attaching a disk",
            &[RunState::Running, RunState::Paused],
            "running or paused",
        )?;
        let (index, d) = self.slot_disk(slot)?;
        d.attach(&disk.path, disk.read_only)
            .map_err(|e| slot_error(slot, e))?;
        self.devices.announce_config(1 + index);
        tracing::info!(
            slot,
            path = %disk.path.display(),
            read_only = disk.read_only,
            size = d.size(),
            "disk attached"
        );
        Ok(())
    }

    /// [`Vm::attach_disk`] with an image the caller opened: `file` (open
    /// for reading, and for writing unless `read_only`), named `path`. A
    /// jailed VMM gets its disks this way, over the API socket.
    pub fn attach_disk_file(
        &mut self,
        slot: usize,
        path: &Path,
        file: File,
        read_only: bool,
    ) -> Result<()> {
        self.need(
            "attaching a disk",
            &[RunState::Running, RunState::Paused],
            "running or paused",
        )?;
        let (index, d) = self.slot_disk(slot)?;
        d.attach_file(path, file, read_only)
            .map_err(|e| slot_error(slot, e))?;
        self.devices.announce_config(1 + index);
        tracing::info!(
            slot,
            path = %path.display(),
            read_only,
            size = d.size(),
            "disk attached (sent descriptor)"
        );
        Ok(())
    }

    /// Empties slot `slot` of this running or paused VM: the guest sees its
    /// capacity drop to 0 and every request fails from now on. The guest
    /// must have let go of the disk first (unmounted it); the file is
    /// closed and left as it is.
    pub fn detach_disk(&mut self, slot: usize) -> Result<()> {
        self.need(
            "detaching a disk",
            &[RunState::Running, RunState::Paused],
            "running or paused",
        )?;
        let (index, d) = self.slot_disk(slot)?;
        let path = d.detach().map_err(|e| slot_error(slot, e))?;
        self.devices.announce_config(1 + index);
        tracing::info!(slot, path = %path.display(), "disk detached");
        Ok(())
    }

    /// What a snapshot records of each disk, in device order.
    pub(super) fn disk_metas(&self) -> Vec<DiskMeta> {
        self.disks.iter().map(|d| d.meta()).collect()
    }

    /// The disks a snapshot copies (those with a read-write image
    /// attached), made durable first: `(index, a descriptor of the image)`.
    /// Call with the vCPUs parked, so every request is complete. A host
    /// block device attached read-write (a raw block volume) refuses the
    /// snapshot: it cannot be copied, and a snapshot that did not rewind
    /// it would restore a guest whose view of it is wrong.
    pub(super) fn disk_sources(&self) -> Result<Vec<(usize, File)>> {
        let mut sources = Vec::new();
        for (i, d) in self.disks.iter().enumerate() {
            if d.meta().has_copy() && d.is_block_device() {
                return Err(Error::Config(format!(
                    "disk {i} is the host block device {}, which a snapshot cannot copy",
                    d.path().unwrap_or_default().display()
                )));
            }
            if d.meta().has_copy() {
                d.sync()?;
                sources.push((i, d.try_clone_file()?));
            }
        }
        Ok(sources)
    }

    /// Refuses a snapshot whose disks do not fit this VM: the number of
    /// fixed disks and of slots, read-only or not, the size of read-only
    /// images (which are not copied, so the same image must be attached);
    /// for a slot with a file attached in the snapshot, a restore needs an
    /// image in `sent` or the file named in `slot_files`, and a rollback
    /// needs a file attached now. An image in `sent` (restore only) for a
    /// slot this VM lacks, or that is empty in the snapshot, is refused.
    pub(super) fn check_disks(
        &self,
        image: &Image,
        sent: &BTreeMap<usize, SlotImage>,
    ) -> Result<()> {
        let theirs = &image.state.meta.disks;
        let err = |m: String| Err(Error::snapshot(&image.dir, m));
        let their_first = theirs.iter().take_while(|d| !d.slot).count();
        if theirs[their_first..].iter().any(|d| !d.slot) {
            return err("the disk metadata lists a fixed disk after the disk slots".into());
        }
        let (their_slots, our_first) = (theirs.len() - their_first, self.first_slot());
        let our_slots = self.disks.len() - our_first;
        if their_first != our_first || their_slots != our_slots {
            return err(format!(
                "disks differ: the snapshot has {their_first} disks and {their_slots} disk slots, this VM {our_first} disks and {our_slots} disk slots"
            ));
        }
        let restoring = self.state == RunState::Created;
        if !restoring && !sent.is_empty() {
            return Err(Error::Config(
                "disk images are sent only with a restore into a new VM".into(),
            ));
        }
        for (s, img) in sent {
            match theirs.get(their_first + s) {
                None => {
                    return err(format!(
                        "an image ({}) was sent for disk slot {s}, but the VM has {our_slots} disk slots",
                        img.name.display()
                    ))
                }
                Some(t) if !t.attached => {
                    return err(format!(
                        "an image ({}) was sent for disk slot {s}, which is empty in the snapshot",
                        img.name.display()
                    ))
                }
                Some(_) => {}
            }
        }
        for (i, (t, d)) in theirs.iter().zip(&self.disks).enumerate() {
            if !restoring && d.is_block_device() {
                return Err(Error::Config(format!(
                    "disk {i} is the host block device {}, which a rollback cannot rewind; detach it first",
                    d.path().unwrap_or_default().display()
                )));
            }
            if !t.slot {
                if t.read_only != d.read_only() {
                    return err(format!(
                        "disk {i} is {} in the snapshot but {} in this VM",
                        kind(t.read_only),
                        kind(d.read_only())
                    ));
                }
                if t.read_only && t.size != d.size() {
                    return err(format!(
                        "read-only disk {i} ({}) is {} bytes, the snapshot's was {} bytes; read-only disks are not copied into snapshots, so the same image must be attached",
                        d.path().unwrap_or_default().display(),
                        d.size(),
                        t.size
                    ));
                }
                continue;
            }
            if !t.attached {
                continue;
            }
            let s = i - our_first;
            if restoring && sent.contains_key(&s) {
                // The sent image's size and mode are checked when it is
                // prepared.
            } else if restoring {
                let Some(file) = self.slot_files.get(&s) else {
                    return err(format!(
                        "disk slot {s} has a {} image of {} bytes attached in the snapshot: send an image for it, or name the file it goes to in slot_files",
                        kind(t.read_only),
                        t.size
                    ));
                };
                if t.read_only {
                    let size = std::fs::metadata(file)
                        .map_err(|e| {
                            Error::io(
                                format!("disk slot {s}: read-only image {}", file.display()),
                                e,
                            )
                        })?
                        .len();
                    if size != t.size {
                        return err(format!(
                            "disk slot {s}: read-only image {} is {size} bytes, the snapshot's was {} bytes; read-only disks are not copied into snapshots, so the same image must be attached",
                            file.display(),
                            t.size
                        ));
                    }
                }
            } else if !d.attached() {
                return err(format!(
                    "disk slot {s} had a {} image attached at the snapshot but is empty now: attach the file its disk goes back to, then roll back",
                    kind(t.read_only)
                ));
            } else if t.read_only != d.read_only() {
                return err(format!(
                    "disk slot {s} is {} in the snapshot but {} in this VM",
                    kind(t.read_only),
                    kind(d.read_only())
                ));
            } else if t.read_only && t.size != d.size() {
                return err(format!(
                    "disk slot {s}: read-only image {} is {} bytes, the snapshot's was {} bytes; read-only disks are not copied into snapshots, so the same image must be attached",
                    d.path().unwrap_or_default().display(),
                    d.size(),
                    t.size
                ));
            }
        }
        Ok(())
    }

    /// Prepares every change restore or rollback makes to the disks,
    /// changing nothing visible: the snapshot's copy of each read-write
    /// image next to the file it replaces (for a slot on restore, the file
    /// named in `slot_files`), read-only slot images opened, slots to empty;
    /// on restore, an image in `sent` is attached to its slot as it is.
    /// An image attached as a descriptor (a jailed VMM may not reach its
    /// directory) is instead backed up by a reflink into the store's `tmp`,
    /// to get the snapshot's copy reflinked into it (see
    /// `virtio/blk/inplace.rs`).
    pub(super) fn prepare_disks(
        &self,
        image: &Image,
        sent: &BTreeMap<usize, SlotImage>,
    ) -> Result<Vec<(Replacement, Arc<DiskFile>)>> {
        let restoring = self.state == RunState::Created;
        let first = self.first_slot();
        let mut out = Vec::new();
        for (i, (d, m)) in self.disks.iter().zip(&image.state.meta.disks).enumerate() {
            let r = match (d.is_slot(), m.attached, m.read_only) {
                (_, true, false) if !restoring && d.sent() => {
                    d.prepare_in_place(&image.disk_path(i), m.size, &scratch_dir(&image.dir)?)?
                }
                (false, _, false) => d.prepare_replacement(&image.disk_path(i), m.size)?,
                (false, _, true) => continue,
                (true, false, _) if d.attached() => Replacement::empty(),
                (true, false, _) => continue,
                (true, true, read_only) if restoring && sent.contains_key(&(i - first)) => {
                    let s = i - first;
                    let img = &sent[&s];
                    let file = img.file.try_clone().map_err(|e| {
                        Error::io(format!("duplicating the image sent for disk slot {s}"), e)
                    })?;
                    Replacement::attach_sent(&img.name, file, read_only, m.size)
                        .map_err(|e| slot_error(s, e))?
                }
                (true, true, read_only) if restoring => {
                    let file = self.slot_files.get(&(i - first)).ok_or_else(|| {
                        Error::snapshot(
                            &image.dir,
                            format!("disk slot {} has no file in slot_files", i - first),
                        )
                    })?;
                    if read_only {
                        Replacement::attach_read_only(file, m.size)?
                    } else {
                        Replacement::copy(file, &image.disk_path(i), m.size)?
                    }
                }
                (true, true, false) => d.prepare_replacement(&image.disk_path(i), m.size)?,
                (true, true, true) => continue,
            };
            out.push((r, d.clone()));
        }
        Ok(out)
    }
}

fn slot_error(slot: usize, e: Error) -> Error {
    let reason = match e {
        Error::Config(r) => r,
        e => e.to_string(),
    };
    Error::Slot { slot, reason }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Duration;

    use super::*;
    use crate::devices::Capture;
    use crate::snapshot::Kind;
    use crate::testguest;
    use crate::virtio::{MMIO_BASE, MMIO_SIZE};
    use crate::vm::{DeviceConfig, Shape};

    use virtio_bindings::virtio_config::{
        VIRTIO_CONFIG_S_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER, VIRTIO_CONFIG_S_DRIVER_OK,
        VIRTIO_CONFIG_S_FEATURES_OK,
    };
    use virtio_bindings::virtio_mmio::{
        VIRTIO_MMIO_CONFIG, VIRTIO_MMIO_CONFIG_GENERATION, VIRTIO_MMIO_INTERRUPT_ACK,
        VIRTIO_MMIO_INTERRUPT_STATUS, VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_STATUS,
    };

    const T: Duration = Duration::from_secs(20);
    /// Virtio device index of slot 0 (after rng and one fixed disk).
    const SLOT0: usize = 2;

    fn boot(dir: &Path, config: &DeviceConfig) -> Vm {
        if let Err(e) = crate::vm::open_kvm() {
            panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
        }
        let serial = Capture::new();
        let mut vm = Vm::create_with(Shape::new(64, 1), serial.writer(), config).unwrap();
        let kernel = testguest::write_to(dir).unwrap();
        vm.boot(&kernel, "console=ttyS0").unwrap();
        testguest::wait_booted(&vm, T).unwrap();
        vm
    }

    /// Register `off` of virtio device `index`, read as the guest reads it.
    fn reg(vm: &Vm, index: usize, off: u32) -> u32 {
        let mut b = [0u8; 4];
        vm.devices.mmio_read(
            MMIO_BASE + index as u64 * MMIO_SIZE + u64::from(off),
            &mut b,
        );
        u32::from_le_bytes(b)
    }

    fn set(vm: &Vm, index: usize, off: u32, v: u32) {
        vm.devices.mmio_write(
            MMIO_BASE + index as u64 * MMIO_SIZE + u64::from(off),
            &v.to_le_bytes(),
        );
    }

    /// The capacity in sectors, as the guest reads it (two 32-bit halves).
    fn capacity(vm: &Vm, index: usize) -> u64 {
        u64::from(reg(vm, index, VIRTIO_MMIO_CONFIG))
            | (u64::from(reg(vm, index, VIRTIO_MMIO_CONFIG + 4)) << 32)
    }

    /// Asserts a pending configuration-change interrupt, then acknowledges it.
    fn config_changed(vm: &Vm, index: usize) {
        let status = reg(vm, index, VIRTIO_MMIO_INTERRUPT_STATUS);
        assert_ne!(status & VIRTIO_MMIO_INT_CONFIG, 0, "config interrupt");
        set(vm, index, VIRTIO_MMIO_INTERRUPT_ACK, VIRTIO_MMIO_INT_CONFIG);
    }

    #[test]
    fn the_guest_sees_slots_fill_and_empty_through_attach_detach_and_rollback() {
        let dir = tempfile::tempdir().unwrap();
        let fixed = dir.path().join("fixed.img");
        std::fs::write(&fixed, vec![1u8; 4096]).unwrap();
        let file = dir.path().join("ctr.img");
        std::fs::write(&file, vec![0x5au8; 64 * 1024]).unwrap();
        let mut vm = boot(
            dir.path(),
            &DeviceConfig {
                disks: vec![DiskConfig {
                    path: fixed,
                    read_only: false,
                }],
                disk_slots: 2,
                ..Default::default()
            },
        );
        // Play the guest's driver: bring both slots up (status DRIVER_OK).
        for i in [SLOT0, SLOT0 + 1] {
            set(
                &vm,
                i,
                VIRTIO_MMIO_STATUS,
                VIRTIO_CONFIG_S_ACKNOWLEDGE
                    | VIRTIO_CONFIG_S_DRIVER
                    | VIRTIO_CONFIG_S_FEATURES_OK
                    | VIRTIO_CONFIG_S_DRIVER_OK,
            );
            assert_eq!(capacity(&vm, i), 0);
        }
        let store = twig_store::NodeStore::open(&dir.path().join("store"), true).unwrap();
        vm.snapshot_into(&store, "s0", Kind::Full).unwrap();
        let s0 = store.snapshot_dir("s0");

        let generation = reg(&vm, SLOT0, VIRTIO_MMIO_CONFIG_GENERATION);
        vm.attach_disk(
            0,
            &DiskConfig {
                path: file.clone(),
                read_only: false,
            },
        )
        .unwrap();
        config_changed(&vm, SLOT0);
        assert_ne!(
            reg(&vm, SLOT0, VIRTIO_MMIO_CONFIG_GENERATION),
            generation,
            "generation bumped"
        );
        assert_eq!(capacity(&vm, SLOT0), 128);
        assert_eq!(
            reg(&vm, SLOT0 + 1, VIRTIO_MMIO_INTERRUPT_STATUS),
            0,
            "the other slot is quiet"
        );
        assert_eq!(capacity(&vm, SLOT0 + 1), 0);

        // Rolling back to before the attach empties the slot, and the
        // guest is told.
        vm.rollback(&s0).unwrap();
        config_changed(&vm, SLOT0);
        assert_eq!(capacity(&vm, SLOT0), 0);
        assert_eq!(vm.disk_slots()[0].path, None);
        assert_eq!(
            std::fs::read(&file).unwrap(),
            vec![0x5a; 64 * 1024],
            "the file is left as it is"
        );

        vm.attach_disk(
            1,
            &DiskConfig {
                path: file.clone(),
                read_only: true,
            },
        )
        .unwrap();
        config_changed(&vm, SLOT0 + 1);
        vm.detach_disk(1).unwrap();
        config_changed(&vm, SLOT0 + 1);
        assert_eq!(capacity(&vm, SLOT0 + 1), 0);
        assert_eq!(vm.state(), RunState::Running);
    }
}
