//! A microVM: creation ([`create`]), snapshot, restore and clone
//! ([`persist`]), in-place rollback ([`rollback`]) and diagnostics
//! ([`diagnostics`]). This file holds the [`Vm`] itself and its lifecycle.

#[cfg(test)]
mod balloon_tests;
mod config;
mod create;
mod diagnostics;
#[cfg(test)]
mod disk_pause_tests;
mod disks;
pub(crate) mod failpoint;
mod lazy;
#[cfg(test)]
mod pause_tests;
mod persist;
mod precopy;
mod rollback;

pub use config::{
    DeviceConfig, DiskConfig, NetConfig, NetStats, RollbackInfo, RunState, Shape, SlotImage,
    SnapshotInfo, Stats, VsockConfig, MAX_VCPUS, MIN_MEM,
};
pub use create::open_kvm;
pub use disks::SlotInfo;
pub use lazy::LazySource;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::kvm_cpuid_entry2;
use kvm_ioctls::{Kvm, VmFd};
use vm_memory::{Bytes, GuestAddress};

use crate::devices::{DeviceThread, Devices, GuestExit};
use crate::error::{Error, Result};
use crate::memory::{GuestRam, PageSet};
use crate::snapshot::Image;
use crate::vcpu::{self, VcpuHandle};
use crate::virtio::blk::{DiskFile, DiskWorker};
use crate::virtio::net::NetBackend;

/// A KVM microVM.
pub struct Vm {
    // Field order is drop order: the device and vCPU threads stop before RAM
    // is unmapped.
    device_thread: Option<DeviceThread>,
    /// One I/O thread per block device (`virtio/blk/worker.rs`).
    disk_workers: Vec<DiskWorker>,
    vcpus: Vec<VcpuHandle>,
    devices: Arc<Devices>,
    /// The fixed disks, then the disk slots, in MMIO order.
    disks: Vec<Arc<DiskFile>>,
    /// The network device's host side, if the VM has one.
    net: Option<Arc<NetBackend>>,
    /// Where a restore puts the disks of attached slots.
    slot_files: BTreeMap<usize, PathBuf>,
    fd: Arc<VmFd>,
    ram: GuestRam,
    shape: Shape,
    state: RunState,
    xsave_words: usize,
    msr_indices: Arc<Vec<u32>>,
    cpuid: Vec<Vec<kvm_cpuid_entry2>>,
    baseline: Option<Arc<Image>>,
    /// A lazy restore's watch of its page server (`lazy.rs`).
    lazy: Option<crate::uffd::Watcher>,
    /// The snapshot a lazily restored VM came from, until it has a
    /// baseline.
    lazy_origin: Option<lazy::LazyOrigin>,
    /// The pages the guest was using, once the process's page tables no
    /// longer say (`persist.rs`, hot lists): after the VMM read all of RAM
    /// (a full snapshot of a VM that keeps its memory) or a page server
    /// filled it (a lazy restore). `None`: `/proc/self/pagemap` says.
    hot: Option<PageSet>,
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

impl Vm {
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

    /// Lets the vCPUs run.
    pub fn resume(&mut self) -> Result<()> {
        self.need("resume", &[RunState::Paused, RunState::Running], "paused")?;
        for v in &self.vcpus {
            v.run();
        }
        self.resume_devices();
        self.state = RunState::Running;
        Ok(())
    }

    /// Parks every vCPU. Pending port or MMIO accesses complete first.
    ///
    /// The disks' I/O workers stop between requests first: a request in
    /// hand gets [`vcpu::PARK_TIMEOUT`] to finish, so a snapshot never holds
    /// half a request. A disk request that does not finish in time, a vCPU
    /// that does not park within [`vcpu::PARK_TIMEOUT`] (its thread busy in
    /// a device's host I/O: a serial output that does not take bytes), or a
    /// device thread that does not stop,
    /// fails the pause with [`Error::PauseTimedOut`] (kind `refused`): the
    /// pause is withdrawn, so every vCPU it stopped runs again and the busy
    /// one carries on once its I/O returns, and the VM is still running. No
    /// VM is left frozen while reported running.
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
            if let Err(e) = t.pause() {
                t.resume();
                return Err(e);
            }
        }
        self.disk_workers.iter().for_each(DiskWorker::request_pause);
        let deadline = Instant::now() + vcpu::PARK_TIMEOUT;
        if let Some(index) = self
            .disk_workers
            .iter()
            .position(|w| !w.wait_paused(deadline))
        {
            self.resume_devices();
            tracing::warn!(
                disk = index,
                "pause withdrawn: a disk request did not finish within {:?}",
                vcpu::PARK_TIMEOUT
            );
            return Err(Error::PauseTimedOut {
                what: format!("disk {index}"),
                waited: vcpu::PARK_TIMEOUT,
            });
        }
        let stopped: Vec<bool> = self.vcpus.iter().map(|v| v.request_park()).collect();
        let deadline = Instant::now() + vcpu::PARK_TIMEOUT;
        let stuck = self.vcpus.iter().position(|v| !v.wait_parked(deadline));
        if let Some(index) = stuck {
            for (v, stopped) in self.vcpus.iter().zip(stopped) {
                if stopped {
                    v.run();
                }
            }
            self.resume_devices();
            tracing::warn!(
                vcpu = index,
                "pause withdrawn: the vCPU did not park within {:?}",
                vcpu::PARK_TIMEOUT
            );
            return Err(Error::PauseTimedOut {
                what: format!("vCPU {index}"),
                waited: vcpu::PARK_TIMEOUT,
            });
        }
        self.devices.flush();
        if self.state == RunState::Running {
            self.state = RunState::Paused;
        }
        Ok(())
    }

    /// Lets the device thread and the disk workers serve again.
    fn resume_devices(&self) {
        if let Some(t) = &self.device_thread {
            t.resume();
        }
        self.disk_workers.iter().for_each(DiskWorker::resume);
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
            net: self.net.as_ref().map(|n| NetStats {
                tap: n.tap_name(),
                tx_dropped: n.tx_dropped(),
            }),
        })
    }

    /// Attaches the tap `tap` (a descriptor opened with
    /// `IFF_TAP|IFF_NO_PI|IFF_VNET_HDR`, e.g. in a pod's network namespace)
    /// to the VM's detached network device, in any state; returns the
    /// interface's name. Refused ([`Error::Net`], nothing changed) if the
    /// VM has no network device, its device has a tap already, or `tap` is
    /// not such a tap. The tap stays through snapshots and rollbacks and is
    /// closed with the VM.
    pub fn attach_net(&self, tap: std::fs::File) -> Result<String> {
        self.net
            .as_ref()
            .ok_or_else(|| Error::Net("the VM has no network device".into()))?
            .attach(tap)
    }

    /// A copy of all of guest RAM (for tests and checks; pause the VM for
    /// one moment's memory: a running guest may write it during the copy).
    pub fn read_guest_ram(&self) -> Result<Vec<u8>> {
        let mut out = vec![0u8; self.shape.mem_size];
        self.read_guest(0, &mut out)?;
        Ok(out)
    }
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).map_err(|e| Error::io(format!("resolving {}", p.display()), e))
}
