//! A container's rootfs: the twig-snapshotter block image the Create
//! request names, handed to the pod's VM on one of its disk slots (empty
//! virtio-blk devices filled while the VM runs), and the guest's device name
//! for each slot.

use std::path::PathBuf;
use std::sync::Mutex;

use containerd_shim_protos::api::Mount;

use crate::error::{Error, Result};

/// The block image that holds the container's rootfs: the Create request's
/// single twig-snapshotter mount. Anything else (no mount: a rootfs already
/// on the host; overlay and other snapshotters) is refused with the way to
/// fix it.
pub fn rootfs_image(id: &str, mounts: &[Mount]) -> Result<PathBuf> {
    let fix =
        "run it with `--snapshotter twig` (ctr) or set the CRI runtime's snapshotter to `twig`";
    match mounts {
        [m] => twig_snapshotter::block_image(&m.type_, &m.source, &m.options).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "container {id}: its rootfs is a {} mount of {}, not a twig-snapshotter block image \
                 (ext4 with `loop`): the twig runtime hands the rootfs to the VM as a disk; {fix}",
                m.type_, m.source
            ))
        }),
        [] => Err(Error::InvalidArgument(format!(
            "container {id}: no rootfs mount; the twig runtime needs a twig-snapshotter block image; {fix}"
        ))),
        _ => Err(Error::InvalidArgument(format!(
            "container {id}: {} rootfs mounts; the twig runtime takes exactly one twig-snapshotter block image; {fix}",
            mounts.len()
        ))),
    }
}

/// The guest's name for disk slot `slot`: the VM has no fixed disks, so the
/// slots are the first virtio-blk devices in MMIO order.
pub fn slot_device(slot: usize) -> Result<String> {
    u8::try_from(slot)
        .ok()
        .filter(|s| *s < 26)
        .map(|s| format!("/dev/vd{}", char::from(b'a' + s)))
        .ok_or_else(|| Error::InvalidArgument(format!("no guest device name for disk slot {slot}")))
}

/// Which of a VM's disk slots hold a container's rootfs.
#[derive(Debug)]
pub struct DiskSlots {
    used: Mutex<Vec<bool>>,
}

impl DiskSlots {
    /// `count` slots, all free.
    pub fn new(count: usize) -> DiskSlots {
        DiskSlots {
            used: Mutex::new(vec![false; count]),
        }
    }

    /// Marks `slots` used (those a restored snapshot's disks fill); a slot
    /// the VM does not have is ignored.
    pub fn mark_used(&self, slots: impl IntoIterator<Item = usize>) {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        for s in slots {
            if let Some(u) = used.get_mut(s) {
                *u = true;
            }
        }
    }

    /// Takes the first free slot.
    pub fn take(&self) -> Result<usize> {
        let mut used = self.used.lock().unwrap_or_else(|p| p.into_inner());
        let free = used.iter().position(|u| !u).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the pod's VM has {} disk slots and all are taken: each container (ephemeral \
                 ones too) takes one for its rootfs, and the pod's disk-backed emptyDirs one \
                 together; twig-node's `disk_slots` sets how many a VM has",
                used.len()
            ))
        })?;
        used[free] = true;
        Ok(free)
    }

    /// Gives `slot` back.
    pub fn free(&self, slot: usize) {
        if let Some(s) = self
            .used
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(slot)
        {
            *s = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(t: &str, source: &str, options: &[&str]) -> Mount {
        Mount {
            type_: t.into(),
            source: source.into(),
            options: options.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    #[test]
    fn rootfs_must_be_one_twig_block_image() {
        let img = rootfs_image(
            "c",
            &[mount("ext4", "/s/snapshots/3/rootfs.img", &["rw", "loop"])],
        )
        .unwrap();
        assert_eq!(img, PathBuf::from("/s/snapshots/3/rootfs.img"));
        let e = rootfs_image("c", &[mount("overlay", "overlay", &["lowerdir=/a"])]).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument(_)));
        assert!(
            e.to_string().contains("--snapshotter twig") && e.to_string().contains("overlay"),
            "{e}"
        );
        let e = rootfs_image("c", &[]).unwrap_err();
        assert!(e.to_string().contains("--snapshotter twig"), "{e}");
        let two = [
            mount("ext4", "/a", &["loop"]),
            mount("ext4", "/b", &["loop"]),
        ];
        assert!(rootfs_image("c", &two)
            .unwrap_err()
            .to_string()
            .contains("2 rootfs mounts"));
    }

    #[test]
    fn slots_are_the_first_virtio_disks() {
        assert_eq!(slot_device(0).unwrap(), "/dev/vda");
        assert_eq!(slot_device(2).unwrap(), "/dev/vdc");
        assert!(slot_device(26).is_err());
    }
}
