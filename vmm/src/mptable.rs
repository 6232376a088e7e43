//! The Intel MultiProcessor Specification table (version 1.4) that tells a
//! Linux guest booted without ACPI how many CPUs it has: a floating pointer
//! at the start of the EBDA (where Linux's `smp_scan_config` looks), and a
//! configuration table after it listing every vCPU's local APIC (id =
//! the vCPU's index, as its CPUID says; vCPU 0 the bootstrap processor), an
//! ISA bus, the in-kernel IOAPIC with the 24 IRQs identity-mapped to its
//! pins (what KVM's default GSI routing does), and LINT0/LINT1 as ExtINT
//! and NMI. Without it Linux sees only the bootstrap processor, however
//! many vCPUs the VM has, and runs without its local APIC: its timer
//! interrupts then come from the PIT. Every guest booted gets one.

use vm_memory::{Bytes, GuestAddress};

use crate::arch::layout;
use crate::error::{Error, Result};
use crate::memory::GuestMem;

/// The local APICs' base address.
const LAPIC_ADDR: u32 = 0xfee0_0000;
/// The IOAPIC's base address.
const IOAPIC_ADDR: u32 = 0xfec0_0000;
/// Local APIC version (an integrated APIC).
const LAPIC_VERSION: u8 = 0x14;
/// IOAPIC version.
const IOAPIC_VERSION: u8 = 0x11;
/// The IOAPIC's input pins (KVM's in-kernel IOAPIC has 24).
const IOAPIC_PINS: u8 = 24;
/// The ISA bus's id.
const ISA_BUS: u8 = 0;

// Entry types.
const PROCESSOR: u8 = 0;
const BUS: u8 = 1;
const IOAPIC: u8 = 2;
const IO_INTERRUPT: u8 = 3;
const LOCAL_INTERRUPT: u8 = 4;
// Interrupt types.
const INT: u8 = 0;
const NMI: u8 = 1;
const EXTINT: u8 = 3;
// Processor flags.
const CPU_ENABLED: u8 = 1;
const CPU_BSP: u8 = 2;
/// CPU signature (family 6) and feature flags (FPU, APIC) of the processor
/// entries: informational, Linux reads CPUID.
const CPU_SIGNATURE: u32 = 0x600;
const CPU_FEATURES: u32 = (1 << 9) | 1;

/// The table for `vcpus` vCPUs as bytes, to be written at `base`: the
/// floating pointer, then the configuration table.
fn table(vcpus: u8, base: u32) -> Vec<u8> {
    let ioapic_id = vcpus;
    let mut entries: Vec<u8> = Vec::new();
    let mut count: u16 = 0;
    for cpu in 0..vcpus {
        entries.extend([
            PROCESSOR,
            cpu,
            LAPIC_VERSION,
            CPU_ENABLED | if cpu == 0 { CPU_BSP } else { 0 },
        ]);
        entries.extend(CPU_SIGNATURE.to_le_bytes());
        entries.extend(CPU_FEATURES.to_le_bytes());
        entries.extend([0u8; 8]);
        count += 1;
    }
    entries.extend([BUS, ISA_BUS]);
    entries.extend(*b"ISA   ");
    count += 1;
    entries.extend([IOAPIC, ioapic_id, IOAPIC_VERSION, 1]);
    entries.extend(IOAPIC_ADDR.to_le_bytes());
    count += 1;
    for irq in 0..IOAPIC_PINS {
        // Polarity and trigger "conforming to the bus" (ISA: active high,
        // edge), source ISA IRQ `irq` on IOAPIC pin `irq`.
        entries.extend([IO_INTERRUPT, INT, 0, 0, ISA_BUS, irq, ioapic_id, irq]);
        count += 1;
    }
    // LINT0 of the bootstrap processor: ExtINT (the PIC); LINT1 of every
    // processor (destination 0xff): NMI.
    entries.extend([LOCAL_INTERRUPT, EXTINT, 0, 0, ISA_BUS, 0, 0, 0]);
    entries.extend([LOCAL_INTERRUPT, NMI, 0, 0, ISA_BUS, 0, 0xff, 1]);
    count += 2;

    let config_addr = base + 16;
    let length = u16::try_from(44 + entries.len()).unwrap_or(u16::MAX);
    let mut config: Vec<u8> = Vec::with_capacity(usize::from(length));
    config.extend(*b"PCMP");
    config.extend(length.to_le_bytes());
    config.push(4); // specification revision 1.4
    config.push(0); // checksum, below
    config.extend(*b"TWIG    "); // OEM id
    config.extend(*b"TWIG-VMM    "); // product id
    config.extend(0u32.to_le_bytes()); // OEM table pointer
    config.extend(0u16.to_le_bytes()); // OEM table size
    config.extend(count.to_le_bytes());
    config.extend(LAPIC_ADDR.to_le_bytes());
    config.extend(0u32.to_le_bytes()); // extended table length, checksum
    config.extend(entries);
    config[7] = checksum(&config);

    let mut floating: Vec<u8> = Vec::with_capacity(16);
    floating.extend(*b"_MP_");
    floating.extend(config_addr.to_le_bytes());
    floating.push(1); // length in 16-byte units
    floating.push(4); // specification revision 1.4
    floating.push(0); // checksum, below
    floating.extend([0u8; 5]); // feature bytes: a configuration table follows
    floating[10] = checksum(&floating);

    floating.extend(config);
    floating
}

/// The byte that makes `bytes` sum to 0 (mod 256), given that the byte it
/// goes into is 0 now.
fn checksum(bytes: &[u8]) -> u8 {
    bytes
        .iter()
        .fold(0u8, |sum, b| sum.wrapping_add(*b))
        .wrapping_neg()
}

/// Writes the table for `vcpus` vCPUs into guest memory at the EBDA (RAM
/// the e820 map leaves to firmware tables).
pub fn write(mem: &GuestMem, vcpus: usize) -> Result<()> {
    let vcpus = u8::try_from(vcpus)
        .ok()
        .filter(|n| *n < 0xff)
        .ok_or_else(|| Error::Config(format!("an MP table for {vcpus} vCPUs")))?;
    let base =
        u32::try_from(layout::EBDA).map_err(|_| Error::Config("the EBDA is above 4 GiB".into()))?;
    mem.write_slice(&table(vcpus, base), GuestAddress(layout::EBDA))
        .map_err(|e| Error::Config(format!("writing the MP table: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sum(bytes: &[u8]) -> u8 {
        bytes.iter().fold(0u8, |s, b| s.wrapping_add(*b))
    }

    #[test]
    fn the_table_lists_every_vcpu_with_valid_checksums() {
        let base = 0x9fc00;
        let t = table(4, base);
        let (floating, config) = t.split_at(16);
        assert_eq!(&floating[..4], b"_MP_");
        assert_eq!(sum(floating), 0, "floating pointer checksum");
        assert_eq!(
            u32::from_le_bytes(floating[4..8].try_into().unwrap()),
            base + 16
        );
        assert_eq!(&config[..4], b"PCMP");
        let length = u16::from_le_bytes(config[4..6].try_into().unwrap());
        assert_eq!(usize::from(length), config.len());
        assert_eq!(sum(config), 0, "configuration table checksum");
        let count = u16::from_le_bytes(config[34..36].try_into().unwrap());
        assert_eq!(count, 4 + 1 + 1 + 24 + 2);
        // Four processors, APIC ids 0..4, the first the bootstrap one.
        let cpus: Vec<(u8, u8)> = (0..4)
            .map(|i| &config[44 + 20 * i..])
            .map(|e| {
                assert_eq!(e[0], PROCESSOR);
                (e[1], e[3])
            })
            .collect();
        assert_eq!(
            cpus,
            vec![(0, 3), (1, 1), (2, 1), (3, 1)],
            "(APIC id, flags)"
        );
        // The IOAPIC after them, with the next id.
        let ioapic = &config[44 + 80 + 8..];
        assert_eq!((ioapic[0], ioapic[1], ioapic[3]), (IOAPIC, 4, 1));
        // 32 vCPUs fit in the EBDA's KiB.
        assert!(table(32, base).len() <= 1024);
    }
}
