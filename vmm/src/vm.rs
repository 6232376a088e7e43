//! A microVM: creation, boot, pause/resume, snapshot, restore, clone and
//! in-place rollback.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_clock_data, kvm_cpuid_entry2, kvm_irqchip, kvm_pit_config, kvm_userspace_memory_region,
    KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VmFd};
use serde::Serialize;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch;
use crate::devices::{self, DeviceThread, Devices, ExitState, GuestExit, SerialOut, COM1_IRQ};
use crate::error::{Error, Result};
use crate::memory::{Backing, GuestRam, PageSet, PAGE_SIZE};
use crate::snapshot::{self, DiskMeta, Image, Kind, Meta, ParentRef, VmState};
use crate::vcpu::{self, VcpuHandle, VcpuState};
use crate::virtio::blk::{Blk, DiskFile, Replacement};
use crate::virtio::net::Net;
use crate::virtio::vsock::Vsock;
use crate::virtio::{self, rng::Rng, MmioTransport, VirtioDevice};

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

    fn validate(&self) -> Result<()> {
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

/// The devices a VM has besides the entropy device every VM gets. Their
/// MMIO order is fixed (rng, the disks in order, net, vsock), so that
/// snapshots line up with VMs built from the same configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeviceConfig {
    /// virtio-blk disks.
    pub disks: Vec<DiskConfig>,
    /// A virtio-net device on a tap.
    pub net: Option<NetConfig>,
    /// A virtio-vsock device.
    pub vsock: Option<VsockConfig>,
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
    /// The tap's name.
    pub tap: String,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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
    fn name(self) -> &'static str {
        match self {
            RunState::Created => "created",
            RunState::Running => "running",
            RunState::Paused => "paused",
            RunState::Stopped => "stopped",
        }
    }
}

/// What a snapshot call did.
#[derive(Debug, Clone, Serialize)]
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
}

/// What a rollback call did.
#[derive(Debug, Clone, Serialize)]
pub struct RollbackInfo {
    /// The snapshot rolled back to.
    pub id: String,
    /// Guest pages put back.
    pub pages_restored: usize,
    /// Whether all of RAM was remapped (the snapshot is from another lineage).
    pub remapped: bool,
    /// Wall time of the whole call.
    pub duration_ms: f64,
}

/// A VM's counters.
#[derive(Debug, Clone, Serialize)]
pub struct Stats {
    pub state: RunState,
    pub vcpus: usize,
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
}

/// A KVM microVM.
pub struct Vm {
    // Field order is drop order: the device and vCPU threads stop before RAM
    // is unmapped.
    device_thread: Option<DeviceThread>,
    vcpus: Vec<VcpuHandle>,
    devices: Arc<Devices>,
    disks: Vec<Arc<DiskFile>>,
    fd: Arc<VmFd>,
    ram: GuestRam,
    shape: Shape,
    state: RunState,
    xsave_words: usize,
    msr_indices: Arc<Vec<u32>>,
    cpuid: Vec<Vec<kvm_cpuid_entry2>>,
    baseline: Option<Arc<Image>>,
    dirty: PageSet,
    host_cpuid: &'static [kvm_cpuid_entry2],
    kvm: Kvm,
}

fn kvm_err(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |e| Error::kvm(op, e)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

/// Opens /dev/kvm and checks what twig-vmm needs.
pub fn open_kvm() -> Result<Kvm> {
    let kvm = Kvm::new().map_err(Error::KvmOpen)?;
    let version = kvm.get_api_version();
    if version != 12 {
        return Err(Error::KvmApi(version));
    }
    for (cap, name) in [
        (Cap::Irqchip, "in-kernel irqchip"),
        (Cap::UserMemory, "user memory"),
        (Cap::Pit2, "PIT2"),
        (Cap::SetTssAddr, "TSS address"),
        (Cap::ImmediateExit, "immediate exit"),
        (Cap::Xsave, "XSAVE"),
        (Cap::Xcrs, "XCRs"),
        (Cap::AdjustClock, "clock adjustment"),
        (Cap::VcpuEvents, "vCPU events"),
        (Cap::Debugregs, "debug registers"),
        (Cap::MpState, "MP state"),
    ] {
        if !kvm.check_extension(cap) {
            return Err(Error::KvmCapability(name));
        }
    }
    Ok(kvm)
}

impl Vm {
    /// Creates a VM of `shape` with its memory slot, irqchip, PIT, devices and
    /// parked vCPU threads, ready to boot or restore. Doing this ahead of time
    /// keeps slot registration and thread creation off the restore path.
    /// Its only virtio device is the entropy device.
    pub fn create(shape: Shape, serial: SerialOut) -> Result<Vm> {
        Vm::create_with(shape, serial, &DeviceConfig::default())
    }

    /// Creates a VM like [`Vm::create`] with the devices of `config` besides
    /// the entropy device: disk images are opened, the tap attached, the
    /// vsock socket bound now, and a device thread is started (paused until
    /// the VM runs) if a device is fed from the host side.
    pub fn create_with(shape: Shape, serial: SerialOut, config: &DeviceConfig) -> Result<Vm> {
        shape.validate()?;
        let count = 1
            + config.disks.len()
            + usize::from(config.net.is_some())
            + usize::from(config.vsock.is_some());
        if count > virtio::MAX_DEVICES {
            return Err(Error::Config(format!(
                "{count} virtio devices; a VM has at most {} (interrupt lines {} to {})",
                virtio::MAX_DEVICES,
                virtio::IRQ_BASE,
                virtio::IRQ_LAST
            )));
        }
        let mut disks = Vec::with_capacity(config.disks.len());
        let mut boxed: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng)];
        for d in &config.disks {
            let disk = Arc::new(DiskFile::open(&d.path, d.read_only)?);
            boxed.push(Box::new(Blk::new(disk.clone())));
            disks.push(disk);
        }
        if let Some(n) = &config.net {
            boxed.push(Box::new(Net::new(&n.tap, n.mac)?));
        }
        if let Some(v) = &config.vsock {
            boxed.push(Box::new(Vsock::new(v.cid, &v.uds_path)?));
        }
        let kvm = open_kvm()?;
        let fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        fd.set_tss_address(arch::layout::KVM_TSS)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
        fd.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        fd.create_pit2(kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        })
        .map_err(kvm_err("KVM_CREATE_PIT2"))?;
        let ram = GuestRam::reserve(shape.mem_size)?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: KVM_MEM_LOG_DIRTY_PAGES,
            guest_phys_addr: 0,
            memory_size: shape.mem_size as u64,
            userspace_addr: ram.host_addr(),
        };
        // SAFETY: the region is ram's mapping, which outlives the VM fd (both
        // are owned by the Vm, and the fd is dropped first).
        unsafe { fd.set_user_memory_region(region) }
            .map_err(kvm_err("KVM_SET_USER_MEMORY_REGION"))?;
        let irq = EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("creating an eventfd", e))?;
        fd.register_irqfd(&irq, COM1_IRQ)
            .map_err(kvm_err("KVM_IRQFD"))?;
        let mut transports = Vec::with_capacity(boxed.len());
        for (i, dev) in boxed.into_iter().enumerate() {
            let dev_irq =
                EventFd::new(EFD_NONBLOCK).map_err(|e| Error::io("creating an eventfd", e))?;
            fd.register_irqfd(&dev_irq, virtio::IRQ_BASE + i as u32)
                .map_err(kvm_err("KVM_IRQFD"))?;
            transports.push(MmioTransport::new(dev, dev_irq, ram.memory().clone())?);
        }
        let devices = Arc::new(Devices::new(
            serial,
            irq,
            transports,
            Arc::new(ExitState::default()),
        ));
        let device_thread = DeviceThread::spawn(&devices)?;
        let xsave_bytes = fd.check_extension_int(Cap::Xsave2);
        let xsave_words = (xsave_bytes.max(4096) as usize).div_ceil(4);
        let mut vcpus = Vec::with_capacity(shape.vcpus);
        for i in 0..shape.vcpus {
            let vfd = fd
                .create_vcpu(i as u64)
                .map_err(kvm_err("KVM_CREATE_VCPU"))?;
            vcpus.push(VcpuHandle::spawn(i, vfd, devices.clone())?);
        }
        let supported = arch::supported_cpuid(&kvm)?;
        let host_cpuid = arch::effective_cpuid(supported, &vcpus[0])?;
        Ok(Vm {
            host_cpuid,
            fd: Arc::new(fd),
            ram,
            device_thread,
            vcpus,
            devices,
            disks,
            shape,
            state: RunState::Created,
            xsave_words,
            msr_indices: Arc::new(Vec::new()),
            cpuid: Vec::new(),
            baseline: None,
            dirty: PageSet::new(shape.mem_size / PAGE_SIZE),
            kvm,
        })
    }

    /// The VM's shape.
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Where the VM is in its life.
    pub fn state(&self) -> RunState {
        if self.state != RunState::Created && self.devices.exit().get().is_some() {
            return RunState::Stopped;
        }
        self.state
    }

    fn need(&self, op: &'static str, ok: &[RunState], needs: &'static str) -> Result<RunState> {
        let s = self.state();
        if ok.contains(&s) {
            Ok(s)
        } else {
            Err(Error::State {
                op,
                state: s.name(),
                needs,
            })
        }
    }

    /// Boots `kernel` (ELF vmlinux or bzImage) with `cmdline` and runs it.
    pub fn boot(&mut self, kernel: &Path, cmdline: &str) -> Result<()> {
        self.boot_linux(kernel, None, cmdline)
    }

    /// Boots `kernel` with an optional initramfs and runs it.
    pub fn boot_linux(
        &mut self,
        kernel: &Path,
        initrd: Option<&Path>,
        cmdline: &str,
    ) -> Result<()> {
        self.need("boot", &[RunState::Created], "newly created")?;
        self.ram.back_with_memfd()?;
        let cmdline = format!("{cmdline}{}", self.devices.virtio_cmdline());
        let entry = arch::load_kernel(
            self.ram.memory(),
            self.shape.mem_size as u64,
            kernel,
            initrd,
            &cmdline,
        )?;
        let supported = arch::supported_cpuid(&self.kvm)?;
        let sregs_mem = self.ram.memory().clone();
        let mut cpuids = Vec::with_capacity(self.vcpus.len());
        for (i, v) in self.vcpus.iter().enumerate() {
            let cpuid = arch::guest_cpuid(supported, i, self.vcpus.len())?;
            let mem = sregs_mem.clone();
            let effective = v.exec(move |fd| -> Result<Vec<kvm_cpuid_entry2>> {
                fd.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
                let lapic = fd.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
                fd.set_lapic(&arch::boot_lapic(lapic))
                    .map_err(kvm_err("KVM_SET_LAPIC"))?;
                if i == 0 {
                    arch::set_msrs(fd, &arch::boot_msrs())?;
                    fd.set_regs(&arch::boot_regs(entry))
                        .map_err(kvm_err("KVM_SET_REGS"))?;
                    fd.set_fpu(&arch::boot_fpu())
                        .map_err(kvm_err("KVM_SET_FPU"))?;
                    let sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
                    fd.set_sregs(&arch::boot_sregs(&mem, sregs)?)
                        .map_err(kvm_err("KVM_SET_SREGS"))?;
                }
                Ok(fd
                    .get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
                    .map_err(kvm_err("KVM_GET_CPUID2"))?
                    .as_slice()
                    .to_vec())
            })??;
            cpuids.push(effective);
        }
        self.cpuid = cpuids;
        let list = self
            .kvm
            .get_msr_index_list()
            .map_err(kvm_err("KVM_GET_MSR_INDEX_LIST"))?
            .as_slice()
            .to_vec();
        self.msr_indices = Arc::new(self.vcpus[0].exec(move |fd| probe_msrs(fd, list))??);
        self.state = RunState::Paused;
        self.resume()
    }

    /// Lets the vCPUs run.
    pub fn resume(&mut self) -> Result<()> {
        self.need("resume", &[RunState::Paused, RunState::Running], "paused")?;
        for v in &self.vcpus {
            v.run();
        }
        if let Some(t) = &self.device_thread {
            t.resume();
        }
        self.state = RunState::Running;
        Ok(())
    }

    /// Parks every vCPU. Pending port or MMIO accesses complete first.
    pub fn pause(&mut self) -> Result<()> {
        let s = self.need(
            "pause",
            &[RunState::Running, RunState::Paused, RunState::Stopped],
            "running",
        )?;
        if s == RunState::Paused {
            return Ok(());
        }
        if let Some(t) = &self.device_thread {
            t.pause()?;
        }
        for v in &self.vcpus {
            v.request_park();
        }
        for v in &self.vcpus {
            v.wait_parked()?;
        }
        self.devices.flush();
        if self.state == RunState::Running {
            self.state = RunState::Paused;
        }
        Ok(())
    }

    /// Wakes a guest parked on the idle port.
    pub fn kick(&self) {
        for v in &self.vcpus {
            v.kick();
        }
    }

    /// Waits up to `timeout` for the guest to stop; returns why it did.
    pub fn wait_exit(&self, timeout: Duration) -> Option<GuestExit> {
        self.devices.exit().wait(timeout)
    }

    /// Reads guest memory.
    pub fn read_guest(&self, gpa: u64, buf: &mut [u8]) -> Result<()> {
        self.ram
            .memory()
            .read_slice(buf, GuestAddress(gpa))
            .map_err(|_| Error::GuestAddress {
                addr: gpa,
                len: buf.len(),
            })
    }

    /// Reads a little-endian u64 from guest memory.
    pub fn read_u64(&self, gpa: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read_guest(gpa, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Writes guest memory from the host. The pages count as dirty for the
    /// next incremental snapshot and for rollback.
    pub fn write_guest(&self, gpa: u64, data: &[u8]) -> Result<()> {
        self.ram
            .memory()
            .write_slice(data, GuestAddress(gpa))
            .map_err(|_| Error::GuestAddress {
                addr: gpa,
                len: data.len(),
            })?;
        Ok(())
    }

    /// Writes a little-endian u64 into guest memory.
    pub fn write_u64(&self, gpa: u64, v: u64) -> Result<()> {
        self.write_guest(gpa, &v.to_le_bytes())
    }

    /// Folds KVM's dirty log into the pages changed since the baseline.
    fn collect_dirty(&mut self) -> Result<()> {
        let words = self
            .fd
            .get_dirty_log(0, self.shape.mem_size)
            .map_err(kvm_err("KVM_GET_DIRTY_LOG"))?;
        let pages = self.ram.pages();
        self.dirty.union_with(&PageSet::from_words(words, pages));
        self.dirty
            .union_with(&PageSet::from_words(self.ram.take_vmm_dirty(), pages));
        Ok(())
    }

    fn save_vcpus(&self) -> Result<Vec<VcpuState>> {
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

    fn load_vcpus(&self, states: &[VcpuState], set_cpuid: bool) -> Result<()> {
        let rxs = self
            .vcpus
            .iter()
            .zip(states)
            .map(|(v, s)| {
                let s = s.clone();
                v.submit(move |fd| vcpu::restore_state(fd, &s, set_cpuid))
            })
            .collect::<Result<Vec<_>>>()?;
        for (index, rx) in rxs.into_iter().enumerate() {
            vcpu::job_result(index, &rx)??;
        }
        Ok(())
    }

    fn save_vm_state(
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

    fn load_vm_state(&self, s: &VmState) -> Result<()> {
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
    /// snapshot into `dir`, which later VMs restore instead of booting. The VM
    /// stays paused. A guest that stops, or is not ready in time, is an error
    /// and nothing is written.
    pub fn template(
        &mut self,
        dir: &Path,
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
        self.snapshot(dir, Kind::Full)
    }

    /// Snapshots the VM into the new directory `dir`. A running VM is paused
    /// only while its state and changed pages are copied out, and runs again
    /// while the snapshot is made durable; the call returns once it is
    /// published. An incremental snapshot writes only the pages changed since
    /// the VM's baseline (its last snapshot, restore or rollback point),
    /// which becomes its parent.
    pub fn snapshot(&mut self, dir: &Path, kind: Kind) -> Result<SnapshotInfo> {
        let start = Instant::now();
        let was = self.need(
            "snapshot",
            &[RunState::Running, RunState::Paused],
            "running or paused",
        )?;
        let parent = match kind {
            Kind::Full => None,
            Kind::Incremental => Some(self.baseline.clone().ok_or_else(|| {
                Error::Config(
                    "an incremental snapshot needs a parent: take a full snapshot or restore one first"
                        .into(),
                )
            })?),
        };
        let dir = absolute(dir)?;
        self.pause()?;
        let staged = self.stage_snapshot(&dir, kind, parent.as_ref());
        // A full snapshot becomes the memory the VM runs on: map it before
        // the guest runs again, while RAM and file are identical.
        let remapped = match &staged {
            Ok((st, _, _)) if kind == Kind::Full => Some(
                st.memory()
                    .try_clone()
                    .map_err(|e| Error::io("reopening the snapshot memory", e))
                    .and_then(|f| self.ram.map_private(Arc::new(f))),
            ),
            _ => None,
        };
        if was == RunState::Running {
            self.resume()?;
        }
        let pause_ms = ms(start);
        let (staged, state, pages) = staged?;
        if let Some(Err(e)) = remapped {
            return Err(e);
        }
        let memory = match staged.commit() {
            Ok(m) => m,
            Err(e) => {
                if kind == Kind::Full {
                    // RAM now maps the unpublished file: no baseline to
                    // track changes against until the next full snapshot.
                    self.baseline = None;
                }
                return Err(e);
            }
        };
        let image = Arc::new(Image {
            dir: dir.to_path_buf(),
            state,
            memory: Arc::new(memory),
            parent,
        });
        self.baseline = Some(image.clone());
        self.dirty = PageSet::new(self.ram.pages());
        let info = SnapshotInfo {
            id: image.id().to_string(),
            kind,
            parent: image.state.meta.parent.as_ref().map(|p| p.id.clone()),
            pages_written: pages,
            pause_ms,
            duration_ms: ms(start),
        };
        tracing::info!(id = %info.id, ?kind, pages, ms = info.duration_ms, "snapshot");
        Ok(info)
    }

    /// Copies the paused VM's state and pages into a staged snapshot.
    fn stage_snapshot(
        &mut self,
        dir: &Path,
        kind: Kind,
        parent: Option<&Arc<Image>>,
    ) -> Result<(snapshot::Staged, VmState, usize)> {
        self.collect_dirty()?;
        let vcpus = self.save_vcpus()?;
        let (irqchips, pit, clock) = self.save_vm_state()?;
        let id = snapshot::new_id();
        let layer = layer_of(kind, &self.dirty);
        let pages = layer.as_ref().map_or(self.ram.pages(), PageSet::count);
        let mut state = VmState {
            meta: Meta {
                id: id.clone(),
                kind,
                parent: parent.map(|p| ParentRef {
                    id: p.id().to_string(),
                    dir: p.dir.clone(),
                }),
                root_id: parent.map_or(id.clone(), |p| p.state.meta.root_id.clone()),
                mem_size: self.shape.mem_size as u64,
                vcpus: self.shape.vcpus,
                pages,
                memory_crc: 0,
                created_unix_ms: std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_millis() as u64)
                    .unwrap_or(0),
                disks: self
                    .disks
                    .iter()
                    .map(|d| DiskMeta {
                        read_only: d.read_only(),
                        size: d.size(),
                    })
                    .collect(),
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
        let mut sources = Vec::new();
        for (i, d) in self.disks.iter().enumerate() {
            if !d.read_only() {
                d.sync()?;
                sources.push((i, d.try_clone_file()?));
            }
        }
        let sources: Vec<(usize, &std::fs::File)> = sources.iter().map(|(i, f)| (*i, f)).collect();
        let ram = &self.ram;
        let write_layer = state.layer.clone();
        let staged = snapshot::stage(
            dir,
            &mut state,
            |f| match &write_layer {
                None => snapshot::write_full_memory(ram, f),
                Some(l) => snapshot::write_layer_memory(ram, l, f),
            },
            &sources,
        )?;
        Ok((staged, state, pages))
    }

    /// Restores the snapshot in `dir` into this newly created VM and runs it.
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
        self.need("restore", &[RunState::Created], "newly created")?;
        self.check_compatible(image)?;
        let mut disks = self.prepare_disks(image)?;
        for (r, _) in &mut disks {
            r.swap_in()?;
        }
        for (r, d) in disks {
            r.finish(&d);
        }
        let chain = image.chain();
        self.ram.map_private(chain[0].memory.clone())?;
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

    /// Copies the snapshot's image of every read-write disk next to the
    /// VM's own disk file, ready to replace it; changes nothing visible.
    fn prepare_disks(&self, image: &Image) -> Result<Vec<(Replacement, Arc<DiskFile>)>> {
        let mut out = Vec::new();
        for (i, (d, m)) in self.disks.iter().zip(&image.state.meta.disks).enumerate() {
            if !d.read_only() {
                out.push((
                    d.prepare_replacement(&image.disk_path(i), m.size)?,
                    d.clone(),
                ));
            }
        }
        Ok(out)
    }

    fn adopt(&mut self, image: &Arc<Image>) {
        let s = &image.state;
        self.cpuid = s.vcpus.iter().map(|v| v.cpuid.clone()).collect();
        self.msr_indices = Arc::new(s.vcpus[0].msrs.iter().map(|m| m.index).collect());
        self.baseline = Some(image.clone());
        self.dirty = PageSet::new(self.ram.pages());
        self.ram.take_vmm_dirty();
        self.devices.exit().clear();
    }

    /// Refuses snapshots this VM cannot take: other shape, CPU features this
    /// host lacks, a larger XSAVE area than KVM here handles.
    fn check_compatible(&self, image: &Image) -> Result<()> {
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
        self.check_disks(image)?;
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

    /// Refuses a snapshot whose disks do not match this VM's: count,
    /// read-only or not, and the size of read-only ones (which are not
    /// copied, so the same image must be attached).
    fn check_disks(&self, image: &Image) -> Result<()> {
        let theirs = &image.state.meta.disks;
        let err = |m: String| Err(Error::snapshot(&image.dir, m));
        if theirs.len() != self.disks.len() {
            return err(format!(
                "disk count differs: the snapshot has {}, this VM {}",
                theirs.len(),
                self.disks.len()
            ));
        }
        for (i, (t, d)) in theirs.iter().zip(&self.disks).enumerate() {
            let kind = |ro: bool| if ro { "read-only" } else { "read-write" };
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
                    d.path().display(),
                    d.size(),
                    t.size
                ));
            }
        }
        Ok(())
    }

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

    /// Every virtio device's transport, queue and device state, one line
    /// each, for diagnostics (a guest that stopped answering, say).
    pub fn describe_devices(&self) -> Vec<String> {
        let mut out = vec![format!(
            "state {}, guest exit {:?}",
            self.state().name(),
            self.devices.exit().get()
        )];
        out.extend(self.devices.describe());
        if let Ok((chips, _, _)) = self.save_vm_state() {
            for (name, chip) in ["pic master", "pic slave"].iter().zip(&chips) {
                // SAFETY: PIC chip ids carry the `pic` member of the union.
                let pic = unsafe { chip.chip.pic };
                out.push(format!(
                    "{name}: irr {:#04x} last irr {:#04x} isr {:#04x} imr {:#04x} elcr {:#04x}",
                    pic.irr, pic.last_irr, pic.isr, pic.imr, pic.elcr
                ));
            }
        }
        out
    }

    /// The VM's counters. Folds KVM's dirty log in, so the count is current.
    pub fn stats(&mut self) -> Result<Stats> {
        if self.state() != RunState::Created {
            self.collect_dirty()?;
        }
        let (resident, private) = self.ram.residency()?;
        Ok(Stats {
            state: self.state(),
            vcpus: self.shape.vcpus,
            mem_mib: self.shape.mem_size >> 20,
            baseline: self.baseline.as_ref().map(|b| b.id().to_string()),
            dirty_pages: self.dirty.count(),
            exits: self
                .vcpus
                .iter()
                .map(|v| {
                    v.counters()
                        .exits
                        .load(std::sync::atomic::Ordering::Relaxed)
                })
                .sum(),
            guest_resident_kib: resident / 1024,
            guest_private_kib: private / 1024,
            guest_exit: self.devices.exit().get().map(|e| format!("{e:?}")),
        })
    }

    /// Guest RAM bytes (for tests and checks; pause the VM for a stable view).
    pub fn guest_ram(&self) -> Result<&[u8]> {
        self.ram.pages_slice(0, self.ram.pages())
    }

    /// What a VM whose guest stopped answering is doing: its devices (as
    /// [`Vm::describe_devices`]), then, after pausing it, every vCPU (as
    /// [`Vm::describe_vcpu`]); one line each.
    pub fn post_mortem(&mut self) -> String {
        let mut lines = self.describe_devices();
        let paused = self.pause();
        for i in 0..self.vcpus.len() {
            lines.push(format!(
                "vCPU {i} (pause: {paused:?}): {:?}",
                self.describe_vcpu(i)
            ));
        }
        lines.join("\n")
    }

    /// A parked vCPU's registers, pending events, run state and local APIC
    /// interrupt registers, one line, for diagnostics.
    pub fn describe_vcpu(&self, i: usize) -> Result<String> {
        self.vcpu(i)?.exec(|fd| -> Result<String> {
            let r = fd.get_regs().map_err(kvm_err("KVM_GET_REGS"))?;
            let e = fd
                .get_vcpu_events()
                .map_err(kvm_err("KVM_GET_VCPU_EVENTS"))?;
            let mp = fd.get_mp_state().map_err(kvm_err("KVM_GET_MP_STATE"))?;
            let lapic = fd.get_lapic().map_err(kvm_err("KVM_GET_LAPIC"))?;
            let reg = |off: usize| {
                let b = &lapic.regs[off..off + 4];
                u32::from_le_bytes([b[0] as u8, b[1] as u8, b[2] as u8, b[3] as u8])
            };
            let bits = |base: usize| {
                (0..8)
                    .map(|k| format!("{:08x}", reg(base + k * 0x10)))
                    .rev()
                    .collect::<String>()
            };
            Ok(format!(
                "rip {:#x} rflags {:#x} mp_state {} interrupt injected {} nr {:#x} shadow {} nmi pending {} | lapic tpr {:#x} svr {:#x} lvt0 {:#x} lvt timer {:#x} isr {} irr {}",
                r.rip,
                r.rflags,
                mp.mp_state,
                e.interrupt.injected,
                e.interrupt.nr,
                e.interrupt.shadow,
                e.nmi.pending,
                reg(0x80),
                reg(0xf0),
                reg(0x350),
                reg(0x320),
                bits(0x100),
                bits(0x200),
            ))
        })?
    }

    /// vCPU `i`'s general registers (the VM must be paused).
    pub fn vcpu_regs(&self, i: usize) -> Result<kvm_bindings::kvm_regs> {
        self.vcpu(i)?
            .exec(|fd| fd.get_regs().map_err(kvm_err("KVM_GET_REGS")))?
    }

    /// The value of MSR `index` on vCPU `i` (the VM must be paused).
    pub fn vcpu_msr(&self, i: usize, index: u32) -> Result<u64> {
        self.vcpu(i)?
            .exec(move |fd| Ok(arch::get_msrs(fd, &[index])?[0].data))?
    }

    fn vcpu(&self, i: usize) -> Result<&VcpuHandle> {
        self.vcpus.get(i).ok_or(Error::Vcpu {
            index: i,
            reason: "no such vCPU".into(),
        })
    }
}

fn layer_of(kind: Kind, dirty: &PageSet) -> Option<PageSet> {
    match kind {
        Kind::Full => None,
        Kind::Incremental => Some(dirty.clone()),
    }
}

fn absolute(p: &Path) -> Result<std::path::PathBuf> {
    std::path::absolute(p).map_err(|e| Error::io(format!("resolving {}", p.display()), e))
}

/// Keeps the MSRs of KVM's index list that this vCPU can both read and write
/// back, so that snapshots save exactly what restore can load.
fn probe_msrs(fd: &mut kvm_ioctls::VcpuFd, mut list: Vec<u32>) -> Result<Vec<u32>> {
    let mut tries = 0;
    loop {
        tries += 1;
        if tries > 4096 {
            return Err(Error::Config("probing MSRs did not converge".into()));
        }
        let entries: Vec<kvm_bindings::kvm_msr_entry> = list
            .iter()
            .map(|&index| kvm_bindings::kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = kvm_bindings::Msrs::from_entries(&entries)
            .map_err(|e| Error::Config(format!("MSR list: {e:?}")))?;
        let n = fd.get_msrs(&mut msrs).map_err(kvm_err("KVM_GET_MSRS"))?;
        if n < list.len() {
            list.remove(n);
            continue;
        }
        let n = fd.set_msrs(&msrs).map_err(kvm_err("KVM_SET_MSRS"))?;
        if n < list.len() {
            list.remove(n);
            continue;
        }
        return Ok(list);
    }
}
