//! Saving and loading a VM: vCPU and VM state, templates, full and
//! incremental snapshots, restore into a new VM, and clones.
//!
//! **What a snapshot pauses.** The guest is paused only for what must be
//! one moment's state; the filesystem is written while it runs, so the
//! pause depends neither on the disk nor, for a full snapshot, on the size
//! of guest memory:
//!
//! 1. before the pause: a full snapshot copies all of RAM into its memory
//!    file, then, in a few rounds, the pages changed meanwhile
//!    (`precopy.rs`); an incremental one folds KVM's dirty log in to size a
//!    buffer for the dirty pages (an eighth larger). Buffers are faulted
//!    in now;
//! 2. paused: the dirty log is folded in again; vCPU, irqchip/PIT/clock and
//!    device state saved to memory; read-write disks `fdatasync`ed and
//!    reflinked/copied into the staging directory (a disk copy must be the
//!    pause's moment); the dirty pages (incremental), or the pages changed
//!    since the pre-copy's last round (full), copied into the buffer
//!    (`snapshot::PageCopy`), which grows if needed;
//! 3. resumed: the memory file is written from the buffer (CRC32 there; a
//!    full snapshot's CRC is folded from its pages' CRCs), then the state
//!    file and the manifest, all fsynced (`Staged::commit`).
//!
//! `SnapshotInfo::pause_ms` is step 2; `duration_ms` the whole call, until
//! durable. The buffer holds at most `COPY_LIMIT` (64 MiB): a larger set is
//! written while paused, so no snapshot holds more than 64 MiB of guest
//! memory twice. A full snapshot of a paused VM (a template) is copied the
//! same way and then remapped privately onto its memory file, which holds
//! exactly RAM by then; a running VM is not remapped (`precopy.rs`). A
//! write that fails after the resume publishes nothing; the VM runs on
//! with its baseline and its dirty set kept, so the next incremental
//! snapshot holds the failed one's pages too. Every VM operation takes
//! `&mut Vm`: they never overlap.
//!
//! **Templates** (`Vm::template`): a booting guest is polled with the
//! caller's readiness probe (`twig-vmm template` waits until the guest
//! accepts vsock connections on `--ready-port`, 1024, where the agent
//! listens), then paused and fully snapshotted; a VM restored from it
//! starts with the agent listening. A guest that stops or is not ready by
//! the deadline is an error and nothing is written.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_clock_data, kvm_irqchip, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};

use crate::arch;
use crate::devices::{self, Devices, SerialOut};
use crate::error::{Error, Result};
use crate::memory::{PageSet, PAGE_SIZE};
use crate::precopy::MemoryWriter;
use crate::snapshot::{self, Image, Kind, Meta, PageCopy, ParentRef, VmState};
use crate::vcpu::{self, VcpuState};

use super::precopy::Precopy;
use super::{absolute, kvm_err, ms, DeviceConfig, RunState, Shape, SlotImage, SnapshotInfo, Vm};

impl Vm {
    /// Folds KVM's dirty log into the pages changed since the baseline.
    pub(super) fn collect_dirty(&mut self) -> Result<()> {
        self.take_dirty().map(drop)
    }

    /// Reads KVM's dirty log and the VMM's dirty bitmap (both start again
    /// empty), folds them into the pages changed since the baseline, and
    /// returns the pages they held.
    pub(super) fn take_dirty(&mut self) -> Result<PageSet> {
        let words = self
            .fd
            .get_dirty_log(0, self.shape.mem_size)
            .map_err(kvm_err("KVM_GET_DIRTY_LOG"))?;
        let pages = self.ram.pages();
        let mut fresh = PageSet::from_words(words, pages);
        fresh.union_with(&PageSet::from_words(self.ram.take_vmm_dirty(), pages));
        self.dirty.union_with(&fresh);
        Ok(fresh)
    }

    pub(super) fn save_vcpus(&self) -> Result<Vec<VcpuState>> {
        let rxs = self
            .vcpus
            .iter()
            .map(|v| {
                let msrs = self.msr_indices.clone();
                let words = self.xsave_words;
                v.submit(move |fd| vcpu::save_state(fd, &msrs, words))
            })
            .collect::<Result<Vec<_>>>()?;
        rxs.into_iter()
            .enumerate()
            .map(|(index, rx)| vcpu::job_result(index, &rx)?)
            .collect()
    }

    pub(super) fn load_vcpus(&self, states: &[VcpuState], set_cpuid: bool) -> Result<()> {
        let rxs = self
            .vcpus
            .iter()
            .zip(states)
            .map(|(v, s)| {
                let s = s.clone();
                let words = self.xsave_words;
                v.submit(move |fd| vcpu::restore_state(fd, &s, set_cpuid, words))
            })
            .collect::<Result<Vec<_>>>()?;
        for (index, rx) in rxs.into_iter().enumerate() {
            vcpu::job_result(index, &rx)??;
        }
        Ok(())
    }

    pub(super) fn save_vm_state(
        &self,
    ) -> Result<(
        [kvm_irqchip; 3],
        kvm_bindings::kvm_pit_state2,
        kvm_clock_data,
    )> {
        let mut chips = [kvm_irqchip::default(); 3];
        for (chip, id) in chips.iter_mut().zip([
            KVM_IRQCHIP_PIC_MASTER,
            KVM_IRQCHIP_PIC_SLAVE,
            KVM_IRQCHIP_IOAPIC,
        ]) {
            chip.chip_id = id;
            self.fd
                .get_irqchip(chip)
                .map_err(kvm_err("KVM_GET_IRQCHIP"))?;
        }
        let pit = self.fd.get_pit2().map_err(kvm_err("KVM_GET_PIT2"))?;
        let clock = self.fd.get_clock().map_err(kvm_err("KVM_GET_CLOCK"))?;
        Ok((chips, pit, clock))
    }

    pub(super) fn load_vm_state(&self, s: &VmState) -> Result<()> {
        for chip in &s.irqchips {
            self.fd
                .set_irqchip(chip)
                .map_err(kvm_err("KVM_SET_IRQCHIP"))?;
        }
        self.fd.set_pit2(&s.pit).map_err(kvm_err("KVM_SET_PIT2"))?;
        let clock = kvm_clock_data {
            clock: s.clock.clock,
            ..Default::default()
        };
        self.fd
            .set_clock(&clock)
            .map_err(kvm_err("KVM_SET_CLOCK"))?;
        Ok(())
    }

    /// Makes a template of a booting guest: polls `ready` (the caller's
    /// readiness probe, such as a ping of the guest's agent) until it
    /// answers yes or `timeout` passes, then pauses the VM and takes a full
    /// snapshot into `staging` (as [`Vm::snapshot`]), which later VMs restore
    /// instead of booting once the store has published it. The VM stays
    /// paused. A guest that stops, or is not ready in time, is an error and
    /// nothing is written.
    pub fn template(
        &mut self,
        staging: &Path,
        timeout: Duration,
        mut ready: impl FnMut() -> bool,
    ) -> Result<SnapshotInfo> {
        self.need("template", &[RunState::Running], "running")?;
        let deadline = Instant::now() + timeout;
        let mut backoff = Duration::from_millis(1);
        while !ready() {
            if let Some(exit) = self.devices.exit().get() {
                return Err(Error::NotReady(format!(
                    "the guest stopped before it was ready: {exit:?}"
                )));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::NotReady(format!(
                    "the guest was not ready within {timeout:?}"
                )));
            }
            // Between probes: a growing pause, never past the deadline.
            std::thread::sleep(backoff.min(left));
            backoff = (backoff * 2).min(Duration::from_millis(50));
        }
        self.pause()?;
        self.snapshot(staging, Kind::Full)
    }

    /// Snapshots the VM into `staging`, an empty staging directory handed
    /// out by the node store (`twig_store::NodeStore::stage`,
    /// `<store>/tmp/<lease>/<id>`): its name is the snapshot's id, and the
    /// snapshot becomes the VM's baseline at the place the store will
    /// publish it, `<store>/snapshots/<id>`. A running VM is paused only
    /// while its state, its read-write disks and its changed pages are
    /// copied out (into a buffer, up to 64 MiB of them; more are written
    /// into the memory file while paused; a full snapshot copies RAM while
    /// the guest runs first, and then only the pages changed meanwhile),
    /// and runs again while the files are written and made durable; the
    /// call returns once they are, ready for the store to publish. If that
    /// fails, nothing is staged, and the VM's baseline and changed pages
    /// stay as they were. An incremental snapshot writes only
    /// the pages changed since the VM's baseline (its last snapshot,
    /// restore or rollback point), which becomes its parent and must be
    /// published in the same store. In-process callers can use
    /// [`Vm::snapshot_into`], which also publishes.
    pub fn snapshot(&mut self, staging: &Path, kind: Kind) -> Result<SnapshotInfo> {
        let start = Instant::now();
        let was = self.need(
            "snapshot",
            &[RunState::Running, RunState::Paused],
            "running or paused",
        )?;
        if kind == Kind::Incremental && self.baseline.is_none() && self.lazy_origin.is_some() {
            self.resolve_lazy_baseline().map_err(|e| {
                Error::Config(format!(
                    "an incremental snapshot of a lazily restored VM needs the snapshot it came from, with its chain, in the store ({e}); take a full snapshot"
                ))
            })?;
        }
        let parent = match kind {
            Kind::Full => None,
            Kind::Incremental => Some(self.baseline.clone().ok_or_else(|| {
                Error::Config(
                    "an incremental snapshot needs a parent: take a full snapshot or restore one first"
                        .into(),
                )
            })?),
        };
        let staging = absolute(staging)?;
        let (id, dir) = twig_store::layout::staging_target(&staging)
            .map_err(|e| Error::snapshot(&staging, e.to_string()))?;
        // While the guest still runs: a full snapshot copies memory into
        // its file (`precopy.rs`); an incremental one folds the dirty log
        // in and makes the buffer the pages will be copied into (faulting
        // its memory in takes longer than the copy). Pages dirtied until
        // the pause are folded in once paused; the buffer grows then if it
        // must.
        // The pages in use (the hot list) are read first: the pre-copy
        // reads every page, after which the page tables map them all.
        let (before, hot) = match kind {
            Kind::Full => {
                let hot = self.hot_pages();
                let p = self.precopy(&staging, was == RunState::Running);
                self.hot = Some(hot.clone());
                (Before::Full(p?), hot)
            }
            Kind::Incremental => {
                self.collect_dirty()?;
                let dirty = self.dirty.count();
                let n = (dirty + dirty / 8 + 16).min(COPY_LIMIT / PAGE_SIZE);
                let hot = self.hot_pages();
                let buffer = (dirty * PAGE_SIZE <= COPY_LIMIT).then(|| PageCopy::buffer(n));
                (Before::Layer(buffer), hot)
            }
        };
        let hot: Vec<(u64, u64)> = hot
            .coarse_runs(snapshot::MAX_HOT_RUNS)
            .into_iter()
            .map(|(first, n)| (first as u64, n as u64))
            .collect();
        let (precopy_rounds, pages_precopied) = match &before {
            Before::Full(p) => (p.rounds, p.pages),
            Before::Layer(_) => (0, 0),
        };
        let paused = Instant::now();
        self.pause()?;
        let taken = self.stage_snapshot(&staging, &id, kind, parent.as_ref(), before, hot);
        // A full snapshot of a paused VM becomes the memory it runs on (its
        // own pages go, the file's page cache is shared): map it while RAM
        // and file are identical. A running VM keeps its memory
        // (`precopy.rs`), and so does one whose lazy restore is not
        // complete (its RAM is registered with the page server).
        let remap = kind == Kind::Full && was == RunState::Paused && !self.lazy_pending();
        let remapped = match &taken {
            Ok(t) if remap => match &t.taken {
                Taken::Written(st) => Some(
                    st.memory()
                        .try_clone()
                        .map_err(|e| Error::io("reopening the snapshot memory", e))
                        .and_then(|f| self.ram.map_private(Arc::new(f))),
                ),
                _ => None,
            },
            _ => None,
        };
        if was == RunState::Running {
            self.resume()?;
        }
        let pause_ms = ms(paused);
        let Stage {
            taken,
            mut state,
            pages,
            pages_paused,
        } = taken?;
        let remapped = match remapped {
            Some(Err(e)) => return Err(e),
            Some(Ok(())) => {
                // A fresh mapping: the page tables say again.
                self.hot = None;
                true
            }
            None => false,
        };
        // From here on the guest runs. A failure leaves the baseline and the
        // pages dirtied since it as they are, so the next incremental
        // snapshot still holds this one's pages; the staged files go.
        let staged = match taken {
            Taken::Written(st) => st,
            Taken::Copied(staging, copy) => {
                let size = self.ram.size();
                staging.finish(&mut state, |f| copy.write(size, f))?
            }
            Taken::Precopied(staging, mut writer, copy) => {
                staging.finish(&mut state, |_| writer.finish(&copy))?
            }
        };
        let memory = match staged.commit() {
            Ok(m) => m,
            Err(e) => {
                if remapped {
                    // RAM now maps the unpublished file: no baseline to
                    // track changes against until the next full snapshot.
                    self.baseline = None;
                }
                return Err(e);
            }
        };
        let image = Arc::new(Image {
            dir,
            state,
            memory: Arc::new(memory),
            parent,
        });
        self.baseline = Some(image.clone());
        self.lazy_origin = None;
        self.dirty = PageSet::new(self.ram.pages());
        let info = SnapshotInfo {
            id: image.id().to_string(),
            kind,
            parent: image.state.meta.parent.as_ref().map(|p| p.id.clone()),
            pages_written: pages,
            pause_ms,
            duration_ms: ms(start),
            precopy_rounds,
            pages_precopied,
            pages_paused,
        };
        tracing::info!(
            id = %info.id,
            ?kind,
            pages,
            pause_ms,
            ms = info.duration_ms,
            rounds = precopy_rounds,
            "snapshot"
        );
        Ok(info)
    }

    /// Takes a snapshot into `store` as `id` and publishes it there (stage,
    /// [`Vm::snapshot`], publish); it is then at
    /// `store.snapshot_dir(id)`. If publishing fails, the VM keeps running
    /// without a baseline (the next snapshot must be full).
    pub fn snapshot_into(
        &mut self,
        store: &twig_store::NodeStore,
        id: &str,
        kind: Kind,
    ) -> Result<SnapshotInfo> {
        let staging = store.stage(id)?;
        let info = self.snapshot(staging.dir(), kind)?;
        if let Err(e) = staging.publish() {
            self.baseline = None;
            return Err(e.into());
        }
        Ok(info)
    }

    /// Copies the paused VM's state and pages out: the state into memory,
    /// the disks into the staging directory, and either the dirty pages of an
    /// incremental snapshot into a buffer (at most [`COPY_LIMIT`] bytes of
    /// them, written after the guest runs again) or else the memory file
    /// itself (a larger dirty set); for a full snapshot, the pages changed
    /// since the pre-copy's last round, into its buffer or, without one or
    /// when they do not fit, into the file. `hot` is the metadata's hot
    /// list, made before the pause.
    fn stage_snapshot(
        &mut self,
        staging: &Path,
        id: &str,
        kind: Kind,
        parent: Option<&Arc<Image>>,
        before: Before,
        hot: Vec<(u64, u64)>,
    ) -> Result<Stage> {
        let fresh = self.take_dirty()?;
        let vcpus = self.save_vcpus()?;
        let (irqchips, pit, clock) = self.save_vm_state()?;
        let uid = snapshot::new_id();
        let layer = layer_of(kind, &self.dirty);
        let pages = layer.as_ref().map_or(self.ram.pages(), PageSet::count);
        let mut state = VmState {
            meta: Meta {
                id: id.to_string(),
                uid: uid.clone(),
                kind,
                parent: parent.map(|p| ParentRef {
                    id: p.id().to_string(),
                    uid: p.state.meta.uid.clone(),
                }),
                root_id: parent.map_or(uid, |p| p.state.meta.root_id.clone()),
                mem_size: self.shape.mem_size as u64,
                vcpus: self.shape.vcpus,
                pages,
                memory_crc: 0,
                created_unix_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
                disks: self.disk_metas(),
                hot,
            },
            irqchips,
            pit,
            clock,
            devices: self.devices.save(),
            layer,
            vcpus,
        };
        // The vCPUs are parked, so every request the guest made of a disk is
        // complete: make it durable, then copy the images.
        let sources = self.disk_sources()?;
        let sources: Vec<(usize, &std::fs::File)> = sources.iter().map(|(i, f)| (*i, f)).collect();
        let ram = &self.ram;
        let (taken, pages_paused) = match before {
            Before::Full(p) => {
                let mut changed = p.pending;
                changed.union_with(&fresh);
                let n = changed.count();
                let begun = snapshot::begin(staging, &state, &sources, Some(p.file))?;
                let mut writer = p.writer;
                match p.buffer {
                    Some(buffer) if n * PAGE_SIZE <= COPY_LIMIT => (
                        Taken::Precopied(begun, writer, PageCopy::take(ram, &changed, buffer)?),
                        n,
                    ),
                    _ => {
                        writer.copy_set(ram, &changed)?;
                        let crc = writer.crc();
                        (Taken::Written(begun.finish(&mut state, |_| Ok(crc))?), n)
                    }
                }
            }
            Before::Layer(buffer) => {
                let begun = snapshot::begin(staging, &state, &sources, None)?;
                match state.layer.clone() {
                    Some(l) if l.count() * PAGE_SIZE <= COPY_LIMIT => (
                        Taken::Copied(begun, PageCopy::take(ram, &l, buffer.unwrap_or_default())?),
                        pages,
                    ),
                    Some(l) => (
                        Taken::Written(
                            begun
                                .finish(&mut state, |f| snapshot::write_layer_memory(ram, &l, f))?,
                        ),
                        pages,
                    ),
                    None => (
                        Taken::Written(
                            begun.finish(&mut state, |f| snapshot::write_full_memory(ram, f))?,
                        ),
                        pages,
                    ),
                }
            }
        };
        Ok(Stage {
            taken,
            state,
            pages,
            pages_paused,
        })
    }

    /// Restores the snapshot in `dir` (`<store>/snapshots/<id>`; its parents
    /// are its siblings) into this newly created VM and runs it.
    pub fn restore(&mut self, dir: &Path) -> Result<()> {
        let image = Image::open(&absolute(dir)?)?;
        self.restore_image(&image)?;
        self.resume()
    }

    /// Restores an opened snapshot into this newly created VM, leaving it
    /// paused: guest RAM maps the root snapshot's memory privately (lazy,
    /// copy-on-write, shared through the page cache), each incremental
    /// layer's pages are read on top, then vCPU, irqchip, PIT, clock and
    /// device state are loaded.
    pub fn restore_image(&mut self, image: &Arc<Image>) -> Result<()> {
        self.restore_image_with(image, &BTreeMap::new())
    }

    /// [`Vm::restore_image`] with images the caller opened for the
    /// snapshot's attached disk slots (slot → image, see [`SlotImage`]):
    /// each is attached to its slot as it is, in place of the file
    /// `slot_files` names. An image for a slot this VM lacks or that is
    /// empty in the snapshot, or of another size than the snapshot's disk,
    /// refuses the restore before anything changes.
    pub fn restore_image_with(
        &mut self,
        image: &Arc<Image>,
        sent: &BTreeMap<usize, SlotImage>,
    ) -> Result<()> {
        self.need("restore", &[RunState::Created], "newly created")?;
        self.check_compatible(image, sent)?;
        let mut disks = self.prepare_disks(image, sent)?;
        for (r, _) in &mut disks {
            r.swap_in()?;
        }
        for (r, d) in disks {
            r.finish(&d);
        }
        let chain = image.chain();
        self.ram.map_private(chain[0].memory.clone())?;
        self.hot = None;
        for layer in &chain[1..] {
            if let Some(pages) = &layer.state.layer {
                for (start, n) in pages.runs() {
                    self.ram.read_pages_from(&layer.memory, start, n)?;
                }
            }
        }
        let s = &image.state;
        self.load_vcpus(&s.vcpus, true)?;
        self.load_vm_state(s)?;
        self.devices.restore(self.devices.parse(&s.devices)?)?;
        self.devices.retrigger_pending();
        self.devices.after_restore();
        self.adopt(image);
        self.state = RunState::Paused;
        Ok(())
    }

    /// The pages the guest is using, for a snapshot's hot list
    /// ([`snapshot::Meta::hot`]): what the process's page tables map of
    /// RAM or, once they no longer say ([`Vm::hot`]), the set known then
    /// and every page dirtied since. A hint: empty, with a warning, when
    /// `/proc/self/pagemap` cannot be read.
    fn hot_pages(&self) -> PageSet {
        match &self.hot {
            Some(known) => {
                let mut s = known.clone();
                s.union_with(&self.dirty);
                s
            }
            None => self.ram.touched().unwrap_or_else(|e| {
                tracing::warn!("the snapshot gets no hot list: {e}");
                PageSet::new(self.ram.pages())
            }),
        }
    }

    pub(super) fn adopt(&mut self, image: &Arc<Image>) {
        let s = &image.state;
        self.cpuid = s.vcpus.iter().map(|v| v.cpuid.clone()).collect();
        self.msr_indices = Arc::new(s.vcpus[0].msrs.iter().map(|m| m.index).collect());
        self.baseline = Some(image.clone());
        self.lazy_origin = None;
        self.dirty = PageSet::new(self.ram.pages());
        self.ram.take_vmm_dirty();
        self.devices.exit().clear();
    }

    /// Refuses snapshots this VM cannot take: other shape, CPU features this
    /// host lacks, a larger XSAVE area than KVM here handles, disks that do
    /// not fit (`sent`: the images sent for a restore's slots).
    pub(super) fn check_compatible(
        &self,
        image: &Image,
        sent: &BTreeMap<usize, SlotImage>,
    ) -> Result<()> {
        let m = &image.state.meta;
        if m.mem_size != self.shape.mem_size as u64 {
            return Err(Error::snapshot(
                &image.dir,
                format!(
                    "memory size mismatch: the snapshot has {} MiB of guest RAM, this VM {} MiB",
                    m.mem_size >> 20,
                    self.shape.mem_size >> 20
                ),
            ));
        }
        if m.vcpus != self.shape.vcpus {
            return Err(Error::snapshot(
                &image.dir,
                format!(
                    "vCPU count mismatch: the snapshot has {}, this VM {}",
                    m.vcpus, self.shape.vcpus
                ),
            ));
        }
        let theirs = Devices::saved_virtio_types(&image.state.devices)
            .map_err(|e| Error::snapshot(&image.dir, e.to_string()))?;
        let ours = self.devices.virtio_types();
        if theirs != ours {
            return Err(Error::snapshot(
                &image.dir,
                format!(
                    "virtio devices differ: {}",
                    devices::describe_difference(&theirs, &ours)
                ),
            ));
        }
        self.check_disks(image, sent)?;
        let host = self.host_cpuid;
        let mut missing = Vec::new();
        for v in &image.state.vcpus {
            for f in arch::missing_features(&v.cpuid, host) {
                if !missing.contains(&f) {
                    missing.push(f);
                }
            }
            if v.xsave.len() > self.xsave_words {
                missing.push(format!(
                    "an XSAVE area of {} bytes (this host: {})",
                    v.xsave.len() * 4,
                    self.xsave_words * 4
                ));
            }
        }
        if !missing.is_empty() {
            return Err(Error::CpuIncompatible {
                path: image.dir.clone(),
                missing: missing.join(", "),
            });
        }
        Ok(())
    }

    /// Restores `n` VMs from the snapshot in `dir`, concurrently, and runs
    /// them. `serial(i)` gives clone i its serial output, `devices(i)` its
    /// devices (each clone needs its own read-write disk files, which get
    /// the snapshot's disk contents).
    pub fn clone_from(
        dir: &Path,
        n: usize,
        serial: impl Fn(usize) -> SerialOut + Sync,
        devices: impl Fn(usize) -> DeviceConfig + Sync,
    ) -> Result<Vec<Vm>> {
        let image = Image::open(&absolute(dir)?)?;
        let shape = Shape {
            mem_size: image.state.meta.mem_size as usize,
            vcpus: image.state.meta.vcpus,
        };
        let results: Vec<Result<Vm>> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..n)
                .map(|i| {
                    let (image, serial, devices) = (&image, &serial, &devices);
                    scope.spawn(move || -> Result<Vm> {
                        let mut vm = Vm::create_with(shape, serial(i), &devices(i))?;
                        vm.restore_image(image)?;
                        vm.resume()?;
                        Ok(vm)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::Config("a clone thread panicked".into())))
                })
                .collect()
        });
        results.into_iter().collect()
    }
}

/// The most bytes of dirty pages an incremental snapshot copies into a
/// buffer while the guest is paused, to write them after it runs again
/// (64 MiB: 16,384 pages). A larger dirty set is written into the memory
/// file while the guest is paused, so a snapshot never holds more than this
/// much guest memory twice.
pub(crate) const COPY_LIMIT: usize = 64 << 20;

/// What a snapshot prepared before the pause.
enum Before {
    /// A full snapshot's pre-copied memory file.
    Full(Precopy),
    /// An incremental snapshot's buffer, when its dirty pages fit.
    Layer(Option<Vec<u8>>),
}

/// A snapshot's memory as taken while the guest was paused.
enum Taken {
    /// Memory and state files written (dirty sets over [`COPY_LIMIT`], a
    /// full snapshot's changed pages without a buffer or over it).
    Written(snapshot::Staged),
    /// Disks copied, dirty pages in a buffer: memory and state files still
    /// to write.
    Copied(snapshot::Staging, PageCopy),
    /// Disks copied, a full snapshot's memory file pre-copied and the
    /// pages changed since in a buffer, to write over it.
    Precopied(snapshot::Staging, MemoryWriter, PageCopy),
}

/// A snapshot staged while paused.
struct Stage {
    taken: Taken,
    state: VmState,
    /// Pages the snapshot holds.
    pages: usize,
    /// Pages copied while paused.
    pages_paused: usize,
}

fn layer_of(kind: Kind, dirty: &PageSet) -> Option<PageSet> {
    match kind {
        Kind::Full => None,
        Kind::Incremental => Some(dirty.clone()),
    }
}
