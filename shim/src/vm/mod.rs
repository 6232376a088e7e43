//! The real sandbox: one `twig-vmm serve` process per pod, taken from the
//! node daemon's warm pool (twig-node: the VM and its memory slots exist
//! already) and restored from a template (never booted on a pod's path),
//! its containers' rootfs images attached to the VM's empty disk slots.
//!
//! - this module: [`VmSandbox`], the [`Sandbox`] a running pod's VM is
//!   (disks, pause, snapshot, rollback, shutdown, the network path's
//!   policy);
//! - `start`: making one, step by step (the pool, the restore, the clone's
//!   identity, the pod's network);
//! - `vmm`: the handed-over `twig-vmm` process (pidfd, death watch, logs).

mod start;
mod vmm;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::Duration;

use twig_agent::client::{AgentClient, ContainerDisks};
use twig_agent::proto::agent::{BlockVolume, ReidentifyRequest};
use twig_net::EgressPolicy;
use twig_vmm::api::Client;

use crate::error::{Error, Result};
use crate::resources::cgroups;
use crate::resources::network::{Joiner, PodNet};
use crate::resources::port_forward::PortForwarder;
use crate::resources::rootfs::{slot_device, DiskSlots};
use crate::restore;
use crate::sandbox::{
    Attachment, Death, NetworkStats, Restored, Sandbox, VmRollback, VmShape, VmSnapshot,
    SANDBOX_ADOPTION, TEMPLATE_ADOPTION,
};
use vmm::Process;

pub use start::{acquire, join_network, NetworkSetup, VmLauncher};
pub use vmm::PID_FILE;

/// The least deadline of a snapshot or rollback call: they copy guest
/// memory and disks, which takes seconds on a loaded node.
const SLOW_CALL: Duration = Duration::from_secs(120);

/// How long a ping on the agent connection may take after a rollback
/// before the connection counts as dropped.
const PING_AFTER_ROLLBACK: Duration = Duration::from_millis(500);

/// A pod's VM: the twig-vmm child, its API client and the agent inside.
pub struct VmSandbox {
    vmm: Mutex<Vmm>,
    agent: RwLock<AgentConn>,
    vsock: PathBuf,
    /// The template the VM was restored from (`<store>/snapshots/<id>`).
    template_dir: PathBuf,
    slots: DiskSlots,
    /// The VM's shape: what a container's limits can grow to.
    shape: VmShape,
    timeout: Duration,
    /// Set before a shutdown stops the VMM: its exit is then no death.
    stopping: Arc<AtomicBool>,
    /// What the watch thread says when the VMM dies unasked, until taken.
    death: Mutex<Option<Death>>,
    /// The shim's state directory of the pod (`vmm.pid`), removed once
    /// the VMM is gone.
    state_dir: PathBuf,
    /// Containers of the pod snapshot the VM was restored from (restore-
    /// from) not adopted yet.
    restored: Mutex<Vec<Restored>>,
    /// The sandbox's cgroup the VMM runs in, removed once it stopped.
    cgroup: Option<PathBuf>,
    /// The pod's network attached to the VM, torn down once it stopped.
    network: Mutex<Option<PodNet>>,
    /// The pod's network path, whose policy changes while the pod runs.
    path: Option<PathControl>,
    /// `kubectl port-forward` into the VM, stopped with it.
    port_forward: Option<PortForwarder>,
}

/// The policy side of a pod's network path: what joined it, where it is
/// pinned, and the policy in force.
struct PathControl {
    joiner: Arc<dyn Joiner>,
    dir: PathBuf,
    policy: Mutex<EgressPolicy>,
}

/// The agent connection and how many times it was replaced.
struct AgentConn {
    client: AgentClient,
    epoch: u64,
}

struct Vmm {
    process: Option<Process>,
    api: Client,
}

fn vmm_error(what: impl Into<String>) -> impl FnOnce(twig_vmm::api::ClientError) -> Error {
    let what = what.into();
    move |source| Error::Vmm { what, source }
}

impl VmSandbox {
    fn vmm(&self) -> MutexGuard<'_, Vmm> {
        self.vmm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Attaches `image` to a free disk slot; the slot is free again if it
    /// fails.
    fn attach(&self, image: &Path, read_only: bool) -> Result<Attachment> {
        let slot = self.slots.take()?;
        let attached = slot_device(slot).and_then(|device| {
            self.vmm()
                .api
                .attach_disk(slot, image, read_only, self.timeout)
                .map_err(vmm_error(format!(
                    "attaching {} to disk slot {slot}",
                    image.display()
                )))?;
            Ok(Attachment {
                device,
                slot: Some(slot),
            })
        });
        if attached.is_err() {
            self.slots.free(slot);
        }
        attached
    }
}

impl Sandbox for VmSandbox {
    fn agent(&self) -> AgentClient {
        self.agent
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .client
            .clone()
    }

    fn agent_epoch(&self) -> u64 {
        self.agent.read().unwrap_or_else(|p| p.into_inner()).epoch
    }

    fn snapshot_store(&self) -> Result<PathBuf> {
        twig_store::layout::locate(&self.template_dir)
            .map(|(root, _)| root)
            .map_err(|e| {
                Error::FailedPrecondition(format!(
                    "the pod's template is not in a node store, so its snapshots have none: {e}"
                ))
            })
    }

    fn attach_disk(&self, image: &Path, read_only: bool) -> Result<Attachment> {
        self.attach(image, read_only)
    }

    fn shape(&self) -> Option<VmShape> {
        Some(self.shape)
    }

    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        block_volumes: Vec<BlockVolume>,
        spec_json: &[u8],
    ) -> Result<Attachment> {
        let attachment = self.attach(image, read_only)?;
        let slot = attachment.slot;
        // The guest sees the new capacity once it handled the slot's
        // configuration-change interrupt: the agent waits for it.
        let created = std::fs::metadata(image)
            .map_err(|e| Error::io(format!("reading the size of {}", image.display()), e))
            .and_then(|meta| {
                let disks = ContainerDisks {
                    rootfs_device: attachment.device.clone(),
                    rootfs_read_only: read_only,
                    rootfs_bytes: meta.len(),
                    block_volumes,
                };
                self.agent()
                    .create_container_on_disks(id, disks, spec_json, self.timeout)
                    .map_err(|e| {
                        Error::agent(
                            format!("creating container {id} on {}", attachment.device),
                            e,
                        )
                    })
            });
        if let Err(e) = created {
            if let Err(d) = self.detach(&attachment) {
                tracing::warn!(slot, "detaching after a failed create: {d}");
            }
            return Err(e);
        }
        Ok(attachment)
    }

    fn detach(&self, attachment: &Attachment) -> Result<()> {
        let Some(slot) = attachment.slot else {
            return Ok(());
        };
        self.vmm()
            .api
            .detach_disk(slot, self.timeout)
            .map_err(vmm_error(format!("detaching disk slot {slot}")))?;
        self.slots.free(slot);
        Ok(())
    }

    fn pause(&self) -> Result<()> {
        self.vmm()
            .api
            .pause(self.timeout)
            .map(|_| ())
            .map_err(vmm_error("pausing the VM"))
    }

    fn resume(&self) -> Result<()> {
        self.vmm()
            .api
            .resume(self.timeout)
            .map(|_| ())
            .map_err(vmm_error("resuming the VM"))
    }

    fn shutdown(&self) -> Result<()> {
        self.stopping.store(true, Ordering::SeqCst);
        let mut vmm = self.vmm();
        let Some(process) = vmm.process.take() else {
            return Ok(());
        };
        let exited = if process.wait(Duration::ZERO) {
            true
        } else {
            match vmm.api.shutdown(self.timeout) {
                Ok(()) if process.wait(self.timeout) => true,
                Ok(()) => {
                    tracing::warn!("twig-vmm did not exit after its shutdown; killing it");
                    false
                }
                Err(e) => {
                    tracing::warn!("twig-vmm did not shut down on request ({e}); killing it");
                    false
                }
            }
        };
        if !exited {
            process.kill();
            if !process.wait(self.timeout) {
                return Err(Error::Internal(format!(
                    "twig-vmm {} did not exit within {:?} of SIGKILL",
                    process.pid, self.timeout
                )));
            }
        }
        if let Some(f) = &self.port_forward {
            f.stop();
        }
        // The VMM held the tap's last descriptor: the tap is gone; the
        // programs and pins go now. If that fails the state directory (and
        // its record) stays, for `delete` to try again.
        let network = self
            .network
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(n) = network {
            n.detach()?;
        }
        if let Some(cgroup) = &self.cgroup {
            if let Err(e) = cgroups::remove(cgroup) {
                tracing::warn!("{e}");
            }
        }
        if let Err(e) = std::fs::remove_dir_all(&self.state_dir) {
            tracing::warn!("removing {}: {e}", self.state_dir.display());
        }
        Ok(())
    }

    fn kill(&self) -> Result<()> {
        match self.vmm().process.as_ref() {
            Some(p) => {
                tracing::warn!(pid = p.pid, "killing the pod's twig-vmm");
                p.kill();
                Ok(())
            }
            None => Err(Error::FailedPrecondition(
                "the pod's VM is already stopped".into(),
            )),
        }
    }

    fn death(&self) -> Option<Death> {
        self.death.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    fn snapshot(&self, staging: &Path, full: bool) -> Result<VmSnapshot> {
        let kind = if full {
            twig_vmm::Kind::Full
        } else {
            twig_vmm::Kind::Incremental
        };
        let info = self
            .vmm()
            .api
            .snapshot(staging, kind, self.timeout.max(SLOW_CALL))
            .map_err(vmm_error(format!(
                "snapshotting the VM into {}",
                staging.display()
            )))?;
        Ok(VmSnapshot {
            parent: info.parent,
            pages_written: u64::try_from(info.pages_written).unwrap_or(u64::MAX),
        })
    }

    fn rollback(&self, dir: &Path) -> Result<VmRollback> {
        // Agent calls wait while the guest goes back and the connection is
        // replaced; calls that failed on the dropped one see a new epoch.
        let mut agent = self.agent.write().unwrap_or_else(|p| p.into_inner());
        let result = self
            .vmm()
            .api
            .rollback(dir, self.timeout.max(SLOW_CALL))
            .map_err(vmm_error(format!(
                "rolling the VM back to {}",
                dir.display()
            )));
        let result = match result {
            Err(e) if e.is_vm_lost() => return Err(e),
            other => other,
        };
        // The VMM drops host vsock connections when the guest's state goes
        // back (a refusal may have undone that far too): keep the
        // connection only if it still answers.
        if agent.client.ping(PING_AFTER_ROLLBACK).is_err() {
            let client =
                AgentClient::wait_ready(&self.vsock, twig_agent::AGENT_VSOCK_PORT, self.timeout)
                    .map_err(|e| Error::agent("reconnecting to the agent after a rollback", e))?;
            agent.client = client;
            agent.epoch += 1;
        }
        let info = result?;
        // The rolled-back guest has its snapshot's RNG state and clock
        // (and, from a clone's snapshot, another pod's network identity):
        // fresh entropy, the host's clock and this pod's network again.
        let own = restore::identity("")?;
        let network = self
            .network
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|n| n.identity().clone())
            .unwrap_or_default();
        agent
            .client
            .reidentify(
                &ReidentifyRequest {
                    entropy: own.entropy,
                    realtime_ns: own.realtime_ns,
                    ..network
                },
                self.timeout,
            )
            .map_err(|e| Error::agent("giving the rolled-back guest its own identity", e))?;
        Ok(VmRollback {
            pages_restored: u64::try_from(info.pages_restored).unwrap_or(u64::MAX),
            remapped: info.remapped,
        })
    }

    fn network_stats(&self) -> Result<Option<NetworkStats>> {
        let Some(path) = &self.path else {
            return Ok(None);
        };
        let policy = path
            .policy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        Ok(Some(NetworkStats {
            policy,
            counters: path.joiner.counters(&path.dir)?,
        }))
    }

    fn set_egress_policy(&self, policy: &EgressPolicy) -> Result<()> {
        let path = self.path.as_ref().ok_or_else(|| {
            Error::FailedPrecondition("the pod has no network path (no network namespace)".into())
        })?;
        let mut current = path.policy.lock().unwrap_or_else(|p| p.into_inner());
        path.joiner.set_policy(&path.dir, policy)?;
        *current = policy.clone();
        tracing::info!(dir = %path.dir.display(), "the pod's egress policy was replaced");
        Ok(())
    }

    fn charge(&self, pid: u32) -> Result<()> {
        match &self.cgroup {
            Some(cgroup) => cgroups::join(cgroup, pid),
            None => Ok(()),
        }
    }

    fn open_port(&self, port: u32, timeout: Duration) -> Result<std::os::unix::net::UnixStream> {
        twig_proto::vsock::connect(&self.vsock, port, timeout).map_err(|e| {
            Error::FailedPrecondition(format!("reaching the guest's vsock port {port}: {e}"))
        })
    }

    fn restored_for(&self, name: &str) -> Option<Restored> {
        let restored = self.restored.lock().unwrap_or_else(|p| p.into_inner());
        restored_index(&restored, name).map(|i| restored[i].clone())
    }

    fn take_restored(&self, name: &str) -> Option<Restored> {
        let mut restored = self.restored.lock().unwrap_or_else(|p| p.into_inner());
        let i = restored_index(&restored, name)?;
        Some(restored.remove(i))
    }
}

/// Which of the restored containers `name` adopts: its own, else (an app
/// template's container goes to the pod's first one) the template's.
fn restored_index(restored: &[Restored], name: &str) -> Option<usize> {
    restored.iter().position(|r| r.name == name).or_else(|| {
        (name != SANDBOX_ADOPTION)
            .then(|| restored.iter().position(|r| r.name == TEMPLATE_ADOPTION))
            .flatten()
    })
}

impl Drop for VmSandbox {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!("stopping the VM: {e}");
        }
    }
}
