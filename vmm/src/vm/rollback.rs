//! In-place rollback of a running VM to a snapshot, all or nothing.
//!
//! A rollback runs in four phases on the paused VM:
//!
//! 1. **Prepare** (nothing visible changes): plan the pages, read the
//!    target's layer pages, check every page range (or, for a snapshot of
//!    another lineage, build all of the target's memory at a scratch
//!    address), parse the device state, copy the disks next to the VM's
//!    files (an image sent as a descriptor: reflink its contents into an
//!    anonymous backup in the store's `tmp`), and back up vCPU,
//!    irqchip/PIT/clock and device state.
//! 2. **State**, each step with an undo: vCPUs (undo: load the backup),
//!    irqchip/PIT/clock (undo: load the backup, the clock advanced by the
//!    time spent), devices (undo: load the backup), disks (undo: exchange
//!    the old files back, or, for an image sent as a descriptor, reflink
//!    its backup back into it). A failure undoes every step begun, in
//!    reverse.
//! 3. **Memory**, last, after the point of no return: `MADV_DONTNEED` and
//!    copies on checked ranges of our own mapping, or one `mremap` of the
//!    prepared memory. Should a syscall still fail, the rollback rolls
//!    *forward*: all of RAM is rebuilt from the target (as restore does) and
//!    moved in with one `mremap`, so the VM runs on exactly the snapshot.
//! 4. **Commit** (cannot fail): the device serves the new disk files,
//!    devices are told, the target becomes the baseline, and KVM's dirty log
//!    is cleared; if that read fails, every page counts as dirty.
//!
//! Only when an undo or the roll-forward fails too is the VM lost: it is
//! stopped, its RAM zeroed, and [`Error::VmLost`] returned.
//!
//! The contract: `Ok` — the VM runs exactly on the snapshot; `Error::Rollback`
//! — the VM is on exactly its previous memory, vCPU, device and disk state,
//! running if it was (its clock moved on); `Error::VmLost` — the caller
//! replaces it (a later rollback restores every part of a snapshot and may
//! revive it). Memory is not made revertible instead because a backup of
//! every page to change would cost about as much as the rollback, while the
//! steps after the point of no return are `madvise`/`memcpy`/`mremap` on
//! ranges already checked. The pages put back are those dirtied since the
//! baseline plus those in incremental layers on the tree path between
//! baseline and target: `MADV_DONTNEED` where the root file holds the right
//! bytes and RAM maps that file, a copy from the layer (or the root file)
//! otherwise. RAM does not map the root file of a full snapshot taken of a
//! running VM (`precopy.rs`): a rollback in its lineage copies up to
//! `ROOT_COPY_PAGES` pages from it, or else maps it over all of RAM (as
//! for another lineage), after which RAM maps it.
//!
//! Proven by fault injection (`rollback/tests.rs`, failpoints of
//! `vm/failpoint.rs`, compiled into test builds only) at every step, on the
//! same lineage and from another, for disks by path and sent as
//! descriptors: after each failure RAM, vCPU state, irqchips, PIT, device
//! state and disks are compared with the old state (or with the snapshot
//! after a roll-forward), and a rollback must then succeed.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use kvm_bindings::{kvm_clock_data, kvm_irqchip, kvm_pit_state2};

use crate::arch;
use crate::devices::{DeviceState, GuestExit};
use crate::error::{Error, Result};
use crate::memory::{PageSet, PreparedRam, PAGE_SIZE};
use crate::snapshot::{self, Image, VmState};
use crate::vcpu::VcpuState;
use crate::virtio::blk::{DiskFile, Replacement};

use super::failpoint;
use super::{absolute, kvm_err, ms, RollbackInfo, RunState, Vm};

/// The most pages a rollback copies from its target's root memory file
/// when RAM does not map that file (4 MiB); with more, it maps the file
/// over all of RAM instead, and RAM maps it from then on.
const ROOT_COPY_PAGES: usize = 1024;

/// How a rollback failed.
enum Failure {
    /// Nothing changed, or every change was undone: the VM is on its
    /// previous state.
    Refused(Error),
    /// A change could neither be undone nor completed.
    Lost(Error),
}

/// What guest memory needs, prepared before anything changes.
enum MemoryPlan {
    /// RAM maps the target's root file: drop the private copies of the
    /// `discard` runs `(first, count)` (the file holds the target's bytes)
    /// and copy the `staged` pages from the target's layers.
    Patch {
        discard: Vec<(usize, usize)>,
        staged: Vec<(usize, Vec<u8>)>,
    },
    /// Another lineage: all of the target's memory, built at a scratch
    /// address.
    Replace(PreparedRam),
}

/// The VM's state before the rollback, to undo the state steps with.
struct Backup {
    vcpus: Vec<VcpuState>,
    irqchips: [kvm_irqchip; 3],
    pit: kvm_pit_state2,
    clock: kvm_clock_data,
    taken: Instant,
    devices: DeviceState,
}

/// Everything a rollback needs, prepared with no visible change.
struct Prepared {
    memory: MemoryPlan,
    pages: usize,
    devices: DeviceState,
    disks: Vec<(Replacement, Arc<DiskFile>)>,
    backup: Backup,
}

/// The state steps, in the order they are applied.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Step {
    None,
    Vcpus,
    VmState,
    Devices,
    Disks,
}

impl Vm {
    /// Rolls this VM back, in place, to the snapshot in `dir`: same process,
    /// same VM fd. Only pages that may differ from the snapshot are touched:
    /// those dirtied since the baseline plus those in incremental layers
    /// between the baseline and the target.
    ///
    /// All or nothing; the outcomes are:
    /// - `Ok`: the VM is exactly on the snapshot (memory, vCPUs,
    ///   irqchip/PIT/clock, devices, read-write disks) and running. If a
    ///   memory operation failed after the point of no return, all of RAM
    ///   was rebuilt from the snapshot instead (`remapped` is then true).
    /// - [`Error::Rollback`]: nothing changed, or every change was undone:
    ///   the VM is on exactly its previous memory, vCPU, device and disk
    ///   state, running if it was running (its clock has moved on by the
    ///   time the call took). A later rollback may succeed.
    /// - [`Error::VmLost`]: a change could neither be undone nor completed.
    ///   The VM is stopped ([`RunState::Stopped`]) with zeroed RAM and its
    ///   disk files put back; replace it. A later rollback restores every
    ///   part of a snapshot and may revive it.
    pub fn rollback(&mut self, dir: &Path) -> Result<RollbackInfo> {
        let start = Instant::now();
        let was = self
            .need(
                "rollback",
                &[RunState::Running, RunState::Paused, RunState::Stopped],
                "booted or restored",
            )
            .map_err(|e| Error::Rollback(Box::new(e)))?;
        self.refuse_while_lazy("roll back")
            .map_err(|e| Error::Rollback(Box::new(e)))?;
        if let Err(e) = self.resolve_lazy_baseline() {
            // Without it every page is put back (all of RAM remapped).
            tracing::debug!("no baseline from the lazy restore yet: {e}");
        }
        let dir = absolute(dir).map_err(|e| Error::Rollback(Box::new(e)))?;
        let target = match &self.baseline {
            Some(b) if b.dir == dir => b.clone(),
            _ => Image::open(&dir).map_err(|e| Error::Rollback(Box::new(e)))?,
        };
        self.check_compatible(&target, &BTreeMap::new())
            .and_then(|_| self.check_same_cpuid(&target))
            .map_err(|e| Error::Rollback(Box::new(e)))?;
        self.pause().map_err(|e| Error::Rollback(Box::new(e)))?;
        match self.rollback_paused(&target) {
            Ok((pages, remapped)) => {
                self.resume()?;
                let info = RollbackInfo {
                    id: target.id().to_string(),
                    pages_restored: pages,
                    remapped,
                    duration_ms: ms(start),
                };
                tracing::info!(id = %info.id, pages, remapped, ms = info.duration_ms, "rollback");
                Ok(info)
            }
            Err(Failure::Refused(e)) => {
                if was == RunState::Running {
                    self.resume()?;
                }
                Err(Error::Rollback(Box::new(e)))
            }
            Err(Failure::Lost(e)) => {
                self.lose(&e);
                Err(Error::VmLost(Box::new(e)))
            }
        }
    }

    fn check_same_cpuid(&self, target: &Image) -> Result<()> {
        let same = target
            .state
            .vcpus
            .iter()
            .zip(&self.cpuid)
            .all(|(s, mine)| arch::same_cpuid(&s.cpuid, mine));
        if same {
            Ok(())
        } else {
            Err(Error::snapshot(
                &target.dir,
                "the snapshot's CPUID differs from this VM's (KVM cannot change CPUID of a running VM); restore it into a new VM instead",
            ))
        }
    }

    /// The pages to put back and whether RAM maps the target's root file
    /// (whose pages are then dropped rather than copied), or `None` when
    /// all of RAM is: no baseline, another lineage, or more than
    /// [`ROOT_COPY_PAGES`] pages to copy from a root file RAM does not map
    /// (after a full snapshot of a running VM, see `precopy.rs`).
    fn rollback_plan(&mut self, target: &Arc<Image>) -> Result<Option<(PageSet, bool)>> {
        let Some(base) = self.baseline.clone() else {
            return Ok(None);
        };
        if base.state.meta.root_id != target.state.meta.root_id {
            return Ok(None);
        }
        self.collect_dirty()?;
        let mut pages = self.dirty.clone();
        let base_chain: Vec<String> = base.chain().iter().map(|i| i.id().to_string()).collect();
        let target_chain = target.chain();
        let common = target_chain
            .iter()
            .rev()
            .find(|i| base_chain.iter().any(|b| b == i.id()))
            .map(|i| i.id().to_string());
        for chain in [base.chain(), target_chain] {
            for img in chain.iter().rev() {
                if Some(img.id()) == common.as_deref() {
                    break;
                }
                if let Some(l) = &img.state.layer {
                    pages.union_with(l);
                }
            }
        }
        let maps_root = self.ram.maps_file(&target.chain()[0].memory);
        if !maps_root
            && pages
                .iter()
                .filter(|p| target.layer_for(*p).is_none())
                .nth(ROOT_COPY_PAGES)
                .is_some()
        {
            return Ok(None);
        }
        Ok(Some((pages, maps_root)))
    }

    fn rollback_paused(
        &mut self,
        target: &Arc<Image>,
    ) -> std::result::Result<(usize, bool), Failure> {
        let Prepared {
            memory,
            pages,
            devices,
            mut disks,
            backup,
        } = self.prepare_rollback(target).map_err(Failure::Refused)?;

        let mut step = Step::None;
        if let Err(e) = self.apply_state(&target.state, devices, &mut disks, &mut step) {
            // Reverse order: the disks first, then the rest.
            let undone = disks
                .iter_mut()
                .rev()
                .try_for_each(|(r, _)| r.undo())
                .and_then(|()| self.undo_state(step, backup, &target.state));
            return match undone {
                Ok(()) => Err(Failure::Refused(e)),
                Err(undo) => {
                    tracing::error!("rollback failed ({e}) and undoing it failed: {undo}");
                    Err(Failure::Lost(undo))
                }
            };
        }

        // The point of no return: guest memory.
        let remapped = match self.apply_memory(memory) {
            Ok(remapped) => remapped,
            Err(e) => {
                tracing::warn!("rollback: {e}; rebuilding all of RAM from the snapshot");
                if let Err(forward) = self.roll_forward(target) {
                    tracing::error!(
                        "rollback failed ({e}) and rolling forward to the snapshot failed: {forward}"
                    );
                    return Err(Failure::Lost(forward));
                }
                true
            }
        };

        for (r, d) in disks {
            r.finish(&d);
        }
        if remapped {
            self.hot = None;
        }
        self.devices.retrigger_pending();
        self.devices.after_restore();
        self.adopt(target);
        // Forget what the guest dirtied before the rollback.
        let cleared = failpoint::check("rollback.dirty_log").and_then(|_| {
            self.fd
                .get_dirty_log(0, self.shape.mem_size)
                .map_err(kvm_err("KVM_GET_DIRTY_LOG"))
        });
        if let Err(e) = cleared {
            tracing::warn!("rollback: {e}; counting every page as dirty");
            self.dirty = PageSet::full(self.ram.pages());
        }
        self.state = RunState::Paused;
        Ok((pages, remapped))
    }

    /// Phase 1: everything that can fail, with no visible change.
    fn prepare_rollback(&mut self, target: &Arc<Image>) -> Result<Prepared> {
        let plan = self.rollback_plan(target)?;
        failpoint::check("rollback.plan")?;
        let (memory, pages) = match plan {
            Some((wanted, maps_root)) => {
                let root = target.chain()[0].clone();
                let mut discard = PageSet::new(self.ram.pages());
                let mut staged = Vec::new();
                for p in wanted.iter() {
                    let from = match target.layer_for(p) {
                        Some(img) => img,
                        None if maps_root => {
                            discard.insert(p);
                            continue;
                        }
                        None => root.clone(),
                    };
                    let mut buf = vec![0u8; PAGE_SIZE];
                    snapshot::read_exact_at(&from.memory, &mut buf, (p * PAGE_SIZE) as u64)
                        .map_err(|e| Error::io(format!("reading {}", from.dir.display()), e))?;
                    staged.push((p, buf));
                }
                failpoint::check("rollback.stage")?;
                let discard = discard.runs();
                for &(start, n) in &discard {
                    self.ram.check(start, n)?;
                }
                for (p, _) in &staged {
                    self.ram.check(*p, 1)?;
                }
                (MemoryPlan::Patch { discard, staged }, wanted.count())
            }
            None => {
                let (prepared, pages) = self.prepare_target_memory(target)?;
                failpoint::check("rollback.stage")?;
                (MemoryPlan::Replace(prepared), pages)
            }
        };
        let devices = self.devices.parse(&target.state.devices)?;
        failpoint::check("rollback.parse_devices")?;
        let disks = self.prepare_disks(target, &BTreeMap::new())?;
        failpoint::check("rollback.prepare_disks")?;
        let vcpus = self.save_vcpus()?;
        let (irqchips, pit, clock) = self.save_vm_state()?;
        let backup = Backup {
            vcpus,
            irqchips,
            pit,
            clock,
            taken: Instant::now(),
            devices: self.devices.parse(&self.devices.save())?,
        };
        failpoint::check("rollback.backup")?;
        Ok(Prepared {
            memory,
            pages,
            devices,
            disks,
            backup,
        })
    }

    /// All of the target's memory at a scratch address: its root file
    /// mapped privately, each layer's pages read on top in chain order.
    /// Returns it and the number of layer pages.
    fn prepare_target_memory(&self, target: &Arc<Image>) -> Result<(PreparedRam, usize)> {
        let chain = target.chain();
        let prepared = self.ram.prepare_private(chain[0].memory.clone())?;
        let mut pages = PageSet::new(self.ram.pages());
        for layer in &chain[1..] {
            if let Some(l) = &layer.state.layer {
                for (start, n) in l.runs() {
                    prepared.read_pages_from(&layer.memory, start, n)?;
                }
                pages.union_with(l);
            }
        }
        Ok((prepared, pages.count()))
    }

    /// Phase 2: loads the target's vCPU, irqchip/PIT/clock and device state
    /// and swaps its disks in. `step` tells how far it got.
    fn apply_state(
        &self,
        s: &VmState,
        devices: DeviceState,
        disks: &mut [(Replacement, Arc<DiskFile>)],
        step: &mut Step,
    ) -> Result<()> {
        *step = Step::Vcpus;
        self.load_vcpus(&s.vcpus, false)?;
        failpoint::check("rollback.vcpus")?;
        *step = Step::VmState;
        self.load_vm_state(s)?;
        failpoint::check("rollback.vm_state")?;
        *step = Step::Devices;
        self.devices.restore(devices)?;
        failpoint::check("rollback.devices")?;
        *step = Step::Disks;
        for (r, _) in disks.iter_mut() {
            r.swap_in()?;
        }
        failpoint::check("rollback.disks")?;
        Ok(())
    }

    /// Undoes the state steps up to `step` (the disks are put back by
    /// dropping their replacements), in reverse order.
    fn undo_state(&self, step: Step, backup: Backup, target: &VmState) -> Result<()> {
        failpoint::check("rollback.undo")?;
        if step >= Step::Devices {
            self.devices.restore(backup.devices)?;
        }
        if step >= Step::VmState {
            let mut old = target.clone();
            old.irqchips = backup.irqchips;
            old.pit = backup.pit;
            // The clock keeps running through a failed rollback.
            let spent = u64::try_from(backup.taken.elapsed().as_nanos()).unwrap_or(u64::MAX);
            old.clock = kvm_clock_data {
                clock: backup.clock.clock.saturating_add(spent),
                ..backup.clock
            };
            self.load_vm_state(&old)?;
        }
        if step >= Step::Vcpus {
            self.load_vcpus(&backup.vcpus, false)?;
        }
        Ok(())
    }

    /// Phase 3: puts the target's memory in. Returns whether all of RAM was
    /// replaced. Ranges were checked, so only a syscall can fail here.
    fn apply_memory(&mut self, plan: MemoryPlan) -> Result<bool> {
        match plan {
            MemoryPlan::Patch { discard, staged } => {
                for (start, n) in discard {
                    self.ram.discard(start, n)?;
                    failpoint::check("rollback.discard")?;
                }
                for (p, data) in &staged {
                    self.ram.write_pages(*p, data)?;
                    failpoint::check("rollback.write_pages")?;
                }
                Ok(false)
            }
            MemoryPlan::Replace(prepared) => {
                failpoint::check("rollback.remap")?;
                self.ram.install(prepared)?;
                Ok(true)
            }
        }
    }

    /// Makes guest RAM exactly the target's memory, whatever it holds now.
    fn roll_forward(&mut self, target: &Arc<Image>) -> Result<()> {
        failpoint::check("rollback.roll_forward")?;
        let (prepared, _) = self.prepare_target_memory(target)?;
        self.ram.install(prepared)
    }

    /// Stops a VM that a rollback left in an unknown state.
    fn lose(&mut self, e: &Error) {
        tracing::error!("rollback lost the VM: {e}");
        if let Err(e) = self.ram.clear() {
            tracing::error!("zeroing the lost VM's RAM: {e}");
        }
        self.baseline = None;
        self.lazy_origin = None;
        self.dirty = PageSet::full(self.ram.pages());
        self.devices
            .exit()
            .set(GuestExit::Failed(format!("lost in a failed rollback: {e}")));
    }
}

#[cfg(test)]
mod tests;
