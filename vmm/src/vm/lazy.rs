//! Lazy restore (`uffd.rs` has the protocol): guest RAM starts empty and
//! registered with a userfaultfd, the page server fills it in on demand.
//!
//! Only the snapshot's `state` (and its disk copies) are read: the memory
//! files of its chain need not be on this node. What a lazily restored VM
//! can do before the page server said `complete`:
//! - run, pause, snapshot (full: every page is read through faults, which
//!   the page server answers; a paused VM is not remapped onto its full
//!   snapshot meanwhile, RAM stays registered);
//! - an incremental snapshot, once the snapshot it was restored from is in
//!   the store with its chain (its baseline: opened then, identified by its
//!   uid); until then it is refused, take a full one;
//! - no rollback: it would map a file over registered RAM under the page
//!   server's feet; refused (`refused`, the VM runs on) until complete.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::{PageSet, PAGE_SIZE};
use crate::snapshot::{self, Image, VmState};
use crate::uffd::{self, Layout, Region, Uffd, Watcher};

use super::{absolute, RunState, SlotImage, Vm};

/// Where a lazily restored VM came from, until it has a baseline of its
/// own: the snapshot directory and its uid.
pub(super) struct LazyOrigin {
    dir: PathBuf,
    uid: String,
}

/// The checked parts of a lazy restore request, made before any VM is
/// touched (a refused request leaves a prepared VM as it was).
pub struct LazySource {
    dir: PathBuf,
    state: VmState,
    uffd: Uffd,
    page_server: UnixStream,
}

impl LazySource {
    /// Reads the `state` of the snapshot in `dir` (nothing else of its
    /// chain), makes a userfaultfd from `userfaultfd` (an open
    /// `/dev/userfaultfd`) and checks `page_server` is a connected stream
    /// socket.
    pub fn open(dir: &Path, userfaultfd: &File, page_server: UnixStream) -> Result<LazySource> {
        let dir = absolute(dir)?;
        let state = snapshot::read_state(&dir)?;
        let uffd = Uffd::open(userfaultfd)?;
        uffd::check_stream(&page_server)?;
        Ok(LazySource {
            dir,
            state,
            uffd,
            page_server,
        })
    }

    /// The snapshot's id.
    pub fn id(&self) -> &str {
        &self.state.meta.id
    }

    /// The shape (RAM, vCPUs) the snapshot restores into.
    pub fn shape(&self) -> super::Shape {
        super::Shape {
            mem_size: self.state.meta.mem_size as usize,
            vcpus: self.state.meta.vcpus,
        }
    }
}

impl Vm {
    /// Restores the snapshot of `source` into this newly created VM lazily,
    /// leaving it paused: disks as [`Vm::restore_image_with`] attaches them
    /// (`sent`: images for the snapshot's slots), guest RAM emptied and
    /// registered with the userfaultfd, the handshake sent to the page
    /// server, then vCPU, irqchip, PIT, clock and device state loaded (which
    /// may fault pages in). From the handshake on, a page server that goes
    /// away before `complete` ends the process (`uffd.rs`). On an error the
    /// VM is unusable: drop it.
    pub fn restore_lazy(
        &mut self,
        source: LazySource,
        sent: &BTreeMap<usize, SlotImage>,
    ) -> Result<()> {
        self.need("restore", &[RunState::Created], "newly created")?;
        let LazySource {
            dir,
            state,
            uffd,
            page_server,
        } = source;
        // An image without memory: the checks and disk preparation read
        // only its directory and state.
        let image = Image {
            dir: dir.clone(),
            state,
            memory: Arc::new(empty_file()?),
            parent: None,
        };
        self.check_compatible(&image, sent)?;
        let devices = self.devices.parse(&image.state.devices)?;
        let mut disks = self.prepare_disks(&image, sent)?;
        for (r, _) in &mut disks {
            r.swap_in()?;
        }
        for (r, d) in disks {
            r.finish(&d);
        }
        // Every page missing: a fresh anonymous mapping.
        self.ram.clear()?;
        let (addr, len) = (self.ram.host_addr(), self.ram.size() as u64);
        uffd.register(addr, len)?;
        let layout = Layout {
            page_size: PAGE_SIZE as u64,
            mem_size: len,
            regions: vec![Region {
                host_addr: addr,
                size: len,
                guest_addr: 0,
            }],
        };
        uffd::send_handshake(&page_server, &layout, &uffd)?;
        self.lazy = Some(Watcher::spawn(uffd, page_server, addr, len)?);
        let s = &image.state;
        self.load_vcpus(&s.vcpus, true)?;
        self.load_vm_state(s)?;
        self.devices.restore(devices)?;
        self.devices.retrigger_pending();
        self.devices.after_restore();
        self.cpuid = s.vcpus.iter().map(|v| v.cpuid.clone()).collect();
        self.msr_indices = Arc::new(s.vcpus[0].msrs.iter().map(|m| m.index).collect());
        self.baseline = None;
        // The page server fills every page: the hot list passed on is
        // the snapshot's (and what the guest dirties).
        let mut hot = PageSet::new(self.ram.pages());
        for &(first, n) in &s.meta.hot {
            (first..first + n).for_each(|p| hot.insert(p as usize));
        }
        self.hot = Some(hot);
        self.lazy_origin = Some(LazyOrigin {
            dir,
            uid: s.meta.uid.clone(),
        });
        self.dirty = PageSet::new(self.ram.pages());
        self.ram.take_vmm_dirty();
        self.devices.exit().clear();
        self.state = RunState::Paused;
        tracing::info!(id = %s.meta.id, mem = len, "restored lazily; pages come from the page server");
        Ok(())
    }

    /// Whether guest memory is still being filled in by a lazy restore's
    /// page server.
    pub fn lazy_pending(&self) -> bool {
        self.lazy.as_ref().is_some_and(|w| !w.is_complete())
    }

    /// Refuses `op` while a lazy restore is incomplete.
    pub(super) fn refuse_while_lazy(&self, op: &str) -> Result<()> {
        if self.lazy_pending() {
            return Err(Error::Config(format!(
                "cannot {op} a lazily restored VM before its page server has sent all of guest memory"
            )));
        }
        Ok(())
    }

    /// A lazily restored VM without a baseline adopts the snapshot it was
    /// restored from once that is in the store with its chain (and is the
    /// same snapshot: same uid). `Err` names why not.
    pub(super) fn resolve_lazy_baseline(&mut self) -> Result<()> {
        if self.baseline.is_some() {
            return Ok(());
        }
        let Some(origin) = &self.lazy_origin else {
            return Ok(());
        };
        let image = Image::open(&origin.dir)?;
        if image.state.meta.uid != origin.uid {
            return Err(Error::snapshot(
                &origin.dir,
                "is not the snapshot this VM was lazily restored from (another uid)",
            ));
        }
        self.baseline = Some(image);
        self.lazy_origin = None;
        Ok(())
    }
}

/// An empty memfd.
fn empty_file() -> Result<File> {
    // SAFETY: memfd_create with a static NUL-terminated name.
    let fd = unsafe { libc::memfd_create(c"twig-lazy".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::io(
            "memfd_create for a lazy restore",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: fd was just returned by memfd_create and is owned here.
    Ok(unsafe { <File as std::os::fd::FromRawFd>::from_raw_fd(fd) })
}
