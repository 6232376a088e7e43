//! In-place rollback of a running VM to a snapshot.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::arch;
use crate::error::{Error, Result};
use crate::memory::{Backing, PageSet, PAGE_SIZE};
use crate::snapshot::{self, Image};

use super::{absolute, kvm_err, ms, RollbackInfo, RunState, Vm};

impl Vm {
    /// Rolls this VM back, in place, to the snapshot in `dir`: same process,
    /// same VM fd. Only pages that may differ from the snapshot are touched:
    /// those dirtied since the baseline plus those in incremental layers
    /// between the baseline and the target. If anything fails before the VM
    /// is changed, it keeps running on its previous state and the error says
    /// why.
    pub fn rollback(&mut self, dir: &Path) -> Result<RollbackInfo> {
        let start = Instant::now();
        let was = self
            .need(
                "rollback",
                &[RunState::Running, RunState::Paused, RunState::Stopped],
                "booted or restored",
            )
            .map_err(|e| Error::Rollback(Box::new(e)))?;
        let dir = absolute(dir).map_err(|e| Error::Rollback(Box::new(e)))?;
        let target = match &self.baseline {
            Some(b) if b.dir == dir => b.clone(),
            _ => Image::open(&dir).map_err(|e| Error::Rollback(Box::new(e)))?,
        };
        self.check_compatible(&target)
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
            Err(e) => {
                if was == RunState::Running {
                    self.resume()?;
                }
                Err(Error::Rollback(Box::new(e)))
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

    /// The pages to put back and, per page, whether the target's root file
    /// (mapped now) already holds the right contents.
    fn rollback_plan(&mut self, target: &Arc<Image>) -> Result<Option<PageSet>> {
        let Some(base) = self.baseline.clone() else {
            return Ok(None);
        };
        let (Backing::Private(_), true) = (
            self.ram.backing(),
            base.state.meta.root_id == target.state.meta.root_id,
        ) else {
            return Ok(None);
        };
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
        Ok(Some(pages))
    }

    fn rollback_paused(&mut self, target: &Arc<Image>) -> Result<(usize, bool)> {
        let plan = self.rollback_plan(target)?;
        // Stage what the target's layers hold for these pages before the VM
        // is touched, so that a failing read changes nothing.
        let mut staged: Vec<(usize, Vec<u8>)> = Vec::new();
        let mut from_root: Vec<usize> = Vec::new();
        let wanted: Vec<usize> = match &plan {
            Some(p) => p.iter().collect(),
            None => {
                let mut all = PageSet::new(self.ram.pages());
                for img in target.chain() {
                    if let Some(l) = &img.state.layer {
                        all.union_with(l);
                    }
                }
                all.iter().collect()
            }
        };
        for p in &wanted {
            match target.layer_for(*p) {
                Some(img) => {
                    let mut buf = vec![0u8; PAGE_SIZE];
                    snapshot::read_exact_at(&img.memory, &mut buf, (*p * PAGE_SIZE) as u64)
                        .map_err(|e| Error::io(format!("reading {}", img.dir.display()), e))?;
                    staged.push((*p, buf));
                }
                None => from_root.push(*p),
            }
        }
        let s = &target.state;
        let devices = self.devices.parse(&s.devices)?;
        // The disks: copied next to the VM's files, then swapped in with the
        // old files kept aside; dropped on failure, the replacements put
        // the old files back.
        let mut disks = self.prepare_disks(target)?;
        for (r, _) in &mut disks {
            r.swap_in()?;
        }
        let backup = self.save_vcpus()?;
        let (chips, pit, clock) = self.save_vm_state()?;
        if let Err(e) = self
            .load_vcpus(&s.vcpus, false)
            .and_then(|_| self.load_vm_state(s))
        {
            let mut old = s.clone();
            old.irqchips = chips;
            old.pit = pit;
            old.clock = clock;
            self.load_vcpus(&backup, false)?;
            self.load_vm_state(&old)?;
            return Err(e);
        }
        for (r, d) in disks {
            r.finish(&d);
        }
        // Past this point nothing can fail half-way: memory operations on
        // our own mapping.
        let remapped = plan.is_none();
        if remapped {
            self.ram.map_private(target.chain()[0].memory.clone())?;
        } else {
            let mut runs = PageSet::new(self.ram.pages());
            from_root.iter().for_each(|p| runs.insert(*p));
            for (start, n) in runs.runs() {
                self.ram.discard(start, n)?;
            }
        }
        for (p, data) in &staged {
            self.ram.write_pages(*p, data)?;
        }
        self.devices.restore(devices)?;
        self.devices.retrigger_pending();
        self.devices.after_restore();
        // Clear what the guest dirtied before we put pages back.
        self.fd
            .get_dirty_log(0, self.shape.mem_size)
            .map_err(kvm_err("KVM_GET_DIRTY_LOG"))?;
        self.adopt(target);
        self.state = RunState::Paused;
        Ok((wanted.len(), remapped))
    }
}
