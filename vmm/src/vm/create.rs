//! Bringing a VM up: /dev/kvm checks, VM creation with its memory slot,
//! irqchip, PIT, devices and parked vCPU threads, and boot.

use std::path::Path;
use std::sync::Arc;

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_pit_config, kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::arch;
use crate::devices::{DeviceThread, Devices, ExitState, SerialOut, COM1_IRQ};
use crate::error::{Error, Result};
use crate::memory::{GuestRam, PageSet, PAGE_SIZE};
use crate::vcpu::VcpuHandle;
use crate::virtio::balloon::Balloon;
use crate::virtio::blk::{Blk, DiskFile, DiskWorker};
use crate::virtio::net::Net;
use crate::virtio::vsock::Vsock;
use crate::virtio::{self, rng::Rng, MmioTransport, VirtioDevice};

use super::{kvm_err, DeviceConfig, RunState, Shape, Vm};

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
            + config.disk_slots
            + usize::from(config.net.is_some())
            + usize::from(config.vsock.is_some())
            + usize::from(config.balloon);
        if count > virtio::MAX_DEVICES {
            return Err(Error::Config(format!(
                "{count} virtio devices; a VM has at most {} (interrupt lines {} to {})",
                virtio::MAX_DEVICES,
                virtio::IRQ_BASE,
                virtio::IRQ_LAST
            )));
        }
        let mut disks = Vec::with_capacity(config.disks.len());
        let mut workers = Vec::new();
        let mut boxed: Vec<Box<dyn VirtioDevice>> = vec![Box::new(Rng)];
        for d in &config.disks {
            let disk = Arc::new(DiskFile::open(&d.path, d.read_only)?);
            let (blk, control) = Blk::with_worker(disk.clone());
            workers.push((boxed.len(), control, disk.clone()));
            boxed.push(Box::new(blk));
            disks.push(disk);
        }
        if let Some(slot) = config.slot_files.keys().find(|s| **s >= config.disk_slots) {
            return Err(Error::Config(format!(
                "slot_files names slot {slot}, but the VM has {} disk slots",
                config.disk_slots
            )));
        }
        for _ in 0..config.disk_slots {
            let disk = Arc::new(DiskFile::slot());
            let (blk, control) = Blk::with_worker(disk.clone());
            workers.push((boxed.len(), control, disk.clone()));
            boxed.push(Box::new(blk));
            disks.push(disk);
        }
        let mut net = None;
        if let Some(n) = &config.net {
            let device = Net::new(n.tap.as_deref(), n.mac)?;
            net = Some(device.backend());
            boxed.push(Box::new(device));
        }
        if let Some(v) = &config.vsock {
            boxed.push(Box::new(Vsock::new(v.cid, &v.uds_path)?));
        }
        if config.balloon {
            boxed.push(Box::new(Balloon::new()));
        }
        let kvm = open_kvm()?;
        let fd = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        // The memory slot goes in before the irqchip: registered after
        // it, the same ioctl sleeps 4-8 ms on this host (off CPU: a grace
        // period by the look of it), before it 0.1 ms (BENCHMARKS.md).
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
        fd.set_tss_address(arch::layout::KVM_TSS)
            .map_err(kvm_err("KVM_SET_TSS_ADDR"))?;
        fd.create_irq_chip()
            .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
        fd.create_pit2(kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        })
        .map_err(kvm_err("KVM_CREATE_PIT2"))?;
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
        let disk_workers = workers
            .into_iter()
            .map(|(index, control, disk)| {
                DiskWorker::spawn(control, devices.clone(), index, disk, ram.memory().clone())
            })
            .collect::<Result<Vec<_>>>()?;
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
            disk_workers,
            vcpus,
            devices,
            disks,
            net,
            slot_files: config.slot_files.clone(),
            shape,
            state: RunState::Created,
            xsave_words,
            msr_indices: Arc::new(Vec::new()),
            cpuid: Vec::new(),
            baseline: None,
            lazy: None,
            lazy_origin: None,
            hot: None,
            dirty: PageSet::new(shape.mem_size / PAGE_SIZE),
            kvm,
        })
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
        // Without ACPI, Linux learns of its CPUs, its local APICs and the
        // IOAPIC from an MP table only, one vCPU or many. Without one it
        // runs in virtual wire mode: no local APIC timer, so its only
        // clock event device is the PIT (three port writes, three VM exits,
        // each time it programs the next timer) and its interrupts go
        // through the legacy PIC.
        crate::mptable::write(self.ram.memory(), self.vcpus.len())?;
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
