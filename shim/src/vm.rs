//! The real sandbox: one `twig-vmm serve` process per pod, restored from
//! the base template (never booted on a pod's path), its containers'
//! rootfs images attached to the VM's empty disk slots.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use twig_agent::client::AgentClient;
use twig_vmm::api::Client;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::restore::{self, Source};
use crate::sandbox::{Attachment, Launcher, Restored, Sandbox, VmRollback, VmSnapshot};
use crate::spec;

/// How long the guest may take to see a new slot's capacity: Linux handles
/// the configuration-change interrupt on a workqueue, and the agent mounts
/// at once (it does not wait for `/sys/block/vdX/size`).
const CAPACITY_WAIT: Duration = Duration::from_secs(2);

/// The least deadline of a snapshot or rollback call: they copy guest
/// memory and disks, which takes seconds on a loaded node.
const SLOW_CALL: Duration = Duration::from_secs(120);

/// How long a ping on the agent connection may take after a rollback
/// before the connection counts as dropped.
const PING_AFTER_ROLLBACK: Duration = Duration::from_millis(500);

/// Makes [`VmSandbox`]es from the shim's configuration.
pub struct VmLauncher {
    config: Config,
    state_dir: PathBuf,
}

impl VmLauncher {
    /// A launcher whose VM keeps its sockets and logs in `state_dir`.
    pub fn new(config: Config, state_dir: PathBuf) -> VmLauncher {
        VmLauncher { config, state_dir }
    }
}

impl Launcher for VmLauncher {
    fn launch(&self, sandbox_id: &str, bundle: &Path) -> Result<Arc<dyn Sandbox>> {
        let oci = spec::read_spec(bundle)?;
        let source = Source::for_spec(&self.config, &self.state_dir, sandbox_id, &oci)?;
        tracing::info!(sandbox_id, state = %self.state_dir.display(), ?source, "starting the sandbox VM");
        Ok(Arc::new(VmSandbox::start(
            &self.config,
            &self.state_dir,
            &source,
        )?))
    }
}

/// A pod's VM: the twig-vmm child, its API client and the agent inside.
pub struct VmSandbox {
    vmm: Mutex<Vmm>,
    agent: RwLock<AgentConn>,
    vsock: PathBuf,
    slots: Mutex<Vec<bool>>,
    /// Containers of the restored pod snapshot not adopted yet.
    restored: Mutex<Vec<Restored>>,
    /// The VM's own files (restored slot disks), removed with it.
    files_dir: Option<PathBuf>,
    timeout: Duration,
}

struct Vmm {
    child: Option<Child>,
    api: Client,
}

/// The agent connection and how many times it was replaced.
struct AgentConn {
    client: AgentClient,
    epoch: u64,
}

fn vmm_error(what: impl Into<String>) -> impl FnOnce(twig_vmm::api::ClientError) -> Error {
    let what = what.into();
    move |source| Error::Vmm { what, source }
}

impl VmSandbox {
    /// Spawns `twig-vmm serve` with the template's shape, restores
    /// `source` (the template, or a pod snapshot: then with a file for each
    /// of its attached slots, and the clone given its own identity) into it
    /// and connects to its agent. On failure the VMM is killed.
    pub fn start(config: &Config, state_dir: &Path, source: &Source) -> Result<VmSandbox> {
        ensure_template(config, state_dir)?;
        std::fs::create_dir_all(state_dir)
            .map_err(|e| Error::io(format!("creating {}", state_dir.display()), e))?;
        let api_sock = state_dir.join("api.sock");
        let vsock = state_dir.join("vsock");
        for stale in [&api_sock, &vsock] {
            let _ = std::fs::remove_file(stale);
        }
        let log = File::create(state_dir.join("vmm.log"))
            .map_err(|e| Error::io(format!("creating {}/vmm.log", state_dir.display()), e))?;
        let t = &config.template;
        let mut cmd = Command::new(&config.vmm_binary);
        cmd.arg("serve")
            .arg("--api-sock")
            .arg(&api_sock)
            .arg("--serial")
            .arg(state_dir.join("serial.log"))
            .args(["--prepare-mem-mib", &t.mem_mib.to_string()])
            .args(["--prepare-vcpus", &t.vcpus.to_string()])
            .args(["--disk-slots", &config.disk_slots.to_string()])
            .arg("--vsock-uds")
            .arg(&vsock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        let (dir, files_dir) = match source {
            Source::Template => (t.dir.clone(), None),
            Source::Snapshot(snap) => {
                std::fs::create_dir_all(&snap.files_dir)
                    .map_err(|e| Error::io(format!("creating {}", snap.files_dir.display()), e))?;
                for (slot, file) in &snap.slot_files {
                    cmd.arg("--slot-file")
                        .arg(format!("{slot}={}", file.display()));
                }
                (snap.dir.clone(), Some(snap.files_dir.clone()))
            }
        };
        let child = cmd
            .spawn()
            .map_err(|e| Error::io(format!("starting {}", config.vmm_binary.display()), e))?;
        let pid = child.id();
        std::fs::write(state_dir.join("vmm.pid"), pid.to_string())
            .map_err(|e| Error::io(format!("writing {}/vmm.pid", state_dir.display()), e))?;
        let timeout = Duration::from_secs(config.call_timeout_s);
        let mut guard = KillOnDrop(Some(child));
        let started = Instant::now();
        let (api, agent) = Self::restore(&dir, &api_sock, &vsock, timeout)
            .map_err(|e| with_vm_logs(e, state_dir))?;
        let mut slots = vec![false; config.disk_slots];
        let mut restored = Vec::new();
        if let Source::Snapshot(snap) = source {
            let req = restore::identity(&snap.hostname)?;
            agent.reidentify(&req, timeout).map_err(|e| {
                Error::agent(format!("giving the clone of {} its identity", snap.id), e)
            })?;
            for (slot, _) in &snap.slot_files {
                if let Some(s) = slots.get_mut(*slot) {
                    *s = true;
                }
            }
            restored = snap.restored.clone();
        }
        tracing::info!(pid, elapsed = ?started.elapsed(), "sandbox VM restored, agent answers");
        Ok(VmSandbox {
            vmm: Mutex::new(Vmm {
                child: guard.0.take(),
                api,
            }),
            agent: RwLock::new(AgentConn {
                client: agent,
                epoch: 0,
            }),
            vsock,
            slots: Mutex::new(slots),
            restored: Mutex::new(restored),
            files_dir,
            timeout,
        })
    }

    /// Restores `template` into the VMM serving `api_sock` and waits for
    /// its agent on `vsock`.
    fn restore(
        template: &Path,
        api_sock: &Path,
        vsock: &Path,
        timeout: Duration,
    ) -> Result<(Client, AgentClient)> {
        let mut api =
            Client::connect(api_sock, timeout).map_err(vmm_error("connecting to twig-vmm"))?;
        api.restore(template, timeout).map_err(vmm_error(format!(
            "restoring the template {}",
            template.display()
        )))?;
        // A connection made while the restored guest is still handling the
        // vsock transport reset that every restore sends is reset with it:
        // retry the handshake and a ping until the agent answers.
        let agent = AgentClient::wait_ready(vsock, twig_agent::AGENT_VSOCK_PORT, timeout)
            .map_err(|e| Error::agent("waiting for the agent of the restored VM", e))?;
        Ok((api, agent))
    }

    fn vmm(&self) -> MutexGuard<'_, Vmm> {
        self.vmm.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take_slot(&self) -> Result<usize> {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let free = slots.iter().position(|used| !used).ok_or_else(|| {
            Error::FailedPrecondition(format!(
                "the pod's VM has {} disk slots and all hold a container's rootfs",
                slots.len()
            ))
        })?;
        slots[free] = true;
        Ok(free)
    }

    fn free_slot(&self, slot: usize) {
        if let Some(s) = self
            .slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(slot)
        {
            *s = false;
        }
    }
}

/// The guest's name for disk slot `slot`: the VM has no fixed disks, so the
/// slots are the first virtio-blk devices in MMIO order.
pub fn slot_device(slot: usize) -> Result<String> {
    u8::try_from(slot)
        .ok()
        .filter(|s| *s < 26)
        .map(|s| format!("/dev/vd{}", char::from(b'a' + s)))
        .ok_or_else(|| Error::InvalidArgument(format!("no guest device name for disk slot {slot}")))
}

/// Kills the VMM if the start fails half-way.
struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
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

    fn create_container(
        &self,
        id: &str,
        image: &Path,
        read_only: bool,
        spec_json: &[u8],
    ) -> Result<Attachment> {
        let slot = self.take_slot()?;
        let attachment = Attachment {
            device: slot_device(slot)?,
            slot: Some(slot),
        };
        if let Err(e) = self
            .vmm()
            .api
            .attach_disk(slot, image, read_only, self.timeout)
        {
            self.free_slot(slot);
            return Err(vmm_error(format!(
                "attaching {} to disk slot {slot}",
                image.display()
            ))(e));
        }
        let deadline = Instant::now() + CAPACITY_WAIT;
        let created = loop {
            match self.agent().create_container(
                id,
                &attachment.device,
                read_only,
                spec_json,
                self.timeout,
            ) {
                // The guest has not seen the new capacity yet: the mount
                // fails; try again until the deadline.
                Err(e)
                    if e.status_code() == Some("INVALID_ARGUMENT")
                        && e.to_string().contains("mounting rootfs device")
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                other => break other,
            }
        };
        if let Err(e) = created {
            if let Err(d) = self.detach(&attachment) {
                tracing::warn!(slot, "detaching after a failed create: {d}");
            }
            return Err(Error::agent(
                format!("creating container {id} on {}", attachment.device),
                e,
            ));
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
        self.free_slot(slot);
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
        Ok(VmRollback {
            pages_restored: u64::try_from(info.pages_restored).unwrap_or(u64::MAX),
            remapped: info.remapped,
        })
    }

    fn shutdown(&self) -> Result<()> {
        let mut vmm = self.vmm();
        let Some(mut child) = vmm.child.take() else {
            return Ok(());
        };
        if let Err(e) = vmm.api.shutdown(self.timeout) {
            tracing::warn!("twig-vmm did not shut down on request ({e}); killing it");
            let _ = child.kill();
        }
        let waited = child
            .wait()
            .map(|_| ())
            .map_err(|e| Error::io("waiting for twig-vmm to exit", e));
        if let Some(dir) = &self.files_dir {
            if let Err(e) = std::fs::remove_dir_all(dir) {
                tracing::warn!("removing the VM's files {}: {e}", dir.display());
            }
        }
        waited
    }

    fn take_restored(&self, name: &str) -> Option<Restored> {
        let mut restored = self.restored.lock().unwrap_or_else(|p| p.into_inner());
        let i = restored.iter().position(|r| r.name == name)?;
        Some(restored.remove(i))
    }
}

impl Drop for VmSandbox {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            tracing::warn!("stopping the VM: {e}");
        }
    }
}

/// Makes sure the base template exists: built once with `twig-vmm
/// template` under an exclusive `flock` on `<template dir>.lock`, so that
/// concurrent shims build it once. (The node daemon takes this over later;
/// this is the one place that knows.)
pub fn ensure_template(config: &Config, state_dir: &Path) -> Result<()> {
    let t = &config.template;
    if t.dir.join("state").exists() {
        return Ok(());
    }
    let parent = t.dir.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(parent)
        .map_err(|e| Error::io(format!("creating {}", parent.display()), e))?;
    let lock_path = PathBuf::from(format!("{}.lock", t.dir.display()));
    let lock_file = File::create(&lock_path)
        .map_err(|e| Error::io(format!("creating {}", lock_path.display()), e))?;
    let _lock = Flock::lock(lock_file, FlockArg::LockExclusive)
        .map_err(|(_, e)| Error::io(format!("locking {}", lock_path.display()), e.into()))?;
    if t.dir.join("state").exists() {
        return Ok(());
    }
    for input in [&t.kernel, &t.initrd, &config.vmm_binary] {
        if !input.exists() {
            return Err(Error::FailedPrecondition(format!(
                "the template {} does not exist and cannot be built: {} is missing",
                t.dir.display(),
                input.display()
            )));
        }
    }
    std::fs::create_dir_all(state_dir)
        .map_err(|e| Error::io(format!("creating {}", state_dir.display()), e))?;
    let vsock = state_dir.join("template.vsock");
    let _ = std::fs::remove_file(&vsock);
    tracing::info!(dir = %t.dir.display(), "building the base template");
    let out = Command::new(&config.vmm_binary)
        .arg("template")
        .arg(&t.dir)
        .arg("--kernel")
        .arg(&t.kernel)
        .arg("--initrd")
        .arg(&t.initrd)
        .args(["--mem-mib", &t.mem_mib.to_string()])
        .args(["--vcpus", &t.vcpus.to_string()])
        .args(["--disk-slots", &config.disk_slots.to_string()])
        .args(["--timeout-s", &t.build_timeout_s.to_string()])
        .arg("--serial")
        .arg(state_dir.join("template-serial.log"))
        .arg("--vsock-uds")
        .arg(&vsock)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            Error::io(
                format!("running {} template", config.vmm_binary.display()),
                e,
            )
        })?;
    if !out.status.success() {
        return Err(Error::Internal(format!(
            "building the template {} failed ({}): {}",
            t.dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Lines of each log a failed VM start quotes.
const LOG_TAIL_LINES: usize = 12;

/// `e` with the end of the VMM's log and of the guest's console appended,
/// so the error containerd shows says why the VM did not come up (the state
/// directory holding the logs goes with the failed task).
fn with_vm_logs(e: Error, state_dir: &Path) -> Error {
    let tail = |name: &str| {
        let text = std::fs::read(state_dir.join(name)).unwrap_or_default();
        let text = String::from_utf8_lossy(&text);
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join(" | ")
    };
    let logs = format!(
        " [twig-vmm log: {}] [guest console: {}]",
        tail("vmm.log"),
        tail("serial.log")
    );
    match e {
        Error::Agent { what, source } => Error::Agent {
            what: what + &logs,
            source,
        },
        Error::Vmm { what, source } => Error::Vmm {
            what: what + &logs,
            source,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_the_first_virtio_disks() {
        assert_eq!(slot_device(0).unwrap(), "/dev/vda");
        assert_eq!(slot_device(2).unwrap(), "/dev/vdc");
        assert!(slot_device(26).is_err());
    }

    #[test]
    fn a_missing_template_without_inputs_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.template.dir = dir.path().join("store/snapshots/tpl");
        config.template.kernel = dir.path().join("no-kernel");
        let e = ensure_template(&config, &dir.path().join("state")).unwrap_err();
        assert!(matches!(e, Error::FailedPrecondition(_)), "{e}");
        assert!(e.to_string().contains("no-kernel"), "{e}");
        assert!(!config.template.dir.exists());
    }
}
