//! What a VM is doing, for diagnostics: device, PIC and vCPU state.

use crate::arch;
use crate::error::{Error, Result};
use crate::vcpu::VcpuHandle;

use super::{kvm_err, Vm};

impl Vm {
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
