//! x86-64 specifics: guest memory layout, the Linux 64-bit boot protocol,
//! initial register state, CPUID filtering and compatibility, and the list of
//! MSRs that make up a vCPU's state.

use std::fs::File;
use std::path::Path;
use std::sync::OnceLock;

use kvm_bindings::{
    kvm_cpuid_entry2, kvm_fpu, kvm_lapic_state, kvm_msr_entry, kvm_regs, kvm_segment, kvm_sregs,
    CpuId, Msrs, KVM_MAX_CPUID_ENTRIES,
};
use kvm_ioctls::{Kvm, VcpuFd};
use linux_loader::cmdline::Cmdline;
use linux_loader::configurator::linux::LinuxBootConfigurator;
use linux_loader::configurator::{BootConfigurator, BootParams};
use linux_loader::loader::bootparam::boot_params;
use linux_loader::loader::{load_cmdline, BzImage, Elf, KernelLoader, KernelLoaderResult};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::GuestMem;

const PAGE_SIZE: u64 = crate::memory::PAGE_SIZE as u64;

use crate::error::{Error, Result};

/// Guest physical layout used at boot.
pub mod layout {
    /// Boot GDT.
    pub const GDT: u64 = 0x500;
    /// Boot IDT (empty).
    pub const IDT: u64 = 0x520;
    /// Linux zero page (boot_params).
    pub const ZERO_PAGE: u64 = 0x7000;
    /// Initial stack pointer.
    pub const BOOT_STACK: u64 = 0x8ff0;
    /// Boot page tables: PML4, PDPT, PD (identity map of the first GiB).
    pub const PML4: u64 = 0x9000;
    /// Page-directory-pointer table.
    pub const PDPT: u64 = 0xa000;
    /// Page directory.
    pub const PD: u64 = 0xb000;
    /// Kernel command line.
    pub const CMDLINE: u64 = 0x20000;
    /// Maximum command-line length, NUL included.
    pub const CMDLINE_MAX: usize = 4096;
    /// End of low RAM in the e820 map (start of the EBDA).
    pub const EBDA: u64 = 0x9fc00;
    /// Where the kernel is loaded.
    pub const HIMEM: u64 = 0x100000;
    /// Guest RAM must end below the 32-bit MMIO gap.
    pub const MMIO_GAP: u64 = 0xc000_0000;
    /// KVM's TSS (three pages) and identity-map page live at the top of 4 GiB.
    pub const KVM_TSS: usize = 0xfffb_d000;
}

const MSR_IA32_TSC: u32 = 0x10;
const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;
const MSR_STAR: u32 = 0xc000_0081;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_CSTAR: u32 = 0xc000_0083;
const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

const E820_RAM: u32 = 1;

/// Where and how a loaded kernel is entered.
#[derive(Debug, Clone, Copy)]
pub struct BootEntry {
    /// 64-bit entry point.
    pub entry: u64,
}

fn kernel_err(path: &Path, reason: impl Into<String>) -> Error {
    Error::Kernel {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// Loads an ELF vmlinux or a bzImage, writes the command line and the zero
/// page (e820 map, setup header) into guest memory.
pub fn load_kernel(
    mem: &GuestMem,
    mem_size: u64,
    kernel: &Path,
    initrd: Option<&Path>,
    cmdline: &str,
) -> Result<BootEntry> {
    let mut file = File::open(kernel).map_err(|e| kernel_err(kernel, e.to_string()))?;
    let himem = Some(GuestAddress(layout::HIMEM));
    let (result, entry): (KernelLoaderResult, u64) = match Elf::load(mem, None, &mut file, himem) {
        Ok(r) => {
            let entry = r.kernel_load.0;
            (r, entry)
        }
        Err(elf_err) => match BzImage::load(mem, None, &mut file, himem) {
            // The 64-bit entry of a bzImage is 0x200 past its load address.
            Ok(r) => (r, r.kernel_load.0 + 0x200),
            Err(bz_err) => {
                return Err(kernel_err(
                    kernel,
                    format!("neither an ELF vmlinux ({elf_err}) nor a bzImage ({bz_err})"),
                ))
            }
        },
    };
    if result.kernel_end > mem_size {
        return Err(kernel_err(
            kernel,
            format!(
                "the kernel ends at {:#x}, beyond guest RAM ({mem_size:#x})",
                result.kernel_end
            ),
        ));
    }

    let mut cl = Cmdline::new(layout::CMDLINE_MAX)
        .map_err(|e| Error::Config(format!("command line: {e}")))?;
    cl.insert_str(cmdline)
        .map_err(|e| Error::Config(format!("command line {cmdline:?}: {e}")))?;
    load_cmdline(mem, GuestAddress(layout::CMDLINE), &cl)
        .map_err(|e| Error::Config(format!("writing the command line: {e}")))?;

    let mut params = boot_params::default();
    if let Some(hdr) = result.setup_header {
        params.hdr = hdr;
    }
    params.hdr.type_of_loader = 0xff;
    params.hdr.boot_flag = 0xaa55;
    params.hdr.header = 0x5372_6448; // "HdrS"
    params.hdr.cmd_line_ptr = layout::CMDLINE as u32;
    params.hdr.cmdline_size = cmdline.len() as u32 + 1;
    params.hdr.kernel_alignment = 0x0100_0000;
    if let Some(initrd) = initrd {
        let (addr, size) = load_initrd(mem, mem_size, result.kernel_end, &params, initrd)?;
        params.hdr.ramdisk_image = addr as u32;
        params.hdr.ramdisk_size = size as u32;
    }
    let e820 = [(0, layout::EBDA), (layout::HIMEM, mem_size - layout::HIMEM)];
    for (i, (addr, size)) in e820.iter().enumerate() {
        params.e820_table[i].addr = *addr;
        params.e820_table[i].size = *size;
        params.e820_table[i].r#type = E820_RAM;
    }
    params.e820_entries = e820.len() as u8;
    LinuxBootConfigurator::write_bootparams::<GuestMem>(
        &BootParams::new::<boot_params>(&params, GuestAddress(layout::ZERO_PAGE)),
        mem,
    )
    .map_err(|e| Error::Config(format!("writing boot_params: {e}")))?;
    Ok(BootEntry { entry })
}

/// Places an initramfs as high in RAM as the kernel allows (below
/// `initrd_addr_max`, page-aligned, above the kernel).
fn load_initrd(
    mem: &GuestMem,
    mem_size: u64,
    kernel_end: u64,
    params: &boot_params,
    path: &Path,
) -> Result<(u64, u64)> {
    let err = |reason: String| Error::Kernel {
        path: path.to_path_buf(),
        reason: format!("initramfs: {reason}"),
    };
    let mut file = File::open(path).map_err(|e| err(e.to_string()))?;
    let size = file.metadata().map_err(|e| err(e.to_string()))?.len();
    let max = match params.hdr.initrd_addr_max {
        0 => 0x37ff_ffff,
        m => u64::from(m),
    };
    let top = mem_size.min(max + 1);
    let addr = top
        .checked_sub(size)
        .map(|a| a & !(PAGE_SIZE - 1))
        .filter(|a| *a >= kernel_end)
        .ok_or_else(|| {
            err(format!(
                "{size} bytes do not fit in guest RAM above the kernel"
            ))
        })?;
    mem.read_exact_volatile_from(GuestAddress(addr), &mut file, size as usize)
        .map_err(|e| err(e.to_string()))?;
    Ok((addr, size))
}

fn gdt_entry(flags: u16, base: u32, limit: u32) -> u64 {
    ((u64::from(base) & 0xff00_0000) << 32)
        | ((u64::from(flags) & 0xf0ff) << 40)
        | ((u64::from(limit) & 0x000f_0000) << 32)
        | ((u64::from(base) & 0x00ff_ffff) << 16)
        | (u64::from(limit) & 0x0000_ffff)
}

fn segment(entry: u64, index: u16) -> kvm_segment {
    kvm_segment {
        base: ((entry >> 16) & 0xff_ffff) | ((entry >> 32) & 0xff00_0000),
        limit: ((entry & 0xffff) | ((entry >> 32) & 0xf_0000)) as u32,
        selector: index * 8,
        type_: ((entry >> 40) & 0xf) as u8,
        present: ((entry >> 47) & 1) as u8,
        dpl: ((entry >> 45) & 3) as u8,
        db: ((entry >> 54) & 1) as u8,
        s: ((entry >> 44) & 1) as u8,
        l: ((entry >> 53) & 1) as u8,
        g: ((entry >> 55) & 1) as u8,
        avl: ((entry >> 52) & 1) as u8,
        padding: 0,
        unusable: if (entry >> 47) & 1 == 0 { 1 } else { 0 },
    }
}

fn write_mem<T: vm_memory::ByteValued>(mem: &GuestMem, addr: u64, v: T) -> Result<()> {
    mem.write_obj(v, GuestAddress(addr))
        .map_err(|e| Error::Config(format!("writing boot structures at {addr:#x}: {e}")))
}

/// Writes the boot GDT and identity page tables and returns the special
/// registers for 64-bit entry (`__BOOT_CS` = 0x10, `__BOOT_DS` = 0x18).
pub fn boot_sregs(mem: &GuestMem, mut sregs: kvm_sregs) -> Result<kvm_sregs> {
    let gdt = [
        gdt_entry(0, 0, 0),
        gdt_entry(0, 0, 0),
        gdt_entry(0xa09b, 0, 0xfffff), // 0x10 code
        gdt_entry(0xc093, 0, 0xfffff), // 0x18 data
        gdt_entry(0x808b, 0, 0xfffff), // 0x20 TSS
    ];
    for (i, e) in gdt.iter().enumerate() {
        write_mem(mem, layout::GDT + 8 * i as u64, *e)?;
    }
    write_mem(mem, layout::IDT, 0u64)?;
    let code = segment(gdt[2], 2);
    let data = segment(gdt[3], 3);
    let tss = segment(gdt[4], 4);
    sregs.gdt.base = layout::GDT;
    sregs.gdt.limit = (gdt.len() * 8 - 1) as u16;
    sregs.idt.base = layout::IDT;
    sregs.idt.limit = 7;
    sregs.cs = code;
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = tss;

    write_mem(mem, layout::PML4, layout::PDPT | 0x3)?;
    write_mem(mem, layout::PDPT, layout::PD | 0x3)?;
    for i in 0..512u64 {
        write_mem(mem, layout::PD + i * 8, (i << 21) | 0x83)?;
    }
    sregs.cr3 = layout::PML4;
    sregs.cr4 |= X86_CR4_PAE;
    sregs.cr0 |= X86_CR0_PE | X86_CR0_PG | X86_CR0_ET;
    sregs.efer |= EFER_LME | EFER_LMA;
    Ok(sregs)
}

/// General registers at the 64-bit entry point.
pub fn boot_regs(entry: BootEntry) -> kvm_regs {
    kvm_regs {
        rflags: 0x2,
        rip: entry.entry,
        rsp: layout::BOOT_STACK,
        rbp: layout::BOOT_STACK,
        rsi: layout::ZERO_PAGE,
        ..Default::default()
    }
}

/// x87/SSE state at power-on.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// MSR values the Linux boot protocol expects.
pub fn boot_msrs() -> Vec<kvm_msr_entry> {
    let e = |index: u32, data: u64| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    };
    vec![
        e(MSR_IA32_SYSENTER_CS, 0),
        e(MSR_IA32_SYSENTER_ESP, 0),
        e(MSR_IA32_SYSENTER_EIP, 0),
        e(MSR_STAR, 0),
        e(MSR_CSTAR, 0),
        e(MSR_KERNEL_GS_BASE, 0),
        e(MSR_SYSCALL_MASK, 0),
        e(MSR_LSTAR, 0),
        e(MSR_IA32_TSC, 0),
        e(MSR_IA32_MISC_ENABLE, 1),          // fast strings
        e(MSR_MTRR_DEF_TYPE, (1 << 11) | 6), // MTRRs on, write-back
    ]
}

/// LINT0 as ExtINT and LINT1 as NMI, as a PC's BIOS leaves them.
pub fn boot_lapic(mut lapic: kvm_lapic_state) -> kvm_lapic_state {
    let set_mode = |lapic: &mut kvm_lapic_state, reg: usize, mode: u32| {
        let mut raw = [0u8; 4];
        for (i, b) in raw.iter_mut().enumerate() {
            *b = lapic.regs[reg + i] as u8;
        }
        let v = (u32::from_le_bytes(raw) & !0x700) | (mode << 8);
        for (i, b) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[reg + i] = *b as i8;
        }
    };
    set_mode(&mut lapic, 0x350, 0x7); // LVT LINT0: ExtINT
    set_mode(&mut lapic, 0x360, 0x4); // LVT LINT1: NMI
    lapic
}

/// Reads the MSRs `indices`, failing with the index of the first one KVM
/// could not read.
pub fn get_msrs(vcpu: &VcpuFd, indices: &[u32]) -> Result<Vec<kvm_msr_entry>> {
    let entries: Vec<kvm_msr_entry> = indices
        .iter()
        .map(|&index| kvm_msr_entry {
            index,
            ..Default::default()
        })
        .collect();
    let mut msrs =
        Msrs::from_entries(&entries).map_err(|e| Error::Config(format!("MSR list: {e:?}")))?;
    let n = vcpu
        .get_msrs(&mut msrs)
        .map_err(|e| Error::kvm("KVM_GET_MSRS", e))?;
    if n != entries.len() {
        return Err(Error::Config(format!(
            "KVM could not read MSR {:#x}",
            entries[n].index
        )));
    }
    Ok(msrs.as_slice().to_vec())
}

/// Writes a list of MSRs, failing with the index of the first one KVM refused.
pub fn set_msrs(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<()> {
    let msrs = Msrs::from_entries(entries)
        .map_err(|e| Error::Config(format!("too many MSRs ({}): {e:?}", entries.len())))?;
    let n = vcpu
        .set_msrs(&msrs)
        .map_err(|e| Error::kvm("KVM_SET_MSRS", e))?;
    if n != entries.len() {
        return Err(Error::Config(format!(
            "KVM refused MSR {:#x} ({} of {} set)",
            entries[n].index,
            n,
            entries.len()
        )));
    }
    Ok(())
}

/// CPUID leaf 1's ECX bit for the local APIC's TSC-deadline timer mode.
const CPUID_1_ECX_TSC_DEADLINE: u32 = 1 << 24;

/// KVM's supported CPUID for this host, read once per process, with the
/// TSC-deadline timer when KVM emulates it (`KVM_CAP_TSC_DEADLINE_TIMER`:
/// KVM emulates it on every host but does not list it in
/// KVM_GET_SUPPORTED_CPUID). A guest that has it programs each timer with
/// one WRMSR, an exit KVM handles from the exit's own information, instead
/// of an MMIO write to the local APIC's initial count, which KVM decodes
/// with its instruction emulator after a nested page fault: every wake-up
/// of an idle guest costs its host less.
pub fn supported_cpuid(kvm: &Kvm) -> Result<&'static CpuId> {
    static CPUID: OnceLock<CpuId> = OnceLock::new();
    if let Some(c) = CPUID.get() {
        return Ok(c);
    }
    let mut c = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .map_err(|e| Error::kvm("KVM_GET_SUPPORTED_CPUID", e))?;
    if kvm.check_extension(kvm_ioctls::Cap::TscDeadlineTimer) {
        with_tsc_deadline(c.as_mut_slice());
    }
    Ok(CPUID.get_or_init(|| c))
}

/// Sets the TSC-deadline timer bit in leaf 1.
fn with_tsc_deadline(entries: &mut [kvm_cpuid_entry2]) {
    for e in entries.iter_mut().filter(|e| e.function == 0x1) {
        e.ecx |= CPUID_1_ECX_TSC_DEADLINE;
    }
}

/// What a vCPU of this host really reports once given [`guest_cpuid`]
/// (read back with KVM_GET_CPUID2; some nested hypervisors report more than
/// KVM_GET_SUPPORTED_CPUID listed). Snapshots are checked against it.
/// Measured once per process, on a vCPU that has not run yet.
pub fn effective_cpuid(
    supported: &CpuId,
    vcpu: &crate::vcpu::VcpuHandle,
) -> Result<&'static [kvm_cpuid_entry2]> {
    static EFFECTIVE: OnceLock<Vec<kvm_cpuid_entry2>> = OnceLock::new();
    if let Some(c) = EFFECTIVE.get() {
        return Ok(c);
    }
    let cpuid = guest_cpuid(supported, 0, 1)?;
    let got = vcpu.exec(move |fd| -> Result<Vec<kvm_cpuid_entry2>> {
        fd.set_cpuid2(&cpuid)
            .map_err(|e| Error::kvm("KVM_SET_CPUID2", e))?;
        Ok(fd
            .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
            .map_err(|e| Error::kvm("KVM_GET_CPUID2", e))?
            .as_slice()
            .to_vec())
    })??;
    Ok(EFFECTIVE.get_or_init(|| got))
}

/// KVM's paravirtual feature leaf (`KVM_CPUID_FEATURES`).
const KVM_CPUID_FEATURES: u32 = 0x4000_0001;
/// Its async-page-fault bits: `KVM_FEATURE_ASYNC_PF`, `_ASYNC_PF_VMEXIT`,
/// `_ASYNC_PF_INT`.
const KVM_ASYNC_PF_FEATURES: u32 = (1 << 4) | (1 << 10) | (1 << 14);

/// The guest CPUID for vCPU `index` of `count`: the host's supported set, with
/// the vCPU's APIC id, the hypervisor bit, and a consistent topology. Every
/// vCPU of a VM gets the same entries but for its APIC id.
///
/// Async page faults are hidden. With them, a guest task that touches a page
/// the host has not faulted in yet sleeps until KVM says "page ready"; that
/// promise lives in the KVM instance, not in guest memory, so a snapshot
/// taken while a task sleeps on it restores into VMs where nobody ever wakes
/// the task. Restored VMs map their RAM from a file and fault it in lazily,
/// which is exactly when KVM goes asynchronous.
pub fn guest_cpuid(supported: &CpuId, index: usize, count: usize) -> Result<CpuId> {
    let mut entries: Vec<kvm_cpuid_entry2> = supported.as_slice().to_vec();
    let apic_id = index as u32;
    for e in entries.iter_mut() {
        match e.function {
            0x1 => {
                e.ebx = (e.ebx & 0x0000_ffff) | (apic_id << 24) | ((count as u32).min(255) << 16);
                e.ecx |= 1 << 31; // hypervisor
                if count > 1 {
                    e.edx |= 1 << 28; // HTT: more than one logical CPU
                }
            }
            0xb | 0x1f => e.edx = apic_id,
            KVM_CPUID_FEATURES => e.eax &= !KVM_ASYNC_PF_FEATURES,
            _ => {}
        }
    }
    CpuId::from_entries(&entries).map_err(|e| Error::Config(format!("CPUID: {e:?}")))
}

/// Bits of the feature leaves that the snapshot's CPU had and this host lacks.
/// OSXSAVE and OSPKE mirror guest control registers and HTT our own
/// topology; they are not host features.
pub fn missing_features(saved: &[kvm_cpuid_entry2], host: &[kvm_cpuid_entry2]) -> Vec<String> {
    const FEATURE_REGS: &[(u32, u32, usize, &str)] = &[
        (0x1, 0, 2, "ecx"),
        (0x1, 0, 3, "edx"),
        (0x7, 0, 1, "ebx"),
        (0x7, 0, 2, "ecx"),
        (0x7, 0, 3, "edx"),
        (0x7, 1, 0, "eax"),
        (0xd, 1, 0, "eax"),
        (0x8000_0001, 0, 2, "ecx"),
        (0x8000_0001, 0, 3, "edx"),
    ];
    let ignore = |f: u32, idx: u32, reg: usize| -> u32 {
        match (f, idx, reg) {
            (0x1, 0, 2) => 1 << 27, // OSXSAVE
            (0x1, 0, 3) => 1 << 28, // HTT: topology we set, not a host feature
            (0x7, 0, 2) => 1 << 4,  // OSPKE
            _ => 0,
        }
    };
    let regs = |e: &kvm_cpuid_entry2| [e.eax, e.ebx, e.ecx, e.edx];
    let find = |entries: &[kvm_cpuid_entry2], f: u32, idx: u32| {
        entries
            .iter()
            .find(|e| e.function == f && e.index == idx)
            .copied()
    };
    let mut missing = Vec::new();
    for &(f, idx, reg, name) in FEATURE_REGS {
        let Some(s) = find(saved, f, idx) else {
            continue;
        };
        let have = find(host, f, idx).map(|h| regs(&h)[reg]).unwrap_or(0);
        let lack = regs(&s)[reg] & !have & !ignore(f, idx, reg);
        if lack != 0 {
            missing.push(format!("leaf {f:#x}.{idx} {name} bits {lack:#010x}"));
        }
    }
    missing
}

/// Whether two vCPUs' CPUID tables describe the same CPU. KVM reports some
/// bits from the guest's own control registers (OSXSAVE and OSPKE follow CR4,
/// the XSAVE area sizes of leaf 0xd follow XCR0), so those are not compared.
pub fn same_cpuid(a: &[kvm_cpuid_entry2], b: &[kvm_cpuid_entry2]) -> bool {
    let key = |e: &kvm_cpuid_entry2| {
        let (mut ebx, mut ecx) = (e.ebx, e.ecx);
        match (e.function, e.index) {
            (0x1, _) => ecx &= !(1 << 27),
            (0x7, 0) => ecx &= !(1 << 4),
            (0xd, 0 | 1) => ebx = 0,
            _ => {}
        }
        (e.function, e.index, e.flags, e.eax, ebx, ecx, e.edx)
    };
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| key(x) == key(y))
}

/// Orders MSRs so that KVM accepts them on restore: the TSC before the TSC
/// deadline (which is relative to it).
pub fn order_msrs(entries: &mut [kvm_msr_entry]) {
    entries.sort_by_key(|e| match e.index {
        MSR_IA32_TSC => 0,
        MSR_IA32_TSC_DEADLINE => 2,
        _ => 1,
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gdt_entries_decode_to_long_mode_segments() {
        let code = segment(gdt_entry(0xa09b, 0, 0xfffff), 2);
        assert_eq!(
            (code.l, code.db, code.present, code.selector),
            (1, 0, 1, 0x10)
        );
        let data = segment(gdt_entry(0xc093, 0, 0xfffff), 3);
        assert_eq!(
            (data.db, data.g, data.type_, data.selector),
            (1, 1, 3, 0x18)
        );
    }

    #[test]
    fn the_tsc_deadline_timer_is_offered_in_leaf_1_only() {
        let leaf = |function, ecx| kvm_cpuid_entry2 {
            function,
            ecx,
            ..Default::default()
        };
        let mut entries = [leaf(0x1, 1), leaf(0x7, 0)];
        with_tsc_deadline(&mut entries);
        assert_eq!(entries[0].ecx, 1 | CPUID_1_ECX_TSC_DEADLINE);
        assert_eq!(entries[1].ecx, 0);
    }

    #[test]
    fn guests_never_see_async_page_faults() {
        let leaf = |function, eax| kvm_cpuid_entry2 {
            function,
            eax,
            ..Default::default()
        };
        let supported = CpuId::from_entries(&[leaf(0x1, 0), leaf(KVM_CPUID_FEATURES, !0)])
            .expect("two entries");
        let cpuid = guest_cpuid(&supported, 1, 2).expect("guest CPUID");
        let kvm = cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == KVM_CPUID_FEATURES)
            .expect("KVM's feature leaf");
        assert_eq!(kvm.eax & KVM_ASYNC_PF_FEATURES, 0);
        // Clock sources, PV EOI and the rest stay.
        assert_eq!(kvm.eax | KVM_ASYNC_PF_FEATURES, !0);
        let leaf1 = cpuid
            .as_slice()
            .iter()
            .find(|e| e.function == 1)
            .expect("leaf 1");
        assert_eq!(leaf1.ebx >> 24, 1, "APIC id of vCPU 1");
    }

    #[test]
    fn cpuid_comparison_ignores_guest_controlled_bits() {
        let e = |function, index, ebx, ecx| kvm_cpuid_entry2 {
            function,
            index,
            ebx,
            ecx,
            ..Default::default()
        };
        let a = [e(1, 0, 0, 0x1), e(0xd, 0, 0x240, 0)];
        let b = [e(1, 0, 0, 0x1 | 1 << 27), e(0xd, 0, 0x340, 0)];
        assert!(same_cpuid(&a, &b));
        let c = [e(1, 0, 0, 0x3), e(0xd, 0, 0x240, 0)];
        assert!(!same_cpuid(&a, &c));
        assert!(!same_cpuid(&a, &a[..1]));
    }

    #[test]
    fn lapic_lint_modes() {
        let l = boot_lapic(kvm_lapic_state::default());
        assert_eq!(l.regs[0x351] as u8 & 0x7, 0x7);
        assert_eq!(l.regs[0x361] as u8 & 0x7, 0x4);
    }
}
